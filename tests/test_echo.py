"""The `echo` model and `python:MODULE:FUNCTION` specs: models for trying brood with no
server. Real supervisors, real workers running the code echo writes, real SQLite; the CLI
as a real process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import brood
from brood.errors import InvalidArgument
from brood.journal import Journal
from brood.models import resolve_model
from brood.models.base import CallableModel, spec_record
from brood.models.echo import CHUNK_TASK, EchoModel, plain_reply
from tests.test_resume import wait_gone
from tests.util import Signal, fast, until

TIMEOUT_S = 120
BROOD = [sys.executable, "-m", "brood.cli.main"]


def counts(text: str) -> dict[str, int]:
    return {"lines": len(text.splitlines()), "words": len(text.split()), "chars": len(text)}


def tree_of(sup: brood.Supervisor, root_id: str) -> list[dict[str, Any]]:
    sup.store.flush()
    return sorted(sup.store.runs(root_id), key=lambda r: (r["depth"], r["prompt"]))


def chunk_answers(runs: list[dict[str, Any]]) -> list[dict[str, int]]:
    children = [r for r in runs if r["depth"] == 1]
    return [json.loads(r["answer"]) for r in sorted(children, key=lambda r: r["prompt"])]


# ---- the echo model through real runs -------------------------------------------------------
def test_a_list_context_is_split_one_child_per_chunk_and_summed_from_their_answers():
    items = ["the quick brown fox", "jumps over\nthe lazy dog", "again", "and", "once more"]
    with brood.Supervisor("echo", limits=fast()) as sup:
        handle = sup.spawn("Count the words in context", context=items)
        result = handle.wait_result(timeout=TIMEOUT_S)
        products = handle.products()
        runs = tree_of(sup, result.run_id)
        steps = [e["data"] for e in sup.store.events(runs[0]["id"], "step")]
    assert result.state == "completed", result
    children = [r for r in runs if r["depth"] == 1]
    # five items, at most four chunks: 2, 1, 1, 1 items, one child each
    assert [r["prompt"] for r in children] == [
        f"{CHUNK_TASK} {i} of 4 in `context`." for i in range(1, 5)
    ]
    assert all(r["state"] == "completed" for r in children)
    parts = ["\n".join(items[:2]), items[2], items[3], items[4]]
    assert chunk_answers(runs) == [{"chunk": i, **counts(p)} for i, p in enumerate(parts, 1)]
    total = {k: sum(counts(p)[k] for p in parts) for k in ("lines", "words", "chars")}
    assert products is not None and products["total"] == total
    assert result.answer.startswith(
        f"a list of 5 items, in 4 chunks: {total['lines']} lines, {total['words']} words, "
        f"{total['chars']} characters (the word count agrees with my own count of the whole)"
    )
    root = runs[0]
    assert "context: a list of 5 items" in steps[0]["stdout"]
    assert "   1| the quick brown fox" in steps[0]["stdout"]  # a few lines, numbered
    assert "rlm_spawn(" in steps[1]["code"] and "rlm_wait_all(handles)" in steps[1]["code"]
    assert root["usage"]["input_tokens"] > 0  # characters / 4, as echo reports them


def test_a_str_context_is_split_by_lines_and_echo_n_sets_the_chunks(tmp_path):
    notes = "".join(f"line {i}: {'word ' * i}\n" for i in range(1, 8))
    with brood.Supervisor("echo:2", limits=fast()) as sup:
        result = sup.run("Summarise the notes", context=notes)
        runs = tree_of(sup, result.run_id)
    assert result.state == "completed", result
    lines = notes.splitlines()
    parts = ["\n".join(lines[:4]), "\n".join(lines[4:])]
    assert chunk_answers(runs) == [{"chunk": i, **counts(p)} for i, p in enumerate(parts, 1)]
    assert result.answer.startswith(f"a str of {len(notes)} characters in 7 lines, in 2 chunks")
    assert f"{sum(len(p.split()) for p in parts)} words" in result.answer


def test_a_dict_context_is_split_by_its_items():
    context = {"north": "4 sightings", "oak": {"count": 6}, "spit": [1, 2]}
    with brood.Supervisor("echo", limits=fast()) as sup:
        result = sup.run("Look at the sites", context=context)
        runs = tree_of(sup, result.run_id)
    assert result.state == "completed", result
    pieces = ["north: 4 sightings", 'oak: {"count": 6}', "spit: [1, 2]"]
    assert chunk_answers(runs) == [{"chunk": i, **counts(p)} for i, p in enumerate(pieces, 1)]
    words = sum(len(p.split()) for p in pieces)
    assert result.answer.startswith(f"a dict of 3 keys, in 3 chunks: 3 lines, {words} words")


def test_with_no_context_echo_answers_about_the_task_and_makes_one_plain_call():
    task = "Write a haiku about owls\nin winter"
    with brood.Supervisor("echo", limits=fast()) as sup:
        result = sup.run(task)
        sup.store.flush()
        calls = [e["data"] for e in sup.store.events(result.run_id, "model_call")]
    assert result.state == "completed", result
    facts = json.loads(result.answer)
    assert facts == {
        "task": "Write a haiku about owls",
        "chars": len(task),
        "words": 7,
        "lines": 2,
        "longest_word": "winter",
        "llm_query": plain_reply(task),
    }
    assert [c["kind"] for c in calls] == ["turn", "llm_query", "turn"]


def test_the_deepest_level_counts_its_chunks_itself_and_answers_the_same():
    items = ["a b", "c d e", "f"]
    with brood.Supervisor("echo", limits=fast(max_depth=1)) as sup:
        alone = sup.run("Count", context=items)
        assert len(sup.store.runs(alone.run_id)) == 1  # no child run
    with brood.Supervisor("echo", limits=fast()) as sup:
        spread = sup.run("Count", context=items)
    assert alone.state == spread.state == "completed"
    assert alone.answer == spread.answer


def test_a_run_with_one_turn_does_everything_left_in_its_answer_now_turn():
    with brood.Supervisor("echo", limits=fast(max_iterations=1)) as sup:
        result = sup.run("Count", context=["one two", "three"])
        reason = sup.store.get_run(result.run_id)["reason"]
    assert (result.state, reason) == ("completed", "answer")  # by FINAL, not a fallback
    assert result.answer.startswith("a list of 2 items, in 2 chunks: 2 lines, 3 words")


def test_an_empty_context_is_said_and_starts_no_child():
    with brood.Supervisor("echo", limits=fast()) as sup:
        result = sup.run("Count", context=[])
        assert len(sup.store.runs(result.run_id)) == 1
    assert result.answer == "the context is an empty list: nothing to count"


def test_a_task_that_begins_with_ask_asks_a_person_and_answers_with_what_was_said():
    with brood.Supervisor("echo", limits=fast()) as sup:
        handle = sup.spawn("Ask: deploy to prod?")
        (ask,) = until(sup.asks)
        assert ask["question"] == "deploy to prod?"
        assert [o["id"] for o in ask["options"]] == ["yes", "no"] and ask["default"] == "no"
        sup.answer(ask["id"], "yes", by="alice")
        assert handle.wait(timeout=TIMEOUT_S) == "alice answered 'deploy to prod?': yes"


def test_the_same_tree_journals_the_same_replies_code_and_output():
    """Determinism: the model's replies, every step's code and output, and every answer
    are the same when the same task runs again. (Run ids, times and the tree-wide figures
    of each child's system prompt, which depend on when siblings were admitted, are
    brood's, not the model's.)"""

    def trace() -> dict[str, Any]:
        with brood.Supervisor("echo", limits=fast()) as sup:
            result = sup.run("Count the words", context="alpha beta\ngamma\ndelta epsilon zeta\n")
            seen = {}
            for run in tree_of(sup, result.run_id):
                events = sup.store.events(run["id"])
                seen[run["prompt"]] = (
                    run["answer"],
                    [e["data"]["response"] for e in events if e["kind"] == "model_call"],
                    [
                        (e["data"]["code"], e["data"]["stdout"], e["data"]["stderr"])
                        for e in events
                        if e["kind"] == "step"
                    ],
                )
            return seen

    first, second = trace(), trace()
    assert len(first) == 4  # the root and three chunks
    assert first == second


def test_the_reply_to_a_failed_step_is_the_error_not_a_guess():
    model = EchoModel()
    system = {"role": "system", "content": "You solve a task ... in a persistent REPL."}
    first = {"role": "user", "content": "Count\n\n`context` is a list of 2 items."}
    turn1 = model.reply([system, first])
    failed = '[output]\nTraceback (most recent call last):\n  File "<repl>", line 3\n'
    failed += "brood.errors.ChildFailed: child r-1 failed: worker error"
    reply = model.reply(
        [
            system,
            first,
            {"role": "assistant", "content": turn1},
            {"role": "user", "content": failed},
        ]
    )
    assert "FINAL(" in reply
    said = "echo stopped: its last step (turn 1) raised brood.errors.ChildFailed: child r-1 failed"
    assert said in reply


# ---- specs ------------------------------------------------------------------------------------
def test_echo_specs_and_their_refusals():
    assert isinstance(resolve_model("echo"), EchoModel)
    assert resolve_model("echo:7").chunks == 7  # type: ignore[attr-defined]
    assert resolve_model("echo").describe() == "echo"
    assert spec_record("echo:7") == {"spec": "echo:7"}  # journaled: a resume reuses it
    for bad in ("echo:0", "echo:65", "echo:x", "echo:-1"):
        with pytest.raises(InvalidArgument, match=r"number of chunks must be a whole number"):
            resolve_model(bad)
    with pytest.raises(InvalidArgument, match=r"EchoModel\(chunks=...\)"):
        EchoModel(chunks=True)


USER_MODULE = '''
import os
import threading

import brood

FENCE = "`" * 3
calls = 0


def chat(messages, model=None):
    """A user's own chat function: a scripted reply in its own words."""
    if messages[0]["role"] != "system":
        return "plain: " + messages[-1]["content"].upper()
    hold = os.environ.get("HOLD_FIFO")
    if hold and len(messages) == 2:  # announce the first turn, then never answer it
        with open(hold, "w") as f:
            f.write("1")
        threading.Event().wait()
    return f"{FENCE}repl\\nFINAL(llm_query('shout ' + str(len(context or ''))))\\n{FENCE}"


class Shouter:
    def __call__(self, messages, model=None):
        return f"{FENCE}repl\\nFINAL('from an object')\\n{FENCE}"


shouter = Shouter()
NOT_A_FUNCTION = 42


def needs_three(a, b, c):
    return "x"


class Plain:
    pass


class Scripted(brood.ScriptedModel):
    def __init__(self):
        super().__init__([f"{FENCE}repl\\nFINAL('from a Model subclass')\\n{FENCE}"])


class Needy(brood.ScriptedModel):
    pass
'''


USER_MODULES = ("usermodels", "broken_import", "raises")


@pytest.fixture
def user_module(tmp_path: Path) -> Iterator[Path]:
    """A module of the user's, `usermodels`, in a folder of its own (not yet importable),
    and two that fail to import; forgotten by this process at the end."""
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "usermodels.py").write_text(USER_MODULE)
    (folder / "broken_import.py").write_text("import not_installed_anywhere_xyz\n")
    (folder / "raises.py").write_text("raise RuntimeError('no key configured')\n")
    yield folder
    for name in USER_MODULES:
        sys.modules.pop(name, None)


def test_a_python_spec_runs_the_users_function_and_its_other_forms(user_module, monkeypatch):
    monkeypatch.syspath_prepend(str(user_module))
    with brood.Supervisor("python:usermodels:chat", limits=fast()) as sup:
        result = sup.run("any task", context="abc")
        assert (result.state, result.answer) == ("completed", "plain: SHOUT 3")
        assert sup.run("t", model="python:usermodels:shouter").answer == "from an object"
        assert sup.run("t", model="python:usermodels:Scripted").answer == "from a Model subclass"
    model = resolve_model("python:usermodels:chat")
    assert isinstance(model, CallableModel) and model.name == "chat"
    assert spec_record("python:usermodels:chat") == {"spec": "python:usermodels:chat"}


@pytest.mark.parametrize(
    ("spec", "said"),
    [
        ("python:", "needs a module and a name in it; write python:MODULE:FUNCTION"),
        ("python:usermodels", "needs a module and a name in it"),
        ("python:usermodels:", "needs a module and a name in it"),
        ("python:user models:chat", "needs a module and a name in it"),
        (
            "python:usermodels.py:chat",
            "names a file; name the module as Python imports it: python:usermodels:chat",
        ),
        ("python:nowhere_xyz:chat", "no module named 'nowhere_xyz' in the current directory"),
        (
            "python:broken_import:chat",
            "importing module 'broken_import' failed: No module named 'not_installed_anywhere_xyz'",
        ),
        ("python:raises:chat", "importing module 'raises' raised RuntimeError: no key configured"),
        (
            "python:usermodels:chta",
            "has no attribute 'chta'; its callables: Needy, Plain, "
            "Scripted, Shouter, chat, needs_three, shouter",
        ),
        (
            "python:usermodels:NOT_A_FUNCTION",
            "names NOT_A_FUNCTION, of type int, which is not callable",
        ),
        (
            "python:usermodels:needs_three",
            "names needs_three(a, b, c), which cannot be called with the messages alone",
        ),
        ("python:usermodels:Plain", "names the class Plain, not a chat function"),
        ("python:usermodels:Needy", "Needy() cannot be made without arguments"),
    ],
)
def test_a_bad_python_spec_says_what_to_fix(user_module, monkeypatch, spec, said):
    monkeypatch.syspath_prepend(str(user_module))
    with pytest.raises(InvalidArgument) as info:
        resolve_model(spec)
    assert said in str(info.value), str(info.value)


def cli(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k not in ("BROOD_MODEL", "PYTHONPATH")}
    full.update(COLUMNS="200", **env)
    return subprocess.run(
        [*BROOD, *args], capture_output=True, text=True, timeout=TIMEOUT_S, env=full, cwd=cwd
    )


def test_the_cli_imports_a_python_spec_from_pythonpath_or_the_current_directory(
    user_module, tmp_path
):
    store = f"sqlite:///{tmp_path}/j.db"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    args = ("run", "a task", "--model", "python:usermodels:chat", "--store", store, "--json")
    on_path = cli(*args, cwd=elsewhere, PYTHONPATH=str(user_module))
    assert on_path.returncode == 0, on_path.stderr
    assert json.loads(on_path.stdout)["answer"] == "plain: SHOUT 0"
    console_script = Path(sys.executable).parent / "brood"  # whose sys.path lacks the cwd
    here = subprocess.run(
        [str(console_script), *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        cwd=user_module,
        env={k: v for k, v in os.environ.items() if k not in ("BROOD_MODEL", "PYTHONPATH")},
    )
    assert here.returncode == 0, here.stderr
    assert json.loads(here.stdout)["answer"] == "plain: SHOUT 0"
    missing = cli(*args, cwd=elsewhere)
    assert missing.returncode == 2
    assert "no module named 'usermodels' in the current directory" in missing.stderr


def test_brood_resume_imports_the_journaled_python_spec_again(user_module, tmp_path):
    store = f"sqlite:///{tmp_path}/j.db"
    held = Signal(tmp_path, "held")
    env = {k: v for k, v in os.environ.items() if k != "BROOD_MODEL"}
    env.update(PYTHONPATH=str(user_module), HOLD_FIFO=held.path)
    first = subprocess.Popen(
        [*BROOD, "run", "held task", "--model", "python:usermodels:chat", "--store", store],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )
    try:
        held.wait()  # the root's first turn is in the user's function
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate(timeout=TIMEOUT_S)
    wait_gone(first.pid)
    with Journal(store) as journal:
        (root,) = journal.roots()
        assert journal.model_spec(root["id"])["spec"] == "python:usermodels:chat"  # type: ignore[index]
    del env["HOLD_FIFO"]
    out = subprocess.run(
        [*BROOD, "resume", root["id"], "--store", store],  # no --model: the journaled spec
        capture_output=True,
        text=True,
        env=env,
        timeout=TIMEOUT_S,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "plain: SHOUT 0"


def test_the_readme_python_example_runs_as_written(tmp_path):
    """The first example of the README (and of the tutorial's first run), as a script of its
    own; tests/test_doc_examples.py runs every Python block of both as they are."""
    script = tmp_path / "first.py"
    script.write_text(textwrap.dedent(README_PYTHON))
    out = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("completed a list of 3 items, in 3 chunks: 4 lines, 19 words")
    assert lines[1:] == [
        "0 completed Count the words in each note",
        f"1 completed {CHUNK_TASK} 1 of 3 in `context`.",
        f"1 completed {CHUNK_TASK} 2 of 3 in `context`.",
        f"1 completed {CHUNK_TASK} 3 of 3 in `context`.",
    ]


README_PYTHON = """
import brood

notes = ["the owl hunts at dusk", "two owls nest in the oak\\nthe oak is old",
         "no owls seen today"]
with brood.Supervisor("echo") as sup:    # or "openai:MODEL@URL", "python:mychat:chat", a chat_fn
    result = sup.run("Count the words in each note", context=notes)
    print(result.state, result.answer)
    for run in sorted(sup.store.runs(result.run_id), key=lambda r: (r["depth"], r["prompt"])):
        print(run["depth"], run["state"], run["prompt"])
"""

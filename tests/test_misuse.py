"""A catalogue of the mistakes a model makes in the REPL: each is refused with an exception
whose message names the mistake and the fix, before it costs a model call or a child, and
the run goes on. One real run tries them all, one step each."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import brood
from tests.util import fast

FENCE = "```"

# (what the model writes, the exception's type, words its message must hold)
MISUSES = [
    ("llm_query(123)", "InvalidArgument", "prompt must be str, got int"),
    ("llm_query('')", "InvalidArgument", "the prompt is empty"),
    ("llm_query('q' * 5000)", "InvalidArgument", "use llm_query_chunked"),
    ("llm_query_batched('one prompt')", "InvalidArgument", "prompts must be a list of str"),
    ("llm_query_batched(['a', ' '])", "InvalidArgument", "llm_query_batched[1]: the prompt is"),
    ("rlm_query(None)", "InvalidArgument", "prompt must be str, got NoneType"),
    ("rlm_wait('r-12345678')", "InvalidArgument", "takes a handle from rlm_spawn"),
    ("rlm_status(42)", "InvalidArgument", "takes a handle from rlm_spawn"),
    ("rlm_cancel([])", "InvalidArgument", "takes a handle from rlm_spawn"),
    ("rlm_send(spawn(llm_query, 'x'), 'hi')", "InvalidArgument", "needs a child-run handle"),
    ("rlm_products(spawn(llm_query, 'x'))", "InvalidArgument", "takes a child's handle"),
    ("rlm_result(rlm_spawn('child: slow'))", "ChildNotReady", "use rlm_wait(h) to block"),
    ("spawn(print, 'x')", "InvalidArgument", "spawn(fn, ...) starts one of llm_query"),
    ("t = spawn(llm_query, 'x'); spawn(rlm_await, t)", "InvalidArgument", "starts one of"),
    ("FINAL(None)", "InvalidArgument", "pass the answer text"),
    ("FINAL_VAR(3)", "InvalidArgument", "FINAL_VAR('answer')"),
    ("FINAL_VAR('no_such_variable')", "NameError", "variables:"),
    ("FINAL('x', products=[1])", "InvalidArgument", "products must be a JSON object"),
    ("input('name?')", "RuntimeError", "blocked"),
    ("rlm_query('x', retries=-1)", "InvalidArgument", "retries must be a whole number"),
    ("rlm_query('x', pool='gpu')", "InvalidArgument", "is not a pool"),
    ("rlm_query('x', timeout='soon')", "InvalidArgument", "timeout"),
    (
        "rlm_query_batched([f'child {i}' for i in range(9)])",
        "LimitExceeded",
        "raise Limits(max_children_per_run=...)",
    ),
    ("ask_person('q', deadline=-5)", "InvalidArgument", "a number > 0"),
    ("ask_person('q', options='yes')", "InvalidArgument", "a list of strings"),
    ("ask_person('q', options=['a'], default='b')", "InvalidArgument", "none of the options"),
    ("search('(', regex=True)", "InvalidArgument", "search"),
    ("llm_query_chunked(12, 'Sum.')", "InvalidArgument", "text must be str, got int"),
    ("map_files('notes.txt', 'Sum.')", "InvalidArgument", "for one file pass [path]"),
    ("flow_status('r-nope')", "InvalidArgument", "is not a flow this run started"),
    # waits: `t` is the task an earlier line started
    ("rlm_wait(t, timeout='3')", "InvalidArgument", "got '3'; pass the number itself: timeout=3"),
    ("rlm_await(t, timeout=-1)", "InvalidArgument", "rlm_await: timeout must be seconds"),
    ("rlm_wait_all([t], timeout=float('nan'))", "InvalidArgument", "a number >= 0"),
    ("rlm_wait_any([t], timeout='soon')", "InvalidArgument", "rlm_wait_any: timeout must be"),
    ("rlm_await_all([t], timeout=float('inf'))", "InvalidArgument", "timeout=None waits"),
    ("rlm_wait_all([t], t)", "InvalidArgument", "pass them as one list"),
    ("t.wait(timeout='1')", "InvalidArgument", "Task.wait: timeout must be seconds"),
    ("flow_wait('r-nope', timeout='3')", "InvalidArgument", "flow_wait: timeout must be"),
    ("rlm_wait_all(t)", "InvalidArgument", "got one Task; pass it in a list: rlm_wait_all([h])"),
    ("rlm_wait_any(t)", "InvalidArgument", "takes a list of handles, got one Task"),
    ("rlm_await_all(t)", "InvalidArgument", "rlm_await_all([h])"),
    ("rlm_wait_all([t, 'r-1'])", "InvalidArgument", "hs[1] is a str, not a handle"),
    ("rlm_wait([t])", "InvalidArgument", "for several handles use rlm_wait_all(hs)"),
]


def test_at_least_twenty_misuses_are_catalogued():
    assert len(MISUSES) >= 20


def test_every_misuse_is_refused_with_its_fix_and_the_run_goes_on():
    steps = [
        f"{FENCE}repl\n"
        "import json\n"
        "seen = []\n"
        "def attempt(source):\n"
        "    try:\n"
        "        exec(source, globals())\n"
        "        seen.append(['no error', ''])\n"
        "    except BaseException as e:\n"
        "        seen.append([type(e).__name__, str(e)])\n"
        f"for source in {json.dumps([m[0] for m in MISUSES])}:\n"
        "    attempt(source)\n"
        "FINAL(json.dumps(seen))\n"
        f"{FENCE}"
    ]
    model = brood.ScriptedModel(
        {"root": steps, "child": [f"{FENCE}repl\nimport time\ntime.sleep(60)\n{FENCE}"]}
    )
    limits = fast(max_prompt_chars=2_000, max_children_per_run=8)
    with brood.Supervisor(model, limits=limits) as sup:
        result = sup.run("root")
        calls = sup.store.get_run(result.run_id)["usage"]["model_calls"]
    assert result.state == "completed", result
    seen = json.loads(result.answer)
    problems = []
    for (source, kind, words), (got_kind, message) in zip(MISUSES, seen, strict=True):
        if got_kind != kind or words not in message:
            problems.append(f"{source}: {got_kind}: {message}")
    assert not problems, "\n".join(problems)
    # Only the turn itself and the two spawned llm_query tasks cost model calls.
    assert calls <= 4


def test_an_oversized_context_is_refused_before_anything_is_journaled(tmp_path, monkeypatch):
    """A context over the bound of one run's context is refused naming both sizes, and the
    journal holds no run for it (from Python and from `brood run --context`)."""
    from brood.supervisor import starts

    monkeypatch.setattr(starts, "MAX_CONTEXT_BYTES", 1_000)
    store = f"sqlite:///{tmp_path}/j.db"
    with brood.Supervisor(brood.ScriptedModel([]), store=store) as sup:
        with pytest.raises(brood.InvalidArgument, match=r"context is [\d,]+ bytes pickled, over"):
            sup.run("task", context="x" * 5_000)
        assert sup.store.roots(10) == []


def test_brood_run_refuses_an_oversized_context_file(tmp_path):
    from brood.protocol import MAX_CONTEXT_BYTES

    big = tmp_path / "big.txt"
    with open(big, "wb") as f:  # a sparse file: its size is all that is read
        f.truncate(MAX_CONTEXT_BYTES + 1)
    store = f"sqlite:///{tmp_path}/j.db"
    cmd = [sys.executable, "-m", "brood.cli.main", "run", "task", "--context", str(big)]
    done = subprocess.run(
        [*cmd, "--store", store, "--model", "scripted:demo"], capture_output=True, text=True
    )
    assert done.returncode != 0
    assert f"{MAX_CONTEXT_BYTES + 1:,} bytes, over the {MAX_CONTEXT_BYTES:,}-byte" in done.stderr
    assert not (tmp_path / "j.db").exists()  # refused before the journal was opened

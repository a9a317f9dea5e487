"""The system prompt is generated from the helpers' docstrings, so it cannot drift from them."""

from __future__ import annotations

import builtins
import inspect
import io
import re
from collections.abc import Callable
from typing import Any

import pytest

import brood
import brood.errors
from brood.limits import PI_RLM_BLOCKED_BUILTINS
from brood.protocol import Start, SyncChannel
from brood.worker import helpers as helpers_module
from brood.worker.helpers import HELPER_NAMES, AskHandle, ChildHandle, Runtime, Task, make_helpers
from brood.worker.link import Link
from brood.worker.main import first_message
from brood.worker.prompt import (
    INTRO,
    OUTRO,
    cached_system_prompt,
    describe_context,
    system_prompt,
)
from brood.worker.repl import Repl, StepClock
from tests.util import fast


def helpers(*, can_spawn: bool = True) -> dict[str, Callable[..., Any]]:
    link = Link(SyncChannel(io.BytesIO(), io.BytesIO()))
    rt = Runtime(
        link,
        run_id="r-test",
        depth=0,
        can_spawn=can_spawn,
        clock=StepClock(),
        max_depth=2,
    )
    return make_helpers(rt)


@pytest.fixture(scope="module")
def prompt() -> str:
    return system_prompt(helpers(), can_spawn=True)


def test_the_helpers_placed_in_the_repl_are_exactly_helper_names() -> None:
    made = helpers()
    assert set(made) == HELPER_NAMES
    assert all(fn.__name__ == name for name, fn in made.items())


@pytest.mark.parametrize("name", sorted(HELPER_NAMES))
def test_every_helper_is_in_the_prompt_with_its_signature_and_first_doc_line(
    name: str, prompt: str
) -> None:
    fn = helpers()[name]
    doc = inspect.getdoc(fn)
    assert doc, f"{name} has no docstring, so the model would not learn what it does"
    first_line = doc.splitlines()[0]
    assert f"\n- {name}(" in prompt
    assert first_line in prompt
    entry = prompt.split(f"\n- {name}(", 1)[1]
    assert entry.split("\n- ", 1)[0].count(first_line) == 1, "the doc belongs to its helper"


@pytest.mark.parametrize("name", sorted(HELPER_NAMES))
def test_every_line_of_every_docstring_reaches_the_model(name: str, prompt: str) -> None:
    doc = inspect.getdoc(helpers()[name]) or ""
    for line in doc.splitlines():
        assert line.strip() in prompt


def test_signatures_read_as_python_without_string_annotations(prompt: str) -> None:
    assert "\n- llm_query(prompt: str, model: str | None = None) -> str\n" in prompt
    assert "- rlm_wait(h: Handle, timeout: float | None = None) -> Any\n" in prompt
    assert "'" not in "".join(line for line in prompt.splitlines() if line.startswith("- "))


def test_the_helper_names_match_the_design_table() -> None:
    design_section_3 = {
        "llm_query", "llm_query_batched", "rlm_query", "rlm_query_batched", "rlm_spawn",
        "rlm_status", "rlm_result", "rlm_wait", "rlm_wait_all", "rlm_wait_any", "rlm_cancel",
        "rlm_send", "rlm_children", "spawn", "rlm_await", "rlm_await_all", "FINAL",
        "FINAL_VAR", "SHOW_VARS",
    }  # fmt: skip
    # Beyond the table: remember() is the replay-safe pattern of DESIGN section 7's resume,
    # and the flow_* helpers are issue 5's way for a model to run a flow.
    flows = {"flow_run", "flow_status", "flow_wait", "flow_stop", "flow_resume"}
    # DESIGN section 9: products, asks to a person (and pi-rlm's form of them).
    section_9 = {"rlm_products", "ask_person", "ask_user_question"}
    # The long-context toolkit (delegation and retrieval).
    toolkit = {"llm_query_chunked", "map_files", "llm_map_reduce", "search", "grep_context"}
    toolkit |= {"outline", "budget_remaining"}
    assert design_section_3 | {"remember"} | flows | section_9 | toolkit == HELPER_NAMES


def test_the_prompt_explains_fences_final_and_context(prompt: str) -> None:
    assert prompt.startswith(INTRO)
    assert prompt.endswith(OUTRO)
    for phrase in ("```repl", "FINAL(answer)", "`context`", "persist"):
        assert phrase in prompt


# A word that reads as an exception's name, whether or not one by that name exists.
_EXCEPTIONISH = re.compile(
    r"\b[A-Z][A-Za-z]*(?:Error|Exception|Timeout|Exceeded|Limited|Failed|Cancelled|NotReady"
    r"|Diverged|Argument|Spec|Closed|Missing|Interrupt)\b"
)
_CAMEL = re.compile(r"\b[A-Z][a-z0-9]+(?:[A-Z][A-Za-z0-9]*)+\b")


def _is_exception(value: object) -> bool:
    return isinstance(value, type) and issubclass(value, BaseException)


def _named_exceptions(text: str) -> set[str]:
    """Every exception `text` names: a CamelCase word that is a brood error or a builtin
    exception, and every word that reads as one (so a name nothing defines is caught)."""
    known = {n for n in vars(brood.errors) if _is_exception(getattr(brood.errors, n))}
    known |= {n for n in vars(builtins) if _is_exception(getattr(builtins, n))}
    return {w for w in _CAMEL.findall(text) if w in known} | set(_EXCEPTIONISH.findall(text))


def _documentation_the_model_reads() -> str:
    """The system prompt (both variants) and every docstring of the helpers and of the
    handles they return, the methods a model calls on them included."""
    docs = [system_prompt(helpers(), can_spawn=True), system_prompt(helpers(), can_spawn=False)]
    docs += [inspect.getdoc(fn) or "" for fn in helpers().values()]
    for cls in (ChildHandle, Task, AskHandle):
        docs.append(inspect.getdoc(cls) or "")
        for name, member in vars(cls).items():
            if not name.startswith("_"):
                target = member.fget if isinstance(member, property) else member
                docs.append(inspect.getdoc(target) or "")
    return "\n".join(docs)


def test_every_exception_the_model_is_told_of_is_in_the_repl_by_that_name() -> None:
    text = _documentation_the_model_reads()
    named = _named_exceptions(text)
    # the walk finds what the prompt plainly names
    assert {"ChildFailed", "ModelError", "RateLimited", "TimeoutError"} <= named
    repl = Repl(
        {**helpers(), **helpers_module.ERRORS},
        None,
        blocked=PI_RLM_BLOCKED_BUILTINS,  # a blocked builtin is not an exception, still
    )
    missing = []
    for name in sorted(named):
        found = repl.namespace.get(name, repl.namespace["__builtins__"].get(name))
        if not _is_exception(found):
            missing.append(name)
    assert not missing, f"named for the model but not catchable by name in the REPL: {missing}"
    out = repl.run("print(issubclass(RateLimited, ModelError), ModelError.__module__)", None)
    assert out.error is None and out.stdout == "True brood.errors\n"


FENCE = "```"


def test_model_code_catches_a_failed_call_by_the_names_the_prompt_gives(gate_clock) -> None:
    """A real run: the root's code catches a rate-limited call as RateLimited and a broken
    call as ModelError, by name, and goes on to answer."""
    root = (
        f"{FENCE}repl\n"
        "caught = []\n"
        "try:\n"
        "    llm_query('limited call')\n"
        "except RateLimited as e:\n"
        "    caught.append(f'RateLimited retry_after={e.retry_after}')\n"
        "try:\n"
        "    llm_query('broken call')\n"
        "except ModelError as e:\n"
        "    caught.append('ModelError ' + str(e))\n"
        "FINAL(' | '.join(caught))\n"
        f"{FENCE}"
    )

    def chat(messages: list[dict[str, Any]], model: str | None = None) -> str:
        task = str(messages[-1]["content"])
        if task == "limited call":
            raise brood.RateLimited("quota exhausted", retry_after=4.0)
        if task == "broken call":
            raise RuntimeError("the server fell over")
        if any(m["role"] == "assistant" for m in messages):
            return f"{FENCE}repl\nFINAL('the first step failed')\n{FENCE}"
        return root

    with brood.Supervisor(chat, limits=fast()) as sup:
        result = sup.run("catch the failures")
    assert result.state == "completed", result
    assert result.answer != "the first step failed", "an except clause named no defined error"
    limited, broken = str(result.answer).split(" | ")
    assert limited == "RateLimited retry_after=4.0"
    assert broken.startswith("ModelError ") and "the server fell over" in broken
    assert gate_clock, "the rate-limited call waited at the gateway's gate first"


def test_a_run_at_the_deepest_level_is_told_rlm_query_is_a_plain_call() -> None:
    note = "rlm_query answers with a plain model call"
    assert note not in system_prompt(helpers(), can_spawn=True)
    assert note in system_prompt(helpers(can_spawn=False), can_spawn=False)


@pytest.mark.parametrize(
    ("context", "words"),
    [
        ("x" * 1234, ["str", "1,234 characters"]),
        ([1, 2, 3], ["list", "3 items"]),
        ({"a": 1, "b": 2}, ["dict", "2 items"]),
        (42, ["value of type int"]),
        ({"a": 1}, ["dict", "1 item."]),
    ],
)
def test_the_context_is_described_by_type_and_size(context: Any, words: list[str]) -> None:
    text = describe_context(context)
    assert text.startswith("`context` is a")
    for word in words:
        assert word in text


def test_no_context_is_said_plainly() -> None:
    assert describe_context(None) == "There is no context: `context` is None."


def test_the_first_message_has_the_task_the_context_and_parent_messages() -> None:
    start = Start(
        run_id="r-1",
        depth=1,
        prompt="Count the sightings",
        context=None,
        limits={},
        messages=["hurry"],
    )
    assert first_message(start, "abc") == (
        "Count the sightings\n\n`context` is a str of 3 characters.\n"
        "[message from your parent] hurry"
    )


@pytest.mark.parametrize("can_spawn", [True, False])
def test_the_prompt_built_from_the_verbs_is_the_one_a_run_s_helpers_give(can_spawn: bool) -> None:
    """Workers take the system prompt from the verbs themselves (no run needed); it must be
    what the helpers placed in a run's REPL describe, signatures without the Runtime."""
    assert cached_system_prompt(can_spawn) == system_prompt(
        helpers(can_spawn=can_spawn), can_spawn=can_spawn
    )
    assert "rt:" not in cached_system_prompt(can_spawn)

"""The system prompt, generated from the helpers' docstrings so it cannot drift from them."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from brood.limits import may_start_children
from brood.protocol import BUDGET_MARK, ToolInfo
from brood.worker.verbs import helpers_in_order
from brood.worker.verbs.base import model_signature

INTRO = """You solve a task by writing Python in a persistent REPL. Put code in ```repl fences;
every block of your reply runs in order and you see what it prints. Variables persist across
steps. The variable `context` holds the task's context. Split big work into pieces: ask a
plain model with llm_query, or start child runs (each a whole solver with its own REPL) with
rlm_query / rlm_spawn; spawned children run while you keep working, and you collect them later.
When you know the answer, call FINAL(answer) in a repl block.

Helpers available in the REPL:
"""

OUTRO = """
Example: start a child, keep working, then collect it.
```repl
h = rlm_spawn("Summarize the first half of this text", context=context[: len(context) // 2])
words = len(context.split())          # your own work while the child runs
summary = rlm_wait(h)                 # collect it (ChildFailed if it failed)
FINAL(f"{words} words. {summary}")
```
Finished children are announced at the start of your next turn. The errors ChildFailed
(.status, .reason, and for batches .failed and .answers), ChildNotReady, AskCancelled
(.ask), StallTimeout, ModelError (a model call failed), RateLimited (a ModelError: the
model's endpoint kept refusing for its rate limit), InvalidArgument, InvalidSpec,
LimitExceeded, StaleHandle and BroodError are defined for except clauses. A wait's
timeout raises TimeoutError; a wait on work that reports nothing for a long while raises
StallTimeout (the work keeps running: wait again or cancel it). Errors name the mistake
and the fix; read them. Do not guess an answer you have not computed."""


Signature = Callable[[Callable[..., Any]], inspect.Signature]


def describe_helper(fn: Callable[..., Any], signature: Signature = inspect.signature) -> str:
    sig = str(signature(fn)).replace("'", "")
    doc = inspect.cleandoc(fn.__doc__ or "")
    body = "\n".join("    " + line for line in doc.splitlines())
    return f"- {fn.__name__}{sig}\n{body}"


def system_prompt(
    helpers: Mapping[str, Callable[..., Any]],
    *,
    can_spawn: bool,
    signature: Signature = inspect.signature,
) -> str:
    """The system prompt listing `helpers`: as placed in a REPL (bound to a run), or the
    verbs themselves with `signature=model_signature`, which leaves out their Runtime."""
    parts = [INTRO]
    parts += [describe_helper(fn, signature) for fn in helpers.values()]
    if not can_spawn:
        parts.append(
            "\nThis run is at the deepest level allowed: rlm_query answers with a plain model "
            "call instead of a child run."
        )
    parts.append(OUTRO)
    return "\n".join(parts)


TOOLS_INTRO = """

Tools: the user's own functions, in the REPL beside the helpers. Call them like any
function, with JSON-like arguments (str, numbers, bools, None, lists, dicts); each call's
arguments are checked against its signature (InvalidArgument says which is wrong), and a
tool that fails raises ToolError with its reason.
"""


def describe_tools(tools: list[ToolInfo]) -> str:
    """The part of a run's system prompt that lists its tools ("" when it has none)."""
    if not tools:
        return ""
    parts = []
    for t in tools:
        body = "\n".join("    " + line for line in t.doc.splitlines())
        parts.append(f"- {t.name}{t.signature}" + (f"\n{body}" if body else ""))
    return TOOLS_INTRO + "\n".join(parts)


def describe_budget(budget: dict[str, Any]) -> str:
    """The run-specific end of its system prompt: its place in the tree and what is left
    (budget_remaining() gives the same figures, then)."""
    left = budget.get("tokens_left")
    tokens = "no token budget" if left is None else f"{left:,} tokens left in the tree"
    cost = budget.get("cost_left")
    money = "" if cost is None else f", {cost:g} of cost left"
    spawn = (
        f"you may start {budget['children_left_for_this_run']:,} more child runs "
        f"({budget['children_left']:,} left in the whole tree)"
        if may_start_children(budget["depth"], budget["max_depth"])
        else "you cannot start child runs (rlm_query is a plain model call here)"
    )
    return (
        f"{BUDGET_MARK} depth {budget['depth']} of max_depth {budget['max_depth']}; "
        f"{spawn}; {tokens}{money}. budget_remaining() gives these figures as they stand."
    )


def describe_context(context: Any) -> str:
    if context is None:
        return "There is no context: `context` is None."
    kind = type(context).__name__
    if isinstance(context, str):
        return f"`context` is a str of {len(context):,} characters."
    try:
        n = len(context)
    except TypeError:
        return f"`context` is a value of type {kind}."
    return f"`context` is a {kind} of {n:,} item{'s' if n != 1 else ''}."


_CACHE: dict[bool, str] = {}


def cached_system_prompt(can_spawn: bool) -> str:
    """The system prompt, built once per process. The zygote builds both variants before it
    freezes its heap, so a forked worker starts its first turn without rebuilding them."""
    if can_spawn not in _CACHE:
        _CACHE[can_spawn] = system_prompt(
            helpers_in_order(), can_spawn=can_spawn, signature=model_signature
        )
    return _CACHE[can_spawn]

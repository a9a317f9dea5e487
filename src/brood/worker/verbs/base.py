"""What every verb module shares: the helper names, declared once in the order the system
prompt lists them; the registry each verb module fills with `@verb`; binding a verb to a
run; the errors placed in the REPL beside the helpers; the checks of prompts.

A verb is written as a module-level function whose last parameter is the keyword-only
`rt: Runtime`; `bind` supplies it. The model sees the function without it (its name,
docstring and `model_signature`), and a call with a wrong argument raises the TypeError
it would raise if `rt` were not there (Python counts only the positional arguments).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from brood import errors
from brood.errors import InvalidArgument
from brood.worker.runtime import Runtime

# The helpers' names, as the model sees them, in the order the system prompt lists them.
HELPER_ORDER: tuple[str, ...] = (
    # calls.py: plain model calls
    "llm_query",
    "llm_query_batched",
    # toolkit.py: delegation over long texts, and retrieval
    "llm_query_chunked",
    "map_files",
    "llm_map_reduce",
    "search",
    "grep_context",
    "outline",
    # children.py: child runs, and the verbs every handle takes
    "rlm_query",
    "rlm_query_batched",
    "rlm_spawn",
    "rlm_status",
    "rlm_result",
    "rlm_products",
    # asks.py: asks to a person
    "ask_person",
    "ask_user_question",
    # children.py
    "rlm_wait",
    "rlm_wait_all",
    "rlm_wait_any",
    "rlm_cancel",
    "rlm_send",
    "rlm_children",
    # tasks.py: work started without waiting
    "spawn",
    "rlm_await",
    "rlm_await_all",
    # flows.py
    "flow_run",
    "flow_status",
    "flow_wait",
    "flow_stop",
    "flow_resume",
    # run.py: the run itself (its journal, its budget, its end, its variables)
    "remember",
    "budget_remaining",
    "FINAL",
    "FINAL_VAR",
    "SHOW_VARS",
)
HELPER_NAMES = frozenset(HELPER_ORDER)

# Errors the model's code may want to catch, placed in the namespace by name: every one the
# system prompt or a helper's docstring names (tests/test_prompt.py walks them), so an
# `except ModelError:` never fails with NameError exactly when a call fails.
ERRORS: dict[str, type[BaseException]] = {
    e.__name__: e
    for e in (
        errors.AskCancelled,
        errors.BroodError,
        errors.ChildFailed,
        errors.ChildNotReady,
        errors.InvalidArgument,
        errors.InvalidSpec,
        errors.LimitExceeded,
        errors.ModelError,
        errors.RateLimited,
        errors.StaleHandle,
        errors.StallTimeout,
        errors.ToolError,
    )
}

Verb = Callable[..., Any]  # a helper as written: it takes the run's Runtime as `rt`
VERBS: dict[str, Verb] = {}  # filled as each verb module is imported


def verb(fn: Verb) -> Verb:
    """Register `fn` as the helper of its name, which HELPER_ORDER must declare."""
    if fn.__name__ not in HELPER_NAMES:
        raise ValueError(f"verb {fn.__name__!r} is not declared in HELPER_ORDER")
    if fn.__name__ in VERBS or "rt" not in inspect.signature(fn).parameters:
        raise ValueError(f"verb {fn.__name__!r} is registered twice or takes no `rt`")
    VERBS[fn.__name__] = fn
    SIGNATURES[fn.__name__] = _without_rt(fn)
    return fn


# Each verb's signature as the model calls it, made once as the verbs are imported (in the
# zygote, before it freezes its heap): a worker binding 35 helpers then makes none itself.
SIGNATURES: dict[str, inspect.Signature] = {}


def _without_rt(fn: Verb) -> inspect.Signature:
    sig = inspect.signature(fn)
    return sig.replace(parameters=[p for p in sig.parameters.values() if p.name != "rt"])


def model_signature(fn: Verb) -> inspect.Signature:
    """A verb's signature as the model calls it: without `rt`, which `bind` supplies."""
    return SIGNATURES.get(fn.__name__) or _without_rt(fn)


def bind(fn: Verb, rt: Runtime) -> Callable[..., Any]:
    """`fn` as placed in the REPL of the run `rt`: its name, docstring and model signature
    (`__wrapped__` is the verb: `spawn` tells its own helpers by it). Set by hand rather
    than by functools.wraps: every worker binds every verb at its start."""

    def helper(*args: Any, **kw: Any) -> Any:
        return fn(*args, rt=rt, **kw)

    return _dressed(helper, fn)


def bind_later(fn: Verb, run: list[Runtime]) -> Callable[..., Any]:
    """`bind`, to the run that `run` (a list of one) will hold when the helper is called."""

    def helper(*args: Any, **kw: Any) -> Any:
        return fn(*args, rt=run[0], **kw)

    return _dressed(helper, fn)


def _dressed(helper: Callable[..., Any], fn: Verb) -> Callable[..., Any]:
    helper.__name__, helper.__qualname__ = fn.__name__, fn.__qualname__
    helper.__module__, helper.__doc__ = fn.__module__, fn.__doc__
    helper.__wrapped__ = fn  # type: ignore[attr-defined]
    helper.__signature__ = model_signature(fn)  # type: ignore[attr-defined]
    return helper


def verb_of(value: object) -> Verb | None:
    """The verb a helper binds, or None for anything else."""
    fn = getattr(value, "__wrapped__", None)
    return fn if fn is not None and VERBS.get(getattr(fn, "__name__", "")) is fn else None


def check_prompt(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise InvalidArgument(f"{where}: prompt must be str, got {type(value).__name__}")
    if not value.strip():
        raise InvalidArgument(f"{where}: the prompt is empty; write what to ask")
    return value


def check_prompts(value: object, where: str) -> list[str]:
    if isinstance(value, str) or not isinstance(value, list | tuple):
        raise InvalidArgument(
            f"{where}: prompts must be a list of str, got {type(value).__name__}; pass a "
            "list, e.g. [prompt] for one"
        )
    return [check_prompt(p, f"{where}[{i}]") for i, p in enumerate(value)]

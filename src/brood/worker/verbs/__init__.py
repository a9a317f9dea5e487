"""The REPL helpers of DESIGN.md section 3 ("verbs"), one module per family:

- `calls`: plain model calls (llm_query, llm_query_batched);
- `toolkit`: delegation over long texts and retrieval (llm_query_chunked, search, ...);
- `children`: child runs and the verbs every handle takes (rlm_query, rlm_wait, ...);
- `asks`: asks to a person (ask_person, ask_user_question);
- `tasks`: work started without waiting (spawn, rlm_await, rlm_await_all);
- `flows`: flows started from the REPL (flow_run, flow_wait, ...);
- `run`: the run itself (remember, budget_remaining, FINAL, FINAL_VAR, SHOW_VARS).

Their names are declared once, in the order the system prompt lists them
(`base.HELPER_ORDER`); each module registers its verbs with `@verb`. Their docstrings are
the documentation the model reads: `prompt.py` builds the system prompt from them, so keep
each one short and exact.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from brood.worker.runtime import Runtime
from brood.worker.verbs import asks, calls, children, flows, run, tasks, toolkit
from brood.worker.verbs.base import (
    ERRORS,
    HELPER_NAMES,
    HELPER_ORDER,
    VERBS,
    Verb,
    bind,
    bind_later,
)

_FAMILIES = (calls, toolkit, children, asks, tasks, flows, run)  # each fills VERBS
if VERBS.keys() != HELPER_NAMES:
    raise ImportError(f"helpers declared but not defined: {sorted(HELPER_NAMES - VERBS.keys())}")


def helpers_in_order() -> dict[str, Verb]:
    """Every verb, unbound, in the order the system prompt lists them."""
    return {name: VERBS[name] for name in HELPER_ORDER}


# Helpers bound ahead (`prebind`), each set with the list its run is to be put in.
_prebound: list[tuple[dict[str, Callable[..., Any]], list[Runtime]]] = []


def make_helpers(rt: Runtime) -> dict[str, Callable[..., Any]]:
    """The functions placed in the REPL namespace, bound to one run."""
    if _prebound:
        helpers, run = _prebound.pop()
        run.append(rt)
        return helpers
    return {name: bind(fn, rt) for name, fn in helpers_in_order().items()}


def prebind() -> None:
    """Bind every verb once ahead, to a run named later: the next `make_helpers` takes this
    set and names its run. The zygote calls it before it forks, so that a worker's one
    `make_helpers` takes helpers made together instead of binding each verb (its name,
    docstring and signature, spread over the zygote's heap, each page touched a
    copy-on-write fault in a fresh worker): 0.2 ms less of its CPU."""
    run: list[Runtime] = []
    _prebound.append(({name: bind_later(fn, run) for name, fn in helpers_in_order().items()}, run))


__all__ = [
    "ERRORS",
    "HELPER_NAMES",
    "HELPER_ORDER",
    "helpers_in_order",
    "make_helpers",
    "prebind",
]

"""The run itself: `remember` (a value journaled for replay), `budget_remaining`, its end
(`FINAL`, `FINAL_VAR`) and its variables (`SHOW_VARS`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import cloudpickle

from brood.errors import InvalidArgument
from brood.protocol import MAX_REMEMBER_BYTES, BudgetReq, Remember
from brood.worker.repl import FinalSignal
from brood.worker.runtime import Runtime
from brood.worker.verbs.base import ERRORS, HELPER_NAMES, verb


@verb
def remember(fn: Callable[..., Any], *args: Any, rt: Runtime, **kw: Any) -> Any:
    """Call fn(*args, **kw) once and journal its result; when a crashed tree is resumed
    and this step replays, the journaled result comes back instead of a new call. Use it
    for the clock, randomness, files and the network, e.g. now = remember(time.time)."""
    if not callable(fn):
        raise InvalidArgument(f"remember(fn, ...) needs a callable, got {type(fn).__name__}")
    replay = rt.replay
    if replay is not None and replay.remembered:
        return cloudpickle.loads(replay.remembered.pop(0))
    value = fn(*args, **kw)
    try:
        blob = cloudpickle.dumps(value)
    except Exception as exc:
        raise InvalidArgument(
            f"remember: the result ({type(value).__name__}) cannot be pickled to be "
            f"journaled: {exc}"
        ) from exc
    if len(blob) > MAX_REMEMBER_BYTES:
        raise InvalidArgument(
            f"remember: the result is {len(blob):,} bytes pickled, over the "
            f"{MAX_REMEMBER_BYTES:,} bytes one remembered value may hold; remember less "
            "(e.g. a file's hash or path rather than its bytes)"
        )
    rt.link.send(Remember(blob))
    return value


@verb
def budget_remaining(*, rt: Runtime) -> dict[str, Any]:
    """This run's place in the tree and what is left now: depth, max_depth,
    children_left (whole tree), children_left_for_this_run, tokens_left / cost_left
    (None: no budget), tokens_used (the tree's)."""
    rt.check_open()
    budget: dict[str, Any] = rt.link.request(BudgetReq(req_id=rt.link.next_id()))
    return budget


@verb
def FINAL(answer: Any, products: dict[str, Any] | None = None, *, rt: Runtime) -> None:
    """End the run with `answer` (converted to str). Nothing after it runs. `products`,
    a JSON object, goes beside the answer: the parent reads it with rlm_products(h)."""
    if answer is None:
        raise InvalidArgument("FINAL(answer): answer is None; pass the answer text")
    rt.products = _check_products(products)
    rt.final = answer if isinstance(answer, str) else str(answer)
    raise FinalSignal


@verb
def FINAL_VAR(name: str, *, rt: Runtime) -> None:
    """End the run with the value of the REPL variable called `name`."""
    if not isinstance(name, str):
        raise InvalidArgument(
            "FINAL_VAR(name): pass the variable's name as a str, e.g. FINAL_VAR('answer')"
        )
    if name not in rt.namespace:
        raise NameError(f"FINAL_VAR: no variable {name!r}; variables: {sorted(SHOW_VARS(rt=rt))}")
    FINAL(rt.namespace[name], rt=rt)


@verb
def SHOW_VARS(*, rt: Runtime) -> dict[str, str]:
    """The user variables of the REPL, as {name: type}."""
    reserved = HELPER_NAMES | ERRORS.keys() | rt.tools.keys() | {"context"}
    return {
        k: type(v).__name__
        for k, v in rt.namespace.items()
        if k not in reserved and not k.startswith("_")
    }


def _check_products(products: object) -> dict[str, Any] | None:
    """FINAL's products: None, or a JSON object (str keys, finite JSON values)."""
    if products is None:
        return None
    if not isinstance(products, dict) or not all(isinstance(k, str) for k in products):
        raise InvalidArgument(
            f"FINAL(answer, products=...): products must be a JSON object (a dict with str "
            f"keys), got {type(products).__name__}"
        )
    try:
        text = json.dumps(products, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(
            f"FINAL(answer, products=...): products must be JSON ({exc}); use str, numbers, "
            "bools, None, lists and dicts"
        ) from None
    result: dict[str, Any] = json.loads(text)  # a copy: later changes in the REPL do not count
    return result

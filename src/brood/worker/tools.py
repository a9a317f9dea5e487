"""The user's tools in a run's REPL (brood.tools): one function per tool its Start lists.

A tool the supervisor runs is a stub that sends a `ToolReq` with the arguments as model
code passed them; the supervisor checks them, calls the tool, journals the call and
answers (from the journal, when the run is resumed). A tool marked `in_worker=True` came
pickled in the Start: it is called here, confined, after the same check of its
arguments, and its outcome is journaled as a `remember()` value is, so a resumed run's
replay gets it back instead of calling it again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import cloudpickle

from brood.errors import InvalidArgument, ToolError
from brood.protocol import MAX_REMEMBER_BYTES, Remember, ToolInfo, ToolReq
from brood.tools import check_arguments, signature_of
from brood.worker.runtime import Runtime


def make_tools(infos: list[ToolInfo], rt: Runtime) -> dict[str, Callable[..., Any]]:
    """The functions placed in the REPL for the tools `infos`, bound to one run."""
    tools = {info.name: _in_worker(info, rt) if info.fn else _remote(info, rt) for info in infos}
    for info, fn in zip(infos, tools.values(), strict=True):
        fn.__name__ = fn.__qualname__ = info.name
        fn.__doc__ = info.doc
    return tools


def _remote(info: ToolInfo, rt: Runtime) -> Callable[..., Any]:
    name = info.name

    def call(*args: Any, **kwargs: Any) -> Any:
        msg = ToolReq(
            req_id=rt.link.next_id(), name=name, args=list(args), kwargs=kwargs, step=rt.step
        )
        with rt.clock.paused():
            try:
                return rt.link.request(msg, what=f"tool {name}")
            except InvalidArgument as exc:
                if "tool " in str(exc):
                    raise
                raise InvalidArgument(
                    f"tool {name}: {exc} (a tool takes JSON-like values: str, numbers, bools, "
                    "None, lists and dicts)"
                ) from None

    return call


def _in_worker(info: ToolInfo, rt: Runtime) -> Callable[..., Any]:
    name = info.name
    fn = cloudpickle.loads(info.fn or b"")
    sig = signature_of(fn, name, loose=True)

    def call(*args: Any, **kwargs: Any) -> Any:
        bound = check_arguments(name, sig, list(args), kwargs)
        replay = rt.replay
        if replay is not None and replay.remembered:
            ok, value = cloudpickle.loads(replay.remembered.pop(0))
        else:
            try:
                ok, value = True, fn(*bound.args, **bound.kwargs)
            except Exception as exc:
                ok, value = False, f"tool {name} raised {type(exc).__name__}: {exc}"
            _journal(rt, name, ok, value)
        if not ok:
            raise ToolError(value, tool=name)
        return value

    return call


def _journal(rt: Runtime, name: str, ok: bool, value: Any) -> None:
    """Journal a call's outcome as a remembered value: (True, result) or (False, error)."""
    try:
        blob = cloudpickle.dumps((ok, value))
    except Exception as exc:
        raise ToolError(
            f"tool {name} returned a {type(value).__name__}, which cannot be pickled to be "
            f"journaled: {exc}; make it return plain values",
            tool=name,
        ) from None
    if len(blob) > MAX_REMEMBER_BYTES:
        raise ToolError(
            f"tool {name} returned {len(blob):,} bytes pickled, over the "
            f"{MAX_REMEMBER_BYTES:,} one journaled result may hold; make it return less",
            tool=name,
        )
    rt.link.send(Remember(blob))


__all__ = ["make_tools"]

"""The user's tools, called for model code (brood.tools): the `ToolReq` a run's REPL sends.

A tool is the user's code with the user's rights, like the model gateway: it runs here, in
the supervisor's process, on a pool of daemon threads (an `async def` tool on the loop), never
in the worker. Each call's arguments, written by model code, are checked against the
tool's signature first; its result must be JSON. Every call that ran is journaled as a
`tool_call` event (its canonical arguments, its result or its error), counted in
Limits.journal_bytes_per_run; a resumed run's calls are answered from those events, in
order per call, so a tool is not called again for what the journal holds.

It owns the tools and their calls; it starts, ends and budgets no run.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any, Protocol

from brood.errors import InvalidArgument, ToolError
from brood.protocol import ToolInfo, ToolReq
from brood.supervisor import frames
from brood.supervisor.frames import Violation
from brood.supervisor.gateway import CallPool
from brood.supervisor.kernel import Kernel
from brood.supervisor.runs import Run
from brood.tools import MAX_TOOL_BYTES, Tool, call_key, check_arguments, json_result

# Tools running at once in this supervisor (each on a daemon thread); more calls queue.
TOOL_THREADS = 16
TOOL_EVENT = "tool_call"


class RemoteTools(Protocol):
    """Tools another process serves (MCP servers: brood.supervisor.mcp), as the ToolBox
    calls them: described, checked before a call, called, closed."""

    infos: list[ToolInfo]

    def arguments(self, name: str, args: list[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
        """The arguments of a call of `name`, checked (InvalidArgument otherwise)."""

    async def call(self, name: str, arguments: dict[str, Any]) -> Any:
        """The result of one call (ToolError when it fails)."""

    async def aclose(self) -> None:
        """Close every connection; no process of theirs is left."""


class ToolBox:
    """The tools of one supervisor, as every run's REPL has them."""

    def __init__(self, kernel: Kernel, tools: tuple[Tool, ...] = ()) -> None:
        self.kernel = kernel
        self.tools = {t.name: t for t in tools}
        self.infos: list[ToolInfo] = [t.spec for t in tools]
        self.remote: RemoteTools | None = None
        self.remote_names: frozenset[str] = frozenset()
        self._pool = CallPool(TOOL_THREADS, name="brood-tool")

    def add_remote(self, remote: RemoteTools) -> None:
        """Add the tools `remote` serves (before any run starts: Start lists them)."""
        taken = self.tools.keys() & {i.name for i in remote.infos}
        if taken:
            raise InvalidArgument(
                f"tool names {sorted(taken)} are taken by the supervisor's own tools; rename "
                "those (Tool(fn, name='...')) or the MCP server (--mcp NAME=CMD)"
            )
        self.remote = remote
        self.remote_names = frozenset(i.name for i in remote.infos)
        self.infos = self.infos + remote.infos

    async def aclose(self) -> None:
        self._pool.close()
        if self.remote is not None:
            await self.remote.aclose()

    def check(self, run: Run, msg: ToolReq) -> None:
        """A frame no worker keeping the protocol sends: Violation."""
        t = self.tools.get(msg.name)
        if (t is None or t.in_worker) and msg.name not in self.remote_names:
            raise Violation(f"a call of {msg.name!r}, which is not a tool the supervisor runs")
        if msg.step > run.steps.last:
            raise Violation(f"a tool was called by step {msg.step}, before it began")

    async def call(self, run: Run, msg: ToolReq) -> Any:
        """The result of one call (from the journal when a resumed run's call is there);
        InvalidArgument for arguments its signature refuses, ToolError when it fails."""
        name = msg.name
        key = call_key(name, msg.args, msg.kwargs)
        recorded = run.tool_replay.get(key)
        if recorded:
            return _outcome(name, recorded.pop(0))
        if len(key) > MAX_TOOL_BYTES:
            raise InvalidArgument(
                f"tool {name}: its arguments are {len(key):,} bytes of JSON, over the "
                f"{MAX_TOOL_BYTES:,} one call may pass; pass less (a path or an id rather "
                "than the text)"
            )
        t = self.tools.get(name)
        if t is not None:
            work = self._run(t, check_arguments(name, t.signature, msg.args, msg.kwargs))
        else:
            assert self.remote is not None  # check() let only its names through
            work = self.remote.call(name, self.remote.arguments(name, msg.args, msg.kwargs))
        began = time.monotonic()
        result: Any = None
        error: str | None = None
        try:
            result = json_result(name, await work)
        except ToolError as exc:
            error = str(exc)
        except Exception as exc:
            error = f"tool {name} raised {type(exc).__name__}: {exc}"
        data = {
            "tool": name,
            "call": key,
            "result": result,
            "error": error,
            "duration": round(time.monotonic() - began, 6),
        }
        k = self.kernel
        if k.charge(run, frames.weight(data)):
            k.event(run, TOOL_EVENT, data)
        return _outcome(name, data)

    async def _run(self, t: Tool, bound: inspect.BoundArguments) -> Any:
        """`t` called with `bound`, within its timeout: an `async def` on the loop, any
        other function on one of the pool's daemon threads (a tool that never returns is
        left there, and the process can still exit)."""
        if inspect.iscoroutinefunction(t.fn):
            return await asyncio.wait_for(t.fn(*bound.args, **bound.kwargs), t.timeout)
        fut = self._pool.submit(_call, t.fn, bound)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), t.timeout)
        except TimeoutError:
            fut.cancel()  # not started yet: it never will be; running: its result is dropped
            raise ToolError(
                f"tool {t.name} did not return within {t.timeout:g} s (its timeout); try "
                "again with less work, or give it more time with Tool(fn, timeout=...)",
                tool=t.name,
            ) from None


def _call(fn: Callable[..., Any], bound: inspect.BoundArguments) -> Any:
    return fn(*bound.args, **bound.kwargs)


def _outcome(name: str, data: dict[str, Any]) -> Any:
    if data.get("error") is not None:
        raise ToolError(str(data["error"]), tool=name)
    return data.get("result")


def tool_replay(events: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """A resumed run's journaled tool calls, by call (its canonical arguments), in order."""
    found: dict[str, list[dict[str, Any]]] = {}
    for ev in events:
        d = ev["data"]
        found.setdefault(str(d.get("call")), []).append(d)
    return found


__all__ = ["TOOL_EVENT", "RemoteTools", "ToolBox", "tool_replay"]

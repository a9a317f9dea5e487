"""The backend protocol: what the supervisor needs from a place that runs workers."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

from brood.errors import InvalidArgument
from brood.protocol import Msg, encode


class WorkerConn:
    """The supervisor's end of one worker: send messages, learn of its exit.

    `exited` resolves with the worker's return code (-N for signal N) when it is reaped;
    `gone` is set once no process of its process group is left (exit confirmed).
    """

    def __init__(self, pid: int, writer: asyncio.StreamWriter | None) -> None:
        self.pid = pid
        self.writer = writer
        self.handler: Callable[[Msg], None] | None = None
        self.on_exit: Callable[[int], object] | None = None
        loop = asyncio.get_running_loop()
        self.exited: asyncio.Future[int] = loop.create_future()
        self.gone = asyncio.Event()
        self.closed = asyncio.Event()

    def send(self, msg: Msg) -> bool:
        """Queue `msg` to the worker; False if its connection is already closed."""
        if self.writer is None or self.writer.is_closing():
            return False
        self.writer.write(encode(msg))
        return True

    def mark_exited(self, status: int) -> None:
        if not self.exited.done():
            self.exited.set_result(status)
            if self.on_exit is not None:
                self.on_exit(status)


class Backend(Protocol):
    async def start(self, preload: tuple[str, ...] = ()) -> None: ...

    async def acquire(self) -> WorkerConn:
        """A worker ready for one run (from the warm pool when one is there)."""
        ...

    def release_unused(self, conn: WorkerConn) -> None:
        """Give back a worker that never received a run."""
        ...

    def signal_group(self, conn: WorkerConn, sig: int) -> None: ...

    def group_pids(self, conn: WorkerConn) -> list[int]: ...

    async def close(self) -> None: ...


def make_backend(name: str, owner: str) -> Backend:
    if name == "local":
        from brood.backends.local import LocalBackend

        return LocalBackend(owner)
    raise InvalidArgument(f"unknown backend {name!r}; brood has 'local'")

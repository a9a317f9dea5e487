"""The backend protocol: what the supervisor needs from a place that runs workers."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from brood.errors import InvalidArgument
from brood.protocol import Msg, encode
from brood.worker.confine import Policy

# The exit status of a worker that no process could reap for brood (its zygote was lost).
STATUS_UNKNOWN = -(2**15)


class WorkerConn:
    """The supervisor's end of one worker: send messages, learn of its exit.

    `exited` resolves with the worker's return code (-N for signal N) when it is reaped;
    `gone` is set once no process of its process group is left (exit confirmed).
    """

    def __init__(self, pid: int, writer: asyncio.WriteTransport | None, scratch: str = "") -> None:
        self.pid = pid
        self.writer = writer
        self.scratch = scratch  # the worker's HOME, TMPDIR and cwd
        self.handler: Callable[[Msg], None] | None = None
        self.early: list[Msg] = []  # sent before a run was attached (a confinement failure)
        self.cpu = 0.0  # CPU seconds the worker used, known once it is reaped
        self.oom_kills = 0  # processes the kernel killed at its memory limit (its cgroup)
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

    def attach(self, handler: Callable[[Msg], None]) -> None:
        """Route the worker's messages to `handler`, first those it sent while idle."""
        self.handler = handler
        early, self.early = self.early, []
        for msg in early:
            handler(msg)

    def deliver(self, msg: Msg) -> None:
        if self.handler is None:
            self.early.append(msg)
        else:
            self.handler(msg)

    def mark_exited(self, status: int) -> None:
        if not self.exited.done():
            self.exited.set_result(status)
            if self.on_exit is not None:
                self.on_exit(status)


@dataclass(frozen=True)
class WorkerSettings:
    """How workers are made: their confinement, environment and scratch directories."""

    policy: Policy
    env: dict[str, str] = field(default_factory=dict)  # the whole environment workers get
    keep_scratch: bool = False


class Backend(Protocol):
    # Told when the backend lost its worker factory (its pid and exit status) and is making
    # a new one: the supervisor journals it.
    on_lost: Callable[[int, int], None] | None

    async def start(self) -> None: ...

    async def acquire(self) -> WorkerConn:
        """A worker ready for one run (from the warm pool when one is there)."""
        ...

    def release_unused(self, conn: WorkerConn) -> None:
        """Give back a worker that never received a run."""
        ...

    def signal_group(self, conn: WorkerConn, sig: int) -> None: ...

    def group_pids(self, conn: WorkerConn) -> list[int]: ...

    def idle_pids(self) -> list[int]:
        """The warm workers waiting for a run."""
        ...

    def discard_scratch(self, conn: WorkerConn) -> asyncio.Future[None]:
        """Start removing the worker's scratch directory (its run has ended and it has
        exited), off the loop; the future resolves once it is gone."""
        ...

    async def close(self) -> None: ...


def make_backend(name: str, settings: WorkerSettings) -> Backend:
    if name == "local":
        from brood.backends.local import LocalBackend

        return LocalBackend(settings)
    raise InvalidArgument(f"unknown backend {name!r}; brood has 'local'")

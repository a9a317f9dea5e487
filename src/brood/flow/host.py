"""What the flow executor needs of the supervisor it runs on, as protocols: the flow
package names no type of the supervisor's, so either can change without the other.

`FlowRun` is what the package reads of a run; `FlowHost` is generic over the host's own
run type (`R`), so a host whose calls take and return its own runs (`Core`, with its
`Run`) is one, and the executor hands back to it exactly the runs it was given."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Protocol, Self, TypeVar

from brood.lifecycle import FailureKind, RunRecord, RunState


class FlowRun(Protocol):
    """A run as the flow package reads it, never writes it: its record, its place in the
    tree, and whether it has ended or is being ended."""

    @property
    def id(self) -> str: ...

    @property
    def rec(self) -> RunRecord: ...

    @property
    def done(self) -> asyncio.Event:
        """Set once the run has ended."""

    @property
    def ending(self) -> object:
        """None unless the run is being ended."""

    @property
    def failure_kind(self) -> FailureKind | None:
        """Why it failed, as its host decided (None until it has failed)."""

    @property
    def parent(self) -> Self | None: ...

    @property
    def children(self) -> Sequence[Self]: ...


R = TypeVar("R", bound=FlowRun)


class FlowHost(Protocol[R]):
    """The supervisor's core, as the executor uses it: the runs of a flow are started,
    adopted, ended and journaled through these calls only (`Core` is a `FlowHost[Run]`)."""

    async def create_controller(
        self, prompt: str, parent: R | None = None, run_id: str | None = None
    ) -> R: ...

    async def start_child(
        self,
        parent: R,
        prompt: str,
        *,
        key: str,
        model_name: str | None = None,
        timeout: float | None = None,
        pool: str | None = None,
    ) -> R: ...

    async def finish(
        self,
        run: R,
        state: RunState,
        reason: str,
        *,
        answer: str | None = None,
        error: str | None = None,
    ) -> RunState: ...

    def event(self, run: R, kind: str, data: dict[str, Any]) -> None: ...

    def adopt_child(
        self, parent: R, key: str, timeout: float | None = None, *, launch: bool = True
    ) -> R | None: ...

    def run_of(self, run_id: str) -> R | None: ...

    def children_left(self, run: R) -> int | None:
        """How many more runs the tree's limits leave to the flow whose run is `run` (None:
        no bound but the flow's own settings)."""

"""What the flow executor needs of the supervisor it runs on, as a protocol: the flow
package names no type of the supervisor's, so either can change without the other."""

from __future__ import annotations

from typing import Any, Protocol

from brood.lifecycle import RunState


class FlowHost(Protocol):
    """The supervisor's core, as the executor uses it: the runs of a flow are started,
    adopted, ended and journaled through these calls only (`Core` is one)."""

    async def create_controller(
        self, prompt: str, parent: Any = None, run_id: str | None = None
    ) -> Any: ...

    async def start_child(
        self,
        parent: Any,
        prompt: str,
        *,
        key: str,
        model_name: str | None = None,
        timeout: float | None = None,
        pool: str | None = None,
    ) -> Any: ...

    async def finish(
        self,
        run: Any,
        state: RunState,
        reason: str,
        *,
        answer: str | None = None,
        error: str | None = None,
    ) -> RunState: ...

    def event(self, run: Any, kind: str, data: dict[str, Any]) -> None: ...

    def adopt_child(
        self, parent: Any, key: str, timeout: float | None = None, *, launch: bool = True
    ) -> Any: ...

    def run_of(self, run_id: str) -> Any: ...

    def children_left(self, run: Any) -> int | None:
        """How many more runs the tree's limits leave to the flow whose run is `run` (None:
        no bound but the flow's own settings)."""

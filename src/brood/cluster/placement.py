"""Placement: how loaded an agent is, and placement="spread", where an agent hands a child
to another node's agent (`Spreader`, the agents' side of `Core.spreader`).

The cluster places a tree whole on the agent with the fewest live runs (`Cluster._place`,
beside the recovery it may set off); a spread child goes to the least loaded other agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from brood.cluster.nodes import ray_cause
from brood.errors import BackendError, BroodError, NodeLost
from brood.lifecycle import TERMINAL_VALUES, RunState

if TYPE_CHECKING:
    from brood.supervisor.core import Core, Run
    from brood.supervisor.engine import Engine


def load_of(stats: dict[str, Any]) -> int:
    """An agent's load, from its `Supervisor.statistics()`: its live runs and its queue."""
    return sum(n for s, n in stats["runs"].items() if s not in TERMINAL_VALUES) + stats["queued"]


@dataclass(frozen=True)
class Peer:
    """Another node agent, as an agent knows it."""

    token: str
    node_id: str
    host: str
    actor: Any


class Agent(Protocol):
    """The node agent, as its `Spreader` uses it (`NodeAgent` is one): its engine, its
    owner token, the other agents, and the agent holding each guest's root."""

    engine: Engine
    token: str
    peers: list[Peer]
    guest_roots: dict[str, str]


def guest_data(core: Core, run: Run) -> dict[str, Any]:
    """What a node sends with a child it places on another node, beside its record: its
    context, model, timeout, the follow-ups held for its start, and its span (a W3C
    traceparent, tracing on: what the child does there goes under it)."""
    return {
        "context": run.context_blob,
        "model_name": run.model_name,
        "timeout": run.timeout,
        "messages": run.messages,
        "traceparent": core.traceparent(run),
    }


class Spreader:
    """The node agent's side of placement="spread": it hands a child to another node's
    agent, follows it there, and asks the agent running a tree's root to admit children
    started below a child placed here. Runs on the supervisor's loop (Core.spreader)."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent

    @staticmethod
    async def _get(ref: Any) -> Any:
        import ray

        try:
            return await asyncio.wrap_future(ref.future())
        except ray.exceptions.RayActorError as exc:
            raise NodeLost(f"the node agent holding it died: {exc}") from None
        except ray.exceptions.RayTaskError as exc:
            cause = ray_cause(exc)
            raise cause if isinstance(cause, Exception) else BackendError(str(exc)) from None

    async def _load(self, peer: Peer) -> float:
        try:
            stats = await self._get(peer.actor.statistics.remote())
        except Exception:
            return math.inf  # dead or refusing: the last choice
        return load_of(stats)

    async def start(self, run: Run) -> Peer | None:
        others = [p for p in self.agent.peers if p.token != self.agent.token]
        if not others:
            return None  # one node: the child starts here
        loads = await asyncio.gather(*(self._load(p) for p in others))
        load, peer = min(zip(loads, others, strict=True), key=lambda t: t[0])
        if load == math.inf:
            return None
        core = self.agent.engine.core
        root_token = self.agent.guest_roots.get(core.top(run).id, self.agent.token)
        data = guest_data(core, run)
        run.messages = []
        await self._get(peer.actor.host_guest.remote(copy.copy(run.rec), data, root_token))
        return peer

    async def started(self, run: Run) -> None:
        await self._get(run.remote.actor.guest_started.remote(run.id))

    async def ended(self, run: Run) -> dict[str, Any]:
        return dict(await self._get(run.remote.actor.guest_ended.remote(run.id)))

    async def cancel(self, run: Run, state: RunState, reason: str) -> dict[str, Any]:
        return dict(await self._get(run.remote.actor.guest_end.remote(run.id, state.value, reason)))

    async def send(self, run: Run, message: str) -> None:
        await self._get(run.remote.actor.guest_send.remote(run.id, message))

    async def lost(self, run: Run) -> None:
        """Its agent can renew no more; revoking its lease makes the runs it held this
        node's to claim now (and fences that supervisor if it was only unreachable)."""
        store = self.agent.engine.store
        await asyncio.wrap_future(store.revoke_lease(run.remote.token))

    def holder(self, token: str) -> Peer | None:
        return next((p for p in self.agent.peers if p.token == token != self.agent.token), None)

    async def _at_root(self, top: Run, method: str, *args: Any) -> Any:
        """Call `method` of the agent running the root of `top`'s tree (this one's core
        when that is this agent). The root's owner is read again from the journal when its
        node was lost (the tree was resumed elsewhere)."""
        root_id = top.rec.root_id
        for _ in range(2):
            token = self.agent.guest_roots[top.id]
            if token == self.agent.token:
                value = getattr(self.agent.engine.core, method)(root_id, *args)
                return await value if asyncio.iscoroutine(value) else value
            peer = self.holder(token)
            try:
                if peer is not None:
                    return await self._get(getattr(peer.actor, method).remote(root_id, *args))
            except NodeLost:
                pass
            self.agent.guest_roots[top.id] = self.agent.engine.store.get_run(root_id)["supervisor"]
        raise BackendError(f"the node running tree {root_id} cannot be reached from here")

    async def admit(self, top: Run, count: int) -> None:
        await self._at_root(top, "admit_remote", count)

    async def budget_enter(self, top: Run) -> None:
        await self._at_root(top, "budget_enter")

    async def budget_leave(self, top: Run, tokens: int, cost: float, answered: bool) -> None:
        with contextlib.suppress(BroodError):  # the tree ended, or its node with it
            await self._at_root(top, "budget_leave", tokens, cost, answered)

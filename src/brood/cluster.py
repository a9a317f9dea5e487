"""Past one machine: trees placed on the nodes of a Ray cluster (DESIGN.md section 13).

`Cluster` has the `Supervisor` API. On each Ray node it starts one node agent, a Ray actor
pinned to that node, which hosts an ordinary `Supervisor`: a tree is placed whole on the
least loaded agent and its children start locally there, with the local spawn latency,
limits and confirmed cleanup. Ray is used for what it is good at (membership, placement,
failure detection), not for children: an actor costs ~300 ms of CPU to start, a local
child ~3 ms.

The journal is one store shared by every node (Postgres; a SQLite file only on a single
node). When an agent dies (Ray reports the actor or its node dead), the cluster revokes
that agent's lease in the journal and resumes each of its unfinished trees on a surviving
agent with `Supervisor.resume`: replay from the journal, children adopted by key. The
trees' handles keep working; they now point at the new agent.

A child placed with `rlm_query(..., placement="spread")` goes to another node's agent
(`_Spreader`, the agents' side of `Core.spreader`): the parent's agent journals it, the
other takes it over, and the parent's follows it there, so it stays a child for every verb.
The tree's limits and budgets stay with its root's agent, which admits children and model
calls made below a spread child.

Ray is imported only when a `Cluster` is made: `import brood` never imports it.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import cloudpickle

from brood.api import RunResult, _check_timeout
from brood.errors import (
    BackendError,
    BroodError,
    ChildCleanupError,
    ChildFailed,
    InvalidArgument,
    RayMissing,
    ReplayDiverged,
    StaleHandle,
    StoreError,
    SupervisorClosed,
    UnknownRun,
)
from brood.lifecycle import RunRecord, RunState
from brood.limits import Limits
from brood.store.base import open_store, redact
from brood.supervisor.core import NodeLost, new_run_id

if TYPE_CHECKING:
    from brood.api import RunHandle, Supervisor
    from brood.models.base import Model
    from brood.supervisor.core import Run

__all__ = ["Cluster", "ClusterFlowHandle", "ClusterHandle"]

ADDRESS_CHECK_S = 3.0  # a TCP connect to the GCS; a bare ray.init retries for minutes
AGENT_START_S = 120.0  # an agent's supervisor starts its zygote; a loaded machine is slow
CALL_S = 60.0  # a call to an agent that does not wait on a run (spawn, status, cancel)
CLOSE_S = 120.0  # an agent's close: cancel its runs, confirm every exit (escalation incl.)
MONITOR_S = 0.5  # how often the cluster asks each agent whether it is alive
JOIN_EVERY = 4  # every this many monitor rounds, nodes that joined get an agent
PING_S = 10.0  # a ping unanswered this long is not a death: Ray's detector decides that
WAIT_SLACK_S = 10.0  # an agent's bounded wait may return this much after its timeout
AGENT_CONCURRENCY = 1000  # blocked waits each hold one of an agent's threads

INSTALL_HINT = "pip install 'rlm-brood[ray]'"
TERMINAL = frozenset(s.value for s in RunState if s.terminal)


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise RayMissing(
            f"brood.Cluster runs on Ray, which is not installed here: {INSTALL_HINT}"
        ) from exc
    return ray


def _check_address(address: str) -> None:
    """Refuse a Ray address that does not answer, within seconds.

    A bare `ray.init` to a wrong port keeps retrying for minutes; a TCP connect to the GCS
    port tells at once whether anything listens there. `auto` (Ray's own discovery of a
    local cluster) is left to Ray.
    """
    if address == "auto":
        return
    hostport = address.split("://", 1)[1] if "://" in address else address
    host, sep, port_text = hostport.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise InvalidArgument(
            f"ray_address must be HOST:PORT (the head node's GCS, e.g. 10.0.0.5:6379), "
            f"ray://HOST:PORT or 'auto'; got {address!r}"
        )
    try:
        with socket.create_connection((host, int(port_text)), timeout=ADDRESS_CHECK_S):
            pass
    except OSError as exc:
        raise BackendError(
            f"no Ray cluster answers at ray_address {address!r} ({exc}); start one with "
            "`ray start --head` and pass the address it prints, or pass ray_address=None "
            "to start a local Ray instance"
        ) from exc


def _shared_store(url: str) -> str:
    """The journal URL as every agent must see it. A shared one is opened here first: a
    store this process cannot open fails now with the store's own message, not once per
    node, and a fresh journal's schema is made once, before the agents open it."""
    scheme, _, rest = url.partition("://")
    if scheme == "sqlite":
        path = rest[1:] if rest.startswith("/") else rest
        if path in ("", ":memory:"):
            raise InvalidArgument(
                f"store {url!r} is a private temporary journal; a cluster needs one its "
                "nodes share: store='postgresql://USER@HOST/DB' (or a SQLite file on one node)"
            )
        # An agent's working directory is Ray's, not this process's. (Not opened here: on
        # several nodes it is refused, and that is known only once Ray is.)
        return f"sqlite:///{os.path.abspath(path)}"
    open_store(url).close()
    return url


# ---- the node agent (a Ray actor) -------------------------------------------------------


class NodeAgent:
    """One per Ray node: an ordinary `Supervisor` and the handles of its trees by run id.

    Runs as a threaded Ray actor: a blocked `wait` holds one thread, so spawns, statuses
    and cancels go on beside it. Errors are returned as values, not raised, so the cluster
    rebuilds brood's own exceptions (with their fields) rather than Ray's wrappers.
    """

    def __init__(self, model_blob: bytes, store: str, limits: Limits | None) -> None:
        from brood.api import Supervisor

        self.sup: Supervisor = Supervisor(cloudpickle.loads(model_blob), store=store, limits=limits)
        self.handles: dict[str, RunHandle] = {}
        self.lock = threading.Lock()
        self.token = self.sup._core.owner
        self.peers: list[_Peer] = []  # every agent of the cluster, this one too
        self.guests: dict[str, Run] = {}  # children placed here by other nodes, by id
        self.guest_roots: dict[str, str] = {}  # guest id -> the token of its root's agent
        self.sup._core.spreader = _Spreader(self)

    def info(self) -> dict[str, Any]:
        import ray

        return {
            "token": self.sup._core.owner,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "node_id": ray.get_runtime_context().get_node_id(),
        }

    def ping(self) -> bool:
        return True

    def spawn(self, prompt: str, context: Any, timeout: float | None, run_id: str) -> tuple[str]:
        """Start a tree under the id the cluster chose (it is the cluster's to resume if
        this agent dies before answering); returns the id it got (another, only if the
        journal already held that one)."""
        from brood.api import RunHandle

        self.sup._check_live("spawn")
        run = self.sup._loop.call(
            self.sup._create(prompt, context, timeout, None, driven=False, run_id=run_id)
        )
        with self.lock:
            self.handles[run.id] = RunHandle(self.sup, run)
        return (run.id,)

    def resume(self, root_id: str) -> str:
        handle = self.sup.resume(root_id)
        with self.lock:
            self.handles[handle.id] = handle
        return handle.id

    def _handle(self, run_id: str) -> RunHandle:
        with self.lock:
            return self.handles[run_id]

    def wait(self, run_id: str, timeout: float | None) -> tuple[str, Any, Any]:
        """("timeout", message, None) or ("ended", RunResult, (error class, message) or None)."""
        handle = self._handle(run_id)
        try:
            result = handle.wait_result(timeout)
        except TimeoutError as exc:
            return ("timeout", str(exc), None)
        try:
            handle.result()
        except BroodError as exc:
            return ("ended", result, (type(exc).__name__, str(exc)))
        return ("ended", result, None)

    def status(self, run_id: str) -> str:
        return self._handle(run_id).status()

    def cancel(self, run_id: str) -> str:
        return self._handle(run_id).cancel()

    def send(self, run_id: str, message: str) -> None:
        self._handle(run_id).send(message)

    def statistics(self) -> dict[str, Any]:
        return self.sup.statistics()

    # ---- children placed here by other nodes (placement="spread") -----------------------
    def set_peers(self, peers: list[_Peer]) -> None:
        self.peers = peers

    def host_guest(self, rec: RunRecord, data: dict[str, Any], root_token: str) -> None:
        import ray

        note = {"node_id": ray.get_runtime_context().get_node_id(), "host": socket.gethostname()}
        run = self.sup._loop.call(self.sup._core.host_guest(rec, data, note))
        with self.lock:
            self.guests[run.id] = run
            self.guest_roots[run.id] = root_token

    def _guest(self, run_id: str) -> Run:
        with self.lock:
            return self.guests[run_id]

    def guest_started(self, run_id: str) -> None:
        """Returns once the guest runs (or ended without running)."""
        run = self._guest(run_id)
        if self.sup._closed:
            return

        async def either() -> None:
            waits = [asyncio.ensure_future(e.wait()) for e in (run.started, run.done)]
            _, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for w in pending:
                w.cancel()

        self.sup._loop.call(either())

    def guest_ended(self, run_id: str) -> dict[str, Any]:
        run = self._guest(run_id)
        if not self.sup._closed:
            self.sup._loop.call(run.done.wait())
        return _end_of(run)

    def guest_end(self, run_id: str, state: str, reason: str) -> dict[str, Any]:
        """End the guest and its subtree; returns once every exit is confirmed here."""
        run = self._guest(run_id)
        if not self.sup._closed:
            self.sup._loop.call(self.sup._core.finish(run, RunState(state), reason))
        return _end_of(run)

    def guest_send(self, run_id: str, message: str) -> None:
        run = self._guest(run_id)
        self.sup._check_live(f"run {run_id}")
        self.sup._loop.call(self.sup._core.send_message(run, message))

    def admit_remote(self, root_id: str, count: int) -> None:
        """Admit `count` children of a subtree of `root_id` (whose root runs here) that
        runs on another node, against the tree-wide limits."""
        self.sup._check_live(f"tree {root_id}")
        self.sup._loop.call(_now(self.sup._core.admit_remote, root_id, count))

    def budget_enter(self, root_id: str) -> None:
        """A model call of that subtree waits here for the tree's budget."""
        self.sup._check_live(f"tree {root_id}")
        self.sup._loop.call(self.sup._core.budget_enter(root_id))

    def budget_leave(self, root_id: str, tokens: int, cost: float, answered: bool) -> None:
        self.sup._check_live(f"tree {root_id}")
        self.sup._loop.call(_now(self.sup._core.budget_leave, root_id, tokens, cost, answered))

    # Flows are looked up in the supervisor by id, not kept here: a flow this agent resumed
    # for a lost node (`resume` of its tree) is rebuilt there from its ledger.
    def flow_run(
        self, spec: dict[str, Any], inputs: dict[str, Any] | None, run_id: str
    ) -> tuple[str, list[str]]:
        """Start a flow under the id the cluster chose, as `spawn` does a tree."""
        from brood.flow.load import load_spec

        self.sup._check_live("flow_run")
        executor = self.sup._loop.call(self.sup._start_flow(load_spec(spec), inputs, None, run_id))
        return executor.run.id, executor.started

    def flow_started(self, run_id: str) -> list[str]:
        return self.sup.flow(run_id).started

    def flow_status(self, run_id: str) -> dict[str, Any]:
        return self.sup.flow(run_id).status()

    def flow_wait(self, run_id: str, timeout: float | None) -> tuple[str, str]:
        """("timeout", message) or ("ended", the status it ended or paused with)."""
        try:
            return ("ended", self.sup.flow(run_id).wait(timeout))
        except TimeoutError as exc:
            return ("timeout", str(exc))

    def flow_wait_change(self, run_id: str) -> None:
        self.sup.flow(run_id).wait_change()

    def flow_outputs(self, run_id: str) -> dict[str, dict[str, Any]]:
        return self.sup.flow(run_id).outputs()

    def flow_stop(self, run_id: str) -> dict[str, Any]:
        return self.sup.flow(run_id).stop()

    def flow_resume(self, run_id: str) -> None:
        self.sup.flow(run_id).resume()

    def close(self) -> dict[str, Any]:
        """Close the supervisor; report what could not be confirmed gone (pids, error)."""
        from brood.backends.owners import processes_owned

        mark = getattr(self.sup._backend, "owner", None)
        error, pids = None, []
        try:
            self.sup.close()
        except ChildCleanupError as exc:
            error, pids = str(exc), list(exc.pids)
        except BroodError as exc:
            error = f"{type(exc).__name__}: {exc}"
        if mark:  # the backend's own sweep ran; this is the confirmation, read from /proc
            pids += [p for p, m in processes_owned().items() if m == mark and p not in pids]
        return {"error": error, "pids": sorted(pids)}


def _end_of(run: Run) -> dict[str, Any]:
    r = run.rec
    return {
        "state": r.state.value,
        "reason": r.reason,
        "answer": r.answer,
        "error": r.error,
        "products": r.products,
        "usage": dict(r.usage),
    }


async def _now(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


@dataclass(frozen=True)
class _Peer:
    """Another node agent, as an agent knows it."""

    token: str
    node_id: str
    host: str
    actor: Any


class _Spreader:
    """The node agent's side of placement="spread": it hands a child to another node's
    agent, follows it there, and asks the agent running a tree's root to admit children
    started below a child placed here. Runs on the supervisor's loop (Core.spreader)."""

    def __init__(self, agent: NodeAgent) -> None:
        self.agent = agent

    @staticmethod
    async def _get(ref: Any) -> Any:
        import ray

        try:
            return await asyncio.wrap_future(ref.future())
        except ray.exceptions.RayActorError as exc:
            raise NodeLost(f"the node agent holding it died: {exc}") from None
        except ray.exceptions.RayTaskError as exc:
            cause = _cause(exc)
            raise cause if isinstance(cause, Exception) else BackendError(str(exc)) from None

    async def _load(self, peer: _Peer) -> float:
        try:
            stats = await self._get(peer.actor.statistics.remote())
        except Exception:
            return math.inf  # dead or refusing: the last choice
        return sum(n for s, n in stats["runs"].items() if s not in TERMINAL) + stats["queued"]

    async def start(self, run: Run) -> _Peer | None:
        others = [p for p in self.agent.peers if p.token != self.agent.token]
        if not others:
            return None  # one node: the child starts here
        loads = await asyncio.gather(*(self._load(p) for p in others))
        load, peer = min(zip(loads, others, strict=True), key=lambda t: t[0])
        if load == math.inf:
            return None
        top = self.agent.sup._core._top(run)
        root_token = self.agent.guest_roots.get(top.id, self.agent.token)
        data = {
            "context": run.context_blob,
            "model_name": run.model_name,
            "timeout": run.timeout,
            "messages": run.messages,
        }
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
        store = self.agent.sup._store
        await asyncio.wrap_future(store.revoke_lease(run.remote.token))

    def holder(self, token: str) -> _Peer | None:
        return next((p for p in self.agent.peers if p.token == token != self.agent.token), None)

    async def _at_root(self, top: Run, method: str, *args: Any) -> Any:
        """Call `method` of the agent running the root of `top`'s tree (this one's core
        when that is this agent). The root's owner is read again from the journal when its
        node was lost (the tree was resumed elsewhere)."""
        root_id = top.rec.root_id
        for _ in range(2):
            token = self.agent.guest_roots[top.id]
            if token == self.agent.token:
                value = getattr(self.agent.sup._core, method)(root_id, *args)
                return await value if asyncio.iscoroutine(value) else value
            peer = self.holder(token)
            try:
                if peer is not None:
                    return await self._get(getattr(peer.actor, method).remote(root_id, *args))
            except NodeLost:
                pass
            self.agent.guest_roots[top.id] = self.agent.sup._store.get_run(root_id)["supervisor"]
        raise BackendError(f"the node running tree {root_id} cannot be reached from here")

    async def admit(self, top: Run, count: int) -> None:
        await self._at_root(top, "admit_remote", count)

    async def budget_enter(self, top: Run) -> None:
        await self._at_root(top, "budget_enter")

    async def budget_leave(self, top: Run, tokens: int, cost: float, answered: bool) -> None:
        with contextlib.suppress(BroodError):  # the tree ended, or its node with it
            await self._at_root(top, "budget_leave", tokens, cost, answered)


class _Agent:
    """The cluster's view of one node agent."""

    def __init__(self, actor: Any, info: dict[str, Any]) -> None:
        self.actor = actor
        self.token: str = info["token"]
        self.pid: int = info["pid"]
        self.host: str = info["host"]
        self.node_id: str = info["node_id"]
        self.placed = 0  # trees placed here by this cluster: the tie-break of placement
        self.dead = False

    def __repr__(self) -> str:
        return f"<agent pid {self.pid} on node {self.node_id[:12]}>"


class _AgentLost(Exception):
    def __init__(self, agent: _Agent) -> None:
        super().__init__(f"{agent} died")
        self.agent = agent


_ERRORS: dict[str, type[BroodError]] = {
    "ReplayDiverged": ReplayDiverged,
    "StoreError": StoreError,
    "StaleHandle": StaleHandle,
}


# ---- the cluster --------------------------------------------------------------------------


class Cluster:
    """Runs trees on the nodes of a Ray cluster, one node agent (a `Supervisor`) per node.

    `model` is a spec string or a picklable model (a `brood.Model`, a chat_fn): every agent
    gets its own copy. `store` is the journal URL every node writes to: a Postgres URL, or
    a SQLite file when the cluster has a single node. `ray_address` is the head node's
    HOST:PORT (checked to answer within seconds); None uses the Ray this process is
    connected to, or starts a local one. `limits` apply per tree, kept by the agent holding
    its root (also for children its runs place on other nodes with placement="spread");
    `max_concurrency` and `pools` are each node's.

    A tree (or a flow, `flow_run`) is placed whole on the agent with the fewest live runs.
    When an agent dies, its unfinished trees are resumed from the journal on a surviving
    agent; their handles keep working. `close()` (or leaving the `with` block) cancels
    what is still running and confirms every worker's exit on every node; it raises
    ChildCleanupError naming the nodes and pids it could not confirm.
    """

    def __init__(
        self,
        model: str | Callable[..., Any] | Model,
        *,
        store: str,
        ray_address: str | None = None,
        limits: Limits | None = None,
    ) -> None:
        if not isinstance(store, str) or not store:
            raise InvalidArgument(
                "store is required: the journal every node writes to, e.g. "
                "store='postgresql://USER@HOST/DB' (a SQLite file only on a single node)"
            )
        if limits is not None and not isinstance(limits, Limits):
            raise InvalidArgument(f"limits must be brood.Limits(...), got {type(limits).__name__}")
        if ray_address is not None and not isinstance(ray_address, str):
            raise InvalidArgument(
                f"ray_address must be 'HOST:PORT' or None, got {type(ray_address).__name__}"
            )
        try:
            model_blob = cloudpickle.dumps(model)
        except Exception as exc:
            raise InvalidArgument(
                f"model cannot be pickled for the node agents ({exc}); pass a spec string "
                "like 'openai:MODEL@URL' or a picklable model"
            ) from exc
        store = _shared_store(store)
        ray = _import_ray()
        self._ray = ray
        self._store_url = store
        self._closed = False
        self._lock = threading.RLock()
        self._agents: list[_Agent] = []
        self._trees: dict[str, _Agent] = {}  # root id -> the agent running it now
        self._lost: dict[str, str] = {}  # root id -> why it could not be resumed
        self._pending: list[Any] = []  # actors started, not yet answering
        self._refused: set[str] = set()  # joined nodes whose agent could not start
        self._model_blob, self._limits = model_blob, limits
        self._started_ray = False
        if ray_address is not None:
            _check_address(ray_address)
        if ray.is_initialized():
            current = ray.get_runtime_context().gcs_address
            if ray_address not in (None, "auto", current):
                raise BackendError(
                    f"this process is already connected to the Ray cluster at {current}, "
                    f"not {ray_address!r}; pass ray_address=None to use it, or "
                    "ray.shutdown() first"
                )
        else:
            ray.init(address=ray_address)
            self._started_ray = True
        try:
            nodes = [n for n in ray.nodes() if n.get("Alive")]
            scheme = store.partition("://")[0]
            if scheme == "sqlite" and len(nodes) > 1:
                raise InvalidArgument(
                    f"store {redact(store)!r} is a SQLite file, which only one machine can "
                    f"write; this Ray cluster has {len(nodes)} nodes: use a Postgres journal "
                    "(store='postgresql://USER@HOST/DB') that every node can reach"
                )
            self._start_agents(model_blob, limits, [n["NodeID"] for n in nodes])
        except BaseException:
            self._stop_agents()
            if self._started_ray:
                ray.shutdown()
            raise
        self._stop_monitor = threading.Event()
        self._monitor = threading.Thread(target=self._watch, name="brood-cluster", daemon=True)
        self._monitor.start()

    def _start_agents(self, model_blob: bytes, limits: Limits | None, node_ids: list[str]) -> None:
        """Start an agent on each of `node_ids`, then tell every live agent of the others."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        remote = self._ray.remote(NodeAgent)
        actors = [
            remote.options(
                num_cpus=0,  # an agent waits; its CPUs are its workers', not Ray's to hold
                max_concurrency=AGENT_CONCURRENCY,
                max_restarts=0,  # a dead agent's trees are resumed elsewhere, from the journal
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            ).remote(model_blob, self._store_url, limits)
            for node_id in node_ids
        ]
        # Kept before they answer, so a failure below still kills every one of them.
        self._pending = actors
        try:
            infos = self._ray.get([a.info.remote() for a in actors], timeout=AGENT_START_S)
        except self._ray.exceptions.GetTimeoutError as exc:
            raise BackendError(
                f"the node agents did not start within {AGENT_START_S} s; is the store "
                f"{redact(self._store_url)!r} reachable from every node?"
            ) from exc
        except self._ray.exceptions.RayError as exc:
            raise BackendError(
                f"a node agent could not start: {_cause(exc)}\n(the model is unpickled on "
                "every node: what it refers to must be importable there)"
            ) from exc
        with self._lock:
            closed = self._closed  # closed meanwhile (a joined node's): these are not needed
            if not closed:
                self._agents = self._agents + [
                    _Agent(a, i) for a, i in zip(actors, infos, strict=True)
                ]
            self._pending = []
        if closed:
            for actor in actors:
                with contextlib.suppress(Exception):
                    self._ray.kill(actor)
            return
        live = self._live()
        peers = [_Peer(a.token, a.node_id, a.host, a.actor) for a in live]
        refs = [a.actor.set_peers.remote(peers) for a in live]
        for ref in refs:
            with contextlib.suppress(self._ray.exceptions.RayActorError):  # the monitor's
                self._ray.get(ref, timeout=CALL_S)

    def _join(self) -> None:
        """Start an agent on each node that joined the Ray cluster since (a node whose agent
        died gets none: its trees went on elsewhere). A SQLite journal has one node only."""
        if self._store_url.startswith("sqlite:"):
            return
        alive = {n["NodeID"] for n in self._ray.nodes() if n.get("Alive")}
        with self._lock:
            new = sorted(alive - {a.node_id for a in self._agents} - self._refused)
        if not new:
            return
        try:
            self._start_agents(self._model_blob, self._limits, new)
        except Exception:
            self._refused.update(new)  # not asked again; close() does not wait on them
            for actor in self._pending:
                with contextlib.suppress(Exception):
                    self._ray.kill(actor)
            self._pending = []

    def _stop_agents(self) -> None:
        for actor in [*self._pending, *(a.actor for a in self._agents)]:
            with contextlib.suppress(Exception):
                self._ray.kill(actor)

    # ---- calls to agents -------------------------------------------------------------
    def _call(self, agent: _Agent, method: str, *args: Any, timeout: float | None = CALL_S) -> Any:
        """Call an agent's method: brood's error for a refusal, _AgentLost for a dead agent,
        TimeoutError when it does not answer within `timeout`."""
        ray = self._ray
        try:
            return ray.get(getattr(agent.actor, method).remote(*args), timeout=timeout)
        except ray.exceptions.RayActorError as exc:
            raise _AgentLost(agent) from exc
        except ray.exceptions.GetTimeoutError as exc:
            raise TimeoutError(f"{agent} did not answer {method} within {timeout} s") from exc
        except ray.exceptions.RayTaskError as exc:
            cause = _cause(exc)
            if isinstance(cause, Exception):
                raise cause from None
            raise BackendError(f"{agent}: {method} failed: {exc}") from exc

    def _live(self) -> list[_Agent]:
        with self._lock:
            return [a for a in self._agents if not a.dead]

    def _place(self) -> _Agent:
        """The agent with the fewest live runs (by the agents' own statistics); ties go to
        the one this cluster placed fewest trees on."""
        while True:
            agents = self._live()
            if not agents:
                raise BackendError("no node agent is alive: every node of the cluster was lost")
            refs = [a.actor.statistics.remote() for a in agents]
            loads = []
            for agent, ref in zip(agents, refs, strict=True):
                try:
                    stats = self._ray.get(ref, timeout=CALL_S)
                except self._ray.exceptions.RayActorError:
                    self._recover(agent)
                    break
                live = sum(n for s, n in stats["runs"].items() if s not in TERMINAL)
                loads.append((live + stats["queued"], agent.placed, agent))
            else:
                return min(loads, key=lambda t: t[:2])[2]

    def _agent_of(self, root_id: str) -> _Agent | None:
        """The agent running tree `root_id` now; None when the tree ended with a lost agent
        (its outcome is in the journal). Raises when it was lost and could not be resumed."""
        with self._lock:
            if root_id in self._lost:
                raise BackendError(f"tree {root_id} was lost with its node: {self._lost[root_id]}")
            agent = self._trees[root_id]
            return None if agent.dead else agent

    # ---- node loss ---------------------------------------------------------------------
    def _watch(self) -> None:
        """Find dead agents even when no handle is being used, and resume their trees;
        start agents on nodes that joined."""
        ticks = 0
        while not self._stop_monitor.wait(MONITOR_S):
            ticks += 1
            if ticks % JOIN_EVERY == 0:
                with contextlib.suppress(Exception):  # Ray shutting down: nothing to join
                    self._join()
            for agent in self._live():
                try:
                    self._ray.get(agent.actor.ping.remote(), timeout=PING_S)
                except self._ray.exceptions.RayActorError:
                    with contextlib.suppress(Exception):  # kept on self._lost per tree
                        self._recover(agent)
                except Exception:
                    continue  # slow or shutting down: Ray's failure detector decides

    def _recover(self, agent: _Agent) -> None:
        """`agent` died: revoke its lease and resume its unfinished trees elsewhere. Once
        per agent; a caller that comes second waits here until the first is done."""
        with self._lock:
            if agent.dead or self._closed:
                return
            agent.dead = True
            mine = [root for root, a in self._trees.items() if a is agent]
            handled: list[str] = []
            try:
                store = open_store(self._store_url)
            except Exception as exc:
                for root_id in mine:
                    self._lost[root_id] = f"{agent} died and the journal could not be opened: {exc}"
                return
            try:
                # Its supervisor cannot renew any more; revoking makes the trees resumable
                # now rather than when the lease would lapse (lease.LEASE_S).
                store.revoke_lease(agent.token).result(timeout=CALL_S)
                for root_id in mine:
                    try:
                        state = store.get_run(root_id)["state"]
                    except UnknownRun:  # a spawn it died before journaling: started again
                        del self._trees[root_id]
                        handled.append(root_id)
                        continue
                    if state not in TERMINAL:
                        self._resume_elsewhere(root_id)
                    # (else it ended before the node did: the journal has its outcome)
                    handled.append(root_id)
            except Exception as exc:  # every tree not handled yet is lost, and says why
                for root_id in mine:
                    if root_id not in handled:
                        self._lost.setdefault(
                            root_id, f"{agent} died and its tree could not be resumed: {exc}"
                        )
            finally:
                store.close()

    def _resume_elsewhere(self, root_id: str) -> None:
        for _ in range(len(self._agents)):
            try:
                target = self._place()
            except BackendError as exc:
                self._lost[root_id] = str(exc)
                return
            try:
                self._call(target, "resume", root_id)
            except _AgentLost:
                self._recover(target)  # nested: this tree is not in its list yet
                continue
            except Exception as exc:
                self._lost[root_id] = f"resume on {target} failed: {type(exc).__name__}: {exc}"
                return
            self._trees[root_id] = target
            target.placed += 1
            return
        self._lost[root_id] = "every node agent died"

    # ---- the Supervisor API ----------------------------------------------------------
    def spawn(
        self, prompt: str, *, context: Any = None, timeout: float | None = None
    ) -> ClusterHandle:
        """Place a new tree on the least loaded node and return its handle at once.
        `timeout` is the root's wall-clock seconds (a number > 0, or None)."""
        self._check_open()
        _check_timeout(timeout)
        if context is not None:
            try:
                cloudpickle.dumps(context)
            except Exception as exc:
                raise InvalidArgument(f"context cannot be pickled: {exc}") from exc
        return ClusterHandle(self, self._start_tree("spawn", prompt, context, timeout)[0])

    def _start_tree(self, method: str, *args: Any) -> tuple[str, tuple[Any, ...] | None]:
        """Start a tree (a run, or a flow) on the least loaded agent: `method(*args, id)`,
        with the id chosen here, before the call. An agent that dies after journaling the
        tree and before answering has it resumed elsewhere (the answer is then None); one
        that dies before journaling it has it started on another agent."""
        wanted = new_run_id()
        for _ in range(len(self._agents)):
            agent = self._place()
            with self._lock:  # known before the call: an agent may journal it, then die
                self._trees[wanted] = agent
            try:
                answer = self._call(agent, method, *args, wanted)
            except _AgentLost:
                self._recover(agent)  # resumes the tree if the agent journaled it
                with self._lock:
                    if wanted in self._trees or wanted in self._lost:
                        return wanted, None  # journaled: resumed, or ended
                continue  # never journaled: started elsewhere
            except BaseException:
                with self._lock:
                    self._trees.pop(wanted, None)
                raise
            with self._lock:
                self._trees.pop(wanted, None)
                self._trees[answer[0]] = agent
                agent.placed += 1
            return answer[0], tuple(answer)
        raise BackendError(f"no node agent could start the tree ({method}): each died while asked")

    def run(self, prompt: str, *, context: Any = None, timeout: float | None = None) -> RunResult:
        """Run a tree to its end on the cluster; never raises for a failed run."""
        return self.spawn(prompt, context=context, timeout=timeout).wait_result()

    def resume(self, run_id: str) -> ClusterHandle:
        """Resume the crashed tree `run_id` belongs to on the least loaded node (refused as
        `Supervisor.resume` refuses: unknown, ended, or still owned by a live supervisor)."""
        self._check_open()
        store = open_store(self._store_url, readonly=True)
        try:
            root_id = store.get_run(run_id)["root_id"]
        finally:
            store.close()
        agent = self._place()
        try:
            self._call(agent, "resume", root_id)
        except _AgentLost:
            self._recover(agent)
            raise BackendError(f"{agent} died while resuming tree {root_id}; try again")
        with self._lock:
            self._trees[root_id] = agent
            agent.placed += 1
        return ClusterHandle(self, root_id)

    def flow_run(self, spec: Any, *, inputs: dict[str, Any] | None = None) -> ClusterFlowHandle:
        """Validate a flow spec (a path, YAML/JSON text or a dict) here and start the flow on
        the least loaded node; returns at once, with the states it started on
        `handle.started`. An invalid spec raises InvalidSpec listing every problem, and
        nothing starts. A path is read here, not on the node (an agent's working directory
        is Ray's). When the node is lost, the flow is resumed from its ledger on another."""
        from brood.api import SPEC_DUMP
        from brood.flow.load import load_spec

        self._check_open()
        # The agent gets the validated spec as journaled: JSON values, which pickle, and
        # what a resume on any node rebuilds the flow from.
        dumped = load_spec(spec).model_dump(**SPEC_DUMP)
        if inputs is not None:
            try:
                cloudpickle.dumps(inputs)
            except Exception as exc:
                raise InvalidArgument(
                    f"flow inputs cannot be pickled for the node agents ({exc}); pass text "
                    "or JSON values"
                ) from exc
        run_id, answer = self._start_tree("flow_run", dumped, inputs)
        if answer is None:  # resumed on another node: its states are read from there
            return self.flow(run_id)
        return ClusterFlowHandle(self, run_id, answer[1])

    def flow(self, run_id: str) -> ClusterFlowHandle:
        """A handle on a flow this cluster runs: one `flow_run` started, or one whose tree
        `resume(run_id)` resumed (its flow is rebuilt from its ledger there)."""
        self._check_open()
        with self._lock:
            known = run_id in self._trees
        if not known:
            raise InvalidArgument(
                f"{run_id!r} is not a flow this cluster runs; start one with flow_run, or "
                "resume its tree with resume(run_id) first"
            )
        handle = ClusterFlowHandle(self, run_id, [])
        with contextlib.suppress(_Ended):  # ended with a lost node: nothing is started
            handle.started = list(handle._on_agent("flow_started"))
        return handle

    def statistics(self) -> dict[str, Any]:
        """A snapshot: `nodes` = {node id: the agent's `Supervisor.statistics()` plus its
        host, pid and trees}, `lost_nodes` (ids), and `totals` (runs by state, free slots,
        queued, workers) over the live nodes."""
        self._check_open()
        nodes: dict[str, Any] = {}
        totals: dict[str, Any] = {
            "runs": {},
            "free_slots": 0,
            "queued": 0,
            "workers": {"runs": 0, "warm": 0, "memory_bytes": 0},
        }
        for agent in self._live():
            try:
                stats = self._call(agent, "statistics")
            except _AgentLost:
                self._recover(agent)
                continue
            with self._lock:
                trees = sorted(r for r, a in self._trees.items() if a is agent)
            nodes[agent.node_id] = stats | {"host": agent.host, "pid": agent.pid, "trees": trees}
            for state, n in stats["runs"].items():
                totals["runs"][state] = totals["runs"].get(state, 0) + n
            totals["free_slots"] += stats["free_slots"]
            totals["queued"] += stats["queued"]
            for k in totals["workers"]:
                totals["workers"][k] += stats["workers"][k]
        with self._lock:
            lost = [a.node_id for a in self._agents if a.dead]
        return {"nodes": nodes, "lost_nodes": lost, "totals": totals}

    def close(self) -> None:
        """Cancel every tree still going and confirm every worker's exit on every node,
        then stop the agents (and Ray, if this cluster started it).

        Raises ChildCleanupError naming each node and the pids it could not confirm gone.
        """
        if self._closed:
            return
        self._stop_monitor.set()
        self._monitor.join(PING_S + MONITOR_S)
        with self._lock:
            self._closed = True
            agents = [a for a in self._agents if not a.dead]
        refs = [a.actor.close.remote() for a in agents]
        failures: list[str] = []
        pids: list[int] = []
        for agent, ref in zip(agents, refs, strict=True):
            try:
                report = self._ray.get(ref, timeout=CLOSE_S)
            except self._ray.exceptions.RayActorError:
                continue  # died while closing: its node's processes went with it
            except Exception as exc:
                failures.append(
                    f"node {agent.node_id} ({agent.host}, agent pid {agent.pid}): {exc}"
                )
                continue
            if report["pids"] or report["error"]:
                pids += report["pids"]
                failures.append(
                    f"node {agent.node_id} ({agent.host}, agent pid {agent.pid}): pids "
                    f"{report['pids']} not confirmed gone"
                    + (f" ({report['error']})" if report["error"] else "")
                )
        self._stop_agents()
        if self._started_ray:
            self._ray.shutdown()
        if failures:
            raise ChildCleanupError(
                "the exit of some workers could not be confirmed: "
                + "; ".join(failures)
                + "; kill them by pid on those nodes",
                pids=pids,
            )

    def _check_open(self) -> None:
        if self._closed:
            raise SupervisorClosed("the cluster is closed; make a new one")

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _cause(exc: BaseException) -> BaseException:
    """The exception an actor raised, out of Ray's wrapper."""
    return getattr(exc, "cause", None) or exc


class _Ended(Exception):
    """The tree ended on an agent that was lost since: the journal holds how it ended."""


class _Followed:
    """A handle on a tree of a cluster, which follows it to the agent running it now."""

    what = "tree"

    def __init__(self, cluster: Cluster, run_id: str) -> None:
        self._cluster = cluster
        self.id = run_id

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id}>"

    def _agent(self) -> _Agent | None:
        if self._cluster._closed:
            raise StaleHandle(f"{self.what} {self.id} belongs to a cluster that was closed")
        return self._cluster._agent_of(self.id)

    @property
    def node_id(self) -> str | None:
        """The Ray node it runs on now (None once it ended with a lost node)."""
        agent = self._agent()
        return agent.node_id if agent is not None else None

    def _on_agent(self, method: str, *args: Any, timeout: float | None = CALL_S) -> Any:
        """`method` of the agent running the tree now, following the tree to the agent that
        resumed it when a node is lost; _Ended once it ended with a lost node."""
        while True:
            agent = self._agent()
            if agent is None:
                raise _Ended
            try:
                return self._cluster._call(agent, method, self.id, *args, timeout=timeout)
            except _AgentLost:
                self._cluster._recover(agent)

    def _bounded(self, method: str, timeout: float | None) -> tuple[Any, ...] | None:
        """The answer of the agent's blocking `method` ("ended", ...), waited for at most
        `timeout` s (TimeoutError after; the work goes on). It follows the tree to the
        agent resuming it when one is lost; None when it ended with a lost node."""
        _check_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            agent = self._agent()
            if agent is None:
                return None
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                answer = self._cluster._call(
                    agent,
                    method,
                    self.id,
                    left or (None if deadline is None else 1e-3),
                    timeout=None if left is None else left + WAIT_SLACK_S,
                )
            except _AgentLost:
                self._cluster._recover(agent)  # it goes on elsewhere: wait there
                continue
            if answer[0] == "timeout":
                raise TimeoutError(answer[1])
            return tuple(answer)


class ClusterHandle(_Followed):
    """A tree started by `Cluster.spawn` (or resumed by `Cluster.resume`). It follows its
    tree when a node is lost and the tree is resumed on another. Used after the cluster's
    close it raises StaleHandle."""

    what = "handle"

    def _journaled(self) -> RunResult:
        store = open_store(self._cluster._store_url, readonly=True)
        try:
            row = store.get_run(self.id)
        finally:
            store.close()
        error = None if row["state"] == RunState.COMPLETED.value else row["reason"]
        return RunResult(row["id"], row["state"], row["answer"], error, row["usage"])

    def status(self) -> str:
        """The tree's root's state; does not wait on the run."""
        try:
            return str(self._on_agent("status"))
        except _Ended:
            return self._journaled().state

    @property
    def done(self) -> bool:
        return self.status() in TERMINAL

    def cancel(self) -> str:
        """Cancel the tree; returns once every exit is confirmed on its node."""
        try:
            return str(self._on_agent("cancel", timeout=CLOSE_S))
        except _Ended:
            return self._journaled().state

    def send(self, message: str) -> None:
        """A follow-up instruction the tree's root sees before its next model turn."""
        if not isinstance(message, str):
            raise InvalidArgument("send(message): message must be str")
        try:
            self._on_agent("send", message)
        except _Ended:
            raise BroodError(
                f"run {self.id} has ended; a follow-up cannot reach a run that has ended"
            ) from None

    def _wait(self, timeout: float | None) -> tuple[RunResult, Any]:
        answer = self._bounded("wait", timeout)
        if answer is None:
            return self._journaled(), None
        return answer[1], answer[2]

    def wait_result(self, timeout: float | None = None) -> RunResult:
        """Block until the tree's root ends and return how it ended (never raises for a run
        that did not complete). On timeout raises TimeoutError and the run keeps running."""
        return self._wait(timeout)[0]

    def wait(self, timeout: float | None = None) -> str:
        """Block until the tree's root ends and return its answer; raises ChildFailed if it
        did not complete. On timeout raises TimeoutError and the run keeps running."""
        result, error = self._wait(timeout)
        if result.state == RunState.COMPLETED.value:
            return result.answer or ""
        if error is not None and error[0] in _ERRORS:
            raise _ERRORS[error[0]](error[1])
        raise ChildFailed(
            f"run {self.id} {result.state}: {result.error}",
            run_id=self.id,
            status=result.state,
            reason=result.error,
        )


class ClusterFlowHandle(_Followed):
    """A flow started by `Cluster.flow_run`: `id` (its run in the journal, the root of its
    tree), `started` (the states it entered first), `status()`, `wait()`, `wait_change()`,
    `outputs()`, `stop()` and `resume()`, as `FlowHandle`'s. It follows its flow when a node
    is lost and the flow is resumed from its ledger on another. Used after the cluster's
    close it raises StaleHandle."""

    what = "flow"

    def __init__(self, cluster: Cluster, run_id: str, started: list[str]) -> None:
        super().__init__(cluster, run_id)
        self.started = started

    def _journaled(self) -> dict[str, Any]:
        """The status of a flow that ended on a lost node, from its ledger."""
        from brood.journal import Journal

        with Journal(self._cluster._store_url) as journal:
            return journal.flow_status(self.id)

    def status(self) -> dict[str, Any]:
        """Per-state entries used / max and instances, milestones, recent ledger events (of a
        flow that ended on a node lost since: as the journal's ledger has them)."""
        try:
            return dict(self._on_agent("flow_status"))
        except _Ended:
            return self._journaled()

    def wait(self, timeout: float | None = None) -> str:
        """Block until the flow ends (finished, failed, stopped) or pauses; returns that
        status. On timeout raises TimeoutError and the flow keeps going. The flow's ledger
        up to that point is committed: the journal's reads see it."""
        answer = self._bounded("flow_wait", timeout)
        if answer is None:
            return str(self._journaled()["status"])
        return str(answer[1])

    def wait_change(self) -> None:
        """Block until the flow's status changes (e.g. a paused flow is resumed). A move to
        another node (its node was lost) counts as a change: read the status again."""
        agent = self._agent()
        if agent is None:
            return
        try:
            self._cluster._call(agent, "flow_wait_change", self.id, timeout=None)
        except _AgentLost:
            self._cluster._recover(agent)

    def outputs(self) -> dict[str, dict[str, Any]]:
        """Each state's latest settled outputs. Of a flow that ended on a node lost since,
        the journal holds the outputs only if it finished (they are its run's answer)."""
        import json

        try:
            return dict(self._on_agent("flow_outputs"))
        except _Ended:
            pass
        store = open_store(self._cluster._store_url, readonly=True)
        try:
            row = store.get_run(self.id)
        finally:
            store.close()
        if row["state"] != RunState.COMPLETED.value or not row["answer"]:
            return {}
        return dict(json.loads(row["answer"]))

    def stop(self) -> dict[str, Any]:
        """Stop: admit nothing more, cancel every running instance (exit confirmed on its
        node). Returns {"state": the final state, "cancelled": the states whose instances it
        cancelled, "instances": those instances}; a flow that has ended cancels nothing."""
        try:
            return dict(self._on_agent("flow_stop", timeout=CLOSE_S))
        except _Ended:
            return {"state": self._journaled()["status"], "cancelled": [], "instances": []}

    def resume(self) -> None:
        """Go on after a pause (escalate, max_transitions, budget); a flow that is not
        paused raises BroodError."""
        try:
            self._on_agent("flow_resume")
        except _Ended:
            status = self._journaled()["status"]
            raise BroodError(f"flow {self.id} is {status}; only a paused flow resumes") from None

"""`Cluster`, in the process that drives Ray: it starts an agent per node, places trees,
watches the agents and resumes a lost agent's trees on the others."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import cloudpickle

from brood.api import RunResult
from brood.cluster.agent import NodeAgent
from brood.cluster.handles import ClusterFlowHandle, ClusterHandle
from brood.cluster.nodes import (
    AGENT_CONCURRENCY,
    AGENT_START_S,
    CALL_S,
    CLOSE_S,
    JOIN_EVERY,
    MONITOR_S,
    PING_S,
    AgentLost,
    AgentRef,
    connect_ray,
    import_ray,
    pickled_model,
    ray_cause,
    shared_store,
)
from brood.cluster.placement import Peer, load_of
from brood.errors import (
    BackendError,
    ChildCleanupError,
    InvalidArgument,
    StaleHandle,
    SupervisorClosed,
    UnknownRun,
)
from brood.lifecycle import TERMINAL_VALUES
from brood.limits import Limits, check_timeout
from brood.models.prices import Price, price_table
from brood.store.base import open_store, redact
from brood.supervisor.core import new_run_id
from brood.supervisor.tracing import check_installed, wanted

if TYPE_CHECKING:
    from brood.models.base import Model


class TreeRouter:
    """How the cluster's handles reach it (their `Router`): where a tree runs now, a call
    to an agent, the recovery of a lost one. The cluster hands it those of its own parts
    (`Cluster._router`), so its methods stay its own."""

    def __init__(
        self,
        store_url: str,
        closed: Callable[[], bool],
        agent_of: Callable[[str], AgentRef | None],
        call: Callable[..., Any],
        recover: Callable[[AgentRef], None],
    ) -> None:
        self.store_url = store_url
        self.closed, self.find, self.calls, self.recovers = closed, agent_of, call, recover

    def agent_of(self, root_id: str, what: str) -> AgentRef | None:
        if self.closed():
            raise StaleHandle(f"{what} belongs to a cluster that was closed")
        return self.find(root_id)

    def call(self, agent: AgentRef, method: str, *args: Any, timeout: float | None) -> Any:
        return self.calls(agent, method, *args, timeout=timeout)

    def recover(self, agent: AgentRef) -> None:
        self.recovers(agent)


class Cluster:
    """Runs trees on the nodes of a Ray cluster, one node agent (a `Supervisor`) per node.

    `model` is a spec string or a picklable model (a `brood.Model`, a chat_fn): every agent
    gets its own copy. `store` is the journal URL every node writes to: a Postgres URL, or
    a SQLite file when the cluster has a single node. `ray_address` is the head node's
    HOST:PORT (checked to answer within seconds); None uses the Ray this process is
    connected to, or starts a local one. `limits` apply per tree, kept by the agent holding
    its root (also for children its runs place on other nodes with placement="spread");
    `max_concurrency` and `pools` are each node's. `prices` are `Supervisor`'s.

    A tree (or a flow, `flow_run`) is placed whole on the agent with the fewest live runs.
    When an agent dies, its unfinished trees are resumed from the journal on a surviving
    agent; their handles keep working. `close()` (or leaving the `with` block) cancels
    what is still running and confirms every worker's exit on every node; it raises
    ChildCleanupError naming the nodes and pids it could not confirm.

    `tracing=True` (or BROOD_OTEL=1) turns on every agent's OpenTelemetry spans (see
    `Supervisor`); a child placed on another node (placement="spread") carries its span
    there, so what it does on that node is traced under it, in the same trace.
    """

    def __init__(
        self,
        model: str | Callable[..., Any] | Model,
        *,
        store: str,
        ray_address: str | None = None,
        limits: Limits | None = None,
        prices: Mapping[str, Price | tuple[float, float]] | None = None,
        tracing: bool | None = None,
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
        self._prices = price_table(prices)  # each agent prices its own calls with these
        if tracing is not None and not isinstance(tracing, bool):
            raise InvalidArgument(
                f"tracing must be True or False on a cluster (each node's supervisor exports "
                f"its spans as its OTEL_* environment says), got {type(tracing).__name__}"
            )
        self._tracing = bool(wanted(tracing))
        if self._tracing:
            check_installed()
        model_blob = pickled_model(model)
        store = shared_store(store)
        ray = import_ray()
        self._ray = ray
        self._store_url = store
        self._closed = False
        self._router = TreeRouter(
            store,
            lambda: self._closed,
            self._agent_of,
            lambda *args, **kw: self._call(*args, **kw),  # looked up at each call
            self._recover,
        )
        self._lock = threading.RLock()
        self._agents: list[AgentRef] = []
        self._trees: dict[str, AgentRef] = {}  # root id -> the agent running it now
        self._lost: dict[str, str] = {}  # root id -> why it could not be resumed
        self._pending: list[Any] = []  # actors started, not yet answering
        self._refused: set[str] = set()  # joined nodes whose agent could not start
        self._model_blob, self._limits = model_blob, limits
        self._started_ray = connect_ray(ray, ray_address)
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
            ).remote(model_blob, self._store_url, limits, self._prices, self._tracing)
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
                f"a node agent could not start: {ray_cause(exc)}\n(the model is unpickled on "
                "every node: what it refers to must be importable there)"
            ) from exc
        with self._lock:
            closed = self._closed  # closed meanwhile (a joined node's): these are not needed
            if not closed:
                self._agents = self._agents + [
                    AgentRef(a, i) for a, i in zip(actors, infos, strict=True)
                ]
            self._pending = []
        if closed:
            for actor in actors:
                with contextlib.suppress(Exception):
                    self._ray.kill(actor)
            return
        live = self._live()
        peers = [Peer(a.token, a.node_id, a.host, a.actor) for a in live]
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
    def _call(
        self, agent: AgentRef, method: str, *args: Any, timeout: float | None = CALL_S
    ) -> Any:
        """Call an agent's method: brood's error for a refusal, AgentLost for a dead agent,
        TimeoutError when it does not answer within `timeout`."""
        ray = self._ray
        try:
            return ray.get(getattr(agent.actor, method).remote(*args), timeout=timeout)
        except ray.exceptions.RayActorError as exc:
            raise AgentLost(agent) from exc
        except ray.exceptions.GetTimeoutError as exc:
            raise TimeoutError(f"{agent} did not answer {method} within {timeout} s") from exc
        except ray.exceptions.RayTaskError as exc:
            cause = ray_cause(exc)
            if isinstance(cause, Exception):
                raise cause from None
            raise BackendError(f"{agent}: {method} failed: {exc}") from exc

    def _live(self) -> list[AgentRef]:
        with self._lock:
            return [a for a in self._agents if not a.dead]

    def _place(self) -> AgentRef:
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
                loads.append((load_of(stats), agent.placed, agent))
            else:
                return min(loads, key=lambda t: t[:2])[2]

    def _agent_of(self, root_id: str) -> AgentRef | None:
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

    def _recover(self, agent: AgentRef) -> None:
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
                revoked = store.revoke_lease(agent.token)
                assert isinstance(revoked, Future)  # a store of this thread's: no loop's
                revoked.result(timeout=CALL_S)
                for root_id in mine:
                    try:
                        state = store.get_run(root_id)["state"]
                    except UnknownRun:  # a spawn it died before journaling: started again
                        del self._trees[root_id]
                        handled.append(root_id)
                        continue
                    if state not in TERMINAL_VALUES:
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
            except AgentLost:
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
        check_timeout(timeout)
        if context is not None:
            try:
                cloudpickle.dumps(context)
            except Exception as exc:
                raise InvalidArgument(f"context cannot be pickled: {exc}") from exc
        return ClusterHandle(self._router, self._start_tree("spawn", prompt, context, timeout)[0])

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
            except AgentLost:
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
        except AgentLost:
            self._recover(agent)
            raise BackendError(f"{agent} died while resuming tree {root_id}; try again")
        with self._lock:
            self._trees[root_id] = agent
            agent.placed += 1
        return ClusterHandle(self._router, root_id)

    def flow_run(self, spec: Any, *, inputs: dict[str, Any] | None = None) -> ClusterFlowHandle:
        """Validate a flow spec (a path, YAML/JSON text or a dict) here and start the flow on
        the least loaded node; returns at once, with the states it started on
        `handle.started`. An invalid spec raises InvalidSpec listing every problem, and
        nothing starts. A path is read here, not on the node (an agent's working directory
        is Ray's). When the node is lost, the flow is resumed from its ledger on another."""
        from brood.flow.load import load_spec
        from brood.flow.service import SPEC_DUMP

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
        return ClusterFlowHandle(self._router, run_id, answer[1])

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
        return ClusterFlowHandle(self._router, run_id)

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
            except AgentLost:
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

"""The node agent: a Ray actor pinned to one node, hosting a supervisor's engine.

It holds the handles of the trees the cluster placed on it and the guests other nodes'
agents placed here (placement="spread"); errors go back as values, not as Ray's wrappers.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import cloudpickle

from brood.cluster.placement import Peer, Spreader
from brood.errors import BroodError, ChildCleanupError
from brood.lifecycle import RunRecord, RunState
from brood.limits import Limits

if TYPE_CHECKING:
    from brood.api import FlowHandle, RunHandle
    from brood.models.prices import Price
    from brood.supervisor.core import Run
    from brood.supervisor.engine import Engine


class NodeAgent:
    """One per Ray node: a supervisor's `Engine` (as a `Supervisor` has) and the handles of
    its trees by run id.

    Runs as a threaded Ray actor: a blocked `wait` holds one thread, so spawns, statuses
    and cancels go on beside it. Errors are returned as values, not raised, so the cluster
    rebuilds brood's own exceptions (with their fields) rather than Ray's wrappers.
    """

    def __init__(
        self,
        model_blob: bytes,
        store: str,
        limits: Limits | None,
        prices: dict[str, Price] | None = None,
        tracing: bool = False,
    ) -> None:
        from brood.supervisor.engine import Engine

        self.handles: dict[str, RunHandle] = {}
        self.lock = threading.Lock()
        self.peers: list[Peer] = []  # every agent of the cluster, this one too
        self.guests: dict[str, Run] = {}  # children placed here by other nodes, by id
        self.guest_roots: dict[str, str] = {}  # guest id -> the token of its root's agent
        model = cloudpickle.loads(model_blob)
        self.engine: Engine = Engine(
            model,
            store=store,
            limits=limits,
            spreader=Spreader(self),
            prices=prices,
            tracing=tracing,
        )
        self.token = self.engine.owner

    def info(self) -> dict[str, Any]:
        import ray

        return {
            "token": self.engine.owner,
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

        engine = self.engine
        engine.check_live("spawn")
        run = engine.call(
            engine.create_root(prompt, context, timeout, None, driven=False, run_id=run_id)
        )
        with self.lock:
            self.handles[run.id] = RunHandle(engine, run)
        return (run.id,)

    def resume(self, root_id: str) -> str:
        from brood.api import RunHandle

        run = self.engine.resume(root_id)
        with self.lock:
            self.handles[run.id] = RunHandle(self.engine, run)
        return run.id

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
        return self.engine.statistics()

    # ---- children placed here by other nodes (placement="spread") -----------------------
    def set_peers(self, peers: list[Peer]) -> None:
        self.peers = peers

    def host_guest(self, rec: RunRecord, data: dict[str, Any], root_token: str) -> None:
        import ray

        note = {"node_id": ray.get_runtime_context().get_node_id(), "host": socket.gethostname()}
        # Known before the guest starts: its first model call asks its root's node.
        self.guest_roots[rec.id] = root_token
        try:
            run = self.engine.call(self.engine.core.host_guest(rec, data, note))
        except BaseException:
            self.guest_roots.pop(rec.id, None)
            raise
        with self.lock:
            self.guests[run.id] = run

    def _guest(self, run_id: str) -> Run:
        with self.lock:
            return self.guests[run_id]

    def guest_started(self, run_id: str) -> None:
        """Returns once the guest runs (or ended without running)."""
        run = self._guest(run_id)
        if self.engine.closed:
            return

        async def either() -> None:
            waits = [asyncio.ensure_future(e.wait()) for e in (run.started, run.done)]
            _, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for w in pending:
                w.cancel()

        self.engine.call(either())

    def guest_ended(self, run_id: str) -> dict[str, Any]:
        run = self._guest(run_id)
        if not self.engine.closed:
            self.engine.call(run.done.wait())
        return _end_of(run)

    def guest_end(self, run_id: str, state: str, reason: str) -> dict[str, Any]:
        """End the guest and its subtree; returns once every exit is confirmed here."""
        run = self._guest(run_id)
        if not self.engine.closed:
            self.engine.call(self.engine.core.finish(run, RunState(state), reason))
        return _end_of(run)

    def guest_send(self, run_id: str, message: str) -> None:
        run = self._guest(run_id)
        self.engine.check_live(f"run {run_id}")
        self.engine.call(self.engine.core.send_message(run, message))

    def admit_remote(self, root_id: str, count: int) -> None:
        """Admit `count` children of a subtree of `root_id` (whose root runs here) that
        runs on another node, against the tree-wide limits."""
        self.engine.check_live(f"tree {root_id}")
        self.engine.call(_now(self.engine.core.admit_remote, root_id, count))

    def budget_enter(self, root_id: str) -> None:
        """A model call of that subtree waits here for the tree's budget."""
        self.engine.check_live(f"tree {root_id}")
        self.engine.call(self.engine.core.budget_enter(root_id))

    def budget_leave(self, root_id: str, tokens: int, cost: float, answered: bool) -> None:
        self.engine.check_live(f"tree {root_id}")
        self.engine.call(_now(self.engine.core.budget_leave, root_id, tokens, cost, answered))

    # Flows are looked up in the engine by id, not kept here: a flow this agent resumed
    # for a lost node (`resume` of its tree) is rebuilt there from its ledger.
    def flow_run(
        self, spec: dict[str, Any], inputs: dict[str, Any] | None, run_id: str
    ) -> tuple[str, list[str]]:
        """Start a flow under the id the cluster chose, as `spawn` does a tree."""
        from brood.flow.load import load_spec

        self.engine.check_live("flow_run")
        executor = self.engine.start_flow(load_spec(spec), inputs, run_id)
        return executor.run.id, executor.started

    def _flow(self, run_id: str) -> FlowHandle:
        """A handle on flow `run_id` of this agent's engine (InvalidArgument if none)."""
        from brood.api import FlowHandle

        executor = self.engine.flow(run_id)
        return FlowHandle(self.engine, executor, executor.started)

    def flow_started(self, run_id: str) -> list[str]:
        return self._flow(run_id).started

    def flow_status(self, run_id: str) -> dict[str, Any]:
        return self._flow(run_id).status()

    def flow_wait(self, run_id: str, timeout: float | None) -> tuple[str, str]:
        """("timeout", message) or ("ended", the status it ended or paused with)."""
        try:
            return ("ended", self._flow(run_id).wait(timeout))
        except TimeoutError as exc:
            return ("timeout", str(exc))

    def flow_wait_change(self, run_id: str) -> None:
        self._flow(run_id).wait_change()

    def flow_outputs(self, run_id: str) -> dict[str, dict[str, Any]]:
        return self._flow(run_id).outputs()

    def flow_stop(self, run_id: str) -> dict[str, Any]:
        return self._flow(run_id).stop()

    def flow_resume(self, run_id: str) -> None:
        self._flow(run_id).resume()

    def close(self) -> dict[str, Any]:
        """Close the engine; report what could not be confirmed gone (pids, error)."""
        from brood.backends.owners import processes_owned

        mark = getattr(self.engine.backend, "owner", None)
        error, pids = None, []
        try:
            self.engine.close()
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
        "failure_kind": run.failure_kind,
    }


async def _now(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)

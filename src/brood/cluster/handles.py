"""The handles of a cluster's trees and flows, which follow them from agent to agent.

A handle reaches its cluster only through a `Router` (the cluster's `TreeRouter`): the
agent running its tree now, a call to that agent, the recovery of a lost one, the journal.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Protocol

from brood.api import RunResult
from brood.cluster.nodes import CALL_S, CLOSE_S, WAIT_SLACK_S, AgentLost, AgentRef
from brood.errors import (
    BroodError,
    ChildFailed,
    InvalidArgument,
    ReplayDiverged,
    StaleHandle,
    StoreError,
)
from brood.lifecycle import TERMINAL_VALUES, RunState
from brood.limits import check_timeout
from brood.store.base import open_store

_ERRORS: dict[str, type[BroodError]] = {
    "ReplayDiverged": ReplayDiverged,
    "StoreError": StoreError,
    "StaleHandle": StaleHandle,
}


class Ended(Exception):
    """The tree ended on an agent that was lost since: the journal holds how it ended."""


class Router(Protocol):
    """What a handle needs of its cluster: where its tree runs now, and calls to agents."""

    @property
    def store_url(self) -> str:
        """The journal every node writes to (a tree that ended with a lost node is read
        there)."""

    def agent_of(self, root_id: str, what: str) -> AgentRef | None:
        """The agent running tree `root_id` now (None: it ended with a lost agent);
        StaleHandle, naming `what`, once the cluster is closed."""

    def call(self, agent: AgentRef, method: str, *args: Any, timeout: float | None) -> Any:
        """`method(*args)` of `agent`; AgentLost when it died."""

    def recover(self, agent: AgentRef) -> None:
        """`agent` died: its trees are resumed elsewhere (once, whoever asks first)."""


class _Followed:
    """A handle on a tree of a cluster, which follows it to the agent running it now."""

    what = "tree"

    def __init__(self, router: Router, run_id: str) -> None:
        self._router = router
        self.id = run_id

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id}>"

    def _agent(self) -> AgentRef | None:
        return self._router.agent_of(self.id, f"{self.what} {self.id}")

    @property
    def node_id(self) -> str | None:
        """The Ray node it runs on now (None once it ended with a lost node)."""
        agent = self._agent()
        return agent.node_id if agent is not None else None

    def _on_agent(self, method: str, *args: Any, timeout: float | None = CALL_S) -> Any:
        """`method` of the agent running the tree now, following the tree to the agent that
        resumed it when a node is lost; Ended once it ended with a lost node."""
        while True:
            agent = self._agent()
            if agent is None:
                raise Ended
            try:
                return self._router.call(agent, method, self.id, *args, timeout=timeout)
            except AgentLost:
                self._router.recover(agent)

    def _bounded(self, method: str, timeout: float | None) -> tuple[Any, ...] | None:
        """The answer of the agent's blocking `method` ("ended", ...), waited for at most
        `timeout` s (TimeoutError after; the work goes on). It follows the tree to the
        agent resuming it when one is lost; None when it ended with a lost node."""
        check_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            agent = self._agent()
            if agent is None:
                return None
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                answer = self._router.call(
                    agent,
                    method,
                    self.id,
                    left or (None if deadline is None else 1e-3),
                    timeout=None if left is None else left + WAIT_SLACK_S,
                )
            except AgentLost:
                self._router.recover(agent)  # it goes on elsewhere: wait there
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
        store = open_store(self._router.store_url, readonly=True)
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
        except Ended:
            return self._journaled().state

    @property
    def done(self) -> bool:
        return self.status() in TERMINAL_VALUES

    def cancel(self) -> str:
        """Cancel the tree; returns once every exit is confirmed on its node."""
        try:
            return str(self._on_agent("cancel", timeout=CLOSE_S))
        except Ended:
            return self._journaled().state

    def send(self, message: str) -> None:
        """A follow-up instruction the tree's root sees before its next model turn."""
        if not isinstance(message, str):
            raise InvalidArgument("send(message): message must be str")
        try:
            self._on_agent("send", message)
        except Ended:
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

    def __init__(self, router: Router, run_id: str, started: list[str] | None = None) -> None:
        """`started`: the states it entered first; None asks its agent (none when it ended
        with a lost node)."""
        super().__init__(router, run_id)
        self.started: list[str] = []
        if started is not None:
            self.started = started
        else:
            with contextlib.suppress(Ended):
                self.started = list(self._on_agent("flow_started"))

    def _journaled(self) -> dict[str, Any]:
        """The status of a flow that ended on a lost node, from its ledger."""
        from brood.journal import Journal

        with Journal(self._router.store_url) as journal:
            return journal.flow_status(self.id)

    def status(self) -> dict[str, Any]:
        """Per-state entries used / max and instances, milestones, recent ledger events (of a
        flow that ended on a node lost since: as the journal's ledger has them)."""
        try:
            return dict(self._on_agent("flow_status"))
        except Ended:
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
            self._router.call(agent, "flow_wait_change", self.id, timeout=None)
        except AgentLost:
            self._router.recover(agent)

    def outputs(self) -> dict[str, dict[str, Any]]:
        """Each state's latest settled outputs. Of a flow that ended on a node lost since,
        the journal holds the outputs only if it finished (they are its run's answer)."""
        import json

        try:
            return dict(self._on_agent("flow_outputs"))
        except Ended:
            pass
        store = open_store(self._router.store_url, readonly=True)
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
        except Ended:
            return {"state": self._journaled()["status"], "cancelled": [], "instances": []}

    def resume(self) -> None:
        """Go on after a pause (escalate, max_transitions, budget); a flow that is not
        paused raises BroodError."""
        try:
            self._on_agent("flow_resume")
        except Ended:
            status = self._journaled()["status"]
            raise BroodError(f"flow {self.id} is {status}; only a paused flow resumes") from None

"""The supervisor's kernel: the single writer of run state.

It owns the registry of runs and the one place a run changes state (`move`: the transition
table, then the journal, and only once that is committed, the parent's worker). Everything
here runs on the supervisor's loop thread. The rooms around it (admission, ending, budget,
spread, resume, starts, requests, asks) each receive this kernel, never `Core`.

The calls that go up from here to rooms built on top of it are bound once by the composition
root (core.py): `finish` and `end` (ending.py) and `waits_changed` (admission.py).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable, Sequence
from types import CoroutineType
from typing import TYPE_CHECKING, Any, Protocol

from brood.backends.base import Backend
from brood.errors import BroodError, StoreError, SupervisorClosed
from brood.lifecycle import FailureKind, RunRecord, RunState, move
from brood.limits import Limits
from brood.models.base import Model
from brood.protocol import Deliver, FlowReq, Progress, WorkerLimits
from brood.store.base import Store
from brood.supervisor.observers import Observers
from brood.supervisor.runs import (
    COST_UNKNOWN,
    FLOW_MODEL,
    RUN,
    STORE_FAILED,
    Run,
    child_update,
    new_run_id,
)
from brood.supervisor.tracing import NO_TRACING, SpanIds, Tracing

if TYPE_CHECKING:  # brood.flow is imported on a flow's first use
    from brood.flow.executor import FlowExecutor

DELIVER_ACK_S = 5.0  # how long a follow-up waits for the worker to confirm it is queued
HEARTBEAT_S = 0.1  # at most one heartbeat from below per this many seconds to one worker
ID_DRAWS = 8  # fresh ids tried for a run whose id the journal already holds


class End(Protocol):
    """Beginning a run's ending without waiting for it (ending.py's `Ending.end`)."""

    def __call__(
        self,
        run: Run,
        state: RunState,
        reason: str,
        *,
        answer: str | None = None,
        error: str | None = None,
        kind: FailureKind = FailureKind.ERROR,
    ) -> None: ...


class Finish(Protocol):
    """Ending a run (ending.py's `Ending.finish`): the state it really ended in."""

    def __call__(
        self,
        run: Run,
        state: RunState,
        reason: str,
        *,
        answer: str | None = None,
        error: str | None = None,
        kind: FailureKind = FailureKind.ERROR,
    ) -> Awaitable[RunState]: ...


class Spreader(Protocol):
    """How a supervisor hosted by a cluster's node agent reaches the other nodes."""

    async def start(self, run: Run) -> Any:
        """Hand `run` to another node's supervisor; where it went, or None for here."""

    async def started(self, run: Run) -> None: ...

    async def ended(self, run: Run) -> dict[str, Any]:
        """Its end, once it ended: state, reason, answer, error, products, usage."""

    async def cancel(self, run: Run, state: RunState, reason: str) -> dict[str, Any]:
        """End it on its node (every exit confirmed there); its end as `ended` gives it."""

    async def send(self, run: Run, message: str) -> None: ...

    async def admit(self, top: Run, count: int) -> None:
        """Ask the node running the tree's root to admit `count` more children."""

    async def lost(self, run: Run) -> None:
        """`run`'s node was lost: make its runs this node's to resume (revoke its lease)."""

    async def budget_enter(self, top: Run) -> None:
        """A model call below `top` waits for the tree's budget at the root's node."""

    async def budget_leave(self, top: Run, tokens: int, cost: float, answered: bool) -> None:
        """That call ended: what it spent, counted at the root's node."""

    def holder(self, token: str) -> Any:
        """The other node whose supervisor has owner token `token` (None if unknown)."""


# Kernel.tasks lets go of its ended tasks once it holds twice the live ones it kept the last
# time, and this many more.
TASKS_PRUNED_AT = 256

LAZY_EVENTS = frozenset({"model_call", "step", "tool_call", "trace", COST_UNKNOWN})


class Flows(Protocol):
    """The flows a supervisor runs, as its rooms reach them (the engine answers, with
    brood.flow's FlowService, imported on a flow's first use)."""

    def flow_executor(self, run_id: str) -> FlowExecutor[Run] | None:
        """The executor of flow `run_id` this supervisor runs, or None."""

    async def answer_flow(self, run: Run, msg: FlowReq) -> Any:
        """A run's code starts or steers a flow (its FlowReq)."""

    def rebuild_flow(self, run: Run) -> None:
        """Rebuild flow `run` from its ledger while its tree is resumed."""


def unbound(*_: Any, **__: Any) -> Any:
    raise RuntimeError("the supervisor's rooms are not bound to its kernel yet (Core binds them)")


class Kernel:
    """The registry of runs, move-and-journal, events, tasks, telling a parent, progress,
    the tree's limits on new runs."""

    def __init__(
        self,
        *,
        model: Model,
        model_name: str | None,
        limits: Limits,
        store: Store,
        backend: Backend,
        observers: Observers,
        owner: str,
        unenforced: list[str],
        keep_scratch: bool,
        spreader: Spreader | None,
        tracing: Tracing = NO_TRACING,
    ) -> None:
        self.model = model
        self.model_name = model_name
        self.limits = limits
        # What every worker's Start carries, built once (the worker keeps no defaults).
        self.worker_limits = WorkerLimits.from_limits(limits)
        self.store = store
        self.backend = backend
        self.observers = observers
        self.owner = owner
        self.runs: dict[str, Run] = {}
        self.unenforced = unenforced  # what confinement this machine does not enforce
        self.keep_scratch = keep_scratch  # runs' scratch directories outlive them (journaled)
        self.closing = False
        self.store_error: StoreError | None = None  # the journal failed: no new work
        # A cluster's node agent's: starts children placed with placement="spread" on
        # other nodes, and asks a tree's root node to admit its children (Spreader).
        self.spreader = spreader
        # The spans of runs, steps, calls, asks and pool waits (tracing.py): a Tracing
        # that does nothing unless the supervisor was made with tracing on.
        self.tracing = tracing
        # The tasks started here, held until they end (`task`); ended ones are let go of
        # in bulk, when the set has doubled, not by a callback per task.
        self.tasks: set[asyncio.Task[Any]] = set()
        self._prune_at = TASKS_PRUNED_AT
        self._deliveries = itertools.count(1 << 30)  # Deliver ids, apart from Exec ids
        # Bound by the composition root (core.py) to the rooms above the kernel.
        self.finish: Finish = unbound
        self.end: End = unbound
        self.waits_changed: Callable[[Run], None] = unbound

    # ---- bookkeeping -------------------------------------------------------------------
    def task(self, coro: Any) -> asyncio.Task[Any]:
        """Run `coro` on the loop, held until it ends (so it is never collected early)."""
        if type(coro) is CoroutineType:  # nearly always: no need of ensure_future's checks
            task = asyncio.get_running_loop().create_task(coro)
        else:
            task = asyncio.ensure_future(coro)
        tasks = self.tasks
        tasks.add(task)
        if len(tasks) >= self._prune_at:  # amortized: at most as many ended as live held
            live = {t for t in tasks if not t.done()}
            self.tasks = live
            self._prune_at = 2 * len(live) + TASKS_PRUNED_AT
        return task

    async def move(
        self,
        run: Run,
        to: RunState,
        reason: str | None = None,
        meanwhile: Callable[[], object] | None = None,
    ) -> None:
        """Move `run` (lifecycle.move), journal it, and only once that is committed tell its
        parent. `meanwhile` runs after the write is queued and before the commit: work that
        tells nobody of the move (a worker's Start) need not wait for the disk."""
        frm, _ = move(run.rec, to, reason)
        committed = asyncio.wrap_future(self.store.transition(run.rec, frm.value, to.value))
        if meanwhile is not None:
            meanwhile()
        try:
            await committed
        except StoreError as exc:
            self.store_failed(exc)  # every run is ending with the journal's error
            if to.terminal:  # an end the journal does not hold is not the end it says
                run.rec.state, run.rec.reason = RunState.FAILED, f"{STORE_FAILED}{exc}"
                run.failure_kind = FailureKind.STORE
        if not run.retrying:  # else its parent hears of the next attempt instead
            self.tell_parent(run)
        parent = run.parent
        if parent is not None and parent.parent is not None:
            self.progress(parent)  # a state change below is progress for the ancestors

    def event(self, run: Run, kind: str, data: dict[str, Any], progress: str | None = None) -> None:
        """Journal an event of `run`."""
        # A model call, a tool call, a step's output and a span's ids (LAZY_EVENTS): nobody
        # waits on them, so they ride with the next write that is waited on (the step's
        # start, the run's end) instead of a commit of their own. Others (a message, an
        # ask) commit as soon as the writer gets to them. A cost_unknown goes with its call.
        self.store.note(run.rec, kind, data, progress, at_once=kind not in LAZY_EVENTS)

    def start_trace(self, run: Run, links: Sequence[SpanIds] = ()) -> None:
        """`run`'s span begins (tracing on), under its parent's and linked to `links` (its
        spans before a crash); its ids are journaled, for a resume's span to link to."""
        self.journal_trace(run, self.tracing.run_started(run, links))

    def journal_trace(self, run: Run, ids: SpanIds | None) -> None:
        """Journal the ids of `run`'s span (a `trace` event), if it has one here."""
        if ids is not None:
            self.event(run, "trace", ids.journaled())

    def store_failed(self, exc: StoreError) -> None:
        """The journal failed a write: end every run at once with that reason (the
        failure is loud, never a hang) and refuse new work."""
        if self.store_error is not None:
            return
        self.store_error = exc
        reason = f"{STORE_FAILED}{exc}"
        for root in self.live_roots():
            self.end(root, RunState.FAILED, reason, kind=FailureKind.STORE)

    def top(self, run: Run) -> Run:
        """The top of `run`'s tree in this supervisor, which holds the tree's counters: its
        root, or the guest run its subtree hangs from (the root is on another node)."""
        while run.parent is not None:
            run = run.parent
        return run

    def tree_root(self, root_id: str) -> Run:
        """The root of tree `root_id`, which runs here (asked by another node)."""
        root = self.runs.get(root_id)
        if root is None or root.parent is not None or root.guest:
            raise BroodError(f"tree {root_id} does not run on this node")
        if root.rec.state.terminal or root.ending is not None:
            raise BroodError(f"tree {root_id} is ending; it starts no more work")
        return root

    def live_roots(self) -> list[Run]:
        """The roots of the trees this supervisor runs that have not ended."""
        return [r for r in self.runs.values() if r.parent is None and not r.rec.state.terminal]

    def check_open(self) -> None:
        """Raise unless this supervisor takes new work."""
        if self.store_error is not None:
            raise StoreError(f"this supervisor refuses new work: {self.store_error}")
        if self.closing:
            raise SupervisorClosed("the supervisor is closed; make a new one")

    async def admit_to_tree(self, under: Run, count: int, run_total: int = 0) -> None:
        """Refuse (LimitExceeded) `count` more runs below `under` unless they fit the tree's
        max_children and, with the `run_total` runs their starter has started already,
        max_children_per_run. Below a guest the tree's own count is kept by its root's
        node: asked (and counted) there. The caller counts them here once they start."""
        self.limits.admit_children(tree_total=under.tree.children, run_total=run_total, count=count)
        top = self.top(under)
        if top.guest and count:
            assert self.spreader is not None
            await self.spreader.admit(top, count)

    def children_of(self, run: Run) -> int:
        """The runs `run` started, for max_children_per_run: its children (every attempt)
        and every run of each flow its code started."""
        if not run.flows_started:  # the common case, on every start of a child: no walk
            return len(run.children)
        return len(run.children) + sum(
            len(c.children) for c in run.children if c.rec.model == FLOW_MODEL
        )

    # ---- telling a parent ----------------------------------------------------------------
    def tell_parent(self, run: Run) -> None:
        """Its parent's worker hears of `run`'s state (unless the parent has ended)."""
        parent = run.parent
        if parent is None or parent.rec.state.terminal:
            return
        if parent.conn is not None:
            parent.conn.send(child_update(run))
        if run.rec.state.terminal and (parent.conn is not None or parent.hibernating):
            self.waits_changed(parent)  # a hibernating parent may wake

    def progress(self, run: Run) -> None:
        """`run` made progress: every ancestor's worker hears a heartbeat (at most one per
        HEARTBEAT_S each), so a step waiting on work below is not taken for stalled."""
        below, parent = run, run.parent
        if parent is None:
            return  # a root: nobody above to tell
        now = asyncio.get_running_loop().time()
        while parent is not None:
            if parent.conn is not None and now - parent.last_beat >= HEARTBEAT_S:
                parent.last_beat = now
                parent.conn.send(Progress(below.handle_id or below.id))
            below, parent = parent, parent.parent

    async def send_message(self, run: Run, message: str) -> None:
        """A follow-up for `run`: journaled, then delivered to its worker (or held for its
        Start). Waits at most DELIVER_ACK_S for the worker to confirm it is queued."""
        if run.spreading is not None:
            await asyncio.shield(run.spreading)
            if run.remote is not None and not run.rec.state.terminal and run.ending is None:
                assert self.spreader is not None
                await self.spreader.send(run, message)
                return
        if run.rec.state.terminal or run.ending is not None:
            how = run.rec.state.value if run.rec.state.terminal else "ending"
            raise BroodError(
                f"run {run.id} is {how}; a follow-up cannot reach a run that has ended"
            )
        self.event(run, "message", {"message": message, "delivered": run.conn is not None})
        if run.conn is None or run.rec.state is not RUN:
            run.messages.append(message)  # given to the run with its Start
            return
        req_id = next(self._deliveries)
        ack: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        run.pending[req_id] = ack
        run.conn.send(Deliver(message, req_id))
        try:  # the worker confirms once the message is queued for its next turn
            await asyncio.wait_for(asyncio.shield(ack), DELIVER_ACK_S)
        except (TimeoutError, BroodError):
            pass  # the run ended meanwhile, or is stuck: the message is journaled either way
        finally:
            run.pending.pop(req_id, None)

    # ---- the journal's bytes and new rows --------------------------------------------------
    def charge(self, run: Run, size: int) -> bool:
        """Count `size` bytes `run` adds to the journal; past Limits.journal_bytes_per_run
        the run fails naming the limit, and False says not to write them."""
        lim = self.limits.journal_bytes_per_run
        if run.journaled + size <= lim:
            run.journaled += size
            return True
        if run.ending is None and not run.rec.state.terminal:
            reason = (
                f"limit journal_bytes_per_run exceeded: run {run.id} has journaled "
                f"{run.journaled:,} bytes and would add {size:,}, over "
                f"Limits.journal_bytes_per_run={lim:,}; print less, or raise the limit"
            )
            self.end(run, RunState.FAILED, reason)
        return False

    def new_id(self) -> str:
        while (rid := new_run_id()) in self.runs:
            pass
        return rid

    def root_record(self, prompt: str, model: str | None, rid: str | None = None) -> RunRecord:
        rid = rid or self.new_id()
        return RunRecord(
            id=rid, root_id=rid, parent_id=None, depth=0, key=None, prompt=prompt, model=model
        )

    def child_record(self, parent: Run, key: str, prompt: str, model: str | None) -> RunRecord:
        return RunRecord(
            id=self.new_id(),
            root_id=parent.rec.root_id,
            parent_id=parent.id,
            depth=parent.rec.depth + 1,
            key=key,
            prompt=prompt,
            model=model,
        )

    async def journal_or_forget(
        self, runs: list[Run], parent: Run | None = None, counted: int = 0
    ) -> None:
        """Journal new runs; if that fails, they never existed: nothing of them stays in
        the supervisor's view or counts against a limit (only a journaled run starts)."""
        try:
            await self.journal_new(runs)
        except BaseException:
            for run in runs:
                self.runs.pop(run.id, None)
                if parent is not None and run in parent.children:
                    parent.children.remove(run)
            if parent is not None:
                parent.tree.children -= counted
            raise

    async def journal_new(self, runs: list[Run]) -> None:
        """Insert new runs into the journal. An id that an earlier tree in the same journal
        already holds is drawn again (the journal outlives this supervisor's memory)."""
        for run in runs:
            self.runs[run.id] = run
        pending = runs
        for _ in range(ID_DRAWS):
            inserted = await asyncio.gather(
                *(
                    asyncio.wrap_future(
                        self.store.insert_run(r.rec, self.owner, r.context_blob, r.model_name)
                    )
                    for r in pending
                )
            )
            pending = [r for r, ok in zip(pending, inserted, strict=True) if not ok]
            if not pending:
                if self.tracing.enabled:
                    for run in runs:
                        self.start_trace(run)
                return
            for run in pending:
                del self.runs[run.id]
                run.rec.id = self.new_id()
                if run.parent is None:
                    run.rec.root_id = run.rec.id
                self.runs[run.id] = run
        raise BroodError(
            f"could not draw an unused run id in {ID_DRAWS} tries; the journal "
            f"{self.store.url} holds very many runs"
        )

    # ---- the supervisor's clock of each step ---------------------------------------------
    def hold(self, run: Run) -> None:
        """The run waits on the supervisor: its step clock stands still."""
        run.holds += 1
        if run.watch is not None:
            run.watch.pause()

    def unhold(self, run: Run) -> None:
        run.holds -= 1
        if run.holds == 0 and run.watch is not None:
            run.watch.go()

    def stop_watch(self, run: Run) -> None:
        if run.watch is not None:
            run.watch.pause()
            run.watch = None


__all__ = ["Finish", "Kernel", "Spreader", "unbound"]

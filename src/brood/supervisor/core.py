"""The supervisor core: owns every run of every tree, on one asyncio loop.

Everything here runs on the supervisor's loop thread, which is the single writer of run
state. `_move` is where a run changes state: it applies the transition table and waits for
the journal to commit before anyone (parent worker, caller, observer) is told.
"""

from __future__ import annotations

import asyncio
import base64
import bisect
import contextlib
import hashlib
import itertools
import logging
import secrets
import signal
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from brood.backends.base import STATUS_UNKNOWN, Backend, WorkerConn
from brood.errors import (
    BroodError,
    ChildCleanupError,
    InvalidArgument,
    LimitExceeded,
    ModelError,
    ReplayDiverged,
    StoreError,
    SupervisorClosed,
)
from brood.lease import lease_holder_gone
from brood.lifecycle import RunRecord, RunState, move
from brood.limits import Limits
from brood.models.base import Completion, Model
from brood.protocol import (
    BUDGET_MARK,
    FAILURE_TEXT_CAP,
    MAX_CONTEXT_BYTES,
    MAX_REMEMBER_BYTES,
    AskCancelReq,
    AskReq,
    Blocked,
    BudgetReq,
    CancelReq,
    ChildUpdate,
    Deliver,
    Exec,
    Failed,
    Final,
    FlowReq,
    ModelReq,
    Msg,
    Progress,
    Remember,
    Replay,
    Reply,
    SendReq,
    SpawnReq,
    Start,
    StepBegan,
    StepDone,
    StepResult,
    Stop,
    WorkerLimits,
    clip,
    error_info,
    user_message_cap,
)
from brood.store.base import Store
from brood.supervisor import frames
from brood.supervisor.asks import Asks
from brood.supervisor.frames import Conversation, Steps, Violation
from brood.supervisor.gateway import ModelGateway
from brood.supervisor.observers import Observers

DELIVER_ACK_S = 5.0  # how long a follow-up waits for the worker to confirm it is queued
HEARTBEAT_S = 0.1  # at most one heartbeat from below per this many seconds to one worker
ID_DRAWS = 8  # fresh ids tried for a run whose id the journal already holds
KILL_CONFIRM_S = 5.0  # after SIGKILL, a group still present this long is reported, not awaited
log = logging.getLogger("brood")
QUARANTINE_RETRY_S = 5.0  # how often a quarantined worker group is sent SIGKILL again
DRAIN_ON_EXIT_S = 1.0  # read what a dead worker sent last before calling its exit a crash
CPU_SLACK_S = 0.05  # rusage of a worker killed at its CPU limit can read just under it
FLOW_MODEL = "flow"  # the model column of a flow's own run (it has no worker)
STORE_FAILED = "StoreError: "  # how the reason of a run ended by a failed journal begins

Q, RUN, CANCELLING = RunState.QUEUED, RunState.RUNNING, RunState.CANCELLING


def _flow_key(parent: Run) -> str:
    return f"flow:{parent.flows_started}"


def _clip(text: str, n: int = 80) -> str:
    return repr(text if len(text) <= n else text[: n - 3] + "...")


def last_line(text: str) -> str:
    """The last non-empty line of a step's output, cut to fit a live view."""
    lines = text.strip().splitlines()
    return lines[-1][-200:] if lines else ""


def new_run_id() -> str:
    """A short, readable id; `Core._journal_new` draws again on a clash in the journal."""
    return "r-" + secrets.token_hex(4)


@dataclass
class RunInfo:
    """What observers and handles see of a run."""

    run_id: str
    parent_id: str | None
    root_id: str
    depth: int
    prompt: str
    state: str
    reason: str | None
    answer: str | None
    error: str | None
    duration: float | None
    usage: dict[str, Any]


@dataclass(eq=False)
class Run:
    rec: RunRecord
    model: Model
    context_blob: bytes | None
    model_name: str | None
    timeout: float | None
    parent: Run | None
    driven: bool = False
    children: list[Run] = field(default_factory=list)
    conn: WorkerConn | None = None
    holds_slot: bool = False
    holds_pool: bool = False  # one place of its pool (rec.pool), from its start to its end
    # Attempts (rlm_query(..., retries=N)): how many more a failure or timeout starts; the
    # id its parent's handle has (the first attempt's); the attempt that followed it; and
    # whether its end starts another (its parent then hears nothing of this one's end).
    retries_left: int = 0
    last_beat: float = 0.0  # when its worker last heard a heartbeat from below (loop time)
    handle_id: str | None = None
    next_attempt: Run | None = None
    retrying: bool = False
    messages: list[str] = field(default_factory=list)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    started: asyncio.Event = field(default_factory=asyncio.Event)
    ending: asyncio.Task[RunState] | None = None
    timer: asyncio.TimerHandle | None = None
    seq: dict[int, int] = field(default_factory=dict)
    pending: dict[int, asyncio.Future[Any]] = field(default_factory=dict)
    last_line: str = ""
    tree_children: int = 0  # roots only: children started in the whole tree
    tree_usage: dict[str, float] = field(default_factory=dict)  # roots only
    replay: Replay | None = None  # a run resumed from the journal, until its worker starts
    by_key: dict[str, Run] = field(default_factory=dict)  # resumed: journaled children by key
    flows_started: int = 0  # flows its code started (their runs' keys: flow:N)
    prompts: set[str] = field(default_factory=set)  # roots only: system prompts journaled
    calls: set[asyncio.Task[Any]] = field(default_factory=set)  # model calls under way
    # Roots only, for budgets: calls of the tree in flight, answered, and the largest.
    calls_in_flight: int = 0
    calls_seen: int = 0
    largest_tokens: int = 0
    largest_cost: float = 0.0
    budget_waiters: list[asyncio.Future[None]] = field(default_factory=list)
    # The supervisor's own clock of the step under way, paused while the run waits on the
    # supervisor (`holds`: requests being answered, and a block on children).
    watch: StepWatch | None = None
    holds: int = 0
    blocked: bool = False
    exec_timeout: float | None = None  # Session.step(timeout=) of the driven step under way
    # What the supervisor itself knows of the worker, to check its frames by (frames.py):
    # its model turns and REPL steps as they were answered and seen, its requests being
    # answered, the bytes it has added to the journal and the asks it opened.
    convo: Conversation = field(default_factory=Conversation)
    steps: Steps = field(default_factory=Steps)
    first_cap: int = 0  # characters of its first user message (frames.Conversation)
    requests: int = 0
    model_requests: int = 0  # model calls asked for and not answered yet (from receipt)
    journaled: int = 0
    asks_opened: int = 0
    # placement="spread" (a cluster): the start of this child on another node (the parent's
    # side), then where it runs (the spreader's), or None when it started here after all.
    spreading: asyncio.Task[Any] | None = None
    remote: Any = None
    guest: bool = False  # the top of a subtree whose parent runs on another node

    @property
    def launchable(self) -> bool:
        """Waiting for a worker: queued, or resumed while it was running."""
        if self.remote is not None:  # it runs on another node
            return False
        if self.rec.state is RUN:
            return self.replay is not None and self.conn is None and self.ending is None
        return self.rec.state is Q

    @property
    def id(self) -> str:
        return self.rec.id

    def info(self) -> RunInfo:
        r = self.rec
        return RunInfo(
            r.id,
            r.parent_id,
            r.root_id,
            r.depth,
            r.prompt,
            r.state.value,
            r.reason,
            r.answer,
            r.error,
            r.duration,
            dict(r.usage),
        )


@dataclass(eq=False)
class Pool:
    """A named capacity pool (Limits.pools): the runs holding it, in the order they took
    it, and the runs waiting for it, oldest first (by creation, so a resume that adopts
    them in another order queues them as they were)."""

    name: str
    capacity: int
    holders: list[Run] = field(default_factory=list)
    waiters: list[Run] = field(default_factory=list)

    def wait(self, run: Run) -> None:
        bisect.insort(self.waiters, run, key=_pool_order)

    def first_waiter(self, run: Run) -> Run | None:
        """The oldest run that can still start and waits ahead of `run`, if any: first
        come, first served, so a newcomer never takes a place an older waiter is owed."""
        mine = _pool_order(run)
        return next(
            (w for w in self.waiters if w is not run and w.launchable and _pool_order(w) < mine),
            None,
        )

    def describe(self) -> str:
        held = ", ".join(r.id for r in self.holders) or "nobody"
        return f"{len(self.holders)} of {self.capacity} held by {held}"


def _pool_order(run: Run) -> tuple[int, float]:
    """Runs that held a place when their host died first, then by creation."""
    return (0 if run.rec.state is RUN else 1, run.rec.created_at)


class StepWatch:
    """The supervisor's clock of one step: the step's compute time, as the worker's own
    StepClock counts it (waits on the supervisor are not counted), plus a grace. It calls
    `on_late` if the step has not ended by then: model code that swallowed StepTimeout or
    disarmed the worker's timer cannot stop this clock."""

    def __init__(self, budget: float, on_late: Callable[[], object], running: bool) -> None:
        self.left = budget
        self.on_late = on_late
        self.handle: asyncio.TimerHandle | None = None
        self.since = 0.0
        if running:
            self.go()

    def go(self) -> None:
        if self.handle is None:
            loop = asyncio.get_running_loop()
            self.since = loop.time()
            self.handle = loop.call_later(max(0.0, self.left), self.on_late)

    def pause(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None
            self.left -= asyncio.get_running_loop().time() - self.since


class NodeLost(BroodError):
    """The node running a spread child was lost (its agent died)."""


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


class Core:
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
    ) -> None:
        self.model = model
        self.model_name = model_name
        self.gateway = ModelGateway()
        self.unenforced: list[str] = []  # what confinement this machine does not enforce
        self.keep_scratch = False  # runs' scratch directories outlive them (journaled)
        self.limits = limits
        self.store = store
        self.backend = backend
        self.observers = observers
        self.owner = owner
        self.runs: dict[str, Run] = {}
        self.free_slots = limits.max_concurrency
        self.pools = {name: Pool(name, cap) for name, cap in limits.pools.items()}
        self.asks = Asks(self)
        self.start_queue: deque[Run] = deque()
        self.resume_queue: deque[tuple[Run, asyncio.Future[None]]] = deque()
        self.closing = False
        # Cleanup failures, in order (close() raises the first), and the worker groups whose
        # exit is still unconfirmed, by run id: quarantined, killed again until they are gone.
        self.cleanup_failures: list[ChildCleanupError] = []
        self.quarantined: dict[str, list[int]] = {}
        self.store_error: StoreError | None = None  # the journal failed: no new work
        self._deliveries = itertools.count(1 << 30)  # Deliver ids, apart from Exec ids
        self.diverged: dict[str, str] = {}  # root id -> why its resume stopped
        self.flows: dict[str, Any] = {}  # flow run id -> its executor (brood.flow)
        # Set by the API (which knows brood.flow): answers a run's FlowReq, and rebuilds a
        # flow from its ledger when its tree is resumed.
        self.flow_handler: Callable[[Run, FlowReq], Awaitable[Any]] | None = None
        self.flow_resumer: Callable[[Run], None] | None = None
        # Set by a cluster's node agent: starts children placed with placement="spread" on
        # other nodes, and asks a tree's root node to admit its children (Spreader).
        self.spreader: Spreader | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        backend.on_lost = self._zygote_lost

    # ---- bookkeeping -------------------------------------------------------------------
    def _task(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _move(
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
        if not run.retrying:  # else its parent hears of the next attempt instead
            self._tell_parent(run)
        parent = run.parent
        if parent is not None and parent.parent is not None:
            self._progress(parent)  # a state change below is progress for the ancestors

    def _event(
        self, run: Run, kind: str, data: dict[str, Any], progress: str | None = None
    ) -> None:
        # A model call and a step's output are what every turn writes, and nobody waits on
        # them: they ride with the next write that is waited on (the step's start, the
        # run's end) instead of a commit of their own. Others (a message, an ask) commit
        # as soon as the writer gets to them.
        self.store.event(run.rec, kind, data, progress, lazy=kind in ("model_call", "step"))

    def store_failed(self, exc: StoreError) -> None:
        """The journal failed a write: end every run at once with that reason (the
        failure is loud, never a hang) and refuse new work."""
        if self.store_error is not None:
            return
        self.store_error = exc
        reason = f"{STORE_FAILED}{exc}"
        for root in self._live_roots():
            self._task(self.finish(root, RunState.FAILED, reason))

    def _top(self, run: Run) -> Run:
        """The top of `run`'s tree in this supervisor, which holds the tree's counters: its
        root, or the guest run its subtree hangs from (the root is on another node)."""
        while run.parent is not None:
            run = run.parent
        return run

    def _live_roots(self) -> list[Run]:
        """The roots of the trees this supervisor runs that have not ended."""
        return [r for r in self.runs.values() if r.parent is None and not r.rec.state.terminal]

    def check_open(self) -> None:
        if self.store_error is not None:
            raise StoreError(f"this supervisor refuses new work: {self.store_error}")
        if self.closing:
            raise SupervisorClosed("the supervisor is closed; make a new one")

    # ---- creating runs -----------------------------------------------------------------
    async def create_root(
        self,
        prompt: str,
        *,
        context_blob: bytes | None,
        model: Model | None = None,
        model_name: str | None = None,
        timeout: float | None = None,
        driven: bool = False,
        pool: str | None = None,
        run_id: str | None = None,
    ) -> Run:
        """A new root run. `run_id` is chosen by the caller (a cluster, which must know a
        tree's id before the node starting it could be lost); by default one is drawn."""
        self.check_open()
        if not isinstance(prompt, str) or not prompt.strip():
            raise InvalidArgument("prompt must be a non-empty str")
        if context_blob is not None and len(context_blob) > MAX_CONTEXT_BYTES:
            raise InvalidArgument(
                f"context is {len(context_blob):,} bytes pickled, over the "
                f"{MAX_CONTEXT_BYTES:,}-byte bound of a run's context; pass less, or let the "
                "run read it from a file (Limits(fs_read=[PATH]))"
            )
        self.limits.check_pool(pool)
        if driven and pool is not None:
            raise InvalidArgument(
                "pool=... does not apply to a Session root (it holds no slot); give the "
                "pool to the runs it starts"
            )
        rec = self._root_record(prompt, model_name or self.model_name, run_id)
        rec.pool = pool
        # A root's model_name only labels the journal row; the model object is the choice.
        run = Run(rec, model or self.model, context_blob, None, timeout, None, driven=driven)
        await self._journal_or_forget([run])
        if self.unenforced:  # said in the journal of every tree this supervisor runs
            self._event(run, "confinement", {"unenforced": self.unenforced})
        self._admit(run)
        return run

    def _new_id(self) -> str:
        while (rid := new_run_id()) in self.runs:
            pass
        return rid

    async def _journal_or_forget(
        self, runs: list[Run], parent: Run | None = None, counted: int = 0
    ) -> None:
        """Journal new runs; if that fails, they never existed: nothing of them stays in
        the supervisor's view or counts against a limit (only a journaled run starts)."""
        try:
            await self._journal_new(runs)
        except BaseException:
            for run in runs:
                self.runs.pop(run.id, None)
                if parent is not None and run in parent.children:
                    parent.children.remove(run)
            if parent is not None:
                self._top(parent).tree_children -= counted
            raise

    async def _journal_new(self, runs: list[Run]) -> None:
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
                return
            for run in pending:
                del self.runs[run.id]
                run.rec.id = self._new_id()
                if run.parent is None:
                    run.rec.root_id = run.rec.id
                self.runs[run.id] = run
        raise BroodError(
            f"could not draw an unused run id in {ID_DRAWS} tries; the journal "
            f"{self.store.url} holds very many runs"
        )

    def _admit(self, run: Run) -> None:
        if run.driven:
            # A Session's root is driven by the trainer between steps; it holds no slot.
            self._task(self._launch(run))
        else:
            self.start_queue.append(run)
            self._grant()

    async def spawn_children(self, parent: Run, msg: SpawnReq) -> list[str]:
        if self.closing or parent.rec.state is not RUN or parent.ending is not None:
            raise BroodError(
                f"run {parent.id} is {parent.rec.state.value} and ending; it cannot start children"
            )
        if not self.limits.can_start_child(parent.rec.depth):
            raise LimitExceeded("max_depth", parent.rec.depth + 2, self.limits.max_depth)
        if not msg.prompts:
            return []
        self.limits.check_pool(msg.pool)
        self.check_model(parent, msg.model)
        keys = []
        for _ in msg.prompts:
            seq = parent.seq.get(msg.step, 0)
            parent.seq[msg.step] = seq + 1
            keys.append(f"{msg.step}:{seq}")
        adopted = self._adopt(parent, msg, keys)
        fresh = [(k, p) for k, p in zip(keys, msg.prompts, strict=True) if k not in adopted]
        root = self._top(parent)
        self.limits.admit_children(
            tree_total=root.tree_children, run_total=self.children_of(parent), count=len(fresh)
        )
        if root.guest and fresh:  # the tree's own count is kept by its root's node
            assert self.spreader is not None
            await self.spreader.admit(root, len(fresh))
        # Each child's row holds its prompt and its own copy of the context.
        size = sum(len(p) + len(msg.context or b"") for _, p in fresh)
        if fresh and not self._charge(parent, size):
            raise BroodError(f"run {parent.id} is over its journal bytes; it starts no children")
        root.tree_children += len(fresh)
        spread = msg.placement == "spread" and self.spreader is not None
        timeout = msg.timeout if msg.timeout is not None else self.limits.child_timeout
        children = []
        for key, prompt in fresh:
            rec = self._child_record(parent, key, prompt, msg.model or parent.rec.model)
            rec.pool = msg.pool
            child = Run(
                rec, parent.model, msg.context, msg.model or parent.model_name, timeout, parent
            )
            child.retries_left = msg.retries
            parent.children.append(child)
            children.append(child)
        await self._journal_or_forget(children, parent, len(fresh))
        if spread:
            for child in children:
                child.spreading = self._task(self._spread(child))
        else:
            self.start_queue.extend(children)
        self.start_queue.extend(c for c in adopted.values() if c.launchable)
        self._grant()
        ended = []
        for c in adopted.values():  # each the latest attempt of its key
            c.retries_left = max(0, msg.retries - c.rec.attempt)
            if not c.rec.state.terminal:
                continue
            if self._retries(c, c.rec.state):  # it failed, and the crash beat its retry
                c.retrying = True
                self._task(self._next_attempt(c))
            else:
                ended.append(c)
        # Children that ended before the crash: tell the parent once it has their ids.
        if ended:
            asyncio.get_running_loop().call_soon(self._announce, parent, ended)
        by_key = {c.rec.key: c for c in children} | adopted
        return [by_key[k].id for k in keys]

    def _root_record(self, prompt: str, model: str | None, rid: str | None = None) -> RunRecord:
        rid = rid or self._new_id()
        return RunRecord(
            id=rid, root_id=rid, parent_id=None, depth=0, key=None, prompt=prompt, model=model
        )

    def _child_record(self, parent: Run, key: str, prompt: str, model: str | None) -> RunRecord:
        return RunRecord(
            id=self._new_id(),
            root_id=parent.rec.root_id,
            parent_id=parent.id,
            depth=parent.rec.depth + 1,
            key=key,
            prompt=prompt,
            model=model,
        )

    def _adopt(self, parent: Run, msg: SpawnReq, keys: list[str]) -> dict[str, Run]:
        """The journaled children a resumed parent's replay asks for again, by key.

        A key the journal holds must come with the same prompt; while the parent replays a
        journaled step, every child it starts must be in the journal. Anything else is a
        divergence, and nothing is started.
        """
        adopted: dict[str, Run] = {}
        for key, prompt in zip(keys, msg.prompts, strict=True):
            child = parent.by_key.get(key)
            if child is None:
                if msg.replaying:
                    raise ReplayDiverged(
                        f"run {parent.id} step {msg.step}: the replay started a child under "
                        f"key {key} ({_clip(prompt)}), but the journal holds no child there"
                    )
                continue
            if child.rec.prompt != prompt:
                raise ReplayDiverged(
                    f"run {parent.id} step {msg.step}: the journal holds child {child.id} "
                    f"under key {key} with prompt {_clip(child.rec.prompt)}, the replay "
                    f"asked for {_clip(prompt)}"
                )
            adopted[key] = child
        for key in adopted:
            del parent.by_key[key]  # adopted once
        return adopted

    def _announce(self, parent: Run, children: list[Run]) -> None:
        if parent.conn is None:
            return
        for c in children:
            parent.conn.send(_update(c))

    # ---- concurrency slots -------------------------------------------------------------
    def _grant(self) -> None:
        """Hand free slots out: parents resuming after a wait first, then queued starts."""
        while self.free_slots > 0:
            if self.resume_queue:
                run, fut = self.resume_queue.popleft()
                if fut.done():
                    continue
                # Asked twice (a worker's frames are not trusted), or ended while it
                # waited: it takes no slot, or the slot would never come back.
                if run.holds_slot or run.ending is not None or run.rec.state.terminal:
                    fut.set_result(None)
                    continue
                run.holds_slot = True
                self.free_slots -= 1
                fut.set_result(None)
            elif self.start_queue:
                run = self.start_queue.popleft()
                if not run.launchable or not self._pool_admits(run):
                    continue  # a run its pool refused waits there, holding no slot
                run.holds_slot = True
                self.free_slots -= 1
                self._task(self._launch(run))
            else:
                break

    def _pool_admits(self, run: Run) -> bool:
        """Whether `run` may start as far as its pool goes: it takes a place, or waits in
        the pool's queue (journaled, with the reason naming the pool and its holders)."""
        if run.rec.pool is None or run.holds_pool:
            return True
        pool = self.pools.get(run.rec.pool)
        if pool is None:  # journaled under a pool this supervisor's limits do not have
            self._task(
                self.finish(
                    run,
                    RunState.FAILED,
                    f"pool {run.rec.pool!r} is not one of this supervisor's pools "
                    f"({', '.join(sorted(self.pools)) or 'none'}); resume it with "
                    "Limits(pools=...) naming it",
                )
            )
            return False
        # Holders are read again here, after any refusal: one that ended meanwhile is gone.
        pool.holders = [r for r in pool.holders if not r.rec.state.terminal]
        first = pool.first_waiter(run)
        if len(pool.holders) < pool.capacity and first is not None:
            # A place is free but an older run waits for it: that one starts first.
            pool.waiters.remove(first)
            self.start_queue.appendleft(first)
        elif len(pool.holders) < pool.capacity:
            pool.holders.append(run)
            run.holds_pool = True
            if run in pool.waiters:
                pool.waiters.remove(run)
            self._event(run, "pool", {"pool": pool.name, "taken": True})
            return True
        if run not in pool.waiters:
            pool.wait(run)
            run.rec.reason = f"waiting for pool {pool.name!r} ({pool.describe()})"
            self.store.note_reason(run.id, run.rec.reason)
            self._event(
                run,
                "pool",
                {"pool": pool.name, "waiting": True, "holders": [r.id for r in pool.holders]},
            )
        return False

    def _pool_release(self, run: Run) -> None:
        """`run` ended: its place goes to the oldest waiter still waiting, which starts
        through the start queue (the supervisor's own event, no polling)."""
        pool = self.pools.get(run.rec.pool or "")
        if pool is None:
            return
        if run in pool.waiters:
            pool.waiters.remove(run)
        if not run.holds_pool:
            return
        run.holds_pool = False
        pool.holders = [r for r in pool.holders if r is not run and not r.rec.state.terminal]
        while pool.waiters and len(pool.holders) < pool.capacity:
            waiter = pool.waiters.pop(0)
            if waiter.launchable:
                self.start_queue.appendleft(waiter)
                break
        self._grant()

    def _release(self, run: Run) -> None:
        if run.holds_slot:
            run.holds_slot = False
            self.free_slots += 1
            self._grant()

    async def _launch(self, run: Run) -> None:
        try:
            conn = await self.backend.acquire()
        except Exception as exc:
            await self.finish(run, RunState.FAILED, f"backend error: {exc}")
            return
        if not run.launchable:
            self.backend.release_unused(conn)
            return
        resumed = run.rec.state is RUN
        run.conn = conn
        conn.attach(lambda msg: self._on_msg(run, msg))
        conn.on_exit = lambda status: self._task(self._on_exit(run, status))
        run.rec.pid = conn.pid
        if self.keep_scratch:  # the user keeps it: say where it is
            self._event(run, "scratch", {"path": conn.scratch, "pid": conn.pid})

        def send_start() -> None:
            r = run.rec
            if run.replay is not None:  # its worker replays these without asking
                run.convo = Conversation(replies=list(run.replay.turns))
                run.steps = Steps(replayed=run.replay.steps)
            run.first_cap = user_message_cap(self.limits.max_prompt_chars, r.prompt, run.messages)
            conn.send(
                Start(
                    run_id=r.id,
                    depth=r.depth,
                    prompt=r.prompt,
                    context=run.context_blob,
                    limits=WorkerLimits.from_limits(self.limits),
                    driven=run.driven,
                    messages=run.messages,
                    model_name=run.model_name,
                    replay=run.replay,
                    budget=self.budget_of(run),
                )
            )
            run.messages = []
            run.replay = None

        if resumed:
            # Still `running` in the journal: a new worker picks it up by replaying it.
            self._event(
                run,
                "resumed",
                {"pid": conn.pid, "turns": len(run.replay.turns) if run.replay else 0},
            )
            send_start()
        else:
            # The worker may start while `running` is committed; the parent hears of it after.
            await self._move(run, RUN, meanwhile=send_start)
        # The run has started (journaled, with a worker) even if a cancel landed while the
        # start was being journaled: observers and waiters hear of it either way.
        run.started.set()
        self.observers.emit("on_start", run.info())
        if run.rec.state is not RUN or run.ending is not None:
            return  # that cancel stops the worker
        if run.timeout is not None:
            run.timer = asyncio.get_running_loop().call_later(
                run.timeout,
                lambda: self._task(
                    self.finish(run, RunState.TIMED_OUT, f"timed out after {run.timeout:g} s")
                ),
            )

    # ---- messages from workers ---------------------------------------------------------
    def _on_msg(self, run: Run, msg: Msg) -> None:
        """A frame from `run`'s worker: hostile input, checked against the protocol and the
        run's limits before anything is done for it (frames.py). A frame no worker keeping
        the protocol sends ends the run with `protocol violation: ...`."""
        if run.ending is not None or run.rec.state.terminal:
            if isinstance(msg, Reply | StepResult):
                self._settle_pending(run, msg)
            return  # an ending run's worker is heard no more
        try:
            self._dispatch(run, msg)
        except Violation as exc:
            self._task(self.finish(run, RunState.FAILED, f"protocol violation: {exc}"))

    def _dispatch(self, run: Run, msg: Msg) -> None:
        if isinstance(msg, SpawnReq):
            if msg.step > run.steps.last:
                raise Violation(f"a child was asked for by step {msg.step}, before it began")
            frames.check_prompts(msg.prompts, self.limits)
            self._ask(run, msg.req_id, self.spawn_children(run, msg))
        elif isinstance(msg, CancelReq | SendReq):
            if isinstance(msg, SendReq) and len(msg.message) > self.limits.max_prompt_chars:
                raise Violation(
                    f"a follow-up of {len(msg.message):,} characters, over "
                    f"Limits.max_prompt_chars={self.limits.max_prompt_chars:,}"
                )
            self._ask(run, msg.req_id, self._request(run, msg))
        elif isinstance(msg, BudgetReq):
            self._ask(run, msg.req_id, _now(self.budget_of(run)))
        elif isinstance(msg, AskReq):
            if msg.step > run.steps.last:
                raise Violation(f"an ask was opened by step {msg.step}, before it began")
            self._ask(run, msg.req_id, self._open_ask(run, msg))
        elif isinstance(msg, AskCancelReq):
            self._ask(run, msg.req_id, self.asks.withdraw(run, msg))
        elif isinstance(msg, FlowReq):
            # A flow's spec and inputs are journaled (on its own run) for its starter.
            if msg.op == "run" and not self._charge(run, frames.weight([msg.spec, msg.inputs])):
                return  # the run fails naming its journal bytes
            self._ask(run, msg.req_id, self._flow_request(run, msg))
        elif isinstance(msg, Blocked):
            self._on_blocked(run, msg)
        elif isinstance(msg, ModelReq):
            if msg.kind == "turn":
                if run.driven:
                    raise Violation("a Session's root asked for a model turn; its steps are driven")
                if msg.model != run.model_name:
                    raise Violation(f"a model turn named model {msg.model!r}, not its run's")
                run.convo.check(
                    msg,
                    max_iterations=self.limits.max_iterations,
                    first_cap=run.first_cap,
                    cap=self.limits.max_prompt_chars,
                )
            else:
                frames.check_call(msg, self.limits)
            self._ask(run, msg.req_id, self._model_call(run, msg))
            run.model_requests += 1  # held from now on: a wait on it may give up the slot
        elif isinstance(msg, StepBegan):
            run.steps.begin(msg)
            self._step_began(run, msg)
        elif isinstance(msg, StepDone):
            run.steps.end(msg)
            self._step_done(run, msg)
        elif isinstance(msg, Remember):
            if len(msg.value) > MAX_REMEMBER_BYTES:
                raise Violation(
                    f"a remembered value of {len(msg.value):,} bytes, over the "
                    f"{MAX_REMEMBER_BYTES:,} one may hold"
                )
            if self._charge(run, len(msg.value) * 4 // 3):  # journaled as base64
                self._event(run, "remember", {"value": base64.b64encode(msg.value).decode()})
        elif isinstance(msg, Final):
            self._on_final(run, msg)
        elif isinstance(msg, Failed):
            self._on_failed(run, msg)
        elif isinstance(msg, Reply | StepResult):
            if isinstance(msg, StepResult):
                cap = frames.output_cap(self.limits.output_limit)
                msg.stdout, msg.stderr = clip(msg.stdout, cap), clip(msg.stderr, cap)
                if msg.answer is not None and len(msg.answer) > self.limits.answer_limit:
                    raise Violation(
                        f"a step's answer of {len(msg.answer):,} characters, over "
                        f"Limits.answer_limit={self.limits.answer_limit:,}"
                    )
            self._settle_pending(run, msg)

    def _settle_pending(self, run: Run, msg: Reply | StepResult) -> None:
        """A worker confirms a delivery (Reply), or ends a driven step (StepResult): only a
        request the supervisor made of it is settled, whatever id the frame names."""
        fut = run.pending.pop(msg.req_id, None)
        if fut is not None and not fut.done():
            fut.set_result(msg if isinstance(msg, StepResult) else None)

    def _step_done(self, run: Run, msg: StepDone) -> None:
        self._stop_watch(run)
        self._progress(run)
        if msg.replayed:
            return
        msg = frames.clipped_step(msg, frames.output_cap(self.limits.output_limit))
        data = {
            "step": msg.step,
            "code": msg.code,
            "stdout": msg.stdout,
            "stderr": msg.stderr,
            "error": msg.error,
            "duration": msg.duration,
            "pending": msg.pending,
        }
        if not self._charge(run, frames.weight(data)):
            return
        run.last_line = last_line(msg.stdout) or run.last_line
        self._event(run, "step", data, progress=run.last_line)

    def _on_final(self, run: Run, msg: Final) -> None:
        """The run's answer, checked whole before any state changes for it."""
        cap = self.limits.answer_limit
        if len(msg.answer) > cap:
            raise Violation(
                f"a FINAL answer of {len(msg.answer):,} characters, over "
                f"Limits.answer_limit={cap:,}"
            )
        products = frames.checked_products(msg.products, cap)
        if msg.reason not in ("answer", "answer after max_iterations"):
            raise Violation(f"FINAL with the reason {clip(msg.reason, 80)!r}")
        if run.steps.open:
            raise Violation(f"FINAL came while step {run.steps.last} was under way")
        run.rec.answer = msg.answer
        run.rec.products = products
        self._task(self.finish(run, RunState.COMPLETED, msg.reason, answer=msg.answer))

    def _on_failed(self, run: Run, msg: Failed) -> None:
        """The worker says its run cannot go on. What it says is data: kept (capped) as the
        reason, never a decision. Only a run the supervisor is replaying can diverge."""
        reason, error = clip(msg.reason, FAILURE_TEXT_CAP), clip(msg.error, FAILURE_TEXT_CAP)
        if reason.startswith(STORE_FAILED):  # that reason is the journal's, said only here
            reason = f"worker error: {reason}"
        self._task(self.finish(run, RunState.FAILED, reason, error=error))
        if msg.kind == "diverged" and run.steps.replaying:
            self._stop_resume(run, reason)

    def _charge(self, run: Run, size: int) -> bool:
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
            self._task(self.finish(run, RunState.FAILED, reason))
        return False

    async def _open_ask(self, run: Run, msg: AskReq) -> str:
        """ask_person: within Limits.max_asks_per_run, and counted as journal bytes."""
        if run.asks_opened >= self.limits.max_asks_per_run:
            raise LimitExceeded(
                "max_asks_per_run",
                run.asks_opened + 1,
                self.limits.max_asks_per_run,
                hint=f"run {run.id} has opened {run.asks_opened} asks; ask fewer (one ask can "
                "hold several questions: ask_user_question), or raise Limits(max_asks_per_run=...)",
            )
        if not self._charge(run, frames.weight(msg.question) + frames.weight(msg.options)):
            raise BroodError(f"run {run.id} is over its journal bytes; it opens no asks")
        run.asks_opened += 1
        return await self.asks.open(run, msg)

    def _ask(self, run: Run, req_id: int, work: Awaitable[Any]) -> None:
        """Answer a worker's request; the run's step clock stands still meanwhile."""
        if run.requests >= frames.MAX_REQUESTS_IN_FLIGHT:
            if asyncio.iscoroutine(work):
                work.close()  # never started
            raise Violation(f"more than {frames.MAX_REQUESTS_IN_FLIGHT} requests at once (a flood)")
        run.requests += 1
        self._hold(run)
        self._task(self._answer(run, req_id, work))

    async def _answer(self, run: Run, req_id: int, work: Awaitable[Any]) -> None:
        try:
            value = await work
            reply = Reply(req_id, value=value)
        except Exception as exc:
            reply = Reply(req_id, error=error_info(exc))
        finally:
            run.requests -= 1
            self._unhold(run)
        if run.conn is not None:
            run.conn.send(reply)

    # ---- blocking: the concurrency slot -------------------------------------------------
    def _on_blocked(self, run: Run, msg: Blocked) -> None:
        """The worker says it waits (blocked) or wants to compute again. A slot is given up
        only while the supervisor itself holds something the run can wait on (a child, an
        ask, a model call): the worker's word alone frees nothing."""
        if msg.blocked:
            if not run.blocked and self._waits_on_something(run):
                run.blocked = True
                self._hold(run)
                self._release(run)
            return
        self._ask(run, msg.req_id, self._unblock(run))
        if run.blocked:
            run.blocked = False
            self._unhold(run)

    def _waits_on_something(self, run: Run) -> bool:
        if run.model_requests or self.asks.open_by_run.get(run.id):
            return True
        # Newest first: the children most likely still going. An attempt that ended and
        # will be followed by another is still going for its parent.
        return any(not c.rec.state.terminal or c.retrying for c in reversed(run.children))

    def waits_changed(self, run: Run) -> None:
        """Something `run` could wait on ended. If nothing is left, a run that said it was
        blocked is not any more: its step clock goes on, and it takes a slot again (its
        worker, if it truly waited, is about to ask for one)."""
        if not run.blocked or self._waits_on_something(run):
            return
        run.blocked = False
        self._unhold(run)
        if not run.holds_slot:
            self._task(self._unblock(run))

    # ---- the supervisor's clock of each step ---------------------------------------------
    def _hold(self, run: Run) -> None:
        run.holds += 1
        if run.watch is not None:
            run.watch.pause()

    def _unhold(self, run: Run) -> None:
        run.holds -= 1
        if run.holds == 0 and run.watch is not None:
            run.watch.go()

    def _stop_watch(self, run: Run) -> None:
        if run.watch is not None:
            run.watch.pause()
            run.watch = None

    def _step_began(self, run: Run, msg: StepBegan) -> None:
        """Start the supervisor's own clock of a step, and let the step run once its start
        is journaled (a step during which the host dies is then known to a resume). On
        the hot path of every step: no task, one callback from the journal's writer."""
        self._stop_watch(run)
        limit = run.exec_timeout if run.exec_timeout is not None else self.limits.step_timeout
        if limit is not None and run.ending is None:
            step = msg.step
            run.watch = StepWatch(
                limit + self.limits.step_grace,
                lambda: self._step_ignored(run, step, limit),
                running=False,
            )
        self._hold(run)  # until the reply is on its way
        if msg.replaying:  # journaled before the crash
            self._step_go(run, msg.req_id)
            return
        loop = asyncio.get_running_loop()

        def written(_: object) -> None:  # on the writer thread
            with contextlib.suppress(RuntimeError):  # the loop has closed meanwhile
                loop.call_soon_threadsafe(self._step_go, run, msg.req_id)

        # A failed write needs no word here: the journal's failure ends the run.
        self.store.event(run.rec, "step_begun", {"step": msg.step}).add_done_callback(written)

    def _step_go(self, run: Run, req_id: int) -> None:
        self._unhold(run)
        if run.conn is not None:
            run.conn.send(Reply(req_id))

    def _step_ignored(self, run: Run, step: int, limit: float) -> None:
        run.watch = None
        if run.ending is not None or run.rec.state.terminal:
            return
        reason = (
            f"step timeout ignored: step {step} computed past its limit of {limit:g} s and "
            f"{self.limits.step_grace:g} s of grace (Limits.step_grace) without ending (its "
            "StepTimeout was swallowed, disarmed or lost, e.g. in a fork loop), so its "
            "worker was stopped"
        )
        self._task(self.finish(run, RunState.FAILED, reason))

    async def _request(self, run: Run, msg: CancelReq | SendReq) -> Any:
        child = self.runs.get(msg.child_id)
        if child is None or child.parent is not run:
            raise InvalidArgument(f"{msg.child_id} is not a child of run {run.id}")
        while child.next_attempt is not None:  # the handle stands for its latest attempt
            child = child.next_attempt
        if isinstance(msg, CancelReq):
            child.retries_left = 0  # a cancelled child is not retried (nor a retry started)
            state = await self.finish(child, RunState.CANCELLED, "cancelled by parent")
            return state.value
        if msg.replaying:
            return None  # delivered (and journaled) before the crash
        if not self._charge(run, len(msg.message)):
            raise BroodError(f"run {run.id} is over its journal bytes; it sends nothing more")
        await self.send_message(child, msg.message)
        return None

    # ---- children placed on another node (placement="spread", a cluster) -----------------
    async def _spread(self, run: Run) -> None:
        """Start `run` on another node through the spreader; then follow its state there
        until it ends. With no other node it starts here like any child."""
        assert self.spreader is not None
        try:
            run.remote = await self.spreader.start(run)
        except Exception as exc:
            if not run.rec.state.terminal and run.ending is None:
                self._task(
                    self.finish(run, RunState.FAILED, f"could not start on another node: {exc}")
                )
            return
        if run.remote is None:
            self.start_queue.append(run)
            self._grant()
            return
        self._task(self._follow(run))

    async def _follow(self, run: Run) -> None:
        """Mirror a spread child's start and end, journaled by the node running it, here:
        its parent hears of them as of any child's."""
        assert self.spreader is not None
        try:
            await self.spreader.started(run)
            if run.rec.state is Q and run.ending is None:
                move(run.rec, RUN)
                self._tell_parent(run)
                run.started.set()
                self.observers.emit("on_start", run.info())
            end = await self.spreader.ended(run)
        except Exception as exc:
            if run.ending is not None or run.rec.state.terminal:
                return
            if isinstance(exc, NodeLost) and await self._adopt_lost(run, exc):
                return
            self._task(self.finish(run, RunState.FAILED, f"its node was lost: {exc}"))
            return
        if run.ending is None:  # else the one ending it mirrors the end
            self._mirror_end(run, end)

    async def _adopt_lost(self, run: Run, exc: Exception) -> bool:
        """A spread child's node was lost: resume its subtree here, from the journal, as a
        local child (replayed, its children adopted by key). False if that failed."""
        assert self.spreader is not None
        try:
            await self.spreader.lost(run)
            await self.resume_subtree(run.rec.root_id, run.id, run)
        except Exception as why:
            self._event(run, "adopt_failed", {"lost": str(exc), "error": str(why)})
            return False
        return True

    def _mirror_end(self, run: Run, end: dict[str, Any]) -> None:
        """A spread child ended on its node (which journaled it): end it here too."""
        if run.rec.state.terminal:
            return
        rec = run.rec
        rec.answer, rec.error, rec.products = end["answer"], end["error"], end["products"]
        rec.usage = dict(end["usage"])
        to = RunState(end["state"])
        if rec.state is Q and to is not RunState.CANCELLED:
            move(rec, RUN)
        if rec.state is RUN and to is RunState.CANCELLED:
            move(rec, CANCELLING)
        move(rec, to, end["reason"] or "ended on its node")
        run.retrying = self._retries(run, to)
        if not run.retrying:  # else its parent hears of the next attempt instead
            self._tell_parent(run)
        run.started.set()
        run.done.set()
        self.observers.emit("on_end", run.info())
        if run.retrying:
            self._task(self._next_attempt(run))

    def _tell_parent(self, run: Run) -> None:
        """Its parent's worker hears of `run`'s state (unless the parent has ended)."""
        parent = run.parent
        if parent is not None and parent.conn is not None and not parent.rec.state.terminal:
            parent.conn.send(_update(run))
            if run.rec.state.terminal:
                self.waits_changed(parent)

    async def host_guest(
        self, rec: RunRecord, run_data: dict[str, Any], note: dict[str, Any]
    ) -> Run:
        """Take a child placed here by its parent's node (placement="spread"): its record is
        journaled already; this supervisor owns it and its subtree from now on."""
        self.check_open()
        run = Run(
            rec,
            self.model,
            run_data.get("context"),
            run_data.get("model_name"),
            run_data.get("timeout"),
            None,
        )
        run.guest = True
        run.messages = list(run_data.get("messages") or [])
        self.runs[run.id] = run
        await asyncio.wrap_future(self.store.claim_run(run.id, self.owner))
        self._event(run, "placed", note | {"supervisor": self.owner})
        self._admit(run)
        return run

    def admit_remote(self, root_id: str, count: int) -> None:
        """A subtree of `root_id` on another node starts `count` children: the tree-wide
        limits are this node's to keep (the root runs here)."""
        root = self._tree_root(root_id)
        self.limits.admit_children(tree_total=root.tree_children, run_total=0, count=count)
        root.tree_children += count

    async def _flow_request(self, run: Run, msg: FlowReq) -> Any:
        if self.flow_handler is None:
            raise BroodError("this supervisor runs no flows")
        return await self.flow_handler(run, msg)

    async def _unblock(self, run: Run) -> None:
        if run.holds_slot or run.driven or run.rec.state is not RUN:
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.resume_queue.append((run, fut))
        self._grant()
        await fut

    async def send_message(self, run: Run, message: str) -> None:
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
        self._event(run, "message", {"message": message, "delivered": run.conn is not None})
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

    async def _model_call(self, run: Run, msg: ModelReq) -> str:
        """Make a worker's model call in the gateway; measure it and journal it here."""
        turn = msg.kind == "turn"
        reply: str | None = None
        try:
            reply = await self._model_call_checked(run, msg)
            return reply
        finally:
            run.model_requests -= 1
            if turn:
                run.convo.answered(reply)
            self.waits_changed(run)

    async def _model_call_checked(self, run: Run, msg: ModelReq) -> str:
        if run.ending is not None or run.rec.state is not RUN:
            raise BroodError(f"run {run.id} is {run.rec.state.value} and ending; no model call")
        self.check_model(run, msg.model)
        request = msg.messages[msg.new_from :]
        if not self._charge(run, frames.weight(request)):
            raise BroodError(f"run {run.id} is over its journal bytes; it makes no model call")
        task = asyncio.current_task()
        assert task is not None
        run.calls.add(task)
        root = self._top(run)
        # Below a spread child the tree's budget is kept by the root's node: asked there.
        far = root.guest and self._budgeted()
        try:
            if far:
                assert self.spreader is not None
                await self.spreader.budget_enter(root)
            else:
                await self._budget_admits(root)
        except BaseException:
            run.calls.discard(task)  # ended while it waited: no call was made
            raise
        root.calls_in_flight += 1
        started = time.perf_counter()
        done: Completion | None = None
        error: str | None = None
        try:
            done = await self.gateway.complete(run.model, msg.messages, msg.model)
            return done.text
        except asyncio.CancelledError:
            error = "abandoned: the run ended while the call was under way"
            raise
        except ModelError as exc:
            error = f"ModelError: {exc}"
            raise
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            raise ModelError(
                f"model {run.model.describe()!r} raised {type(exc).__name__}: {exc}"
            ) from exc
        finally:
            run.calls.discard(task)
            root.calls_in_flight -= 1
            self._account(
                run,
                kind=msg.kind,
                model=msg.model or run.model.name,
                latency=time.perf_counter() - started,
                done=done,
                error=error,
                request=request,
                far=far,
            )
            self._wake_budget(root)

    def check_model(self, run: Run, name: str | None) -> None:
        """A model name model code passed (`llm_query` / `rlm_query` with model=): its own
        run's, or one of `allowed_models`; else InvalidArgument listing them."""
        if name is None or name == run.model_name:
            return
        allowed = self.allowed_models(run)
        if name not in allowed:
            raise InvalidArgument(
                f"model {clip(name, 100)!r} is not one this tree may use (Limits.models: "
                f"{', '.join(map(repr, allowed)) or 'none'}); name one of them, or pass no "
                "model for this run's own. The user lists more with Limits(models=[...])"
            )

    def allowed_models(self, run: Run) -> list[str]:
        """Limits.models; by default the supervisor's model and the one its tree's root was
        given. Model code never adds to it, nor names an address to call."""
        if self.limits.models is not None:
            return list(self.limits.models)
        names = [self.model_name, self._top(run).rec.model]
        return [n for n in dict.fromkeys(names) if n is not None and n != FLOW_MODEL]

    def _budgeted(self) -> bool:
        return self.limits.token_budget is not None or self.limits.cost_budget is not None

    def _wake_budget(self, root: Run) -> None:
        waiting, root.budget_waiters = root.budget_waiters, []
        for fut in waiting:  # the budget left and the calls in flight have changed
            if not fut.done():
                fut.set_result(None)

    def _tree_root(self, root_id: str) -> Run:
        """The root of tree `root_id`, which runs here (asked by another node)."""
        root = self.runs.get(root_id)
        if root is None or root.parent is not None or root.guest:
            raise BroodError(f"tree {root_id} does not run on this node")
        if root.rec.state.terminal or root.ending is not None:
            raise BroodError(f"tree {root_id} is ending; it starts no more work")
        return root

    async def budget_enter(self, root_id: str) -> None:
        """A model call below a spread child of tree `root_id` waits for the tree's budget
        here, as one of this node's own calls does."""
        root = self._tree_root(root_id)
        await self._budget_admits(root)
        root.calls_in_flight += 1

    def budget_leave(self, root_id: str, tokens: int, cost: float, answered: bool) -> None:
        """That call ended, having spent `tokens` and `cost`."""
        root = self.runs.get(root_id)
        if root is None:
            return
        root.calls_in_flight -= 1
        self._spend(root, tokens, cost, answered)
        self._wake_budget(root)

    async def _budget_admits(self, root: Run) -> None:
        """Wait until the tree's budget left covers this call on top of those in flight,
        each estimated by the largest call seen so far, so a budget is overshot by one call
        at most, not by as many as run at once. Until a call has been seen, one at a time."""
        while not self._budget_covers(root):
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            root.budget_waiters.append(fut)
            await fut

    def _budget_covers(self, root: Run) -> bool:
        lim = self.limits
        if lim.token_budget is None and lim.cost_budget is None:
            return True
        if self._over_budget(root, 0) or root.ending is not None:
            return False  # spent: the tree is being cancelled, this call waits for that
        if root.calls_in_flight == 0:
            return True  # the one call a budget may be overshot by
        if root.calls_seen == 0:
            return False  # nothing to estimate by yet
        return not self._over_budget(root, root.calls_in_flight + 1)

    def _over_budget(self, root: Run, calls: int) -> str | None:
        """Which budget the tree's usage breaks with `calls` more of its largest call."""
        lim, t = self.limits, root.tree_usage
        if (
            lim.token_budget is not None
            and t.get("tokens", 0) + calls * root.largest_tokens > lim.token_budget
        ):
            return "tokens"
        if (
            lim.cost_budget is not None
            and t.get("cost", 0.0) + calls * root.largest_cost > lim.cost_budget
        ):
            return "cost"
        return None

    def _progress(self, run: Run) -> None:
        """`run` made progress: every ancestor's worker hears a heartbeat (at most one per
        HEARTBEAT_S each), so a step waiting on work below is not taken for stalled."""
        now = asyncio.get_running_loop().time()
        below, parent = run, run.parent
        while parent is not None:
            if parent.conn is not None and now - parent.last_beat >= HEARTBEAT_S:
                parent.last_beat = now
                parent.conn.send(Progress(below.handle_id or below.id))
            below, parent = parent, parent.parent

    def _account(
        self,
        run: Run,
        *,
        kind: str,
        model: str | None,
        latency: float,
        done: Completion | None,
        error: str | None,
        request: list[dict[str, Any]],
        far: bool = False,
    ) -> None:
        if done is not None:  # journaled whatever the limit says: the call was made
            self._charge(run, len(done.text))
        # A model's own count is trusted (it is the user's code), but never negative.
        tokens_in = max(0, int(done.input_tokens)) if done else 0
        tokens_out = max(0, int(done.output_tokens)) if done else 0
        cost = max(0.0, float(done.cost)) if done else 0.0
        u = run.rec.usage
        u["model_calls"] = u.get("model_calls", 0) + 1
        u["input_tokens"] = u.get("input_tokens", 0) + tokens_in
        u["output_tokens"] = u.get("output_tokens", 0) + tokens_out
        u["cost"] = u.get("cost", 0.0) + cost
        self._event(
            run,
            "model_call",
            {
                "kind": kind,
                "model": model,
                "latency": latency,
                "input_tokens": tokens_in,
                "output_tokens": tokens_out,
                "error": error,
                "request": self._by_ref(run, request),
                "response": done.text if done else None,
            },
        )
        root = self._top(run)
        self._spend(root, tokens_in + tokens_out, cost, done is not None)
        if far:  # the tree's own count is its root's node's
            assert self.spreader is not None
            self._task(
                self.spreader.budget_leave(root, tokens_in + tokens_out, cost, done is not None)
            )
        self._progress(run)

    def _spend(self, root: Run, tokens: int, cost: float, answered: bool) -> None:
        """A call of the tree under `root` spent `tokens` and `cost`: a tree over its budget
        is cancelled whole."""
        t = root.tree_usage
        t["tokens"] = t.get("tokens", 0) + tokens
        t["cost"] = t.get("cost", 0.0) + cost
        if answered:
            root.calls_seen += 1
            root.largest_tokens = max(root.largest_tokens, tokens)
            root.largest_cost = max(root.largest_cost, cost)
        over = self._over_budget(root, 0)
        if over and root.ending is None and not root.guest:
            self._task(self.finish(root, RunState.CANCELLED, f"budget: {over}"))

    def _by_ref(self, run: Run, request: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The request as journaled: a system prompt (several KB, the same for most runs of
        a tree) is journaled once per tree, as a `prompt` event of the root, and a request
        refers to it by hash, with its run-specific end (from BUDGET_MARK) inline as
        `suffix` (`Journal.export` puts them together again)."""
        if not request or request[0].get("role") != "system":
            return request
        text, mark, rest = str(request[0].get("content", "")).partition(BUDGET_MARK)
        ref = hashlib.sha256(text.encode()).hexdigest()[:16]
        root = self._top(run)
        if ref not in root.prompts:
            root.prompts.add(ref)
            self._event(root, "prompt", {"ref": ref, "content": text})
        head: dict[str, Any] = {"role": "system", "prompt_ref": ref}
        if mark:
            head["suffix"] = mark + rest
        return [head, *request[1:]]

    def budget_of(self, run: Run) -> dict[str, Any]:
        """A run's place in the tree and the budgets left now (budget_remaining())."""
        lim = self.limits
        root = self._top(run)
        tokens = root.tree_usage.get("tokens", 0)
        cost = root.tree_usage.get("cost", 0.0)
        return {
            "depth": run.rec.depth,
            "max_depth": lim.max_depth,
            "children_left": max(0, lim.max_children - root.tree_children),
            "children_left_for_this_run": max(0, lim.max_children_per_run - self.children_of(run)),
            "tokens_left": None if lim.token_budget is None else max(0, lim.token_budget - tokens),
            "cost_left": None if lim.cost_budget is None else max(0.0, lim.cost_budget - cost),
            "tokens_used": int(tokens),
        }

    # ---- ending runs -------------------------------------------------------------------
    async def finish(
        self,
        run: Run,
        state: RunState,
        reason: str,
        *,
        answer: str | None = None,
        error: str | None = None,
    ) -> RunState:
        """End `run` (and its subtree) in `state`; returns the state it really ended in.

        The first caller decides how a run ends; later callers wait for that ending. The
        work is shielded: a caller that is cancelled does not interrupt cleanup.
        """
        if run.rec.state.terminal:
            return run.rec.state
        if run.ending is None:
            run.ending = self._task(self._end(run, state, reason, answer, error))
        return await asyncio.shield(run.ending)

    async def _end(
        self, run: Run, state: RunState, reason: str, answer: str | None, error: str | None
    ) -> RunState:
        if run.spreading is not None:
            await asyncio.shield(run.spreading)  # its start, one way or the other
            if run.rec.state.terminal:
                return run.rec.state
            if run.remote is not None:
                assert self.spreader is not None
                try:  # on its node, which confirms every exit there
                    self._mirror_end(run, await self.spreader.cancel(run, state, reason))
                    return run.rec.state
                except Exception as exc:  # its node is gone, its processes with it
                    # Its subtree is rebuilt here from the journal, to be ended here.
                    if not (isinstance(exc, NodeLost) and await self._adopt_lost(run, exc)):
                        run.remote, run.spreading = None, None
        rec = run.rec
        run.retrying = self._retries(run, state)
        if run.timer is not None:
            run.timer.cancel()
        self._stop_watch(run)
        for call in list(run.calls):  # abandoned: nobody will read their replies
            call.cancel()
        if answer is not None:
            rec.answer = answer
        if error is not None:
            rec.error = error
        if state in (RunState.CANCELLED, RunState.TIMED_OUT) and rec.state is RUN:
            await self._move(run, CANCELLING, reason)
        why = {
            RunState.COMPLETED: "parent finished",
            RunState.FAILED: "parent failed",
            RunState.TIMED_OUT: "parent timed out",
        }.get(state, "parent cancelled")
        open_children = [c for c in run.children if not c.rec.state.terminal]
        await asyncio.gather(*(self.finish(c, RunState.CANCELLED, why) for c in open_children))
        confirmed = await self._stop_worker(run)
        if confirmed and run.conn is not None:
            self.backend.discard_scratch(run.conn)
        with contextlib.suppress(StoreError):  # a failed journal fails every tree anyway
            await self.asks.end_of(run, f"its run ended ({state.value}: {reason})")
        self._release(run)
        if not confirmed and run.conn is not None:
            self._quarantine(run, run.conn)
        await self._move(run, state, reason)
        # Its pool place is given up once its end is journaled, so a pool's sections never
        # overlap in the journal's times.
        self._pool_release(run)
        if run.retrying:  # its children were cancelled above, before its end
            self._task(self._next_attempt(run))
        for fut in run.pending.values():
            if not fut.done():
                fut.set_exception(BroodError(f"run {run.id} ended ({state.value}: {reason})"))
        run.done.set()
        self.observers.emit("on_end", run.info())
        return state

    def _quarantine(self, run: Run, conn: WorkerConn) -> None:
        """`run`'s worker group outlived the whole escalation: its cleanup failed. That is
        said loudly (the log, the journal's `quarantined` event, which `brood ps` and `brood
        doctor` show, and close()), the group is killed again until its exit is confirmed
        (then `released`), and the supervisor goes on serving the other trees."""
        pids = self.backend.group_pids(conn)
        err = ChildCleanupError(
            f"exit of run {run.id}'s worker group {conn.pid} could not be confirmed; "
            f"processes {pids} may still be alive; the group is quarantined (killed again "
            f"every {QUARANTINE_RETRY_S:g} s until it is gone; `brood doctor` lists it) and "
            "the supervisor goes on serving other trees",
            pids=pids,
            answer=run.rec.answer,
        )
        log.error("brood: %s", err)
        self.cleanup_failures.append(err)
        self.quarantined[run.id] = pids
        self._event(run, "quarantined", {"group": conn.pid, "pids": pids, "error": str(err)})
        self._task(self._kill_quarantined(run, conn))

    async def _kill_quarantined(self, run: Run, conn: WorkerConn) -> None:
        while not await _wait_event(conn.gone, QUARANTINE_RETRY_S):
            self.backend.signal_group(conn, signal.SIGKILL)
        del self.quarantined[run.id]
        self._event(run, "released", {"group": conn.pid})
        if not self.closing:
            self.backend.discard_scratch(conn)

    def _retries(self, run: Run, state: RunState) -> bool:
        """Whether ending `run` in `state` starts its next attempt."""
        parent = run.parent
        return (
            run.retries_left > 0
            and state in (RunState.FAILED, RunState.TIMED_OUT)
            and parent is not None
            and parent.ending is None
            and parent.rec.state is RUN
            and not self.closing
            and self.store_error is None
        )

    async def _next_attempt(self, old: Run) -> None:
        """Start attempt k+1 of a child that ended failed or timed out: same parent, key,
        prompt, context, model, timeout and pool; journaled under (parent, key, attempt).
        If it cannot start, the parent hears how attempt k ended."""
        parent = old.parent
        assert parent is not None
        rec = self._child_record(parent, old.rec.key or "", old.rec.prompt, old.rec.model)
        rec.attempt, rec.pool = old.rec.attempt + 1, old.rec.pool
        new = Run(rec, old.model, old.context_blob, old.model_name, old.timeout, parent)
        new.retries_left = old.retries_left - 1
        new.handle_id = old.handle_id or old.id
        if not self._retries(old, old.rec.state):  # its parent ended, or it was cancelled
            old.retrying = False
            self._tell_parent(old)
            return
        root = self._top(parent)
        try:  # an attempt is one more run of the tree: it counts against max_children
            self.limits.admit_children(tree_total=root.tree_children, run_total=0, count=1)
            if root.guest:  # the tree's own count is kept by its root's node
                assert self.spreader is not None
                await self.spreader.admit(root, 1)
        except Exception as exc:
            old.retrying = False
            self._event(old, "retry_refused", {"error": str(exc)})
            self._tell_parent(old)
            return
        root.tree_children += 1
        parent.children.append(new)
        old.next_attempt = new  # from now on its parent's handle stands for this attempt
        try:
            await self._journal_or_forget([new], parent, 1)
        except Exception:
            old.next_attempt, old.retrying = None, False
            self._tell_parent(old)
            return
        self._event(
            new,
            "attempt",
            {"attempt": rec.attempt, "previous": old.id, "reason": old.rec.reason},
        )
        self._tell_parent(new)  # queued again
        if old.spreading is not None:  # placed as it was: on another node
            new.spreading = self._task(self._spread(new))
            return
        self.start_queue.append(new)
        self._grant()

    async def _stop_worker(self, run: Run) -> bool:
        """The one escalation: Stop → grace → SIGTERM group → term_grace → SIGKILL group.

        Returns True once no process of the worker's group is left.
        """
        conn = run.conn
        if conn is None or conn.gone.is_set():
            return True
        lim = self.limits
        conn.send(_STOP)
        # The zygote reports the exit and whether the group emptied with it, in one message;
        # processes the run left behind (grandchildren) get the signals below at once.
        if await _wait(conn.exited, lim.shutdown_grace) and conn.gone.is_set():
            return True
        for sig, grace in ((signal.SIGTERM, lim.term_grace), (signal.SIGKILL, KILL_CONFIRM_S)):
            self.backend.signal_group(conn, sig)
            if await _wait_event(conn.gone, grace):
                return True
        return False

    async def _on_exit(self, run: Run, status: int) -> None:
        """The worker died. Unless its run is already ending, that is a crash."""
        if run.ending is not None or run.rec.state.terminal:
            return
        if run.conn is not None:
            await _wait_event(run.conn.closed, DRAIN_ON_EXIT_S)  # a Final may still be queued
            await asyncio.sleep(0)
        if run.ending is not None or run.rec.state.terminal:
            return
        conn = run.conn
        used, oom = (conn.cpu, conn.oom_kills) if conn is not None else (0.0, 0)
        await self.finish(run, RunState.FAILED, self._exit_reason(status, used, oom))

    def _zygote_lost(self, pid: int, status: int) -> None:
        """The backend lost its zygote and is starting another: said in every live tree.
        Runs whose workers it forked go on; their exits are confirmed without it."""
        how = f"signal {-status}" if status < 0 else f"status {status}"
        data = {"pid": pid, "exit": how, "replaced": True}
        for root in self._live_roots():
            self._event(root, "zygote_lost", data)

    def _exit_reason(self, status: int, cpu_used: float, oom_kills: int = 0) -> str:
        """Why a worker died, naming the limit when a limit killed it."""
        if status == STATUS_UNKNOWN:
            return "worker exited; its status is unknown (the zygote that forked it was lost)"
        how = f"signal {-status}" if status < 0 else f"status {status}"
        if status == -signal.SIGKILL and oom_kills:
            return (
                f"worker exited with {how}: the kernel killed it at its memory limit, "
                f"Limits.worker_memory={self.limits.worker_memory}"
            )
        cpu = self.limits.worker_cpu_seconds
        # RLIMIT_CPU sends SIGXCPU at the limit (nothing else sends it to a worker) and
        # SIGKILL a second later if that was ignored; for SIGKILL, the CPU time the zygote
        # read at the reap tells whether the limit did it (rusage rounds: a little slack).
        if cpu is not None and (
            status == -signal.SIGXCPU
            or (status == -signal.SIGKILL and cpu_used >= cpu - CPU_SLACK_S)
        ):
            return (
                f"worker exited with {how}: it used its CPU time limit, "
                f"Limits.worker_cpu_seconds={cpu:g} ({cpu_used:.1f} s used)"
            )
        return f"worker exited with {how}"

    # ---- driving a Session root --------------------------------------------------------
    async def exec_step(
        self, run: Run, code: str, req_id: int, timeout: float | None = None
    ) -> StepResult:
        if run.conn is None or run.rec.state is not RUN:
            raise BroodError(f"run {run.id} is {run.rec.state.value}; it takes no more steps")
        fut: asyncio.Future[StepResult] = asyncio.get_running_loop().create_future()
        run.pending[req_id] = fut
        run.exec_timeout = timeout
        run.conn.send(Exec(req_id, code, timeout))
        return await fut

    # ---- runs the supervisor's own code drives (flows) ----------------------------------
    async def create_controller(
        self, prompt: str, parent: Run | None = None, run_id: str | None = None
    ) -> Run:
        """A run with no worker of its own, driven by code in the supervisor (a flow's
        control loop): a root (under `run_id`, if the caller chose it), or a child of
        `parent` (a flow a run's code started). It is `running` at once; its children
        come from `start_child`."""
        self.check_open()
        if parent is None:
            rec = self._root_record(prompt, FLOW_MODEL, run_id)
        else:
            await self._admit_for_flow(parent)
            rec = self._child_record(parent, _flow_key(parent), prompt, FLOW_MODEL)
            # A flow's run holds no worker and is no level of the tree: it is recorded at
            # its parent's depth, so its instances are at the depth of the parent's own
            # children, where every check of depth (admission, the worker's Start,
            # budget_remaining, a resume) reads it from the record.
            rec.depth = parent.rec.depth
            parent.flows_started += 1
        run = Run(rec, self.model, None, None, None, parent)
        if parent is not None:
            parent.children.append(run)
        await self._journal_or_forget([run], parent, 0 if parent is None else 1)
        await self._move(run, RUN)
        run.started.set()
        return run

    async def start_child(
        self,
        parent: Run,
        prompt: str,
        *,
        key: str,
        context_blob: bytes | None = None,
        model: Model | None = None,
        model_name: str | None = None,
        timeout: float | None = None,
        pool: str | None = None,
    ) -> Run:
        """Start a child of a controller run. Its outcome is awaited on `child.done`.
        The instances of a flow the user started are bounded by the flow's own settings;
        those of a flow a run's code started are that run's children for every tree limit
        (LimitExceeded when one would pass)."""
        if self.closing or parent.ending is not None or parent.rec.state is not RUN:
            raise BroodError(f"run {parent.id} is {parent.rec.state.value}; it starts no children")
        self.limits.check_pool(pool)
        if parent.parent is not None:  # counted by the admission
            await self._admit_for_flow(parent.parent)
        else:
            self._top(parent).tree_children += 1
        rec = self._child_record(parent, key, prompt, model_name or self.model_name)
        rec.pool = pool
        child = Run(
            rec,
            model or parent.model,
            context_blob,
            model_name,
            timeout if timeout is not None else self.limits.child_timeout,
            parent,
        )
        parent.children.append(child)
        await self._journal_or_forget([child], parent, 1)
        self.start_queue.append(child)
        self._grant()
        return child

    async def _admit_for_flow(self, starter: Run) -> None:
        """One more run for a flow `starter`'s code started (the flow's own run, or one of
        its instances), admitted and counted as a child of `starter` (DESIGN.md section
        14): refused with LimitExceeded unless `starter` may start children (max_depth)
        and one more child fits max_children (the tree) and max_children_per_run."""
        if not self.limits.can_start_child(starter.rec.depth):
            raise LimitExceeded("max_depth", starter.rec.depth + 2, self.limits.max_depth)
        top = self._top(starter)
        self.limits.admit_children(
            tree_total=top.tree_children, run_total=self.children_of(starter), count=1
        )
        if top.guest:  # the tree's own count is kept by its root's node
            assert self.spreader is not None
            await self.spreader.admit(top, 1)
        top.tree_children += 1

    def children_of(self, run: Run) -> int:
        """The runs `run` started, for max_children_per_run: its children (every attempt)
        and every run of each flow its code started."""
        if not run.flows_started:  # the common case, on every start of a child: no walk
            return len(run.children)
        return len(run.children) + sum(
            len(c.children) for c in run.children if c.rec.model == FLOW_MODEL
        )

    def children_left(self, flow: Run) -> int | None:
        """How many more runs the tree limits leave to the flow whose run is `flow`: None
        for a flow the user started (its own settings bound it)."""
        starter = flow.parent
        if starter is None:
            return None
        if not self.limits.can_start_child(starter.rec.depth):
            return 0
        lim = self.limits
        tree = lim.max_children - self._top(starter).tree_children
        return max(0, min(tree, lim.max_children_per_run - self.children_of(starter)))

    def event(self, run: Run, kind: str, data: dict[str, Any]) -> None:
        """Journal an event of a run (a flow's ledger)."""
        self._event(run, kind, data)

    def run_of(self, run_id: str) -> Run | None:
        return self.runs.get(run_id)

    def adopt_child(
        self, parent: Run, key: str, timeout: float | None = None, *, launch: bool = True
    ) -> Run | None:
        """The journaled child of a resumed controller run under `key`, once (None when the
        journal holds none). An unfinished one is queued to resume, unless `launch` is
        False (its flow is ending and will cancel it)."""
        child = parent.by_key.pop(key, None)
        if child is None:
            return None
        if timeout is not None:
            child.timeout = timeout
        if launch and child.launchable:
            self.start_queue.append(child)
            self._grant()
        return child

    def adopt_flow(self, parent: Run) -> Run | None:
        """The journaled flow a resumed run's replay starts again (the next flow:N key)."""
        child = parent.by_key.pop(_flow_key(parent), None)
        if child is not None:
            parent.flows_started += 1
        return child

    # ---- resuming a tree from the journal ----------------------------------------------
    async def resume_tree(self, root_id: str) -> Run:
        """Rebuild the tree under `root_id` from the journal and start its root again.

        Runs that ended keep their journaled outcome. A run cancelled before the crash, or
        under a parent that ended, is cancelled (not resumed). The root replays its journal
        in a new worker; each child waits until its parent's replay asks for it again by
        key (adoption) and is then resumed the same way, or handed its journaled answer.
        """
        self.check_open()
        return await self._rebuild(root_id, root_id)

    async def resume_subtree(self, root_id: str, top_id: str, top: Run | None = None) -> Run:
        """Resume the subtree of tree `root_id` under run `top_id`, as `resume_tree` resumes
        a tree: a child placed on a node that was lost. `top` is its run here when its
        parent runs here (its own node's run then goes on as a local child); without it the
        subtree is a guest here, as on the node that was lost."""
        self.check_open()
        return await self._rebuild(root_id, top_id, top)

    async def _rebuild(self, root_id: str, top_id: str, top: Run | None = None) -> Run:
        rows = self.store.runs(root_id)
        counted = len(rows) - 1
        away = self._away(rows) if top_id == root_id else {}
        if away:  # what runs below them is their nodes': not rebuilt here
            below = _below(rows, set(away)) - set(away)
            rows = [r for r in rows if r["id"] not in below]
        if top_id != root_id:  # its subtree
            kept = _below(rows, {top_id})
            rows = [r for r in rows if r["id"] in kept]
        extra = self.store.resume_data(root_id)
        runs: dict[str, Run] = {}
        for row in rows:  # in creation order: a parent comes before its children
            rec = RunRecord(
                id=row["id"],
                root_id=row["root_id"],
                parent_id=row["parent_id"],
                depth=row["depth"],
                key=row["key"],
                prompt=row["prompt"],
                model=row["model"],
                pool=row["pool"],
                context_ref=row["context_ref"],
                attempt=row["attempt"],
                state=RunState(row["state"]),
                reason=row["reason"],
                answer=row["answer"],
                error=row["error"],
                usage=dict(row["usage"]),
                products=row["products"],
                created_at=row["created_at"],
                started_at=row["started_at"],
                ended_at=row["ended_at"],
            )
            parent = runs.get(row["parent_id"]) if row["parent_id"] else None
            data = extra.get(rec.id, {})
            if rec.id == top_id and top is not None:  # its parent runs here: the same run
                top.rec, top.remote, top.spreading = rec, None, None
                runs[rec.id] = top
                continue
            where = away.get(rec.id)
            if isinstance(where, Run):  # placed here by the lost node: a local child now
                where.guest, where.parent = False, parent
                assert parent is not None
                parent.children.append(where)
                if rec.key is not None:
                    parent.by_key[rec.key] = where
                runs[rec.id] = where
                continue
            run = Run(
                rec,
                self.model,
                data.get("context"),
                data.get("model_name"),
                self.limits.child_timeout if parent or rec.id != root_id else None,
                parent,
            )
            run.guest = rec.id == top_id != root_id
            run.remote = where  # placed on a node that goes on: followed there
            if parent is not None:
                parent.children.append(run)
                if rec.key is not None:
                    parent.by_key[rec.key] = run
            if rec.state.terminal:
                run.started.set()
                run.done.set()
            runs[rec.id] = run
        root = runs[top_id]
        # A local child's tree keeps its counters here already (its root runs here).
        for run in runs.values() if top is None else ():
            if run.id in away:
                continue
            u = run.rec.usage
            root.tree_usage["tokens"] = (
                root.tree_usage.get("tokens", 0)
                + u.get("input_tokens", 0)
                + u.get("output_tokens", 0)
            )
            root.tree_usage["cost"] = root.tree_usage.get("cost", 0.0) + u.get("cost", 0.0)
        if top is None:
            root.tree_children = counted if top_id == root_id else len(runs) - 1
            root.prompts = {e["data"]["ref"] for e in self.store.events(top_id, "prompt")}
        self.runs.update(runs)
        followed = [runs[i] for i in away]
        runs = {i: r for i, r in runs.items() if i not in away}
        for run in runs.values():  # answered asks replay; open ones are open again
            if not run.rec.state.terminal:
                self.asks.adopt(run, self.store.events(run.id, "ask"))
        if top_id == root_id and not away:
            await asyncio.wrap_future(self.store.claim_tree(root_id, self.owner))
        else:
            for run in runs.values():
                if not run.rec.state.terminal:
                    await asyncio.wrap_future(self.store.claim_run(run.id, self.owner))
        for run in followed:
            if run.remote is not None:
                run.started.set()
                self._task(self._follow(run))
        open_ids = [r.id for r in runs.values() if not r.rec.state.terminal]
        self._event(root, "resume", {"supervisor": self.owner, "open": open_ids})
        ending: set[Run] = set()  # cancelled by this resume
        # Each running run's journaled steps, read once: for poison steps and its replay.
        steps = {r: self.store.events(r.id, "step") for r in runs.values() if r.rec.state is RUN}
        poisoned = self._poison_steps(steps)
        for run in runs.values():
            if run.rec.state.terminal or run.ending is not None:
                continue
            parent = run.parent
            if run.rec.state is CANCELLING:  # journaled first, so it stays cancelled
                ending.add(run)
                self._task(self.finish(run, RunState.CANCELLED, run.rec.reason or "cancelled"))
            elif parent is not None and (parent.rec.state.terminal or parent in ending):
                ending.add(run)
                self._task(self.finish(run, RunState.CANCELLED, "parent ended before the resume"))
            elif run.rec.model == FLOW_MODEL:
                pass  # a flow's run has no worker: its ledger rebuilds it, below
            elif run in poisoned:
                ending.add(run)
                why = (
                    f"step {poisoned[run]} was under way each time its host process died, twice; "
                    "it is not replayed a third time (its code may be what kills the host)"
                )
                self._task(self.finish(run, RunState.FAILED, why))
            elif run.rec.state is RUN:
                run.replay = self._replay_of(run, steps[run])
            else:  # queued: follow-ups held for its start were in memory only
                run.messages = [e["data"]["message"] for e in self.store.events(run.id, "message")]
        # Flows, before any worker starts (a resumed parent's replay asks for its flows):
        # each flow whose run or parent goes on is rebuilt from its ledger.
        for run in runs.values():
            parent = run.parent
            if run.rec.model != FLOW_MODEL or run in ending:
                continue
            if parent is not None and (parent.rec.state.terminal or parent in ending):
                continue
            self._resume_flow(run)
        if root.launchable:
            self.start_queue.append(root)
            self._grant()
        return root

    def _away(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        """The runs of a tree being resumed that head a subtree placed on another node
        (placement="spread") whose supervisor still holds its lease: they go on there, and
        are followed, not resumed; one that supervisor is this one joins the tree here."""
        if self.spreader is None:
            return {}
        owner = {r["id"]: r["supervisor"] for r in rows}
        away: dict[str, Any] = {}
        for row in rows:
            holder = row["supervisor"]
            if row["parent_id"] is None or holder == owner.get(row["parent_id"]):
                continue
            if RunState(row["state"]).terminal:
                continue
            if holder == self.owner:
                guest = self.runs.get(row["id"])
                if guest is not None and guest.guest:
                    away[row["id"]] = guest
            elif not lease_holder_gone(self.store.supervisor(holder)):
                peer = self.spreader.holder(holder)
                if peer is not None:
                    away[row["id"]] = peer
        return away

    def _poison_steps(self, steps: dict[Run, list[dict[str, Any]]]) -> dict[Run, int]:
        """The runs whose step was under way at two host deaths, each with that step. A run
        with such a descendant is not one of them: its step was waiting on that one."""
        found = {}
        for run, done in steps.items():
            if (step := self._poison_step(run, done)) is not None:
                found[run] = step

        def waits_below(run: Run) -> bool:
            return any(c in found or waits_below(c) for c in run.children)

        return {run: step for run, step in found.items() if not waits_below(run)}

    def _poison_step(self, run: Run, steps: list[dict[str, Any]]) -> int | None:
        """The step of `run` that was under way at two host deaths (begun twice in the
        journal, ended never), if there is one."""
        done = {int(e["data"]["step"]) for e in steps}
        begun: dict[int, int] = {}
        for e in self.store.events(run.id, "step_begun"):
            step = int(e["data"]["step"])
            begun[step] = begun.get(step, 0) + 1
        return next((n for n, c in sorted(begun.items()) if c >= 2 and n not in done), None)

    def _replay_of(self, run: Run, steps: list[dict[str, Any]]) -> Replay:
        """What the journal holds of a run: its turns' replies, its plain calls' replies by
        prompt, the number of its last journaled step."""
        replay = Replay()
        for ev in self.store.events(run.id, "model_call"):
            d = ev["data"]
            if d.get("response") is None:
                continue
            if d["kind"] == "turn":
                replay.turns.append(d["response"])
            else:
                prompt = str((d.get("request") or [{}])[-1].get("content", ""))
                replay.calls.setdefault(prompt, []).append(d["response"])
        replay.remembered = [
            base64.b64decode(e["data"]["value"]) for e in self.store.events(run.id, "remember")
        ]
        replay.pending = [p for e in steps for p in e["data"].get("pending", [])]
        replay.steps = max((int(e["data"]["step"]) for e in steps), default=0)
        return replay

    def _resume_flow(self, run: Run) -> None:
        try:
            if self.flow_resumer is None:
                raise BroodError("this supervisor runs no flows")
            self.flow_resumer(run)
        except BroodError as exc:
            why = f"could not resume flow {run.id}: {exc}"
            self._stop_resume(run, why)
            if not run.rec.state.terminal:
                self._task(self.finish(run, RunState.FAILED, why))

    def _stop_resume(self, run: Run, reason: str) -> None:
        """A replay diverged: the resume of the whole tree stops."""
        root = self._top(run)
        self.diverged.setdefault(root.id, reason)
        if root is not run:
            self._task(self.finish(root, RunState.CANCELLED, f"resume stopped: {reason}"))

    # ---- shutting down -----------------------------------------------------------------
    async def close(self, reason: str = "supervisor closed") -> None:
        self.closing = True
        roots = self._live_roots()
        await asyncio.gather(*(self.finish(r, RunState.CANCELLED, reason) for r in roots))
        await self.gateway.aclose()
        await self.backend.close()

    def snapshot(self, run: Run) -> dict[str, Any]:
        r = run.rec
        return {
            "run_id": r.id,
            "parent_id": r.parent_id,
            "depth": r.depth,
            "key": r.key,
            "prompt": r.prompt,
            "state": r.state.value,
            "reason": r.reason,
            "answer": r.answer,
            "duration": r.duration,
            "usage": dict(r.usage),
            "last_line": run.last_line,
            "started_at": r.started_at,
            "children": [self.snapshot(c) for c in run.children],
        }


_STOP = Stop()


def _below(rows: list[dict[str, Any]], tops: set[str]) -> set[str]:
    """The ids of `tops` and of every run under them, from a tree's rows in creation order
    (a parent's row comes before its children's)."""
    found = set(tops)
    for row in rows:
        if row["parent_id"] in found:
            found.add(row["id"])
    return found


def _update(run: Run) -> ChildUpdate:
    """A child's state, as its parent's worker hears it: under the id of the parent's handle
    (a later attempt goes on under its first attempt's id)."""
    r = run.rec
    return ChildUpdate(
        run.handle_id or r.id, r.state.value, r.answer, r.reason, r.error, r.products
    )


async def _now(value: Any) -> Any:
    return value


async def _wait(fut: asyncio.Future[Any], timeout: float) -> bool:
    if fut.done():
        return True
    try:
        await asyncio.wait_for(asyncio.shield(fut), timeout)
        return True
    except TimeoutError:
        return False


async def _wait_event(event: asyncio.Event, timeout: float) -> bool:
    if event.is_set():
        return True
    try:
        await asyncio.wait_for(event.wait(), timeout)
        return True
    except TimeoutError:
        return False


__all__ = ["Core", "Run", "RunInfo"]

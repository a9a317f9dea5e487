"""The supervisor's records of runs: `Run` (one run, as the supervisor holds it), `Tree`
(the counters its tree keeps), `RunInfo` (what observers and handles see of a run), `Pool`
(a named capacity pool) and `StepWatch` (the supervisor's own clock of a step). Data and
small rules on it; nothing here journals, signals or starts anything.
"""

from __future__ import annotations

import asyncio
import bisect
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from brood.backends.base import WorkerConn
from brood.lifecycle import FailureKind, RunRecord, RunState
from brood.models.base import Model
from brood.protocol import ChildUpdate, Replay
from brood.supervisor.frames import Conversation, Steps

Q, RUN, CANCELLING = RunState.QUEUED, RunState.RUNNING, RunState.CANCELLING
FLOW_MODEL = "flow"  # the model column of a flow's own run (it has no worker)
STORE_FAILED = "StoreError: "  # how the reason of a run ended by a failed journal begins
COST_UNKNOWN = "cost_unknown"  # the event of a run's first call to a model nobody prices


def journaled_kind(rec: RunRecord) -> FailureKind | None:
    """The failure kind of a run the journal holds as ended (a resume's), from what the
    supervisor alone wrote there: a reason beginning with STORE_FAILED is the journal's own
    (a worker's reason that begins so is kept as "worker error: ..."). A rate limit is not
    journaled: after a resume such a run is an ordinary failure."""
    if rec.state is not RunState.FAILED:
        return None
    store = (rec.reason or "").startswith(STORE_FAILED)
    return FailureKind.STORE if store else FailureKind.ERROR


def new_run_id() -> str:
    """A short, readable id; `Kernel.journal_new` draws again on a clash in the journal."""
    return "r-" + secrets.token_hex(4)


def last_line(text: str) -> str:
    """The last non-empty line of a step's output, cut to fit a live view."""
    lines = text.strip().splitlines()
    return lines[-1][-200:] if lines else ""


def flow_key(parent: Run) -> str:
    """The key of the next flow `parent`'s code starts (flow:N)."""
    return f"flow:{parent.flows_started}"


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
class Tree:
    """What one tree keeps in this supervisor, for its limits and budgets: the children
    started in the whole tree (Limits.max_children), its spend, the system prompts it has
    journaled (once per tree), and for its budgets the model calls in flight, those
    answered, the largest of them, and the calls waiting for the budget.

    The tree here is the subtree of its top run: its root, or a guest whose parent runs on
    another node (whose own counts are then the root's node's). Every run holds its top's
    record (`Run.tree`), taken from its parent when the run is made: the simplest way in
    and the cheapest, one reference a run set once, where a record held by the top alone
    would take a walk up the tree on every model call and every start, and be None on
    every other run. The one run that changes tree is a guest adopted as a local child
    (`graft`)."""

    children: int = 0
    usage: dict[str, float] = field(default_factory=dict)  # tokens and cost spent
    prompts: set[str] = field(default_factory=set)  # refs of the system prompts journaled
    calls_in_flight: int = 0
    calls_seen: int = 0
    largest_tokens: int = 0
    largest_cost: float = 0.0
    budget_waiters: list[asyncio.Future[None]] = field(default_factory=list)


@dataclass(eq=False)
class Turns:
    """A conversation root's user turns (Supervisor.conversation), as the supervisor
    handed them and saw them end: every turn handed (journaled `user_turn`s, in order, each
    with the number of model replies before it), how many have a journaled answer, and how
    many its current worker has ended (a resumed one replays the journaled ones first).
    Between two turns the root holds no slot, takes no step and no model turn."""

    prompts: list[str] = field(default_factory=list)
    at: list[int] = field(default_factory=list)  # model replies before each turn began
    answered: int = 0
    ended: int = 0
    answer: str | None = None  # the last turn's
    waiter: asyncio.Future[None] | None = None  # the send() of the turn under way
    usage_at: dict[str, Any] = field(default_factory=dict)  # the root's usage as it began
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one send at a time
    suspended: bool = False  # its worker stopped between turns; resumable from the journal

    @property
    def between(self) -> bool:
        """No turn under way: every turn handed has ended."""
        return self.ended >= len(self.prompts)


@dataclass(eq=False, kw_only=True)
class Run:
    """One run as the supervisor holds it: its journaled record, its worker, its place in
    the tree, and what the supervisor keeps to check its worker's frames by."""

    rec: RunRecord
    model: Model
    # The model of its children and of its plain calls (llm_query and its kin) when model
    # code names none; None: its own. A root started with spawn(sub_model=) passes it down.
    sub_model: Model | None = None
    context_blob: bytes | None = None
    model_name: str | None = None
    timeout: float | None = None
    parent: Run | None = None
    driven: bool = False
    turns: Turns | None = None  # a conversation root's user turns
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
    replay: Replay | None = None  # a run resumed from the journal, until its worker starts
    by_key: dict[str, Run] = field(default_factory=dict)  # resumed: journaled children by key
    # Resumed: its journaled tool calls by canonical arguments, answered in order (tools.py).
    tool_replay: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    flows_started: int = 0  # flows its code started (their runs' keys: flow:N)
    calls: set[asyncio.Task[Any]] = field(default_factory=set)  # model calls under way
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
    # Why it failed, as the supervisor decided it (None until it has failed), and whether
    # its last model call was refused by a rate limit (what the gateway answered, not what
    # the worker says): a run that then fails failed on that rate limit.
    failure_kind: FailureKind | None = None
    rate_limited: bool = False
    unpriced: set[str | None] = field(default_factory=set)  # models whose cost_unknown it said
    # Hibernation (hibernation.py): when it said it waits (loop time), the timer that
    # hibernates it, whether its worker is stopped (or being stopped) for its wait, whether
    # something it may wait on changed since, and why it stays live (journaled once).
    blocked_at: float = 0.0
    hibernate_timer: asyncio.TimerHandle | None = None
    hibernating: bool = False
    wake_due: bool = False
    stays_live: str | None = None
    tree: Tree = field(init=False)  # its top's record: its parent's, or a new one

    def __post_init__(self) -> None:
        self.tree = Tree() if self.parent is None else self.parent.tree

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
            run_id=r.id,
            parent_id=r.parent_id,
            root_id=r.root_id,
            depth=r.depth,
            prompt=r.prompt,
            state=r.state.value,
            reason=r.reason,
            answer=r.answer,
            error=r.error,
            duration=r.duration,
            usage=dict(r.usage),
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
        bisect.insort(self.waiters, run, key=pool_order)

    def take_waiter(self, ahead_of: Run | None = None) -> Run | None:
        """The oldest waiter that can still start (given `ahead_of`, one that waits ahead
        of that run), taken off the queue; None if there is none. First come, first served:
        a newcomer never takes a place an older waiter is owed, and a freed place goes to
        the oldest."""
        mine = None if ahead_of is None else pool_order(ahead_of)
        first = next(
            (w for w in self.waiters if w.launchable and (mine is None or pool_order(w) < mine)),
            None,
        )
        if first is not None:
            self.waiters.remove(first)
        return first

    def describe(self) -> str:
        held = ", ".join(r.id for r in self.holders) or "nobody"
        return f"{len(self.holders)} of {self.capacity} held by {held}"


def pool_order(run: Run) -> tuple[int, float]:
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


def graft(run: Run, parent: Run) -> None:
    """`run`, a guest (the top of a subtree another node placed here), becomes a child of
    `parent`, which runs here: it and every run under it count in `parent`'s tree."""
    run.guest, run.parent = False, parent
    parent.children.append(run)
    below = [run]
    while below:
        r = below.pop()
        r.tree = parent.tree
        below.extend(r.children)


def child_update(run: Run) -> ChildUpdate:
    """A child's state, as its parent's worker hears it: under the id of the parent's handle
    (a later attempt goes on under its first attempt's id)."""
    r = run.rec
    return ChildUpdate(
        run.handle_id or r.id, r.state.value, r.answer, r.reason, r.error, r.products
    )


__all__ = [
    "COST_UNKNOWN",
    "Pool",
    "Run",
    "RunInfo",
    "StepWatch",
    "Tree",
    "Turns",
    "child_update",
    "graft",
    "journaled_kind",
    "last_line",
    "new_run_id",
]

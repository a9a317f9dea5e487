"""What one run's REPL helpers share (`Runtime`): the link to the supervisor, the step clock,
the limits, the answer, the journal a resumed run replays; its model calls, its waits on
work below (children, tasks, asks) and the threads its concurrent calls run on.

The helpers themselves are in `brood.worker.verbs`, the handles they return in
`brood.worker.handles`.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from typing import Any, Protocol

from brood.errors import InvalidArgument, StaleHandle
from brood.limits import Limits
from brood.protocol import Blocked, ChildUpdate, ModelReq, Replay, WorkerLimits
from brood.worker.confine import BATCH_THREADS
from brood.worker.link import Link, stalled
from brood.worker.repl import ReplayStop, StepClock
from brood.worker.threads import CallThreads

# True inside work started by `spawn` (and what that work starts in turn): nobody waits on
# it as it goes, so the stall alarm is not its to raise; its waiter's rlm_await raises it.
SPAWNED: ContextVar[bool] = ContextVar("brood_spawned", default=False)
# A model call is a wait worth hibernating in only once it is slow: unanswered after
# Limits.hibernate_after and at least this long, so hibernate_after=0 stops no worker for
# each quick call.
SLOW_CALL_S = 0.25


def as_spawned(fn: Callable[..., Any], /, *args: Any, **kw: Any) -> Any:
    """fn(*args, **kw) as spawned work: a job of the call pool that nobody waits on as it
    goes (`SPAWNED`)."""
    SPAWNED.set(True)  # in this job's own copy of the context
    return fn(*args, **kw)


class ChildRef(Protocol):
    """What the runtime keeps of a child handle (`handles.ChildHandle`, whose module is
    built on this one): the child's id and the task it was given."""

    id: str
    prompt: str


class Runtime:
    """What the helpers of one run share: the link, the step clock, the limits, the answer;
    its model calls, its waits on work below, and its threads for concurrent calls."""

    def __init__(
        self,
        link: Link,
        *,
        run_id: str,
        depth: int,
        can_spawn: bool,
        clock: StepClock,
        max_depth: int,
        limits: WorkerLimits | None = None,
    ) -> None:
        self.link = link
        self.run_id = run_id
        self.depth = depth
        self.can_spawn = can_spawn
        self.max_depth = max_depth
        self.clock = clock
        self.step = 0
        self.final: str | None = None
        self.products: dict[str, Any] | None = None  # FINAL(answer, products=...)
        # The tree's limits, as the Start carried them (a bare Runtime: Limits' defaults).
        self.limits = limits or WorkerLimits.from_limits(Limits(max_depth=max_depth))
        self.model_name: str | None = None  # the model name this run was started with
        self.replay: Replay | None = None  # what the journal holds, for a resumed run
        self.in_flight: dict[str, int] = {}  # plain calls under way, by prompt
        self.turn_sent = 0  # messages of the conversation already journaled
        self.prompt_tokens = 0  # of the last model turn, as its model reported them (0: not)
        self.namespace: dict[str, Any] = {}
        self.tools: dict[str, Callable[..., Any]] = {}  # the user's tools in its REPL
        self.closed: str | None = None  # why handles are stale, once they are
        self.handles: dict[str, ChildRef] = {}  # the code's child handles, by child id
        self.seen: set[str] = set()  # children whose outcome the code has already observed
        self.notes: list[str] = []  # one-time notes for the model, shown with step output
        self.depth_noted = False
        self._pool: CallThreads | None = None
        self._blocked = 0
        self._block_lock = threading.Lock()
        self._task_ids = itertools.count(1)
        # What the worker held before model code ran: threads and open descriptors that
        # are brood's own (`hazard` names the others).
        self._threads: set[int | None] = set()
        self._fds: set[str] = set()

    def baseline(self) -> None:
        """Note the threads and descriptors the worker holds before model code runs."""
        self._threads = {t.ident for t in threading.enumerate()}
        self._fds = _open_fds()

    def next_task_id(self) -> str:
        return f"t-{next(self._task_ids)}"

    def pending_calls(self) -> list[str]:
        """The prompts of the plain calls under way, once per call (a step's journal entry
        lists them: a resumed run asks them again, live)."""
        with self._block_lock:
            return [p for p, n in self.in_flight.items() for _ in range(n)]

    # ---- model calls ----------------------------------------------------------------------
    def call_model(self, messages: list[dict[str, Any]], kind: str, model: str | None) -> str:
        """One model call, made by the supervisor's model gateway (which measures and
        journals it); a recorded reply when the run is resumed and the journal has one."""
        recorded = self.recorded_reply(messages, kind)
        if recorded is not None:
            return recorded
        prompt = str(messages[-1].get("content", "")) if kind == "llm_query" else ""
        if prompt:
            with self._block_lock:
                self.in_flight[prompt] = self.in_flight.get(prompt, 0) + 1
        new_from = 0
        turn = kind in ("turn", "compact")  # the run's own conversation, not a step's call
        if turn:
            new_from, self.turn_sent = self.turn_sent, len(messages)
        what = f"the model call ({kind}{': ' + repr(prompt[:60]) if prompt else ''})"
        try:
            with self.clock.paused():
                reply = self.link.request_reply(
                    ModelReq(
                        req_id=self.link.next_id(),
                        kind=kind,  # type: ignore[arg-type]
                        messages=messages,
                        new_from=new_from,
                        model=model or self.model_name,
                    ),
                    stall=None if turn else self.stall_alarm,  # steps' calls only
                    what=what,
                    slow=self._slow_call(),
                )
            if kind == "turn":
                self.prompt_tokens = reply.prompt_tokens
            text: str = reply.value
            return text
        finally:
            if prompt:
                with self._block_lock:
                    self.in_flight[prompt] -= 1

    def _slow_call(self) -> tuple[float, Callable[[], AbstractContextManager[None]]] | None:
        """A model call unanswered after Limits.hibernate_after is a wait like a child's (the
        run may hibernate in it); None: never (or from spawned work, whose waiter decides)."""
        after = self.limits.hibernate_after
        if after is None or SPAWNED.get():
            return None
        return max(after, SLOW_CALL_S), self.blocked

    # ---- resuming from the journal -----------------------------------------------------
    @property
    def replaying(self) -> bool:
        """Whether the current step is one the journal holds (so it must repeat its calls)."""
        return self.replay is not None and self.step <= self.replay.steps

    def recorded_reply(self, messages: list[dict[str, Any]], kind: str) -> str | None:
        """The journaled reply to this call, if the run is resumed and the journal has it.
        Recorded replies are used once each, and are not journaled again."""
        replay = self.replay
        if replay is None:
            return None
        if kind == "compact":
            return None  # a journaled compaction is replayed by the agent, without a call
        if kind == "turn":
            if not replay.turns:
                return None
            self.turn_sent = len(messages)
            if replay.turn_tokens:
                self.prompt_tokens = replay.turn_tokens.pop(0)
            return replay.turns.pop(0)
        prompt = str(messages[-1].get("content", ""))
        with self._block_lock:  # batched calls run on several threads
            queue = replay.calls.get(prompt)
            if queue:
                return queue.pop(0)
            if prompt in replay.pending:  # in flight at the crash: asked again, live
                replay.pending.remove(prompt)
                return None
        if self.replaying:
            raise ReplayStop(
                f"run {self.run_id} step {self.step}: the replay asked llm_query({prompt[:80]!r}),"
                " a call the journal does not hold for this step"
            )
        return None

    def pool(self) -> CallThreads:
        """The threads concurrent calls run on, started as work comes (or all at once
        before model code runs: `start_threads`)."""
        if self._pool is None:
            self._pool = CallThreads(BATCH_THREADS)
        return self._pool

    def start_threads(self) -> None:
        """Start every call thread now (`CallThreads.start_all`); call before model code
        runs."""
        self.pool().start_all()

    # ---- waiting on children -----------------------------------------------------------
    def hazard(self, timeout: float | None) -> str:
        """Why a rebuild of this run by replay could diverge from what this worker holds
        now ("" if nothing the worker can see): the supervisor then keeps it live."""
        if self.limits.hibernate_after is None:
            return ""  # it never hibernates: nothing to look for
        if timeout is not None:
            return f"its wait has a timeout ({timeout:g} s), which a rebuild would start over"
        pool = self._pool
        if pool is not None:
            waiting = threading.get_ident() in pool.idents  # a spawned job, itself waiting
            if pool.load > int(waiting):
                return "work it started with spawn() is in flight"
        ours = self._threads | (pool.idents if pool is not None else set())
        threads = [t for t in threading.enumerate() if t.ident not in ours and t.is_alive()]
        if threads:
            return f"its code started threads that are still running ({len(threads)})"
        fds = _open_fds() - self._fds
        if len(fds) > 1:  # the listing's own descriptor may be a new number
            return f"its code holds open files or sockets ({len(fds) - 1} more than at start)"
        return ""

    @contextmanager
    def blocked(self, timeout: float | None = None) -> Iterator[None]:
        """While code waits on children: stop the step clock and give up the compute slot."""
        with self.clock.paused():
            with self._block_lock:
                self._blocked += 1
                if self._blocked == 1:
                    self.link.send(Blocked(req_id=0, blocked=True, hazard=self.hazard(timeout)))
            try:
                yield
            finally:
                with self._block_lock:
                    self._blocked -= 1
                    resume = self._blocked == 0
                if resume:
                    # Answered once the supervisor grants a slot again.
                    self.link.request(Blocked(req_id=self.link.next_id(), blocked=False))

    @property
    def stall_timeout(self) -> float | None:
        return self.limits.stall_timeout

    @property
    def stall_alarm(self) -> float | None:
        """The stall alarm of a wait made here: Limits.stall_timeout in the step itself,
        none in spawned work (the alarm belongs to whoever awaits it, never to the work)."""
        return None if SPAWNED.get() else self.stall_timeout

    def wait_for(
        self, ready: Callable[[], bool], timeout: float | None, what: str | None = None
    ) -> bool:
        """Until `ready()` (True) or `timeout` (False). Waiting on `what` (work below: a
        child, a task), hearing nothing from below for Limits.stall_timeout raises
        StallTimeout; `timeout` bounds the total time, the stall alarm the silence."""
        with self.link.cond:
            if ready():
                return True
        stall = self.stall_alarm if what else None
        began = time.monotonic()
        deadline = None if timeout is None else began + timeout
        with self.blocked(timeout), self.link.cond:
            while True:
                now = time.monotonic()
                bounds = [] if deadline is None else [deadline - now]
                if stall is not None:
                    bounds.append(max(self.link.heard, began) + stall - now)
                if self.link.cond.wait_for(ready, max(min(bounds), 0.0) if bounds else None):
                    return True
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    return False
                if stall is not None and now - max(self.link.heard, began) >= stall:
                    raise stalled(what or "the wait", stall)

    def state_of(self, child_id: str) -> ChildUpdate:
        with self.link.cond:
            return self.link.children[child_id]

    def check_open(self) -> None:
        if self.closed:
            raise StaleHandle(self.closed)

    def fits(self, text: str, where: str) -> str:
        """Refuses a prompt over Limits.max_prompt_chars before it costs a call (the
        supervisor refuses it too, ending the run: a worker sends none)."""
        cap = self.limits.max_prompt_chars
        if len(text) > cap:
            raise InvalidArgument(
                f"{where}: the prompt has {len(text):,} characters, over "
                f"Limits.max_prompt_chars={cap:,}; use llm_query_chunked(text, prompt) (or "
                "search / grep_context to find the part that matters) instead"
            )
        return text

    def note_depth(self) -> None:
        if not self.depth_noted:
            self.depth_noted = True
            self.notes.append(
                f"note: this run is at depth {self.depth} of max_depth={self.max_depth}, so "
                "rlm_query answers with a plain model call (llm_query) instead of a child run"
            )


def _open_fds() -> set[str]:
    """The descriptors this process holds open (empty where /proc cannot say)."""
    try:
        return set(os.listdir("/proc/self/fd"))
    except OSError:
        return set()

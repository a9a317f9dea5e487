"""The REPL helpers of DESIGN.md section 3, and the handles they return.

Their docstrings are the documentation the model reads: `prompt.py` builds the system
prompt from them, so keep each one short and exact.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import math
import os
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar, copy_context
from typing import Any

import cloudpickle

from brood.errors import (
    AskCancelled,
    BroodError,
    ChildFailed,
    ChildNotReady,
    InvalidArgument,
    InvalidSpec,
    LimitExceeded,
    ModelError,
    RateLimited,
    ReplayDiverged,
    StaleHandle,
    StallTimeout,
)
from brood.lifecycle import TERMINAL_VALUES
from brood.protocol import (
    MAX_REMEMBER_BYTES,
    MAX_RETRIES,
    AskCancelReq,
    AskOption,
    AskReq,
    AskUpdate,
    Blocked,
    BudgetReq,
    CancelReq,
    ChildUpdate,
    FlowReq,
    ModelReq,
    Remember,
    Replay,
    SendReq,
    SpawnReq,
)
from brood.spec_text import MAX_SPEC_BYTES, looks_like_path, over_bound, read_bounded
from brood.worker.confine import BATCH_THREADS
from brood.worker.link import Link, stalled
from brood.worker.repl import FinalSignal, ReplayStop, StepClock
from brood.worker.toolkit import make_toolkit

# True inside work started by `spawn` (and what that work starts in turn): nobody waits on
# it as it goes, so the stall alarm is not its to raise; its waiter's rlm_await raises it.
SPAWNED: ContextVar[bool] = ContextVar("brood_spawned", default=False)


class _Pool(ThreadPoolExecutor):
    """The run's threads for concurrent calls; each job runs in a copy of the submitter's
    context, so work a spawned task starts is spawned work too."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kw: Any) -> Future[Any]:
        return super().submit(copy_context().run, fn, *args, **kw)

    def start_all(self) -> None:
        """Start every thread now, not as work comes: in a pids cgroup
        (`confine.pids_capped`) brood's own tasks must all exist before model code runs, so
        that it gets exactly `Limits.worker_processes` places and none of brood's threads
        finds them taken later. One job per thread, each held until all have started (a
        pool never ends its threads); should a start fail (an address-space limit too small
        for every stack), the rest start as work comes."""
        together = threading.Barrier(self._max_workers + 1)
        try:
            for _ in range(self._max_workers):
                self.submit(together.wait)
            together.wait()
        except (RuntimeError, threading.BrokenBarrierError):
            together.abort()


def _as_spawned(fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    SPAWNED.set(True)  # in this job's own copy of the context
    return fn(*args, **kw)


class Runtime:
    """What the helpers of one run share: the link, the step clock, the answer."""

    def __init__(
        self,
        link: Link,
        *,
        run_id: str,
        depth: int,
        can_spawn: bool,
        clock: StepClock,
        max_depth: int,
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
        self.limits: dict[str, Any] = {}  # the tree's Limits, as the Start carried them
        self.model_name: str | None = None  # the model name this run was started with
        self.replay: Replay | None = None  # what the journal holds, for a resumed run
        self.in_flight: dict[str, int] = {}  # plain calls under way, by prompt
        self.turn_sent = 0  # messages of the conversation already journaled
        self.namespace: dict[str, Any] = {}
        self.closed: str | None = None  # why handles are stale, once they are
        self.handles: dict[str, ChildHandle] = {}
        self.seen: set[str] = set()  # children whose outcome the code has already observed
        self.notes: list[str] = []  # one-time notes for the model, shown with step output
        self.depth_noted = False
        self._pool: _Pool | None = None
        self._blocked = 0
        self._block_lock = threading.Lock()
        self._task_ids = itertools.count(1)

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
        if kind == "turn":
            new_from, self.turn_sent = self.turn_sent, len(messages)
        what = f"the model call ({kind}{': ' + repr(prompt[:60]) if prompt else ''})"
        try:
            with self.clock.paused():
                reply: str = self.link.request(
                    ModelReq(
                        req_id=self.link.next_id(),
                        kind=kind,  # type: ignore[arg-type]
                        messages=messages,
                        new_from=new_from,
                        model=model or self.model_name,
                    ),
                    stall=None if kind == "turn" else self.stall_alarm,  # steps' calls only
                    what=what,
                )
            return reply
        finally:
            if prompt:
                with self._block_lock:
                    self.in_flight[prompt] -= 1

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
        if kind == "turn":
            if not replay.turns:
                return None
            self.turn_sent = len(messages)
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

    def pool(self) -> _Pool:
        """The threads concurrent calls run on, started as work comes (or all at once
        before model code runs: `start_threads`)."""
        if self._pool is None:
            self._pool = _Pool(BATCH_THREADS, thread_name_prefix="brood-call")
        return self._pool

    def start_threads(self) -> None:
        """Start every call thread now (`_Pool.start_all`); call before model code runs."""
        self.pool().start_all()

    # ---- waiting on children -----------------------------------------------------------
    @contextmanager
    def blocked(self) -> Iterator[None]:
        """While code waits on children: stop the step clock and give up the compute slot."""
        with self.clock.paused():
            with self._block_lock:
                self._blocked += 1
                if self._blocked == 1:
                    self.link.send(Blocked(req_id=0, blocked=True))
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
        value = self.limits.get("stall_timeout")
        return None if value is None else float(value)

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
        with self.blocked(), self.link.cond:
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
        cap = int(self.limits.get("max_prompt_chars", 400_000))
        if len(text) > cap:
            raise InvalidArgument(
                f"{where}: the prompt has {len(text):,} characters, over "
                f"Limits.max_prompt_chars={cap:,}; use llm_query_chunked(text, prompt) (or "
                "search / grep_context to find the part that matters) instead"
            )
        return text

    # ---- starting children -------------------------------------------------------------
    def spawn_children(
        self,
        prompts: Sequence[str],
        *,
        context: Any = None,
        model: str | None = None,
        timeout: float | None = None,
        pool: str | None = None,
        retries: int = 0,
        placement: str = "local",
    ) -> list[ChildHandle]:
        self.check_open()
        if placement not in ("local", "spread"):
            raise InvalidArgument(
                f"placement must be 'local' (this node) or 'spread' (another node of a "
                f"cluster), got {placement!r}"
            )
        if pool is not None and not isinstance(pool, str):
            raise InvalidArgument(f"pool must be the name of a pool (a str), got {pool!r}")
        if (
            isinstance(retries, bool)
            or not isinstance(retries, int)
            or not 0 <= retries <= MAX_RETRIES
        ):
            raise InvalidArgument(
                f"retries must be a whole number from 0 to {MAX_RETRIES} (attempts after the "
                f"first, for a child that fails or times out), got {retries!r}"
            )
        for i, p in enumerate(prompts):
            self.fits(p, f"rlm_query_batched[{i}]" if len(prompts) > 1 else "rlm_query")
        blob = cloudpickle.dumps(context) if context is not None else None
        try:
            ids: list[str] = self.link.request(
                SpawnReq(
                    req_id=self.link.next_id(),
                    prompts=list(prompts),
                    context=blob,
                    model=model,
                    timeout=timeout,
                    step=self.step,
                    replaying=self.replaying,
                    pool=pool,
                    retries=retries,
                    placement=placement,  # type: ignore[arg-type]
                )
            )
        except ReplayDiverged as exc:
            raise ReplayStop(str(exc)) from None
        handles = []
        with self.link.cond:
            for child_id, prompt in zip(ids, prompts, strict=True):
                self.link.children.setdefault(child_id, ChildUpdate(child_id, "queued"))
                handles.append(ChildHandle(self, child_id, prompt))
        for h in handles:
            self.handles[h.id] = h
        return handles

    # ---- asks to a person -----------------------------------------------------------------
    def open_ask(
        self, question: object, options: object, deadline: object, default: object
    ) -> AskHandle:
        self.check_open()
        if not isinstance(question, str) or not question.strip():
            raise InvalidArgument("ask_person(question): the question must be non-empty text")
        if deadline is not None and not (
            isinstance(deadline, int | float)
            and not isinstance(deadline, bool)
            and math.isfinite(deadline)
            and deadline > 0
        ):
            raise InvalidArgument(
                f"ask_person(deadline=...) is seconds from now, a number > 0, or None for "
                f"none; got {deadline!r}"
            )
        if default is not None and (not isinstance(default, str) or not default.strip()):
            raise InvalidArgument(
                f"ask_person(default=...) is an option id or text, got {default!r}"
            )
        ask_id: str = self.link.request(
            AskReq(
                req_id=self.link.next_id(),
                question=question,
                options=_ask_options(options),
                deadline=None if deadline is None else float(deadline),
                default=default,
                step=self.step,
                replaying=self.replaying,
            )
        )
        with self.link.cond:  # an update may have come first (a replayed, answered ask)
            self.link.asks.setdefault(ask_id, AskUpdate(ask_id, "open"))
        return AskHandle(self, ask_id, question)

    def note_depth(self) -> None:
        if not self.depth_noted:
            self.depth_noted = True
            self.notes.append(
                f"note: this run is at depth {self.depth} of max_depth={self.max_depth}, so "
                "rlm_query answers with a plain model call (llm_query) instead of a child run"
            )

    def wait_handles(
        self, handles: Sequence[Handle], quantifier: Callable[[Any], bool], timeout: float | None
    ) -> bool:
        """Wait (one release of the compute slot) until `quantifier` (all / any) of the
        handles have ended; False on timeout."""
        for h in handles:
            if isinstance(h, Task):  # wake the waiter when a task finishes
                h._future.add_done_callback(lambda _f: _notify(self.link))

        def ended(h: Handle) -> bool:
            if isinstance(h, Task):
                return h._future.done()
            if isinstance(h, AskHandle):
                return self.link.asks[h.id].state != "open"
            return self.link.children[h.id].state in TERMINAL_VALUES

        below = [h.id for h in handles if not isinstance(h, AskHandle)]
        what = (", ".join(below[:3]) + (", ..." if len(below) > 3 else "")) if below else None
        return self.wait_for(lambda: quantifier(ended(h) for h in handles), timeout, what)

    def collect(self, handles: Sequence[Handle], timeout: float | None) -> list[Any]:
        """Wait for every handle, in one wait (one release of the compute slot); results in
        order, or ChildFailed naming the failed indices once all have settled."""
        self.check_open()
        if not self.wait_handles(handles, all, timeout):
            pending = [x.id for x in handles if not x.done]
            raise TimeoutError(
                f"{len(pending)} of {len(handles)} still running after {timeout} s "
                f"({', '.join(pending[:5])}); they keep running: wait again later, "
                "or cancel them"
            )
        answers: list[Any] = []
        failed: list[int] = []
        for i, h in enumerate(handles):
            try:
                answers.append(h.result())
            except AskCancelled:
                raise  # every wait on a withdrawn ask raises it
            except Exception:  # ChildFailed, or whatever a task raised
                answers.append(None)
                failed.append(i)
        if failed:
            reasons = "; ".join(f"#{i} {handles[i].failure()}" for i in failed[:5])
            raise ChildFailed(
                f"{len(failed)} of {len(handles)} failed: {reasons}; "
                "e.answers holds every answer (None where failed)",
                failed=failed,
                answers=answers,
            )
        return answers


class ChildHandle:
    """A child run started by this run. Never blocks except `wait` and `cancel`."""

    def __init__(self, rt: Runtime, child_id: str, prompt: str) -> None:
        self._rt = rt
        self.id = child_id
        self.prompt = prompt

    def __repr__(self) -> str:
        return f"<ChildHandle {self.id} {self.status()}>"

    @property
    def done(self) -> bool:
        return self.status() in TERMINAL_VALUES

    def status(self) -> str:
        self._rt.check_open()
        return self._rt.state_of(self.id).state

    def failure(self) -> str:
        u = self._rt.state_of(self.id)
        return f"{self.id} {u.state}: {u.reason or u.error or 'no reason recorded'}"

    def result(self) -> str:
        self._rt.check_open()
        u = self._rt.state_of(self.id)
        if u.state not in TERMINAL_VALUES:
            raise ChildNotReady(
                f"child {self.id} is {u.state}; use rlm_wait(h) to block, or check "
                "rlm_status(h) in a later step"
            )
        self._rt.seen.add(self.id)
        if u.state == "completed":
            return u.answer or ""
        raise ChildFailed(
            f"child {self.id} {u.state}: {u.reason or u.error}",
            run_id=self.id,
            status=u.state,
            reason=u.reason or u.error,
        )

    def products(self) -> dict[str, Any] | None:
        """What the child gave with FINAL(answer, products=...) (None: nothing); raises as
        result() does while it is going or if it did not complete."""
        self.result()
        return self._rt.state_of(self.id).products

    def wait_done(self, timeout: float | None) -> bool:
        self._rt.check_open()
        return self._rt.wait_for(
            lambda: self._rt.link.children[self.id].state in TERMINAL_VALUES,
            timeout,
            f"child {self.id}",
        )

    def wait(self, timeout: float | None = None) -> str:
        timeout = _check_timeout(timeout, "ChildHandle.wait")
        if not self.wait_done(timeout):
            raise TimeoutError(
                f"child {self.id} is still {self.status()} after {timeout} s; it keeps "
                "running: wait again later, or rlm_cancel(h)"
            )
        return self.result()

    def cancel(self) -> str:
        self._rt.check_open()
        if self.done:
            return self.status()
        with self._rt.blocked():
            state: str = self._rt.link.request(
                CancelReq(req_id=self._rt.link.next_id(), child_id=self.id)
            )
        self._rt.seen.add(self.id)
        return state

    def send(self, message: str) -> None:
        self._rt.check_open()
        if not isinstance(message, str):
            raise InvalidArgument(
                f"rlm_send(h, message): message must be str, got {type(message).__name__}"
            )
        cap = int(self._rt.limits.get("max_prompt_chars", 400_000))
        if len(message) > cap:  # it goes into the child's next prompt
            raise InvalidArgument(
                f"rlm_send(h, message): the message has {len(message):,} characters, over "
                f"Limits.max_prompt_chars={cap:,}; send less, or pass data as a child's context"
            )
        self._rt.link.request(
            SendReq(
                req_id=self._rt.link.next_id(),
                child_id=self.id,
                message=message,
                replaying=self._rt.replaying,
            )
        )


class Task:
    """Work started by `spawn` that is not a single child run: plain model calls, a batch."""

    def __init__(
        self, rt: Runtime, future: Future[Any], what: str, children: Sequence[ChildHandle] = ()
    ) -> None:
        self._rt = rt
        self._future = future
        self.id = f"t-{next(rt._task_ids)}"
        self.what = what
        self.children = list(children)
        self.cancelled = False  # rlm_cancel was asked before the work completed

    def __repr__(self) -> str:
        return f"<Task {self.id} {self.what} {self.status()}>"

    @property
    def done(self) -> bool:
        return self._future.done()

    def status(self) -> str:
        if self.cancelled:  # cancelled while it ran (its children ended cancelled under it)
            return "cancelled"
        if not self._future.done():
            return "running"
        return "failed" if self._future.exception() is not None else "completed"

    def result(self) -> Any:
        if not self._future.done():
            raise ChildNotReady(f"task {self.id} ({self.what}) is still running")
        return self._future.result()

    def wait_done(self, timeout: float | None) -> bool:
        if self._future.done():
            return True
        self._future.add_done_callback(lambda _f: _notify(self._rt.link))
        return self._rt.wait_for(self._future.done, timeout, f"task {self.id} ({self.what})")

    def wait(self, timeout: float | None = None) -> Any:
        timeout = _check_timeout(timeout, "Task.wait")
        if not self.wait_done(timeout):
            raise TimeoutError(
                f"task {self.id} ({self.what}) still running after {timeout} s; it keeps "
                "running: wait again later"
            )
        return self._future.result()

    def cancel(self) -> str:
        if self._future.done():
            return self.status()
        self.cancelled = True
        for h in self.children:  # each returns once its exit is confirmed
            h.cancel()
        self._future.cancel()
        return "cancelled"

    def failure(self) -> str:
        exc = self._future.exception() if self._future.done() else None
        return f"{self.id} failed: {exc}"


class AskHandle:
    """An ask to a person (`ask_person(..., blocking=False)`): the child verbs take it.
    Its states: open, answered, cancelled (withdrawn, or its deadline passed with no
    default, or its run ended)."""

    def __init__(self, rt: Runtime, ask_id: str, question: str) -> None:
        self._rt = rt
        self.id = ask_id
        self.question = question

    def __repr__(self) -> str:
        return f"<AskHandle {self.id} {self.status()}>"

    def _update(self) -> AskUpdate:
        with self._rt.link.cond:
            return self._rt.link.asks[self.id]

    @property
    def done(self) -> bool:
        return self.status() != "open"

    def status(self) -> str:
        self._rt.check_open()
        return self._update().state

    def result(self) -> dict[str, Any]:
        """The ask's result once answered; ChildNotReady while open; AskCancelled once it
        ended without an answer."""
        self._rt.check_open()
        u = self._update()
        if u.state == "open":
            raise ChildNotReady(
                f"ask {self.id} is still open; rlm_wait(h) blocks until someone answers"
            )
        if u.state != "answered" or u.result is None:
            raise AskCancelled(f"ask {self.id} was cancelled: {u.reason}", ask=self.id)
        return dict(u.result)

    def failure(self) -> str:
        return f"{self.id} cancelled: {self._update().reason}"

    def wait_done(self, timeout: float | None) -> bool:
        self._rt.check_open()
        return self._rt.wait_for(lambda: self._rt.link.asks[self.id].state != "open", timeout)

    def wait(self, timeout: float | None = None) -> dict[str, Any]:
        timeout = _check_timeout(timeout, "AskHandle.wait")
        if not self.wait_done(timeout):
            raise TimeoutError(
                f"ask {self.id} is still open after {timeout} s; it stays open: wait again "
                "later, or rlm_cancel(h) to withdraw it"
            )
        return self.result()

    def cancel(self) -> str:
        """Withdraw the ask (its waits then raise AskCancelled); returns its state."""
        self._rt.check_open()
        if self.done:
            return self.status()
        state: str = self._rt.link.request(
            AskCancelReq(req_id=self._rt.link.next_id(), ask_id=self.id)
        )
        return state


Handle = ChildHandle | Task | AskHandle


def _check_prompt(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise InvalidArgument(f"{where}: prompt must be str, got {type(value).__name__}")
    if not value.strip():
        raise InvalidArgument(f"{where}: the prompt is empty; write what to ask")
    return value


def _check_prompts(value: object, where: str) -> list[str]:
    if isinstance(value, str) or not isinstance(value, list | tuple):
        raise InvalidArgument(
            f"{where}: prompts must be a list of str, got {type(value).__name__}; pass a "
            "list, e.g. [prompt] for one"
        )
    return [_check_prompt(p, f"{where}[{i}]") for i, p in enumerate(value)]


HANDLE_SOURCES = "rlm_spawn/rlm_query(blocking=False)/spawn"
# A helper that takes one handle, and its form for several.
_FOR_SEVERAL = {"rlm_wait": "rlm_wait_all", "rlm_await": "rlm_await_all"}


def _check_handle(value: object, where: str) -> Handle:
    if not isinstance(value, ChildHandle | Task | AskHandle):
        several = _FOR_SEVERAL.get(where)
        hint = (
            f"; for several handles use {several}(hs)"
            if several and isinstance(value, list | tuple)
            else ""
        )
        raise InvalidArgument(
            f"{where} takes a handle from {HANDLE_SOURCES}, got {type(value).__name__}{hint}"
        )
    return value


def _check_handles(value: object, where: str, name: str) -> list[Handle]:
    """The list of handles a helper such as rlm_wait_all takes (its argument `name`)."""
    if isinstance(value, ChildHandle | Task | AskHandle):
        raise InvalidArgument(
            f"{where}({name}) takes a list of handles, got one {type(value).__name__}; pass "
            f"it in a list: {where}([h]) (several: {where}([h1, h2]))"
        )
    if isinstance(value, str | bytes | dict) or not isinstance(value, Iterable):
        raise InvalidArgument(
            f"{where}({name}) takes a list of handles from {HANDLE_SOURCES}, got "
            f"{type(value).__name__}; e.g. {where}([h1, h2])"
        )
    handles = list(value)
    for i, h in enumerate(handles):
        if not isinstance(h, ChildHandle | Task | AskHandle):
            raise InvalidArgument(
                f"{where}({name}): {name}[{i}] is a {type(h).__name__}, not a handle; pass "
                f"the handles {HANDLE_SOURCES} returned"
            )
    return handles


def _check_timeout(value: object, where: str) -> float | None:
    """A wait's `timeout`: None (until the work ends) or seconds, a finite number >= 0. A
    wrong one is refused rather than read as something else (a str, or a handle meant as
    the next item of a list)."""
    if value is None:
        return None
    if (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value >= 0
    ):
        return float(value)
    fix = "e.g. timeout=30, or timeout=None to wait until it ends"
    if isinstance(value, str):
        try:
            number: float | None = float(value)
        except ValueError:
            number = None
        if number is not None and math.isfinite(number) and number >= 0:
            fix = f"pass the number itself: timeout={number:g}"
    elif isinstance(value, ChildHandle | Task | AskHandle):
        several = where if where.endswith(("_all", "_any")) else "rlm_wait_all"
        fix = f"to wait on several handles pass them as one list, e.g. {several}([h1, h2])"
    elif isinstance(value, float) and math.isinf(value) and value > 0:
        fix = "timeout=None waits without a bound"
    shown = repr(value) if isinstance(value, str | int | float) else type(value).__name__
    raise InvalidArgument(
        f"{where}: timeout must be seconds, a number >= 0 (or None: until it ends), got "
        f"{shown}; {fix}"
    )


def _ask_options(options: object) -> list[AskOption]:
    """ask_person's options: strings (each its own id and label) or {"id", "label"}."""
    if options is None:
        return []
    if isinstance(options, str) or not isinstance(options, list | tuple):
        raise InvalidArgument(
            f"ask_person(options=...) is a list of strings or {{'id', 'label'}} dicts, got "
            f"{type(options).__name__}"
        )
    out = []
    for i, o in enumerate(options):
        if isinstance(o, str) and o.strip():
            out.append(AskOption(o, o))
        elif (
            isinstance(o, dict)
            and isinstance(o.get("id"), str)
            and o["id"].strip()
            and isinstance(o.get("label", o.get("id")), str)
        ):
            out.append(AskOption(o["id"], o.get("label") or o["id"]))
        else:
            raise InvalidArgument(
                f"ask_person(options=...)[{i}] must be non-empty text or {{'id': ..., "
                f"'label': ...}}, got {o!r}"
            )
    ids = [o.id for o in out]
    if len(set(ids)) != len(ids):
        raise InvalidArgument(f"ask_person(options=...): option ids must differ, got {ids}")
    return out


def _check_child(value: object, where: str) -> ChildHandle:
    if not isinstance(value, ChildHandle):
        raise InvalidArgument(
            f"{where} takes a child's handle from rlm_spawn/rlm_query(blocking=False), "
            f"got {type(value).__name__}"
        )
    return value


def _check_products(products: object) -> dict[str, Any] | None:
    """FINAL's products: None, or a JSON object (str keys, finite JSON values)."""
    if products is None:
        return None
    if not isinstance(products, dict) or not all(isinstance(k, str) for k in products):
        raise InvalidArgument(
            f"FINAL(answer, products=...): products must be a JSON object (a dict with str "
            f"keys), got {type(products).__name__}"
        )
    try:
        text = json.dumps(products, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(
            f"FINAL(answer, products=...): products must be JSON ({exc}); use str, numbers, "
            "bools, None, lists and dicts"
        ) from None
    result: dict[str, Any] = json.loads(text)  # a copy: later changes in the REPL do not count
    return result


def make_helpers(rt: Runtime) -> dict[str, Callable[..., Any]]:
    """The functions placed in the REPL namespace, bound to one run."""

    def llm_query(prompt: str, model: str | None = None) -> str:
        """One plain model call: the model's reply to `prompt`."""
        rt.fits(_check_prompt(prompt, "llm_query"), "llm_query")
        return rt.call_model([{"role": "user", "content": prompt}], "llm_query", model)

    def llm_query_batched(prompts: list[str], model: str | None = None) -> list[str]:
        """Concurrent plain model calls; replies in the order of `prompts`, same length. If
        some fail, raises ModelError once all have ended, with .failed (their indices) and
        .answers (every reply, None where one failed): no reply is lost."""
        prompts = _check_prompts(prompts, "llm_query_batched")
        for i, p in enumerate(prompts):
            rt.fits(p, f"llm_query_batched[{i}]")

        def one(p: str) -> tuple[str | None, BaseException | None]:
            try:
                return llm_query(p, model), None
            except Exception as exc:  # every call ends before the batch says how it went
                return None, exc

        with rt.clock.paused():
            results = list(rt.pool().map(one, prompts))
        failed = [i for i, (_, exc) in enumerate(results) if exc is not None]
        if not failed:
            return [reply for reply, _ in results]  # type: ignore[misc]
        if isinstance(results[failed[0]][1], ReplayStop | StaleHandle):
            raise results[failed[0]][1]  # type: ignore[misc]
        reasons = "; ".join(f"#{i} {results[i][1]}" for i in failed[:5])
        err = ModelError(
            f"{len(failed)} of {len(prompts)} calls failed: {reasons}; e.answers holds every "
            "reply (None where failed), e.failed the indices"
        )
        err.failed = failed  # type: ignore[attr-defined]
        err.answers = [reply for reply, _ in results]  # type: ignore[attr-defined]
        raise err

    def rlm_query(
        prompt: str,
        *,
        blocking: bool = True,
        context: Any = None,
        model: str | None = None,
        timeout: float | None = None,
        pool: str | None = None,
        retries: int = 0,
        placement: str = "local",
    ) -> Any:
        """Start a child run (a whole RLM with its own REPL) on `prompt`.

        blocking=True waits and returns its answer (raises ChildFailed if it fails);
        blocking=False returns a ChildHandle at once. `context` becomes the child's
        `context` variable; `timeout` bounds its wall-clock seconds; `pool` names a
        capacity pool the child holds a place in from its start to its end; `retries`
        starts a child that failed or timed out again (same handle), up to that many times.
        placement="spread" runs the child's subtree on another node of a cluster (here
        when there is none); it stays a child for every helper.
        """
        rt.fits(_check_prompt(prompt, "rlm_query"), "rlm_query")
        if not rt.can_spawn:
            rt.note_depth()
            if blocking:
                return llm_query(prompt, model)
            return spawn(llm_query, prompt, model)
        (h,) = rt.spawn_children(
            [prompt],
            context=context,
            model=model,
            timeout=timeout,
            pool=pool,
            retries=retries,
            placement=placement,
        )
        return h.wait() if blocking else h

    def rlm_query_batched(prompts: list[str], **kw: Any) -> list[str]:
        """Concurrent blocking children; answers in order. If any fails, raises ChildFailed
        once all have settled, naming the failed indices, with e.answers (None where failed)."""
        prompts = _check_prompts(prompts, "rlm_query_batched")
        if not rt.can_spawn:
            rt.note_depth()
            return llm_query_batched(prompts, kw.get("model"))
        return rt.collect(rt.spawn_children(prompts, **kw), None)

    def rlm_spawn(prompt: str, **kw: Any) -> Any:
        """Start a child run without waiting: same as rlm_query(prompt, blocking=False)."""
        return rlm_query(prompt, blocking=False, **kw)

    def rlm_status(h: Handle) -> str:
        """The child's state: queued, running, cancelling, completed, failed, cancelled or
        timed_out (an ask's: open, answered or cancelled). Never blocks."""
        return _check_handle(h, "rlm_status").status()

    def rlm_result(h: Handle) -> Any:
        """The child's answer if completed; raises ChildNotReady if it is still going,
        ChildFailed (with the reason) if it ended otherwise."""
        return _check_handle(h, "rlm_result").result()

    def ask_person(
        question: str,
        *,
        options: list[Any] | None = None,
        deadline: float | None = None,
        default: str | None = None,
        blocking: bool = True,
    ) -> Any:
        """Ask a person. `options`: strings or {"id", "label"}; `deadline`: seconds from
        now; `default`: an option id or text, applied when the deadline passes. Blocking,
        returns {"answer": {"type": "choice"|"text", "id", "label", "text"}, "summary",
        "resolved_by"} (raises AskCancelled if it ends unanswered); else an AskHandle that
        rlm_status / rlm_result / rlm_wait* / rlm_cancel (withdraw) take."""
        h = rt.open_ask(question, options, deadline, default)
        return h.wait() if blocking else h

    def ask_user_question(questions: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """pi-rlm's form: several questions ({"question", "options"?, "deadline"?,
        "default"?}) asked at once; blocks until all are answered; results in order."""
        if not isinstance(questions, list | tuple) or not all(
            isinstance(q, dict) for q in questions
        ):
            raise InvalidArgument("ask_user_question(questions) takes a list of dicts")
        handles = []
        for i, q in enumerate(questions):
            unknown = set(q) - {"question", "options", "deadline", "default"}
            if unknown:
                raise InvalidArgument(
                    f"ask_user_question: questions[{i}] has unknown keys {sorted(unknown)}; "
                    "use question, options, deadline, default"
                )
            handles.append(
                rt.open_ask(
                    q.get("question"), q.get("options"), q.get("deadline"), q.get("default")
                )
            )
        return rt.collect(handles, None)

    def rlm_products(h: Handle) -> dict[str, Any] | None:
        """The products (a JSON object) the child gave with FINAL(answer, products=...), or
        None if it gave none; raises like rlm_result if it did not complete."""
        return _check_child(h, "rlm_products").products()

    def rlm_wait(h: Handle, timeout: float | None = None) -> Any:
        """Block until the child ends and return its answer (raises ChildFailed). On timeout
        raises TimeoutError and the child keeps running."""
        handle = _check_handle(h, "rlm_wait")
        return handle.wait(_check_timeout(timeout, "rlm_wait"))

    def rlm_wait_all(hs: list[Handle], timeout: float | None = None) -> list[Any]:
        """rlm_wait over several handles: answers in order; ChildFailed names failed indices
        (e.answers has None there). On timeout TimeoutError; the children keep running."""
        handles = _check_handles(hs, "rlm_wait_all", "hs")
        return rt.collect(handles, _check_timeout(timeout, "rlm_wait_all"))

    def rlm_wait_any(hs: list[Handle], timeout: float | None = None) -> Handle:
        """Block until one of the handles has ended and return that handle. On timeout
        TimeoutError; the children keep running."""
        handles = _check_handles(hs, "rlm_wait_any", "hs")
        timeout = _check_timeout(timeout, "rlm_wait_any")
        if not handles:
            raise InvalidArgument("rlm_wait_any needs at least one handle")
        if not rt.wait_handles(handles, any, timeout):
            raise TimeoutError(
                f"none of {len(handles)} handles ended within {timeout} s; they keep running"
            )
        return next(h for h in handles if h.done)

    def rlm_cancel(h: Handle) -> str:
        """Cancel the child and its whole subtree; returns once their exit is confirmed,
        with the final status. For an ask: withdraw it."""
        return _check_handle(h, "rlm_cancel").cancel()

    def rlm_send(h: Handle, message: str) -> None:
        """Send a follow-up instruction; the child sees it before its next model turn."""
        handle = _check_handle(h, "rlm_send")
        if not isinstance(handle, ChildHandle):
            raise InvalidArgument("rlm_send needs a child-run handle, not a task")
        handle.send(message)

    def rlm_children() -> list[ChildHandle]:
        """This run's child handles, newest last."""
        with rt.link.cond:
            ids = list(rt.link.children)
        return [rt.handles[i] for i in ids if i in rt.handles]

    def spawn(fn: Callable[..., Any], *args: Any, **kw: Any) -> Handle:
        """Start a query helper (llm_query, llm_query_batched, rlm_query, rlm_query_batched,
        llm_query_chunked, map_files, llm_map_reduce) without waiting; returns a Task, or a
        ChildHandle for rlm_query. Collect it later with rlm_await."""
        if fn is rlm_query or fn is rlm_spawn:
            kw["blocking"] = False
            return rlm_query(*args, **kw)
        if fn is rlm_query_batched and rt.can_spawn:
            prompts = _check_prompts(
                args[0] if args else kw.pop("prompts", None), "spawn(rlm_query_batched)"
            )
            handles = rt.spawn_children(prompts, **kw)
            fut = rt.pool().submit(_as_spawned, rt.collect, handles, None)
            return Task(rt, fut, "rlm_query_batched", handles)
        delegates = [toolkit[n] for n in ("llm_query_chunked", "map_files", "llm_map_reduce")]
        if fn in (llm_query, llm_query_batched, rlm_query_batched, *delegates):
            return Task(rt, rt.pool().submit(_as_spawned, fn, *args, **kw), fn.__name__)
        raise InvalidArgument(
            "spawn(fn, ...) starts one of llm_query, llm_query_batched, rlm_query, "
            "rlm_query_batched, llm_query_chunked, map_files, llm_map_reduce; got "
            f"{getattr(fn, '__name__', fn)!r}"
        )

    def rlm_await(task: Handle, timeout: float | None = None) -> Any:
        """Collect a Task or ChildHandle, possibly in a later step. On timeout TimeoutError;
        the work keeps running."""
        handle = _check_handle(task, "rlm_await")
        return handle.wait(_check_timeout(timeout, "rlm_await"))

    def rlm_await_all(tasks: list[Handle], timeout: float | None = None) -> list[Any]:
        """rlm_await over several tasks or handles; results in order."""
        handles = _check_handles(tasks, "rlm_await_all", "tasks")
        return rt.collect(handles, _check_timeout(timeout, "rlm_await_all"))

    def FINAL(answer: Any, products: dict[str, Any] | None = None) -> None:
        """End the run with `answer` (converted to str). Nothing after it runs. `products`,
        a JSON object, goes beside the answer: the parent reads it with rlm_products(h)."""
        if answer is None:
            raise InvalidArgument("FINAL(answer): answer is None; pass the answer text")
        rt.products = _check_products(products)
        rt.final = answer if isinstance(answer, str) else str(answer)
        raise FinalSignal

    def FINAL_VAR(name: str) -> None:
        """End the run with the value of the REPL variable called `name`."""
        if not isinstance(name, str):
            raise InvalidArgument(
                "FINAL_VAR(name): pass the variable's name as a str, e.g. FINAL_VAR('answer')"
            )
        if name not in rt.namespace:
            raise NameError(f"FINAL_VAR: no variable {name!r}; variables: {sorted(SHOW_VARS())}")
        FINAL(rt.namespace[name])

    def _flow(op: str, **fields: Any) -> Any:
        rt.check_open()
        with rt.blocked() if op in ("stop", "wait") else contextlib.nullcontext():
            return rt.link.request(
                FlowReq(
                    req_id=rt.link.next_id(),
                    op=op,  # type: ignore[arg-type]
                    replaying=rt.replaying,
                    **fields,
                )
            )

    def flow_run(spec: Any, inputs: dict[str, Any] | None = None) -> str:
        """Start a flow (a state-machine workflow of sub-agents) from a spec: a dict, or
        YAML/JSON text, or a path to a spec file (read here, as your code reads any file).
        Its states' runs are children of this run for every limit. Returns its id at once;
        its milestones (finished, failed, paused, ...) are announced in your next turns.
        A spec with problems raises InvalidSpec listing every one."""
        if not isinstance(spec, dict | str):
            raise InvalidArgument("flow_run(spec): pass a dict, YAML/JSON text or a file path")
        if inputs is not None and not isinstance(inputs, dict):
            raise InvalidArgument(
                f"flow_run(spec, inputs): inputs must be a dict {{name: value}}, "
                f"got {type(inputs).__name__}"
            )
        if not rt.can_spawn:  # the supervisor refuses it too; this saves the trip
            raise LimitExceeded(
                "max_depth",
                rt.depth + 2,
                rt.max_depth,
                hint=f"this run is at depth {rt.depth} of max_depth={rt.max_depth}; a flow's "
                "states are this run's children, and it may start none",
            )
        if isinstance(spec, dict):
            text = _json("spec", spec)
        elif looks_like_path(spec):
            text = _read_spec_file(spec)
        else:
            text = spec
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > MAX_SPEC_BYTES:
            raise InvalidSpec(over_bound("(text)", size))
        result: dict[str, Any] = _flow("run", spec=text, inputs=_json("inputs", inputs or {}))
        flow_id = str(result["id"])
        # Its run is a child of this one, but no handle collects it: its milestones are
        # announced instead, never "collect it with rlm_result".
        rt.seen.add(flow_id)
        return flow_id

    def _json(what: str, value: Any) -> str:
        try:
            return json.dumps(value, allow_nan=False)
        except (TypeError, ValueError, RecursionError) as exc:
            raise InvalidArgument(
                f"flow_run: {what} must hold only JSON values (dict, list, str, finite "
                f"numbers, bool, None), nested less deeply than Python recurses: {exc}"
            ) from None

    def flow_status(flow_id: str) -> dict[str, Any]:
        """A flow's status: per-state entries and instances, milestones, recent events."""
        status: dict[str, Any] = _flow("status", ref=flow_id)
        return status

    def flow_wait(flow_id: str, timeout: float | None = None) -> str:
        """Block until the flow ends or pauses and return its status (finished, failed,
        stopped, paused). On timeout raises TimeoutError and the flow keeps going."""
        return str(_flow("wait", ref=flow_id, timeout=_check_timeout(timeout, "flow_wait")))

    def flow_stop(flow_id: str) -> str:
        """Stop a flow: it admits nothing more and its running children are cancelled."""
        return str(_flow("stop", ref=flow_id))

    def flow_resume(flow_id: str) -> str:
        """Let a paused flow go on."""
        return str(_flow("resume", ref=flow_id))

    def remember(fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """Call fn(*args, **kw) once and journal its result; when a crashed tree is resumed
        and this step replays, the journaled result comes back instead of a new call. Use it
        for the clock, randomness, files and the network, e.g. now = remember(time.time)."""
        if not callable(fn):
            raise InvalidArgument(f"remember(fn, ...) needs a callable, got {type(fn).__name__}")
        replay = rt.replay
        if replay is not None and replay.remembered:
            return cloudpickle.loads(replay.remembered.pop(0))
        value = fn(*args, **kw)
        try:
            blob = cloudpickle.dumps(value)
        except Exception as exc:
            raise InvalidArgument(
                f"remember: the result ({type(value).__name__}) cannot be pickled to be "
                f"journaled: {exc}"
            ) from exc
        if len(blob) > MAX_REMEMBER_BYTES:
            raise InvalidArgument(
                f"remember: the result is {len(blob):,} bytes pickled, over the "
                f"{MAX_REMEMBER_BYTES:,} bytes one remembered value may hold; remember less "
                "(e.g. a file's hash or path rather than its bytes)"
            )
        rt.link.send(Remember(blob))
        return value

    def budget_remaining() -> dict[str, Any]:
        """This run's place in the tree and what is left now: depth, max_depth,
        children_left (whole tree), children_left_for_this_run, tokens_left / cost_left
        (None: no budget), tokens_used (the tree's)."""
        rt.check_open()
        budget: dict[str, Any] = rt.link.request(BudgetReq(req_id=rt.link.next_id()))
        return budget

    def SHOW_VARS() -> dict[str, str]:
        """The user variables of the REPL, as {name: type}."""
        reserved = HELPER_NAMES | ERRORS.keys() | {"context"}
        return {
            k: type(v).__name__
            for k, v in rt.namespace.items()
            if k not in reserved and not k.startswith("_")
        }

    toolkit = make_toolkit(
        rt.limits if rt is not None else {},
        lambda: rt.namespace,
        llm_query,
        llm_query_batched,
    )
    helpers: dict[str, Callable[..., Any]] = {"llm_query": llm_query}
    helpers["llm_query_batched"] = llm_query_batched
    helpers |= toolkit
    helpers |= {
        f.__name__: f
        for f in (
            rlm_query,
            rlm_query_batched,
            rlm_spawn,
            rlm_status,
            rlm_result,
            rlm_products,
            ask_person,
            ask_user_question,
            rlm_wait,
            rlm_wait_all,
            rlm_wait_any,
            rlm_cancel,
            rlm_send,
            rlm_children,
            spawn,
            rlm_await,
            rlm_await_all,
            flow_run,
            flow_status,
            flow_wait,
            flow_stop,
            flow_resume,
            remember,
            budget_remaining,
            FINAL,
            FINAL_VAR,
            SHOW_VARS,
        )
    }
    return helpers


_NOT_A_FILE = (
    "not a regular file (a spec is read from a .yaml, .yml or .json file; a FIFO, a device "
    "or a directory is not read)"
)


def _read_spec_file(name: str) -> str:
    """The text of the spec file `name` (relative to this worker's cwd, its scratch), read
    by this worker under its own confinement: a file the run may not read raises the
    OSError naming it. Only a regular file is read (a FIFO would block, a device would not
    end), and only up to MAX_SPEC_BYTES."""
    try:
        if not stat.S_ISREG(os.stat(name).st_mode):
            raise InvalidSpec(f"flow_run({name!r}): {_NOT_A_FILE}")
        # O_NONBLOCK: if a FIFO took the file's place since the stat, opening it does not
        # wait for a writer (and fstat tells).
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise FileNotFoundError(
            errno.ENOENT,
            "no such spec file (a relative path is read from the run's scratch "
            "directory, its working directory)",
            name,
        ) from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InvalidSpec(f"flow_run({name!r}): {_NOT_A_FILE}")
        data = read_bounded(f, repr(name))
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidSpec(
            f"flow_run({name!r}): not UTF-8 text (byte {exc.start}); a spec is a YAML or JSON file"
        ) from None


def _notify(link: Link) -> None:
    with link.cond:
        link.cond.notify_all()


# Errors the model's code may want to catch, placed in the namespace by name: every one the
# system prompt or a helper's docstring names (tests/test_prompt.py walks them), so an
# `except ModelError:` never fails with NameError exactly when a call fails.
ERRORS: dict[str, type[BaseException]] = {
    e.__name__: e
    for e in (
        AskCancelled,
        BroodError,
        ChildFailed,
        ChildNotReady,
        InvalidArgument,
        InvalidSpec,
        LimitExceeded,
        ModelError,
        RateLimited,
        StaleHandle,
        StallTimeout,
    )
}

# The helpers' names, as the model sees them (make_helpers only defines functions).
HELPER_NAMES = frozenset(make_helpers(None))  # type: ignore[arg-type]

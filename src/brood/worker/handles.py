"""The handles the REPL helpers return (`ChildHandle`, `Task`, `AskHandle`), the checks of
the handles and timeouts the helpers take, and the waits on several handles at once.

Their docstrings are documentation the model reads (tests/test_prompt.py walks them).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import Any

from brood.errors import AskCancelled, ChildFailed, ChildNotReady, InvalidArgument
from brood.lifecycle import TERMINAL_VALUES, AskState
from brood.protocol import AskCancelReq, AskUpdate, CancelReq, SendReq
from brood.worker.link import Link
from brood.worker.runtime import Runtime


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
        timeout = check_timeout(timeout, "ChildHandle.wait")
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
        cap = self._rt.limits.max_prompt_chars
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
        future.add_done_callback(lambda _f: notify(rt.link))  # wakes a wait on the task
        self.id = rt.next_task_id()
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
        self._future.add_done_callback(lambda _f: notify(self._rt.link))
        return self._rt.wait_for(self._future.done, timeout, f"task {self.id} ({self.what})")

    def wait(self, timeout: float | None = None) -> Any:
        timeout = check_timeout(timeout, "Task.wait")
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
        return self.status() != AskState.OPEN

    def status(self) -> str:
        """Its state, as plain text (what model code prints is the word, not an enum)."""
        self._rt.check_open()
        return self._update().state.value

    def result(self) -> dict[str, Any]:
        """The ask's result once answered; ChildNotReady while open; AskCancelled once it
        ended without an answer."""
        self._rt.check_open()
        u = self._update()
        if u.state is AskState.OPEN:
            raise ChildNotReady(
                f"ask {self.id} is still open; rlm_wait(h) blocks until someone answers"
            )
        if u.state is not AskState.ANSWERED or u.result is None:
            raise AskCancelled(f"ask {self.id} was cancelled: {u.reason}", ask=self.id)
        return dict(u.result)

    def failure(self) -> str:
        return f"{self.id} cancelled: {self._update().reason}"

    def wait_done(self, timeout: float | None) -> bool:
        self._rt.check_open()
        return self._rt.wait_for(
            lambda: self._rt.link.asks[self.id].state is not AskState.OPEN, timeout
        )

    def wait(self, timeout: float | None = None) -> dict[str, Any]:
        timeout = check_timeout(timeout, "AskHandle.wait")
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


def start_task(
    rt: Runtime,
    what: str,
    fn: Callable[..., Any],
    /,
    *args: Any,
    prompts: Sequence[str] = (),
    **kw: Any,
) -> Task:
    """Run fn(*args, **kw) on the run's call threads as spawned work; its Task at once.
    `prompts`: the plain calls it makes, counted as under way from now (`Runtime.reserve`)."""
    held = rt.reserve(prompts)
    try:
        fut = rt.pool().submit(rt.reserved_job, held, fn, *args, **kw)
    except BaseException:
        rt.release(held)
        raise
    return Task(rt, fut, what)


HANDLE_SOURCES = "rlm_spawn/rlm_query(blocking=False)/spawn"
# A helper that takes one handle, and its form for several.
_FOR_SEVERAL = {"rlm_wait": "rlm_wait_all", "rlm_await": "rlm_await_all"}


def check_handle(value: object, where: str) -> Handle:
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


def check_handles(value: object, where: str, name: str) -> list[Handle]:
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


def check_timeout(value: object, where: str) -> float | None:
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


def check_child(value: object, where: str) -> ChildHandle:
    if not isinstance(value, ChildHandle):
        raise InvalidArgument(
            f"{where} takes a child's handle from rlm_spawn/rlm_query(blocking=False), "
            f"got {type(value).__name__}"
        )
    return value


def wait_handles(
    rt: Runtime, handles: Sequence[Handle], quantifier: Callable[[Any], bool], timeout: float | None
) -> bool:
    """Wait (one release of the compute slot) until `quantifier` (all / any) of the
    handles have ended; False on timeout."""

    def ended(h: Handle) -> bool:
        if isinstance(h, Task):
            return h.done
        if isinstance(h, AskHandle):
            return rt.link.asks[h.id].state is not AskState.OPEN
        return rt.link.children[h.id].state in TERMINAL_VALUES

    below = [h.id for h in handles if not isinstance(h, AskHandle)]
    what = (", ".join(below[:3]) + (", ..." if len(below) > 3 else "")) if below else None
    return rt.wait_for(lambda: quantifier(ended(h) for h in handles), timeout, what)


def collect(rt: Runtime, handles: Sequence[Handle], timeout: float | None) -> list[Any]:
    """Wait for every handle, in one wait (one release of the compute slot); results in
    order, or ChildFailed naming the failed indices once all have settled."""
    rt.check_open()
    if not wait_handles(rt, handles, all, timeout):
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


def notify(link: Link) -> None:
    """Wake every wait on the link (a task ended: no frame will)."""
    with link.cond:
        link.cond.notify_all()

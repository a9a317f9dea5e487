"""The worker's end of its connection to the supervisor.

A reader thread takes every incoming frame: replies resolve pending requests, child updates
go to a table that waits are built on, follow-up messages to an inbox, and `Stop` ends the
process at once (the cooperative step of the cleanup escalation).
"""

from __future__ import annotations

import _thread
import itertools
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import AbstractContextManager
from typing import Any

from brood.errors import StallTimeout
from brood.protocol import (
    AskUpdate,
    ChildUpdate,
    Deliver,
    Exec,
    Msg,
    Notice,
    Progress,
    Reply,
    Start,
    Stop,
    SyncChannel,
    Turn,
    check,
    rebuild_error,
)


class _Answer:
    """The reply a request waits for: what the link needs of a concurrent.futures.Future
    (set_result, set_exception, result with a timeout) on one bare lock, held until the
    reply comes. A Future builds a threading.Condition, in Python, for every request."""

    __slots__ = ("_error", "_key", "_notify", "_ready", "_value")

    def __init__(self, notify: queue.SimpleQueue[Any] | None = None, key: Any = None) -> None:
        self._ready = _thread.allocate_lock()
        self._ready.acquire()
        self._value: Any = None
        self._error: BaseException | None = None
        self._notify, self._key = notify, key  # told `key` once answered (`Link.start`)

    def set_result(self, value: Any) -> None:
        self._value = value
        self._answered()

    def set_exception(self, error: BaseException) -> None:
        self._error = error
        self._answered()

    def _answered(self) -> None:
        self._ready.release()
        if self._notify is not None:
            self._notify.put(self._key)

    def result(self, timeout: float | None = None) -> Any:
        if not self._ready.acquire(timeout=-1 if timeout is None else timeout):
            raise FutureTimeout
        self._ready.release()  # answered for good: a later call returns at once
        if self._error is not None:
            raise self._error
        return self._value


def stalled(what: str, stall: float) -> StallTimeout:
    return StallTimeout(
        f"{what} made no progress for {stall:g} s (Limits.stall_timeout): no reply, state "
        "change or heartbeat came from below. It keeps running: wait for it again (rlm_wait "
        "/ rlm_await), cancel it, or do something else meanwhile",
        waited_on=what,
    )


class Link:
    def __init__(self, chan: SyncChannel) -> None:
        self.chan = chan
        self._ids = itertools.count(1)
        self._pending: dict[int, _Answer] = {}
        self._whole: set[int] = set()  # requests answered with their whole Reply
        self._pending_lock = threading.Lock()
        self.cond = threading.Condition()
        self.children: dict[str, ChildUpdate] = {}  # guarded by cond; insertion = start order
        self.asks: dict[str, AskUpdate] = {}  # guarded by cond; the run's asks to people
        self.heard = time.monotonic()  # when the supervisor last said anything (progress)
        self.inbox: list[str] = []  # guarded by cond
        # SimpleQueues: put and a blocking get is all these need, and a queue.Queue builds a
        # lock and three Conditions, in Python, in every worker.
        self.execs: queue.SimpleQueue[Exec] = queue.SimpleQueue()
        self.starts: queue.SimpleQueue[Start] = queue.SimpleQueue()
        self.turns: queue.SimpleQueue[Turn] = queue.SimpleQueue()  # a conversation's next turns

    def start_reader(self) -> None:
        # A bare thread, not threading.Thread: the worker never joins or names it, and
        # threading's bookkeeping (Event, Condition, registries) touches about 40 pages,
        # each a copy-on-write fault in a freshly forked worker.
        _thread.start_new_thread(self._read_loop, ())

    def send(self, msg: Msg) -> None:
        self.chan.send(msg)

    def next_id(self) -> int:
        return next(self._ids)

    def request(self, msg: Msg, *, stall: float | None = None, what: str = "") -> Any:
        """Send a request (a message with `req_id`) and block until its reply's value. A
        request the supervisor could not decode is refused here, naming the field. With
        `stall`, a wait that hears nothing from the supervisor for that long raises
        StallTimeout (the request stays under way; its reply, if it comes, is dropped)."""
        return self._request(msg, stall, what, whole=False)

    def start(self, msg: Msg, *, notify: queue.SimpleQueue[Any], key: Any) -> _Answer:
        """Send a request without waiting for its reply: its answer, which puts `key` on
        `notify` once it comes (many requests in flight from one thread). A request the
        supervisor could not decode is refused here, naming the field."""
        return self._send_request(msg, _Answer(notify, key), whole=False)

    def _send_request(self, msg: Msg, fut: _Answer, *, whole: bool) -> _Answer:
        """Refuse `msg` if the supervisor could not decode it; else wait for its reply in
        `fut` (the whole Reply with `whole`) and send it."""
        check(msg)
        with self._pending_lock:
            self._pending[msg.req_id] = fut  # type: ignore[attr-defined]
            if whole:
                self._whole.add(msg.req_id)  # type: ignore[attr-defined]
        self.chan.send(msg)
        return fut

    def forget(self, req_id: int) -> None:
        """Stop waiting for request `req_id`: its reply, if it ever comes, is dropped."""
        with self._pending_lock:
            self._pending.pop(req_id, None)
            self._whole.discard(req_id)

    def request_reply(
        self,
        msg: Msg,
        *,
        stall: float | None = None,
        what: str = "",
        slow: tuple[float, Callable[[], AbstractContextManager[None]]] | None = None,
    ) -> Reply:
        """`request`, giving the whole Reply (a model turn's carries its prompt tokens).
        With `slow` = (seconds, wait), a reply that has not come after that long is waited
        for inside `wait()` (the run says it waits: it may hibernate)."""
        reply: Reply = self._request(msg, stall, what, whole=True, slow=slow)
        return reply

    def _request(
        self,
        msg: Msg,
        stall: float | None,
        what: str,
        *,
        whole: bool,
        slow: tuple[float, Callable[[], AbstractContextManager[None]]] | None = None,
    ) -> Any:
        fut = self._send_request(msg, _Answer(), whole=whole)
        began = time.monotonic()
        if slow is not None:
            patience, waiting = slow
            try:
                return fut.result(timeout=patience if stall is None else min(patience, stall))
            except FutureTimeout:
                with waiting():
                    return self._await(fut, msg, stall, what, began)
        return self._await(fut, msg, stall, what, began)

    def _await(self, fut: _Answer, msg: Msg, stall: float | None, what: str, began: float) -> Any:
        if stall is None:
            return fut.result()
        while True:
            quiet = time.monotonic() - max(self.heard, began)
            try:
                return fut.result(timeout=max(stall - quiet, 0.0))
            except FutureTimeout:
                if time.monotonic() - max(self.heard, began) >= stall:
                    self.forget(msg.req_id)  # type: ignore[attr-defined]
                    raise stalled(what, stall) from None

    def _read_loop(self) -> None:
        try:
            while True:
                msg = self.chan.recv()
                if msg is None or isinstance(msg, Stop):
                    break
                self._dispatch(msg)
        except Exception:
            pass
        # The supervisor asked us to stop, or it is gone: either way this run is over, and a
        # worker never serves a second run. Exit without running the model's cleanup code.
        os._exit(0)

    def _dispatch(self, msg: Msg) -> None:
        self.heard = time.monotonic()
        if isinstance(msg, Progress):
            with self.cond:
                self.cond.notify_all()  # a waiter looks at `heard` again
        elif isinstance(msg, Reply):
            with self._pending_lock:
                fut = self._pending.pop(msg.req_id, None)
                whole = msg.req_id in self._whole
                self._whole.discard(msg.req_id)
            if fut is None:
                return
            if msg.error is not None:
                fut.set_exception(rebuild_error(msg.error))
            else:
                fut.set_result(msg if whole else msg.value)
        elif isinstance(msg, ChildUpdate):
            with self.cond:
                self.children[msg.child_id] = msg
                self.cond.notify_all()
        elif isinstance(msg, AskUpdate):
            with self.cond:
                self.asks[msg.ask_id] = msg
                self.cond.notify_all()
        elif isinstance(msg, Deliver | Notice):
            line = (
                f"[message from your parent] {msg.message}"
                if isinstance(msg, Deliver)
                else f"[notice] {msg.text}"
            )
            with self.cond:
                self.inbox.append(line)
                self.cond.notify_all()
            if isinstance(msg, Deliver) and msg.req_id:
                # The sender's rlm_send returns only now: the message is sure to be in the
                # next model turn, whatever the main thread does meanwhile.
                self.send(Reply(msg.req_id))
        elif isinstance(msg, Exec):
            self.execs.put(msg)
        elif isinstance(msg, Start):
            self.starts.put(msg)
        elif isinstance(msg, Turn):
            self.turns.put(msg)

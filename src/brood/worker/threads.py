"""The threads a worker runs spawned work on (`spawn`).

Bare threads (`_thread`), not `threading.Thread`s in a ThreadPoolExecutor: a worker is a
fresh fork, and threading's bookkeeping costs page faults in it (three times the CPU of a
bare start, measured for 16 threads). Each job runs in a copy of its submitter's context,
so work that spawned work starts is spawned work too (`runtime.SPAWNED`).

A thread starts when work finds none idle, up to the pool's size. In a pids cgroup
(`confine.pids_capped`) these threads count among model code's `Limits.worker_processes`:
they run the work it asked for, so a start may be refused when its own processes hold every
place, and the `spawn` that needed it says so.
"""

from __future__ import annotations

import _thread
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from contextvars import copy_context
from typing import Any

Job = tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class CallThreads(Executor):
    def __init__(self, size: int) -> None:
        self._jobs: queue.SimpleQueue[Job] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._size = size
        self._started = 0
        self._load = 0  # jobs submitted and not yet done
        self._idents: set[int] = set()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kw: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        with self._lock:
            if self._load >= self._started and self._started < self._size:
                try:
                    self._start()
                except RuntimeError as exc:
                    if not self._started:  # no thread to run it: the caller learns why
                        raise RuntimeError(
                            f"spawned work found no thread to run on ({exc}): its threads "
                            "count among Limits.worker_processes, which the run's own "
                            "processes and threads hold; end some, or raise the limit"
                        ) from exc
            self._load += 1
        context = copy_context()
        self._jobs.put((fut, context.run, (fn, *args), kw))
        return fut

    @property
    def load(self) -> int:
        """Jobs submitted and not yet done."""
        return self._load

    @property
    def idents(self) -> set[int]:
        """The idents of the threads serving jobs (bare threads: `threading` lists them
        only once they have asked for their own Thread object)."""
        with self._lock:
            return set(self._idents)

    def _start(self) -> None:
        _thread.start_new_thread(self._serve, ())  # RuntimeError when none can start
        self._started += 1

    def _serve(self) -> None:
        with self._lock:
            self._idents.add(_thread.get_ident())
        while True:
            fut, fn, args, kw = self._jobs.get()
            try:
                if fut.set_running_or_notify_cancel():
                    fut.set_result(fn(*args, **kw))
            except BaseException as exc:  # the caller sees it, as with ThreadPoolExecutor
                fut.set_exception(exc)
            finally:
                with self._lock:
                    self._load -= 1

"""Observer callbacks, run on their own thread so that none can delay or stop cleanup."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("brood")
DRAIN_TIMEOUT_S = 2.0  # close() waits this long for queued callbacks; a stuck one is left


class Observers:
    def __init__(
        self, on_start: Callable[[Any], Any] | None, on_end: Callable[[Any], Any] | None
    ) -> None:
        self.callbacks = {"on_start": on_start, "on_end": on_end}
        self._queue: queue.Queue[tuple[Callable[[Any], Any], Any] | None] = queue.Queue()
        self._thread: threading.Thread | None = None

    def emit(self, name: str, info: Callable[[], Any]) -> None:
        """Hand `info()` (made now, on the loop) to the user's `name` callback, if any; a
        supervisor with no callback makes none."""
        cb = self.callbacks.get(name)
        if cb is None:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="brood-observers", daemon=True)
            self._thread.start()
        self._queue.put((cb, info()))

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            cb, info = item
            try:
                cb(info)
            except Exception:
                log.exception("observer %s raised; brood goes on", getattr(cb, "__name__", cb))
            finally:
                self._queue.task_done()

    def drain(self, timeout: float = DRAIN_TIMEOUT_S) -> None:
        """Wait (bounded) for the callbacks queued so far, then stop the thread."""
        if self._thread is None:
            return
        self._queue.put(None)
        self._thread.join(timeout)

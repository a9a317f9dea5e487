"""Ctrl-C (SIGINT) while a command's tree runs.

Python turns SIGINT into KeyboardInterrupt wherever the main thread happens to be: half-way
through a journal write, a worker's cleanup, the supervisor's own start. A command that owns
a tree takes the signal itself instead: it only notes it, and the command ends the tree in
order (its cancel journaled, every worker's exit confirmed), says so and exits 130. A second
Ctrl-C while that cleanup is under way is told to wait: the cleanup is bounded (the cleanup
escalation's graces), and stopping it half-way is what leaves stale runs behind.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any, TypeVar

T = TypeVar("T")
EXIT_CODE = 130  # 128 + SIGINT, as shells report an interrupted command


class Interrupt:
    """Whether (and how often) Ctrl-C came."""

    def __init__(self) -> None:
        self.wake = threading.Event()  # set at Ctrl-C, or by what the command waits for
        self.count = 0
        self.cleaning = False  # set while the command ends its tree

    @property
    def hit(self) -> bool:
        return self.count > 0

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1
        self.wake.set()
        if self.cleaning:
            sys.stderr.write("brood: cancelling the tree and confirming its workers' exit\n")

    def wait(self, seconds: float | None = None) -> bool:
        """Sleep up to `seconds`, waking at Ctrl-C; True if it came."""
        self.wake.wait(seconds)
        return self.hit

    def result_of(self, wait: Callable[[], T]) -> T | None:
        """`wait()` (a blocking call) on a helper thread, the main thread free for Ctrl-C:
        its value, or None if Ctrl-C came first (the call goes on; what it waits for is
        ended by the command)."""
        box: list[Any] = []
        if not self.hit:
            self.wake.clear()

        def call() -> None:
            try:
                box.append((True, wait()))
            except BaseException as exc:  # raised again on the main thread
                box.append((False, exc))
            finally:
                self.wake.set()

        threading.Thread(target=call, name="brood-cli-wait", daemon=True).start()
        while not box and not self.wait():
            pass
        if not box:
            return None
        ok, value = box[0]
        if not ok:
            raise value
        return value


@contextmanager
def interruptible() -> Iterator[Interrupt]:
    """Take SIGINT for the block (the main thread only; elsewhere it is left as it is)."""
    interrupt = Interrupt()
    if threading.current_thread() is not threading.main_thread():
        yield interrupt
        return
    previous = signal.signal(signal.SIGINT, interrupt.on_signal)
    try:
        yield interrupt
    finally:
        signal.signal(signal.SIGINT, previous)

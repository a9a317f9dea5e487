"""The persistent REPL namespace: run code, capture output, enforce the step's compute limit."""

from __future__ import annotations

import ast
import builtins
import contextlib
import io
import signal
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from brood.protocol import STEP_CAPTURE_MIN


class StepTimeout(BaseException):
    """The step used up its compute limit (a BaseException so `except Exception` cannot hide it)."""


class ReplayStop(BaseException):
    """A resumed run's replay diverged from its journal: the run stops, the model's code
    cannot catch it."""


class FinalSignal(BaseException):
    """Raised by FINAL to end the step at once; the executor catches it."""


CAPTURE_LIMIT = STEP_CAPTURE_MIN  # characters of one step's stdout (and stderr) kept


def _blocked(name: str, why: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{name}() is blocked on purpose in the brood REPL: {why}")

    refuse.__name__ = name
    return refuse


BLOCKED_BUILTINS = {
    "input": "no person reads this REPL; put what you need in a variable or ask via your answer",
    "exit": "it would kill the worker; call FINAL(answer) to end the run",
    "quit": "it would kill the worker; call FINAL(answer) to end the run",
    "help": "it waits for a person; read a docstring with print(obj.__doc__)",
    "breakpoint": "no debugger is attached; print the values you want to see",
}


def truncate(text: str, limit: int, written: int = 0) -> str:
    """`text` cut to `limit` characters, keeping its head and tail, with a note that says so.
    `written` is how much was printed, when the capture already dropped some of it."""
    n = written or len(text)
    if len(text) <= limit:
        return text
    half = limit // 2
    if half == 0:
        return f"[output of {n:,} characters not shown: the output limit is {limit}]"
    cut = n - 2 * half
    return (
        text[:half] + f"\n[... output truncated: {n:,} characters, {cut:,} not shown; "
        "print less, or slice the value ...]\n" + text[-half:]
    )


class CappedText(io.TextIOBase):
    """A step's captured output, holding at most `cap` characters: its head and its tail,
    with a note of how much was dropped between them. Model code that prints hundreds of
    MB neither grows the worker past its memory nor sends a frame it may not send."""

    def __init__(self, cap: int) -> None:
        self._half = max(cap // 2, 1)
        self._head: list[str] = []
        self._head_len = 0
        self._tail: deque[str] = deque()
        self._tail_len = 0
        self._dropped = 0
        self.written = 0  # characters written, dropped ones included

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        n = len(text)
        self.written += n
        room = self._half - self._head_len
        if room > 0:
            self._head.append(text[:room])
            self._head_len += min(room, n)
            text = text[room:]
        if text:
            self._tail.append(text[-self._half :])
            self._dropped += max(0, len(text) - self._half)
            self._tail_len += min(len(text), self._half)
            while self._tail_len - len(self._tail[0]) >= self._half:
                first = self._tail.popleft()
                self._tail_len -= len(first)
                self._dropped += len(first)
            if self._tail_len > self._half:
                over = self._tail_len - self._half
                self._tail[0] = self._tail[0][over:]
                self._tail_len -= over
                self._dropped += over
        return n

    def getvalue(self) -> str:
        head, tail = "".join(self._head), "".join(self._tail)
        if not self._dropped:
            return head + tail
        return (
            head + f"\n[... {self._dropped:,} characters of output dropped: a step keeps at most "
            f"{2 * self._half:,}; print less ...]\n" + tail
        )


class StepClock:
    """Counts one step's own compute time; waits on children and models are not counted.

    Uses ITIMER_REAL in the main thread: when the remaining time runs out, SIGALRM raises
    StepTimeout in the code being run. `paused()` stops the clock during waits.
    """

    def __init__(self) -> None:
        self.limit: float | None = None
        self._depth = 0
        self._main = threading.main_thread()

    def _on_alarm(self, signum: int, frame: Any) -> None:
        # The alarm may land just after the step ended, before the timer was disarmed.
        if self.limit is not None:
            raise StepTimeout(f"the step used its compute limit of {self.limit:g} s")

    @contextlib.contextmanager
    def running(self, limit: float | None) -> Iterator[None]:
        self.limit = limit
        if limit is None or threading.current_thread() is not self._main:
            yield
            return
        old = signal.signal(signal.SIGALRM, self._on_alarm)
        signal.setitimer(signal.ITIMER_REAL, max(limit, 1e-6))  # 0 would disarm the timer
        try:
            yield
        finally:
            self.limit = None  # first: from here on a late alarm is ignored
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        if self.limit is None or threading.current_thread() is not self._main:
            yield
            return
        self._depth += 1
        remaining = signal.setitimer(signal.ITIMER_REAL, 0)[0] if self._depth == 1 else 0.0
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0 and self.limit is not None:
                signal.setitimer(signal.ITIMER_REAL, max(remaining, 1e-3))


@dataclass
class StepOutput:
    stdout: str
    stderr: str
    error: str | None
    duration: float
    written: int = 0  # characters printed to stdout and stderr, before any cap


GUIDED_WHY = {
    "eval": "write the expression in the repl block itself",
    "exec": "write the code in the repl block itself",
    "compile": "write the code in the repl block itself",
    "globals": "name the variables you need; SHOW_VARS() lists them",
    "locals": "name the variables you need; SHOW_VARS() lists them",
}


def _guided(name: str) -> Callable[..., Any]:
    """A builtin this run's Limits.blocked_builtins turns off (guidance for the model)."""
    why = GUIDED_WHY.get(name, "do without it")

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise PermissionError(
            f"{name}() is turned off for this run (Limits.blocked_builtins): {why}"
        )

    refuse.__name__ = name
    return refuse


def _read_only_open(real: Callable[..., Any]) -> Callable[..., Any]:
    def open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if isinstance(mode, str) and any(c in mode for c in "wax+"):
            raise PermissionError(
                f"open({file!r}, {mode!r}): this run may not write files "
                "(Limits.read_only=True); keep results in variables and FINAL them"
            )
        return real(file, mode, *args, **kwargs)

    return open


# Builtins copied ahead (`prebuild_builtins`), each taken by one Repl.
_spare_builtins: list[dict[str, Any]] = []


def _safe_builtins() -> dict[str, Any]:
    """The builtins of a REPL before its run's own blocks: every builtin, with
    BLOCKED_BUILTINS replaced by their explanations."""
    safe = dict(vars(builtins))
    for name, why in BLOCKED_BUILTINS.items():
        safe[name] = _blocked(name, why)
    return safe


def prebuild_builtins() -> None:
    """Copy the builtins once ahead for the next Repl made in this process. The zygote
    calls it before it forks: copying ~160 builtins in a fresh worker touches each of them
    (a reference count), and so dozens of pages, each a copy-on-write fault there."""
    _spare_builtins.append(_safe_builtins())


class Repl:
    """One run's namespace. `run(code)` executes a block and returns what it printed.

    `blocked` builtins raise an explanatory PermissionError, and with `read_only` so does
    `open` for writing: guidance for the model, not security (the kernel's confinement is
    the boundary)."""

    def __init__(
        self,
        helpers: dict[str, Any],
        context: Any,
        clock: StepClock | None = None,
        *,
        blocked: tuple[str, ...] = (),
        read_only: bool = False,
    ) -> None:
        safe_builtins = _spare_builtins.pop() if _spare_builtins else _safe_builtins()
        for name in blocked:
            safe_builtins[name] = _guided(name)
        if read_only:
            safe_builtins["open"] = _read_only_open(builtins.open)
        self.namespace: dict[str, Any] = {"__builtins__": safe_builtins, "__name__": "__repl__"}
        self.namespace.update(helpers)
        self.namespace["context"] = context
        self.reserved = frozenset(self.namespace)
        self.clock = clock or StepClock()

    def user_variables(self) -> dict[str, str]:
        return {
            k: type(v).__name__
            for k, v in self.namespace.items()
            if k not in self.reserved and not k.startswith("_")
        }

    def run(
        self, code: str, step_timeout: float | None, capture: int = CAPTURE_LIMIT
    ) -> StepOutput:
        out, err = CappedText(capture), CappedText(capture)
        error: str | None = None
        start = time.perf_counter()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                with self.clock.running(step_timeout):
                    self._exec(code)
            except FinalSignal:
                pass
            except ReplayStop:
                raise
            except StepTimeout as exc:
                error = f"StepTimeout: {exc}"
                err.write(error + "\n")
            except BaseException as exc:  # the model's code may raise anything
                error = f"{type(exc).__name__}: {exc}"
                err.write(_user_traceback(exc))
        return StepOutput(
            out.getvalue(),
            err.getvalue(),
            error,
            time.perf_counter() - start,
            out.written + err.written,
        )

    def _exec(self, code: str) -> None:
        tree = ast.parse(code, "<repl>", "exec")
        last = tree.body[-1] if tree.body else None
        if isinstance(last, ast.Expr):
            # Like an interactive prompt: the value of a trailing expression is shown.
            tree.body.pop()
            if tree.body:  # a block that is one expression (FINAL(...)) compiles once
                exec(compile(tree, "<repl>", "exec"), self.namespace)
            value = eval(compile(ast.Expression(last.value), "<repl>", "eval"), self.namespace)
            if value is not None:
                print(repr(value))
        else:
            exec(compile(tree, "<repl>", "exec"), self.namespace)


def _user_traceback(exc: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == "<repl>"]
    lines = ["Traceback (most recent call last):\n"] if frames else []
    lines += traceback.format_list(frames)
    lines += traceback.format_exception_only(type(exc), exc)
    return "".join(lines)

"""What every benchmark shares: result rows, the leftover check, small statistics.

A benchmark prints its figures as ratios against a floor it measured in the same run, and
never fails on an absolute time: a target that is missed is reported, not raised. It does
fail (exit status 1) when it leaves a process behind, because that is a correctness bug.
`run_all.py` passes `--json PATH`; the benchmark then also writes its rows there.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TypeVar

import psutil

import brood
from brood.testing import leftover_processes

T = TypeVar("T")

MS = 1e3
MIB = 1024 * 1024


@dataclass
class Row:
    """One figure: `value` (in `unit`) against `floor`, with the target it is held to."""

    bench: str
    what: str
    value: float
    unit: str
    floor: float | None = None
    target: str = ""
    met: bool | None = None  # None: the row has no target

    @property
    def ratio(self) -> float | None:
        if self.floor is None or self.floor == 0:
            return None
        return self.value / self.floor


def parse_args(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--json", metavar="PATH", help="also write the result rows here")
    return parser.parse_args()


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def quantile(xs: Sequence[float], q: float) -> float:
    """The q-quantile by nearest rank: enough for the p10/p90 spread printed next to medians."""
    s = sorted(xs)
    return s[min(int(q * len(s)), len(s) - 1)]


def spread_ms(xs: Sequence[float]) -> str:
    return (
        f"median {median(xs) * MS:7.3f} ms  (p10 {quantile(xs, 0.1) * MS:.3f}, "
        f"p90 {quantile(xs, 0.9) * MS:.3f}, n={len(xs)})"
    )


def fork_pipe_round_trip() -> float:
    """Seconds for a bare os.fork whose child writes one byte to a pipe the parent reads,
    until the child is reaped: the least any way of starting a process can cost here."""
    r, w = os.pipe()
    try:
        t0 = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            os.write(w, b"x")
            os._exit(0)
        os.read(r, 1)
        os.waitpid(pid, 0)
        return time.perf_counter() - t0
    finally:
        os.close(r)
        os.close(w)


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll `check` (set-up only, never inside a timed region) until it holds."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout:g} s")
        time.sleep(0.005)


class RunFailed(RuntimeError):
    """A benchmark's run did not complete; the message carries its last step's stderr."""


def run_completed(sup: brood.Supervisor, prompt: str) -> brood.RunResult:
    """`sup.run(prompt)`, raising RunFailed (with what its code printed last) unless it
    completed."""
    res = sup.run(prompt)
    if res.state != "completed":
        steps = sup.store.events(res.run_id, "step")
        last = steps[-1]["data"]["stderr"][-2000:] if steps else ""
        raise RunFailed(f"run {res.run_id} ({prompt!r}) ended {res.state}: {res.error}\n{last}")
    return res


def idle_worker_pids(sup: brood.Supervisor) -> list[int]:
    """Pids of the warm workers waiting in the local backend's pool."""
    return list(sup._engine.backend.idle_pids())


def zygote_pid(sup: brood.Supervisor) -> int:
    """The zygote's pid: the parent of every worker (found that way to lean on no more of
    the backend's internals than its idle-worker list)."""
    wait_until(lambda: bool(idle_worker_pids(sup)), 30.0, "a warm worker in the pool")
    return psutil.Process(idle_worker_pids(sup)[0]).ppid()


def no_leftovers(bench: str) -> list[int]:
    """Pids this benchmark left behind (killed here so they cannot disturb the next one)."""
    left = leftover_processes()
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    print(f"[{bench}] processes left behind: {len(left)}" + (f" {left}" if left else ""))
    return left


def finish(bench: str, rows: list[Row], left: list[int], json_path: str | None) -> None:
    """Print the rows, write them for run_all, and exit 1 if a process was left behind."""
    print()
    print(format_table(rows))
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"bench": bench, "rows": [asdict(r) for r in rows], "leftover": left}, f)
    if left:
        sys.exit(1)


def format_value(value: float, unit: str) -> str:
    if unit == "s":
        return f"{value * MS:.3f} ms"
    if unit == "B":
        return f"{value / MIB:.2f} MiB"
    if unit == "/s":
        return f"{value:,.0f}/s"
    if unit == "x":
        return f"{value:.2f}x"
    if unit == "%":
        return f"{value:.1f}%"
    return f"{value:g} {unit}".strip()


def format_table(rows: Sequence[Row]) -> str:
    header = ("benchmark", "measure", "value", "floor", "ratio", "target", "")
    lines = [header]
    for r in rows:
        floor = format_value(r.floor, r.unit) if r.floor is not None else ""
        ratio = f"{r.ratio:.2f}x" if r.ratio is not None else ""
        mark = {True: "met", False: "MISSED", None: ""}[r.met]
        lines.append((r.bench, r.what, format_value(r.value, r.unit), floor, ratio, r.target, mark))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = []
    for n, line in enumerate(lines):
        out.append("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)))
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(s.rstrip() for s in out)

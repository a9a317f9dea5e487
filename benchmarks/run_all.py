"""Run every benchmark, each in a process of its own, and print one summary table.

`make bench` calls this. Each benchmark measures its own floor in the same run and prints
ratios against it; a missed target is reported here, never raised. Every benchmark runs,
whatever happened to the ones before it; the summary then says which ran and which could
not, and the exit status is 1 when a benchmark could not run (it failed, timed out or wrote
no results) or left a process behind.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from _common import Row, format_table

HERE = os.path.dirname(os.path.abspath(__file__))
BENCHMARKS = (
    "bench_spawn",
    "bench_fanout",
    "bench_tracing",
    "bench_close",
    "bench_memory",
    "bench_hibernate",
    "bench_journal",
    "bench_resume",
    "bench_flow",
    "bench_gateway",
    "bench_tools",
    "bench_frames",
    "bench_confine",
    "bench_pools",
    "bench_asks",
    "bench_toolkit",
    "bench_serve",
    "bench_openenv",
    "bench_cluster",
    "bench_export",
)
TIMEOUT_S = 300.0  # each is meant to take under a minute; this only stops a hung one


def run_one(name: str) -> tuple[list[Row], str | None]:
    """Run benchmarks/NAME.py with its output shown; its rows, or why there are none."""
    print(f"\n=== {name} " + "=" * (70 - len(name)), flush=True)
    fd, path = tempfile.mkstemp(prefix=f"{name}-", suffix=".json")
    os.close(fd)
    try:
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(
                [sys.executable, os.path.join(HERE, f"{name}.py"), "--json", path],
                timeout=TIMEOUT_S,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return [], f"timed out after {TIMEOUT_S:g} s"
        print(f"({name} took {time.perf_counter() - t0:.1f} s)", flush=True)
        with open(path) as f:
            text = f.read()
        if not text:
            return [], f"exited with status {proc.returncode} before writing its results"
        try:
            data = json.loads(text)
            rows = [Row(**r) for r in data["rows"]]
        except (ValueError, TypeError, KeyError) as exc:
            return [], f"wrote results that cannot be read ({exc})"
        if data["leftover"]:
            return rows, f"left processes behind: {data['leftover']}"
        if proc.returncode:
            return rows, f"exited with status {proc.returncode}"
        return rows, None
    finally:
        os.unlink(path)


def main() -> None:
    names = sys.argv[1:] or list(BENCHMARKS)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        sys.exit(f"unknown benchmark(s) {unknown}; choose from {list(BENCHMARKS)}")
    rows: list[Row] = []
    problems: dict[str, str] = {}
    for name in names:
        got, problem = run_one(name)
        rows += got
        if problem:
            problems[name] = problem
    print("\n=== summary " + "=" * 63)
    print(format_table(rows))
    missed = [f"{r.bench}: {r.what.strip()}" for r in rows if r.met is False]
    print(
        f"\ntargets met: {sum(r.met is True for r in rows)} of "
        f"{sum(r.met is not None for r in rows)}" + (f"; missed: {missed}" if missed else "")
    )
    print("\n=== benchmarks " + "=" * 60)
    for name in names:
        print(f"{'FAILED' if name in problems else 'ran':6}  {name}", end="")
        print(f": {problems[name]}" if name in problems else "")
    ran = len(names) - len(problems)
    print(
        f"\n{ran} of {len(names)} benchmarks ran" + (f"; failed: {list(problems)}" * bool(problems))
    )
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()

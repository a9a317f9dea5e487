"""Worker memory: USS (memory only this process holds) of idle and busy workers.

Measured with psutil.Process(pid).memory_full_info().uss for:

  warm idle      workers forked from the zygote and waiting in the warm pool
  in a run       a worker whose run is blocked in a long REPL step (time.sleep)
  waiting        a worker whose run is blocked in rlm_wait on a child (the child sleeps)

Target: under 12 MiB each. Two references are measured in the same run: the floor, a
child os.fork'ed from a Python that imported brood's worker code and froze its heap (what
the zygote does) and then only blocks on a pipe; and a fresh interpreter with asyncio
imported (the cost a worker started by exec would have).

Waiting parents: what a supervisor holds for roots that wait. N roots each start one child
that sleeps in its step and then block in rlm_wait on it; once every one of them is there,
the memory of the whole (PSS, so that pages shared with the zygote are counted once: this
process, the zygote and every live worker) is measured, at WAITING_SMALL and WAITING_LARGE
roots, each on a supervisor of its own. The slope between the two is one waiting parent's
cost (its worker and its child's); base + 10,000 x slope is held to 1 GiB (the issue's
target for 10,000 waiting parents). A waiting run keeps its worker today; a variant whose
runs give their worker up while they wait is one more entry in WAITING_VARIANTS.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time

import psutil

import brood
from _common import (
    MIB,
    Row,
    RunFailed,
    finish,
    idle_worker_pids,
    median,
    no_leftovers,
    parse_args,
    wait_until,
    zygote_pid,
)

BENCH = "memory"
TARGET_BYTES = 12 * MIB
WAITING_SMALL, WAITING_LARGE = 10, 40  # waiting roots (each with one live child) measured
WAITING_PROJECTED = 10_000
WAITING_TARGET_BYTES = 1024 * MIB  # for WAITING_PROJECTED waiting parents, all included
WAITING_TIMEOUT_S = 120.0  # every root and child reaching its blocking call
SETTLE_S = 0.5  # let freshly forked workers finish connecting before they are measured

FORKED_FLOOR = """
import gc, os, sys
import brood.worker.main
gc.collect()
gc.freeze()
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(w)
    os.read(r, 1)
    os._exit(0)
print(pid, flush=True)
sys.stdin.read()
os.close(w)
os.waitpid(pid, 0)
"""

FRESH_INTERPRETER = "import asyncio, sys; print(0, flush=True); sys.stdin.read()"

SLEEPER = "```repl\nimport time\nopen({path!r}, 'w').close()\ntime.sleep(10**6)\n```"
WAITER = """```repl
import time
h = rlm_spawn('sleeping child')
open({path!r}, 'w').close()
rlm_wait(h)
```"""


WAITING_CHILD = """```repl
import os, time
open(os.path.join({marks!r}, 'child-' + str(os.getpid())), 'w').close()
time.sleep(10**6)
```"""
WAITING_ROOT = """```repl
import os
h = rlm_spawn('sleeping child')
open(os.path.join({marks!r}, 'root-' + str(os.getpid())), 'w').close()
rlm_wait(h)
```"""
# What a waiting parent runs with, by variant: today one, whose runs keep their workers.
WAITING_VARIANTS: dict[str, dict[str, object]] = {"live workers": {}}


def uss(pid: int) -> int:
    return int(psutil.Process(pid).memory_full_info().uss)


def still_going(sup: brood.Supervisor, *roots: brood.RunHandle, fail: bool = False) -> bool:
    """Whether every run of these trees is still going; with `fail`, RunFailed naming the
    first that ended (the runs here end only when they cannot do what they measure)."""
    for root in roots:
        for run in sup.store.runs(root.id):
            if run["state"] in ("queued", "running"):
                continue
            if fail:
                steps = sup.store.events(run["id"], "step")
                last = steps[-1]["data"]["stderr"][-2000:] if steps else ""
                raise RunFailed(
                    f"run {run['id']} ({run['prompt']!r}) ended {run['state']} before it was "
                    f"measured: {run['error'] or run['reason']}\n{last}"
                )
            return False
    return True


def reference_uss(code: str) -> int:
    """USS of the process a helper script names on its first line (itself when 0)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        pid = int(proc.stdout.readline()) or proc.pid
        time.sleep(SETTLE_S)
        return uss(pid)
    finally:
        proc.communicate("", timeout=30)


def pss_total(sup: brood.Supervisor) -> tuple[int, int]:
    """PSS of this process, the zygote and every process below it; and how many workers."""
    zygote = psutil.Process(zygote_pid(sup))
    below = zygote.children(recursive=True)
    total = 0
    for proc in [psutil.Process(), zygote, *below]:
        try:
            total += int(proc.memory_full_info().pss)
        except psutil.NoSuchProcess:
            continue
    return total, len(below)


def waiting_parents(n: int, extra: dict[str, object]) -> tuple[int, int]:
    """Total memory (PSS) with `n` roots each waiting on a sleeping child, on a supervisor
    of their own (Limits updated with `extra`); and how many workers were live."""
    marks = tempfile.mkdtemp(prefix="bench-memory-waiting-")
    model = brood.ScriptedModel(
        {
            "waiting root": [WAITING_ROOT.format(marks=marks)],
            "sleeping child": [WAITING_CHILD.format(marks=marks)],
        }
    )
    limits = brood.Limits(
        step_timeout=None,
        shutdown_grace=0.2,
        term_grace=0.2,
        fs_write=(marks,),
        max_concurrency=2 * n + 2,
        **extra,  # type: ignore[arg-type]
    )
    try:
        with brood.Supervisor(model=model, limits=limits) as sup:
            roots = [sup.spawn("waiting root") for _ in range(n)]
            wait_until(
                lambda: len(os.listdir(marks)) >= 2 * n or not still_going(sup, *roots),
                WAITING_TIMEOUT_S,
                f"{n} waiting roots and their children reaching their blocking calls",
            )
            still_going(sup, *roots, fail=True)
            time.sleep(SETTLE_S)
            return pss_total(sup)
    finally:
        shutil.rmtree(marks, ignore_errors=True)


def waiting_rows() -> list[Row]:
    rows = []
    for variant, extra in WAITING_VARIANTS.items():
        small, small_workers = waiting_parents(WAITING_SMALL, extra)
        large, large_workers = waiting_parents(WAITING_LARGE, extra)
        slope = (large - small) / (WAITING_LARGE - WAITING_SMALL)
        base = small - WAITING_SMALL * slope
        projected = base + WAITING_PROJECTED * slope
        print(
            f"waiting parents ({variant}): {WAITING_SMALL} roots {small / MIB:.1f} MiB "
            f"({small_workers} workers), {WAITING_LARGE} roots {large / MIB:.1f} MiB "
            f"({large_workers} workers): base {base / MIB:.1f} MiB + {slope / MIB:.2f} MiB "
            f"per waiting parent; {WAITING_PROJECTED:,} of them: {projected / MIB:,.0f} MiB"
        )
        rows += [
            Row(BENCH, f"memory per waiting parent ({variant})", slope, "B"),
            Row(BENCH, f"  base: supervisor + zygote ({variant})", base, "B"),
            Row(
                BENCH,
                f"  {WAITING_PROJECTED:,} waiting parents, projected ({variant})",
                projected,
                "B",
                None,
                f"< {WAITING_TARGET_BYTES // MIB} MiB",
                projected < WAITING_TARGET_BYTES,
            ),
        ]
    return rows


def main() -> None:
    args = parse_args(__doc__ or "")
    floor = median([reference_uss(FORKED_FLOOR) for _ in range(3)])
    fresh = median([reference_uss(FRESH_INTERPRETER) for _ in range(3)])
    marks = tempfile.mkdtemp(prefix="bench-memory-")
    sleeping, waiting, rooted = (os.path.join(marks, n) for n in ("child", "waiter", "root"))
    model = brood.ScriptedModel(
        {
            "sleeping child": [SLEEPER.format(path=sleeping)],
            "waiting root": [WAITER.format(path=waiting)],
            "sleeping root": [SLEEPER.format(path=rooted)],
        }
    )
    # The runs' code announces its blocking call by a file in `marks`: a folder outside the
    # workers' scratch, which they may write to only when the limits say so.
    limits = brood.Limits(step_timeout=None, shutdown_grace=0.2, term_grace=0.2, fs_write=(marks,))
    try:
        with brood.Supervisor(model=model, limits=limits) as sup:
            time.sleep(SETTLE_S)
            idle = [uss(pid) for pid in idle_worker_pids(sup)]
            zygote = uss(zygote_pid(sup))
            root = sup.spawn("sleeping root")
            waiter = sup.spawn("waiting root")
            wait_until(
                lambda: (
                    all(os.path.exists(p) for p in (sleeping, waiting, rooted))
                    or not still_going(sup, root, waiter)
                ),
                30.0,
                "the runs reaching their blocking call",
            )
            still_going(sup, root, waiter, fail=True)
            time.sleep(SETTLE_S)
            in_run = uss(sup.store.get_run(root.id)["pid"])
            waiting_uss = uss(sup.store.get_run(waiter.id)["pid"])
            child = waiter.tree()["children"][0]
            child_uss = uss(sup.store.get_run(child["run_id"])["pid"])
            idle_later = [uss(pid) for pid in idle_worker_pids(sup)]
    finally:
        shutil.rmtree(marks, ignore_errors=True)
    parents = waiting_rows()
    left = no_leftovers(BENCH)

    def mib(b: float) -> str:
        return f"{b / MIB:.2f} MiB"

    print(f"floor: forked child of a frozen, pre-imported parent  {mib(floor)}")
    print(f"reference: fresh interpreter with asyncio imported    {mib(fresh)}")
    print(f"zygote                                                {mib(zygote)}")
    print(f"warm idle workers at start    {', '.join(mib(b) for b in idle)}")
    print(f"warm idle workers, runs going {', '.join(mib(b) for b in idle_later)}")
    print(f"worker in a run (sleeping step)     {mib(in_run)}")
    print(f"worker in a run (sleeping child)    {mib(child_uss)}")
    print(f"worker blocked in rlm_wait          {mib(waiting_uss)}")
    idle_all = idle + idle_later
    busy = max(in_run, child_uss)
    rows = [
        Row(
            BENCH,
            "warm idle worker USS (median)",
            median(idle_all),
            "B",
            floor,
            f"< {TARGET_BYTES // MIB} MiB",
            max(idle_all) < TARGET_BYTES,
        ),
        Row(
            BENCH,
            "worker USS in a run (sleeping step)",
            busy,
            "B",
            floor,
            f"< {TARGET_BYTES // MIB} MiB",
            busy < TARGET_BYTES,
        ),
        Row(
            BENCH,
            "worker USS blocked in rlm_wait",
            waiting_uss,
            "B",
            floor,
            f"< {TARGET_BYTES // MIB} MiB",
            waiting_uss < TARGET_BYTES,
        ),
        Row(BENCH, "fresh interpreter + asyncio (reference)", fresh, "B", floor),
        *parents,
    ]
    finish(BENCH, rows, left, args.json)


if __name__ == "__main__":
    main()

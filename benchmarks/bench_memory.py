"""Worker memory: USS (memory only this process holds) of idle and busy workers.

Measured with psutil.Process(pid).memory_full_info().uss for:

  warm idle      workers forked from the zygote and waiting in the warm pool
  in a run       a worker whose run is blocked in a long REPL step (time.sleep)
  waiting        a worker whose run is blocked in rlm_wait on a child (the child sleeps)

Target: under 12 MiB each. Two references are measured in the same run: the floor, a
child os.fork'ed from a Python that imported brood's worker code and froze its heap (what
the zygote does) and then only blocks on a pipe; and a fresh interpreter with asyncio
imported (the cost a worker started by exec would have).
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
    ]
    finish(BENCH, rows, left, args.json)


if __name__ == "__main__":
    main()

"""close() of 64 workers that ignore SIGTERM, each with a grandchild that ignores it too.

Each worker's model code ignores SIGTERM, starts a grandchild Python that ignores SIGTERM
(it notes the time the signal came, in a file, and sleeps on), and then blocks forever.
The escalation (DESIGN.md section 6) is: Stop message -> grace -> SIGTERM to the group ->
term_grace -> SIGKILL to the group -> reap and confirm. A worker leaves at once on Stop, so
only the grandchildren are left for the signals. The benchmark watches every worker and
grandchild through a pidfd, so it can say when each one died, and reports what the
escalation actually did, the time close() took beyond the configured graces (target under
100 ms) and the survivors (brood.testing.leftover_processes(), plus any zombie of the 128
processes watched; must be zero).

The floor is the same escalation done by hand in a small helper process with one session
per worker: wait the grace, os.killpg SIGTERM to 64 groups, wait term_grace, os.killpg
SIGKILL, reap everything as a child subreaper. Ratio: brood's close() time to the floor's.
"""

from __future__ import annotations

import ctypes
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

import psutil

import brood
from _common import (
    MS,
    Row,
    finish,
    idle_worker_pids,
    median,
    no_leftovers,
    parse_args,
    wait_until,
)
from brood.testing import leftover_processes

BENCH = "close"
WORKERS = 64
ROUNDS = 3
SHUTDOWN_GRACE = 0.2
TERM_GRACE = 0.2
TARGET_BEYOND_S = 0.100
READY_TIMEOUT_S = 60.0
WATCH_S = 120.0  # how long the death watch waits for every watched process to exit
AFTER_CLOSE_S = 5.0  # a watched process not seen to die this long after close() survived it
PR_SET_CHILD_SUBREAPER = 36
# After a worker exits, how long brood waits for the rest of its process group before SIGTERM.

# The grandchild: ignores SIGTERM (noting when it came) and sleeps; argv[1] is the marker dir.
GRANDCHILD = """
import os, signal, sys, time
d = sys.argv[1]
def noted(signum, frame):
    with open(os.path.join(d, f"{os.getpid()}.term"), "w") as f:
        f.write(repr(time.time()))
signal.signal(signal.SIGTERM, noted)
open(os.path.join(d, f"{os.getppid()}-{os.getpid()}.ready"), "w").close()
time.sleep(1000)
"""


def worker_reply(marker_dir: str) -> str:
    return f"""```repl
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
p = subprocess.Popen([sys.executable, '-c', {GRANDCHILD!r}, {marker_dir!r}])
time.sleep(10**6)
```"""


def ready_pairs(marker_dir: str) -> list[tuple[int, int]]:
    """(worker pid, grandchild pid) of every grandchild that ignores SIGTERM by now."""
    pairs = []
    for name in os.listdir(marker_dir):
        if name.endswith(".ready"):
            worker, _, grandchild = name[: -len(".ready")].partition("-")
            pairs.append((int(worker), int(grandchild)))
    return pairs


def sigterm_times(marker_dir: str) -> dict[int, float]:
    out = {}
    for n in os.listdir(marker_dir):
        if n.endswith(".term"):
            with open(os.path.join(marker_dir, n)) as f:
                out[int(n[: -len(".term")])] = float(f.read())
    return out


class DeathWatch:
    """Notes the time each pid exits (pidfds polled by one thread blocked in epoll)."""

    def __init__(self, pids: list[int]) -> None:
        self.died: dict[int, float] = {}
        self._sel = selectors.DefaultSelector()
        for pid in pids:
            try:
                self._sel.register(os.pidfd_open(pid), selectors.EVENT_READ, pid)
            except ProcessLookupError:
                raise RuntimeError(f"process {pid} died before close() was called") from None
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        deadline = time.monotonic() + WATCH_S
        while self._sel.get_map() and time.monotonic() < deadline:
            for key, _ in self._sel.select(timeout=1.0):
                self.died[key.data] = time.time()
                self._sel.unregister(key.fd)
                os.close(key.fd)
        for key in list(self._sel.get_map().values()):  # never died: reported as survivors
            os.close(key.fd)
        self._sel.close()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


def alive_or_zombie(pids: list[int]) -> list[int]:
    return [pid for pid in pids if os.path.exists(f"/proc/{pid}")]


@dataclass
class Round:
    """One brood close(); times in seconds since close() was called."""

    close: float
    worker_exit: list[float]  # [i] is the worker whose grandchild is at [i] below
    sigterm: list[float]  # when each grandchild noted the SIGTERM it ignored (inf: never)
    grandchild_exit: list[float]
    leftover: list[int]  # brood.testing.leftover_processes() after close()
    remaining: list[int]  # watched pids still in /proc (alive or zombie)


def brood_round() -> Round:
    marker_dir = tempfile.mkdtemp(prefix="bench-close-")
    model = brood.ScriptedModel({"sigterm-proof": [worker_reply(marker_dir)]})
    limits = brood.Limits(
        max_concurrency=WORKERS,
        step_timeout=None,
        shutdown_grace=SHUTDOWN_GRACE,
        term_grace=TERM_GRACE,
        fs_write=(marker_dir,),  # the grandchildren's marks: outside the workers' scratch
    )
    sup = brood.Supervisor(model=model, limits=limits)
    try:
        handles = [sup.spawn(f"sigterm-proof worker {i}") for i in range(WORKERS)]
        wait_until(
            lambda: len(ready_pairs(marker_dir)) == WORKERS,
            READY_TIMEOUT_S,
            f"{WORKERS} workers with a SIGTERM-proof grandchild",
        )
        pairs = ready_pairs(marker_dir)
        run_pids = {sup.store.get_run(h.id)["pid"] for h in handles}
        assert run_pids == {w for w, _ in pairs}, "grandchildren of unknown workers"
        workers, grandchildren = [w for w, _ in pairs], [g for _, g in pairs]
        zygote = psutil.Process(workers[0]).ppid()  # workers are the zygote's children
        others = [zygote, *idle_worker_pids(sup)]
        watch = DeathWatch(workers + grandchildren)
    except BaseException:
        sup.close()
        shutil.rmtree(marker_dir, ignore_errors=True)
        raise
    t0 = time.time()
    sup.close()
    t1 = time.time()
    watch.join(AFTER_CLOSE_S)
    terms = sigterm_times(marker_dir)
    shutil.rmtree(marker_dir, ignore_errors=True)
    never = float("inf")
    return Round(
        close=t1 - t0,
        worker_exit=[watch.died.get(p, never) - t0 for p in workers],
        sigterm=[terms.get(g, never) - t0 for g in grandchildren],
        grandchild_exit=[watch.died.get(p, never) - t0 for p in grandchildren],
        leftover=leftover_processes(),
        remaining=alive_or_zombie(workers + grandchildren + others),
    )


def bare_escalation() -> dict[str, float]:
    """The floor, run in a helper process (`--floor`): the same escalation by hand."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # orphaned grandchildren come back here
    marker_dir = tempfile.mkdtemp(prefix="bench-close-floor-")
    groups = []
    for _ in range(WORKERS):
        pid = os.fork()
        if pid == 0:
            try:
                os.setsid()
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                subprocess.Popen([sys.executable, "-c", GRANDCHILD, marker_dir])
                time.sleep(10**6)
            finally:
                os._exit(0)
        groups.append(pid)
    try:
        wait_until(
            lambda: len(ready_pairs(marker_dir)) == WORKERS,
            READY_TIMEOUT_S,
            "floor workers with a SIGTERM-proof grandchild",
        )
        t0 = time.perf_counter()
        # brood's workers leave on Stop at once; what is left of each group (the
        # grandchildren) gets SIGTERM straight away, so the floor skips the first grace too.
        for pgid in groups:
            os.killpg(pgid, signal.SIGTERM)
        time.sleep(TERM_GRACE)
        for pgid in groups:
            os.killpg(pgid, signal.SIGKILL)
        while True:
            try:
                os.waitpid(-1, 0)
            except ChildProcessError:
                break
        gone = True
        for pgid in groups:
            try:
                os.killpg(pgid, 0)
                gone = False
            except ProcessLookupError:
                pass
        elapsed = time.perf_counter() - t0
        terms = len(sigterm_times(marker_dir))
    finally:
        for pgid in groups:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except OSError:
                pass
        shutil.rmtree(marker_dir, ignore_errors=True)
    return {"elapsed": elapsed, "gone": float(gone), "terms": terms}


def floor_round() -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, __file__, "--floor"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    if not result["gone"]:
        raise RuntimeError("the floor escalation left a process group behind")
    return result


def ms(seconds: float) -> str:
    return f"{seconds * MS:.1f} ms"


def main() -> None:
    if sys.argv[1:] == ["--floor"]:
        print(json.dumps(bare_escalation()))
        return
    args = parse_args(__doc__ or "")
    # The graces the escalation waits here: the workers leave on Stop, so shutdown_grace
    # never runs out; only term_grace stands between SIGTERM and SIGKILL.
    graces = TERM_GRACE
    floors = [floor_round()["elapsed"] for _ in range(ROUNDS)]
    rounds = [brood_round() for _ in range(ROUNDS)]
    left = no_leftovers(BENCH)

    print(
        f"{WORKERS} workers, shutdown_grace={SHUTDOWN_GRACE:g} s, term_grace={TERM_GRACE:g} s "
        f"(graces waited: term_grace, {graces * MS:.0f} ms; workers leave on Stop)"
    )
    print(
        "floor: hand-made killpg escalation, "
        + ", ".join(f"{f * MS:.1f}" for f in floors)
        + f" ms; beyond graces {(median(floors) - graces) * MS:.1f} ms (median)"
    )
    for i, r in enumerate(rounds, 1):
        wx, st, gx = r.worker_exit, r.sigterm, r.grandchild_exit
        print(
            f"round {i}: close() {r.close * MS:.1f} ms, {(r.close - graces) * MS:.1f} ms "
            "beyond the graces waited"
        )
        print(f"  workers exited on Stop:        {len(wx)}, the last at {ms(max(wx))}")
        print(
            f"  SIGTERM reached grandchildren: {sum(t < float('inf') for t in st)}/{WORKERS}, "
            f"from {ms(min(st))} to {ms(max(st))}; all ignored it"
        )
        print(f"  grandchildren killed (SIGKILL): {len(gx)}, from {ms(min(gx))} to {ms(max(gx))}")
        print(
            f"  close() returned {(r.close - max(gx)) * MS:.1f} ms after the last death; "
            f"survivors: {len(r.leftover)} brood-owned, {len(r.remaining)} of the watched "
            "pids alive or zombie"
        )
    closes = [r.close for r in rounds]
    gap = median([t - w for r in rounds for w, t in zip(r.worker_exit, r.sigterm, strict=True)])
    print(
        f"each group got SIGTERM {gap * MS:.1f} ms (median) after its worker left on Stop "
        f"(shutdown_grace, {SHUTDOWN_GRACE * MS:.0f} ms, is only waited for a worker that "
        "does not leave)"
    )
    survivors = sum(len(r.leftover) + len(r.remaining) for r in rounds)
    beyond = median(closes) - graces
    floor = median(floors)
    rows = [
        Row(BENCH, f"close() of {WORKERS} SIGTERM-proof workers", median(closes), "s", floor),
        Row(
            BENCH,
            "  beyond the graces waited",
            beyond,
            "s",
            floor - graces,
            f"< {TARGET_BEYOND_S * MS:.0f} ms",
            beyond < TARGET_BEYOND_S,
        ),
        Row(BENCH, "survivors after close()", survivors, "", None, "0", survivors == 0),
    ]
    finish(BENCH, rows, left, args.json)
    if survivors:
        sys.exit(1)


if __name__ == "__main__":
    main()

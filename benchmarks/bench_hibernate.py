"""Hibernation: the memory of many waiting parents, and the rebuild of a woken one.

Memory: N roots each start a child that asks a person and wait on it, under
`Limits(max_workers=LIVE, hibernate_after=0)`: parents and children hibernate (no
process). Measured: supervisor + zygote + live workers (USS), against the same supervisor
idle (its floor), as base + slope per parent (its child included), held for 10,000
parents (target: under 1 GiB).

Rebuild: a 20-step root whose last step waits on a child is woken when the child ends; the
time from its `woken` event to its end (a new worker replays 19 journaled steps, goes on
with the wait's result and answers) against a fresh start of the same run whose child
answers at once (target: at most 3x).
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from typing import Any

import psutil

import brood
from _common import (
    MIB,
    Row,
    finish,
    idle_worker_pids,
    no_leftovers,
    parse_args,
    wait_until,
    zygote_pid,
)
from brood.journal import Journal

BENCH = "hibernate"
PARENTS = int(os.environ.get("BROOD_BENCH_HIBERNATE_PARENTS", "500"))
LIVE = 16  # children holding a worker at once
HELD_FOR = 10_000
STEPS = 20
F = "```"


def repl(code: str) -> str:
    return f"{F}repl\n{code}\n{F}"


def uss(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_full_info().uss
        except psutil.Error:
            pass
    return total


def footprint(sup: brood.Supervisor, zygote: int) -> tuple[int, int]:
    """(supervisor (this process) + zygote, the live workers serving runs), in USS."""
    workers = [c.pid for c in psutil.Process(zygote).children()]
    warm = set(idle_worker_pids(sup))
    return uss([os.getpid(), zygote]), uss([p for p in workers if p not in warm])


def memory(tmp: str) -> list[Row]:
    model = brood.ScriptedModel(
        {
            "parent": [repl("r = rlm_query('child: waits')\nFINAL(r)")],
            "child": [repl("FINAL(ask_person('go on?'))")],
        }
    )
    limits = brood.Limits(
        max_workers=LIVE,
        hibernate_after=0,
        max_concurrency=LIVE,
        max_depth=2,
        shutdown_grace=0.2,
        term_grace=0.2,
        fs_write=(tmp,),
    )
    with brood.Supervisor(model, limits=limits, store=f"sqlite:///{tmp}/m.db") as sup:
        zygote = zygote_pid(sup)
        base, _ = footprint(sup, zygote)
        t0 = time.perf_counter()
        # Each parent starts, asks for its child and hibernates; its child asks a person
        # and hibernates too (a child that held its worker would hold it for good here).
        for i in range(PARENTS):
            sup.spawn(f"parent {i}")
        wait_until(
            lambda: sup.statistics()["hibernating"] >= 2 * PARENTS,
            600.0,
            f"{PARENTS} hibernating parents",
        )
        took = time.perf_counter() - t0
        stats = sup.statistics()
        own, live = footprint(sup, zygote)
    slope = (own - base) / PARENTS  # live workers are bounded by max_workers, not by parents
    held = base + live + HELD_FOR * slope
    print(
        f"[{BENCH}] {PARENTS} parents hibernated in {took:.1f} s; live workers "
        f"{stats['workers']['runs']} (max {stats['workers']['max']}) holding "
        f"{live / MIB:.0f} MiB; supervisor + zygote {base / MIB:.0f} MiB idle"
    )
    return [
        Row(BENCH, f"{PARENTS} hibernated parents: total memory", own + live, "B", base),
        Row(BENCH, "per hibernated parent (supervisor + journal)", slope, "B"),
        Row(BENCH, f"held for {HELD_FOR:,} parents", held, "B", None, "< 1 GiB", held < 2**30),
        Row(
            BENCH,
            "live workers (max_workers)",
            stats["workers"]["runs"],
            "",
            None,
            f"<= {LIVE}",
            stats["workers"]["runs"] <= LIVE,
        ),
    ]


def rebuild(tmp: str) -> list[Row]:
    gate = os.path.join(tmp, "rebuild-gate")
    os.mkfifo(gate)
    steps = [repl(f"x{i} = {i}") for i in range(STEPS - 1)]
    last = repl("r = rlm_query('child: ' + context)\nFINAL(r + str(x1))")
    model = brood.ScriptedModel(
        {
            "root": [*steps, last],
            "child: gated": [repl(f"open({gate!r}).read()\nFINAL('done')")],
            "child: quick": [repl("FINAL('done')")],
        }
    )
    url = f"sqlite:///{tmp}/r.db"
    limits = brood.Limits(
        hibernate_after=0,
        max_depth=2,
        max_iterations=STEPS + 5,
        shutdown_grace=0.2,
        term_grace=0.2,
        fs_write=(tmp,),
    )
    fresh, woken = [], []
    with brood.Supervisor(model, limits=limits, store=url) as sup:
        for _ in range(3):
            t0 = time.perf_counter()
            assert sup.run("root task", context="quick").answer == "done1"
            fresh.append(time.perf_counter() - t0)
            h = sup.spawn("root task", context="gated")
            wait_until(lambda: sup.statistics()["hibernating"] >= 1, 60.0, "a hibernation")
            opener = threading.Thread(target=lambda: open(gate, "w").close())
            opener.start()
            assert h.wait(timeout=120) == "done1"
            opener.join()
            sup.store.flush()
            with Journal(url) as journal:
                at = [e["at"] for e in journal.store.events(h.id, "woken")][-1]
                ended = journal.run(h.id)["ended_at"]
            woken.append(ended - at)
    f, w = sorted(fresh)[1], sorted(woken)[1]
    return [
        Row(BENCH, f"fresh start of a {STEPS}-step run", f, "s"),
        Row(BENCH, "rebuild of the woken run", w, "s", f, "<= 3x", w <= 3 * f),
    ]


def main() -> None:
    args = parse_args(__doc__ or BENCH)
    rows: list[Any] = []
    with tempfile.TemporaryDirectory() as tmp:
        rows += rebuild(tmp)
        rows += memory(tmp)
    left = no_leftovers(BENCH)
    finish(BENCH, rows, left, args.json)


if __name__ == "__main__":
    main()

"""The journal under a 1,000-child fan-out with SQLite.

A root starts 1,000 children of one scripted turn each (max_concurrency=16) with the
journal in an SQLite file. Every run, transition, model call and REPL step is journaled by
the one writer thread. Reported: journal writes per second over the fan-out's wall time,
and the share of that wall time spent journaling (target under 10%).

The share is measured end to end, against a floor: the same fan-out with a journal that
commits nothing (every write resolves at once), run alternately with the real one. The
wall time the journal adds over the floor, as a share of the fan-out's wall time, is what
journaling costs the fan-out, including the supervisor's side of it (encoding and queueing
the writes, waiting for commits before telling parents). The writer thread's own time in
commits is printed too, but it is not that cost: the writer runs beside the loop, and its
commit time includes waiting for the GIL while the loop thread runs (its CPU time is
about half of it).
"""

from __future__ import annotations

import os
import tempfile
import time
from concurrent.futures import Future
from typing import Any

import brood
import brood.supervisor.engine as brood_engine
from _common import Row, finish, median, no_leftovers, parse_args, run_completed

BENCH = "journal"
CHILDREN = 1000
ROUNDS = 3
TARGET_SHARE = 0.10
ROOT = f"""```repl
answers = rlm_query_batched([f'child {{i}}' for i in range({CHILDREN})])
FINAL(str(len(answers)))
```"""
MODEL = brood.ScriptedModel(
    {"root": [ROOT], "child": ["```repl\nprint('x')\nFINAL('x')\n```"]}, tokens_per_call=(50, 5)
)
LIMITS = brood.Limits(
    max_concurrency=16, max_children=CHILDREN, max_children_per_run=CHILDREN, max_depth=2
)


class NullStore:
    """A journal that keeps nothing: every write is 'committed' at once."""

    url = "null://"
    readonly = False
    failure = None  # never fails
    on_failure = None

    def __init__(self) -> None:
        self.writes = 0

    def _done(self, *args: Any, **kw: Any) -> Future[Any]:
        self.writes += 1
        fut: Future[Any] = Future()
        fut.set_result(1)
        return fut

    insert_supervisor = close_supervisor = insert_run = transition = event = _done

    def note(self, *args: Any, **kw: Any) -> None:
        self.writes += 1

    def bind_loop(self) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def fan_out(store: str | None) -> tuple[float, dict[str, float]]:
    with brood.Supervisor(MODEL, limits=LIMITS, store=store) as sup:
        t0 = time.perf_counter()
        res = run_completed(sup, "root")
        wall = time.perf_counter() - t0
        assert res.answer == str(CHILDREN), res
        sup.store.flush()
        stats = sup.store.statistics()  # type: ignore[attr-defined]
        events = len(sup.store.events(root_id=res.run_id))
        stats["events"] = events
    return wall, stats


def null_fan_out() -> float:
    real = brood_engine.open_store
    brood_engine.open_store = lambda url, **kw: NullStore()  # type: ignore[assignment]
    try:
        with brood.Supervisor(MODEL, limits=LIMITS) as sup:
            t0 = time.perf_counter()
            res = sup.run("root")
            wall = time.perf_counter() - t0
            assert res.answer == str(CHILDREN), res
    finally:
        brood_engine.open_store = real
    return wall


def main() -> None:
    args = parse_args(__doc__ or "")
    walls, shares, busy, rates, null_walls = [], [], [], [], []
    with tempfile.TemporaryDirectory(prefix="brood-bench-journal-") as tmp:
        fan_out(None)  # warm-up: first-use costs on both sides
        for i in range(ROUNDS):
            url = f"sqlite:///{os.path.join(tmp, f'j{i}.db')}"
            wall, stats = fan_out(url)
            null_walls.append(null_fan_out())
            walls.append(wall)
            shares.append(1 - null_walls[-1] / wall)
            busy.append(stats["busy_s"] / wall)
            rates.append(stats["writes"] / wall)
            print(
                f"round {i + 1}: fan-out {wall:.2f} s, {int(stats['writes'])} writes in "
                f"{int(stats['batches'])} commits ({stats['writes'] / stats['batches']:.1f} per "
                f"commit), {stats['events']} events; writer busy {stats['busy_s']:.3f} s "
                f"({stats['busy_s'] / wall:.1%}); without a journal {null_walls[-1]:.2f} s"
            )
    left = no_leftovers(BENCH)
    share = median(shares)
    rows = [
        Row(BENCH, "journal writes per second (fan-out)", median(rates), "/s"),
        Row(
            BENCH,
            "share of the fan-out's wall time journaling adds",
            share * 100,
            "%",
            None,
            f"< {TARGET_SHARE:.0%}",
            share < TARGET_SHARE,
        ),
        Row(BENCH, "  writer thread in commits (beside the loop)", median(busy) * 100, "%"),
        Row(
            BENCH,
            f"fan-out of {CHILDREN} with the SQLite journal",
            median(walls),
            "s",
            median(null_walls),
        ),
    ]
    finish(BENCH, rows, left, args.json)


if __name__ == "__main__":
    main()

"""Pool wake-up: how long a capacity-1 pool stands empty between one holder and the next.

A chain of N roots is queued at once on a pool of capacity 1 (`Limits(pools={"deploy": 1})`,
`sup.spawn(..., pool="deploy")`). Each root's model (a `chat_fn`) answers at once with
FINAL, so a root holds the pool for about as long as brood takes to start and end it. The
figure is the handoff gap read from the journal, in start order:

  gap(k) = started_at(k+1) - ended_at(k)

It covers the end of a holder being journaled, the wake-up of the oldest waiter through the
supervisor's own events, a warm worker from the pool and the waiter's `running` transition.
A gate root holds the pool (its model call blocks) until all N are queued, so no gap
competes with the `spawn` calls that queue the chain.

The floor is the supervisor's own event dispatch without pools: the same gated chain under
`Limits(max_concurrency=1)` and no pool, so each start waits for the previous root's
concurrency slot; the same gaps (reported as a ratio; no target is set). The two are not
quite alike: a run gives its slot back before its end is journaled,
but its pool place only once that end is committed (so the sections never overlap in the
journal), so each pool gap holds one journal commit that the floor's gaps do not.

Each of ROUNDS rounds runs both chains, each on a fresh supervisor; the figures are medians
over the rounds of each round's median and p90.

Correctness: the [started_at, ended_at] spans of the capacity-1 pool never overlap. An
overlap exits with status 1, as a process left behind does.
"""

from __future__ import annotations

import itertools
import sys
import threading
from collections.abc import Callable
from typing import Any

import brood
from _common import (
    MS,
    Row,
    RunFailed,
    finish,
    median,
    no_leftovers,
    parse_args,
    quantile,
    run_completed,
    spread_ms,
)

BENCH = "pools"
CHAIN = 40  # roots contending for the pool, one round's chain
ROUNDS = 3
POOL = "deploy"
GATE_TIMEOUT_S = 30.0  # only stops a hung set-up: the gate opens once the chain is queued
WAIT_TIMEOUT_S = 60.0  # per root of the chain; only stops a hung run

REPLY = "```repl\nFINAL('ok')\n```"
GATE_TASK = "gate: hold the line until the chain is queued"


def gated_model(gate: threading.Event) -> Callable[[list[dict[str, Any]]], str]:
    """A chat_fn answering at once, except for the gate root, which waits for `gate`."""

    def chat_fn(messages: list[dict[str, Any]]) -> str:
        task = next(str(m["content"]) for m in messages if m["role"] == "user")
        if GATE_TASK in task and not gate.wait(GATE_TIMEOUT_S):
            raise TimeoutError(f"the gate was not opened within {GATE_TIMEOUT_S:g} s")
        return REPLY

    return chat_fn


def chain_spans(limits: brood.Limits, pool: str | None) -> list[tuple[float, float]]:
    """Queue a gated chain of CHAIN roots on a fresh supervisor; their journaled
    (started_at, ended_at), in start order."""
    gate = threading.Event()
    with brood.Supervisor(model=gated_model(gate), limits=limits) as sup:
        run_completed(sup, "warm-up: first use of the supervisor and a worker")
        holder = sup.spawn(GATE_TASK, pool=pool)
        chain = [sup.spawn(f"chain root {i}", pool=pool) for i in range(CHAIN)]
        gate.set()
        for h in [holder, *chain]:
            res = h.wait_result(timeout=WAIT_TIMEOUT_S)
            if res.state != "completed":
                raise RunFailed(f"run {res.run_id} ended {res.state}: {res.error}")
        sup.store.flush()
        rows = [sup.store.get_run(h.id) for h in chain]
    return sorted((r["started_at"], r["ended_at"]) for r in rows)


def gaps(spans: list[tuple[float, float]]) -> list[float]:
    """started_at(k+1) - ended_at(k): negative where two spans overlap."""
    return [start - end for (_, end), (start, _) in itertools.pairwise(spans)]


def main() -> None:
    args = parse_args(__doc__ or "")

    def make_limits(**kw: Any) -> brood.Limits:
        return brood.Limits(shutdown_grace=0.3, term_grace=0.3, step_timeout=None, **kw)

    series = {
        "floor": (make_limits(max_concurrency=1), None),
        "pool": (make_limits(pools={POOL: 1}), POOL),
    }
    per_round: dict[str, list[list[float]]] = {name: [] for name in series}
    for n in range(ROUNDS):
        # Alternate which chain goes first, so a drift of the machine touches both alike.
        names = list(series) if n % 2 == 0 else list(reversed(series))
        for name in names:
            limits, pool = series[name]
            per_round[name].append(gaps(chain_spans(limits, pool)))
    left = no_leftovers(BENCH)

    for n in range(ROUNDS):
        for name in series:
            print(f"round {n + 1}  {name:<5} gap  {spread_ms(per_round[name][n])}")
    med = {name: median([median(g) for g in rounds]) for name, rounds in per_round.items()}
    p90 = {name: median([quantile(g, 0.9) for g in rounds]) for name, rounds in per_round.items()}
    overlaps = sum(g < 0 for round_gaps in per_round["pool"] for g in round_gaps)
    print(
        f"\nfloor (concurrency slot, no pool): median {med['floor'] * MS:.3f} ms, "
        f"p90 {p90['floor'] * MS:.3f} ms"
    )
    print(
        f"pool  (capacity 1):                median {med['pool'] * MS:.3f} ms, "
        f"p90 {p90['pool'] * MS:.3f} ms"
    )
    ratio = med["pool"] / med["floor"]
    print(
        f"headline: pool handoff {med['pool'] * MS:.3f} ms = {ratio:.2f}x the floor "
        "(one journal commit more: a pool place is given back once the end is committed)"
    )
    print(f"overlapping capacity-1 spans: {overlaps} of {ROUNDS * (CHAIN - 1)} handoffs")

    rows = [
        Row(BENCH, "pool handoff gap (median)", med["pool"], "s", med["floor"]),
        Row(BENCH, "pool handoff gap (p90)", p90["pool"], "s", p90["floor"]),
        Row(BENCH, "  floor: slot handoff gap (median)", med["floor"], "s"),
        Row(BENCH, "  floor: slot handoff gap (p90)", p90["floor"], "s"),
        Row(BENCH, "overlapping capacity-1 spans", overlaps, ""),
    ]
    finish(BENCH, rows, left, args.json)
    if overlaps:
        print(f"[{BENCH}] FAILED: {overlaps} capacity-1 pool spans overlap in the journal")
        sys.exit(1)


if __name__ == "__main__":
    main()

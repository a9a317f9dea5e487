"""Spawn -> running: how long a child takes from its parent's request until it runs.

"Running" means the child's own code is executing: its worker got the Start message, loaded
the model, built its REPL, took its first (scripted, instant) model turn and ran the first
line of the block. Both ends are stamped inside model code with time.time(), the clock the
journal uses, so the journal splits the interval into three stages:

  request    parent calls rlm_spawn            -> the supervisor creates the run record
  admission  run record created                -> the `running` transition is journaled
             (journal insert, a concurrency slot, a warm worker from the pool)
  start      `running` journaled               -> the child's first line runs
             (journal commit, Start message, worker set-up, first model turn)

The floor is a bare os.fork whose child writes one byte to a pipe, read and reaped by the
parent, measured in this process before and after the runs. Target: median <= 3x the floor.

Three series: children started one at a time with a pause between them (the warm pool is
full and the machine quiet: the headline), back-to-back (each start competes with the
refill fork of the previous one), and roots started from the Python API (Supervisor.spawn).

A fourth series measures what a spawn costs up to the child's first model request, the
moment the supervisor's model gateway is handed the child's first call: the model here
defines `acomplete`, so the gateway awaits it on the supervisor's loop as it receives the
call (no thread hand-off in between), and that reply stamps time.time() into the code it
returns, which the child hands back as its answer. With the warm pool the fork is off this
path; what is left is the journal (the child's insert and its `running` transition), the
messages (SpawnReq, Start, ModelReq) and the worker's own set-up. Target: median <= 1.5x
the same fork + pipe floor.
"""

from __future__ import annotations

import json
import time
from typing import Any

import brood
from _common import (
    MS,
    Row,
    finish,
    fork_pipe_round_trip,
    median,
    no_leftovers,
    parse_args,
    run_completed,
    spread_ms,
)

BENCH = "spawn"
CHILDREN = 200  # per series of child spawns
WARM_UP = 20  # children of an untimed first series: first-use costs on both sides
ROOTS = 100
FLOOR_SAMPLES = 200  # per half (before and after the runs)
SETTLE_S = 0.02  # pause between spawns: lets the warm pool refill and the machine go quiet
TARGET_RATIO = 3.0
FIRST_REQUEST_TARGET = 1.5

CHILD_REPLY = "```repl\nimport time\nFINAL(repr(time.time()))\n```"


def first_request_reply(messages: object) -> str:
    """A child's first turn: the time its call reached the gateway, as its answer."""
    return f"```repl\nFINAL({time.time()!r})\n```"


class GatewayStamped(brood.ScriptedModel):
    """A scripted model the gateway awaits on its loop (see the module docstring)."""

    async def acomplete(self, messages: Any, model: str | None = None) -> brood.Completion:
        return self.complete(messages, model)


def parent_reply(n: int, settle: float) -> str:
    """A root that starts `n` children one at a time, stamping each request."""
    return f"""```repl
import json, time
stamps = []
for i in range({n}):
    time.sleep({settle})
    t0 = time.time()
    h = rlm_spawn(f'child {{i}}')
    stamps.append((h.id, t0, float(rlm_wait(h))))
FINAL(json.dumps(stamps))
```"""


def child_series(sup: brood.Supervisor, key: str) -> dict[str, list[float]]:
    res = run_completed(sup, f"{key}: a series of spawns")
    stages: dict[str, list[float]] = {"total": [], "request": [], "admission": [], "start": []}
    for child_id, t_request, t_running in json.loads(res.answer or "[]"):
        rec = sup.store.get_run(child_id)
        journaled = next(t["at"] for t in sup.store.transitions(child_id) if t["to"] == "running")
        stages["total"].append(t_running - t_request)
        stages["request"].append(rec["created_at"] - t_request)
        stages["admission"].append(journaled - rec["created_at"])
        stages["start"].append(t_running - journaled)
    return stages


def first_request_series(sup: brood.Supervisor, key: str) -> list[float]:
    """rlm_spawn -> the child's first model request at the gateway, one child at a time."""
    res = run_completed(sup, f"{key}: a series of spawns")
    return [t_request_seen - t0 for _, t0, t_request_seen in json.loads(res.answer or "[]")]


def root_series(sup: brood.Supervisor, n: int) -> list[float]:
    """Supervisor.spawn -> the root's first line runs, one root at a time."""
    out = []
    for i in range(n):
        time.sleep(SETTLE_S)
        t0 = time.time()
        h = sup.spawn(f"api root {i}")
        out.append(float(h.wait(timeout=30)) - t0)
    return out


def main() -> None:
    args = parse_args(__doc__ or "")
    floor = [fork_pipe_round_trip() for _ in range(FLOOR_SAMPLES)]
    model = brood.ScriptedModel(
        {
            "warm-up": [parent_reply(WARM_UP, SETTLE_S)],
            "settled": [parent_reply(CHILDREN, SETTLE_S)],
            "back-to-back": [parent_reply(CHILDREN, 0)],
            "first-request": [parent_reply(CHILDREN, SETTLE_S)],
            "child": [CHILD_REPLY],
            "api root": [CHILD_REPLY],
        }
    )
    stamped = GatewayStamped(
        {
            "warm-up": [parent_reply(WARM_UP, SETTLE_S)],
            "first-request": [parent_reply(CHILDREN, SETTLE_S)],
            "child": [first_request_reply],
        }
    )
    limits = brood.Limits(
        max_children=4 * CHILDREN,
        max_children_per_run=CHILDREN,
        step_timeout=None,
        shutdown_grace=0.5,
        term_grace=0.5,
    )
    with brood.Supervisor(model=model, limits=limits) as sup:
        child_series(sup, "warm-up")
        settled = child_series(sup, "settled")
        back_to_back = child_series(sup, "back-to-back")
        roots = root_series(sup, ROOTS)
    with brood.Supervisor(model=stamped, limits=limits) as sup:
        first_request_series(sup, "warm-up")
        first_request = first_request_series(sup, "first-request")
    floor += [fork_pipe_round_trip() for _ in range(FLOOR_SAMPLES)]
    left = no_leftovers(BENCH)

    f = median(floor)
    print(f"floor  fork + pipe byte + waitpid       {spread_ms(floor)}")
    for name, series in (("settled", settled), ("back-to-back", back_to_back)):
        print(f"child spawn -> running, {name}:")
        for stage, xs in series.items():
            print(f"  {stage:<10} {spread_ms(xs)}  = {median(xs) / f:5.2f}x floor")
    print(f"root Supervisor.spawn -> running       {spread_ms(roots)}  = {median(roots) / f:.2f}x")
    first = median(first_request)
    print(f"rlm_spawn -> first model request       {spread_ms(first_request)}  = {first / f:.2f}x")

    total = median(settled["total"])
    rows = [
        Row(
            BENCH,
            "rlm_spawn -> child running (settled)",
            total,
            "s",
            f,
            f"<= {TARGET_RATIO:g}x floor",
            total / f <= TARGET_RATIO,
        ),
        Row(
            BENCH,
            "rlm_spawn -> child running (back-to-back)",
            median(back_to_back["total"]),
            "s",
            f,
        ),
        Row(BENCH, "  of which request (settled)", median(settled["request"]), "s", f),
        Row(BENCH, "  of which admission (settled)", median(settled["admission"]), "s", f),
        Row(BENCH, "  of which start (settled)", median(settled["start"]), "s", f),
        Row(BENCH, "Supervisor.spawn -> root running", median(roots), "s", f),
        Row(
            BENCH,
            "rlm_spawn -> child's first model request (settled)",
            first,
            "s",
            f,
            f"<= {FIRST_REQUEST_TARGET:g}x floor",
            first / f <= FIRST_REQUEST_TARGET,
        ),
    ]
    print(f"\nheadline: {total * MS:.3f} ms = {total / f:.2f}x the fork floor of {f * MS:.3f} ms")
    finish(BENCH, rows, left, args.json)


if __name__ == "__main__":
    main()

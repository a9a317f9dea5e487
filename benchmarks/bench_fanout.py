"""Fan-out: 1,000 children of one scripted turn each, under max_concurrency=16.

Every child replies "```repl\\nFINAL('x')\\n```", so all the time is brood's: admission,
journal, a worker per child from the zygote, messages, cleanup. The model is a
ScriptedModel of text replies, which the gateway answers on the supervisor's loop (it is
`instant`), as it awaits a served model's client there: no thread hop per turn. The root
starts them in one step, timed inside its own code from the call to the last answer, in
two ways:
`rlm_query_batched(prompts)`, and `rlm_spawn` for each prompt then `rlm_wait_all`.

The floor is a bare asyncio loop making the same scripted model calls (ScriptedModel.complete
on the messages each child's first turn sees, captured from a real child first) as 1,000
tasks behind a semaphore of 16, with no processes. The ratio says how many times more a
child costs than its model call alone.

CPU per child is split between the supervisor process (this one: loop, journal writer) and
the zygote with every worker it forked and reaped (user + system time of both).

A second floor, the fork-all floor, holds brood to what the machine can do with processes:
in the same run (before and after the fan-outs, median of both), this process forks 1,000
bare children, 16 at a time, each writing one byte to a pipe and exiting, read and reaped
here. Its throughput over brood's (floor time / brood time, from the root's own clock) is
the figure held to >= 0.45x: brood's child is a process too, so the ratio says how much of
a child's cost is brood's rather than the kernel's. CPU per child is held to <= 5 ms for the
zygote and workers (confinement on) and <= 1.2 ms for the supervisor.

The journal's share of the fan-out is the time the store's writer thread spent in its
transactions (executing and committing, `SQLStore.statistics()["busy_s"]`) over the
fan-out's wall time (sup.run), target < 10%. That is an upper bound of what the journal
costs the fan-out: the writer runs beside the loop, and its busy time includes the time
it waits for the GIL while the loop thread runs (its CPU time alone, `cpu_s`, is printed
next to it). bench_journal measures the same share end to end against a journal that keeps
nothing. Statements and commits per child are printed from the same statistics.
"""

from __future__ import annotations

import ast
import asyncio
import json
import os
import tempfile
import time
from typing import Any

import psutil

import brood
from _common import (
    MS,
    Row,
    finish,
    median,
    no_leftovers,
    parse_args,
    run_completed,
    zygote_pid,
)

BENCH = "fanout"
CHILDREN = 1000
CONCURRENCY = 16
WARM_UP = 50  # children of a first, untimed root: first-use costs on both sides
FLOOR_REPEATS = 5
FORK_FLOOR_REPEATS = 3  # before the fan-outs, and as many after
TARGET_FORK_RATIO = 0.45
TARGET_WORKER_CPU_S = 0.005  # zygote + workers, per child, confinement on
TARGET_SUPERVISOR_CPU_S = 0.0012
TARGET_JOURNAL_SHARE = 0.10
CHILD_REPLY = "```repl\nFINAL('x')\n```"

BATCHED = """```repl
import time
t0 = time.perf_counter()
answers = rlm_query_batched([f'child {{i}}' for i in range({n})])
FINAL(repr((time.perf_counter() - t0, len(answers), sorted(set(answers)))))
```"""

SPAWN_WAIT_ALL = """```repl
import time
t0 = time.perf_counter()
hs = [rlm_spawn(f'child {{i}}') for i in range({n})]
answers = rlm_wait_all(hs)
FINAL(repr((time.perf_counter() - t0, len(answers), sorted(set(answers)))))
```"""


def captured_messages(limits: brood.Limits) -> list[dict[str, Any]]:
    """The messages of a real child's first model turn ('child 0'), as its worker sent them."""
    fd, path = tempfile.mkstemp(prefix="bench-fanout-", suffix=".json")
    os.close(fd)

    def capture(messages: list[dict[str, Any]]) -> str:
        with open(path, "w") as f:
            json.dump(messages, f)
        return CHILD_REPLY

    model = brood.ScriptedModel(
        {"capture": ["```repl\nFINAL(rlm_query('child 0'))\n```"], "child": [capture]}
    )
    try:
        with brood.Supervisor(model=model, limits=limits) as sup:
            run_completed(sup, "capture: one child")
        with open(path) as f:
            messages: list[dict[str, Any]] = json.load(f)
    finally:
        os.unlink(path)
    return messages


def floor_seconds(model: brood.ScriptedModel, first: list[dict[str, Any]]) -> float:
    """One run of the asyncio floor: 1,000 scripted calls, 16 at a time, no processes.

    `first` holds child 0's messages; child i's differ only in its task."""
    messages = [
        [{**m, "content": str(m["content"]).replace("child 0", f"child {i}")} for m in first]
        for i in range(CHILDREN)
    ]

    async def calls() -> list[str]:
        sem = asyncio.Semaphore(CONCURRENCY)

        async def one(msgs: list[dict[str, Any]]) -> str:
            async with sem:
                await asyncio.sleep(0)  # a turn of the loop, as a child's messages would take
                return model.complete(msgs).text

        return await asyncio.gather(*(one(m) for m in messages))

    t0 = time.perf_counter()
    replies = asyncio.run(calls())
    elapsed = time.perf_counter() - t0
    assert replies == [CHILD_REPLY] * CHILDREN, "the floor made different calls"
    return elapsed


def fork_all_seconds(n: int, concurrency: int) -> float:
    """Fork `n` bare children, `concurrency` at a time; each writes a byte to a pipe and
    exits, and is read and reaped here. Seconds from the first fork to the last reap.

    Measured with no supervisor open, so every child this process has is one of these."""
    r, w = os.pipe()
    live: set[int] = set()
    started = 0
    try:
        t0 = time.perf_counter()
        while started < n or live:
            while len(live) < concurrency and started < n:
                pid = os.fork()
                if pid == 0:
                    os.write(w, b"x")
                    os._exit(0)
                live.add(pid)
                started += 1
            os.read(r, 1)
            pid, _ = os.waitpid(-1, 0)
            live.discard(pid)
        return time.perf_counter() - t0
    finally:
        os.close(r)
        os.close(w)


def cpu_seconds(proc: psutil.Process, *, children: bool) -> float:
    t = proc.cpu_times()
    own = t.user + t.system
    return own + t.children_user + t.children_system if children else own


def fan_out(key: str, model: brood.ScriptedModel, limits: brood.Limits) -> dict[str, float]:
    """One root fanning out, on a supervisor of its own, after an untimed warm-up root."""
    with brood.Supervisor(model=model, limits=limits) as sup:
        run_completed(sup, "warm-up: fan out")
        me = psutil.Process()
        zygote = psutil.Process(zygote_pid(sup))
        sup.store.flush()
        journal = sup.store.statistics()  # type: ignore[attr-defined]
        sup_cpu, zyg_cpu = cpu_seconds(me, children=False), cpu_seconds(zygote, children=True)
        t0 = time.perf_counter()
        res = run_completed(sup, f"{key}: fan out")
        wall = time.perf_counter() - t0
        sup_cpu = cpu_seconds(me, children=False) - sup_cpu
        worker_cpu = cpu_seconds(zygote, children=True) - zyg_cpu
        sup.store.flush()  # the fan-out's last writes, committed before they are counted
        after = sup.store.statistics()  # type: ignore[attr-defined]
    inside, count, answers = ast.literal_eval(res.answer or "")
    if count != CHILDREN or answers != ["x"]:
        raise RuntimeError(f"the {key} root collected {count} answers {answers}")
    spent = {k: after[k] - journal.get(k, 0) for k in after}
    return {
        "inside": inside,
        "wall": wall,
        "sup_cpu": sup_cpu,
        "worker_cpu": worker_cpu,
        "journal_busy": spent["busy_s"],
        "journal_cpu": spent.get("cpu_s", 0.0),
        "statements": spent.get("statements", 0.0),
        "commits": spent["batches"],
    }


def main() -> None:
    args = parse_args(__doc__ or "")
    model = brood.ScriptedModel(
        {
            "warm-up": [BATCHED.format(n=WARM_UP)],
            "batched": [BATCHED.format(n=CHILDREN)],
            "spawn-wait-all": [SPAWN_WAIT_ALL.format(n=CHILDREN)],
            "child": [CHILD_REPLY],
        }
    )
    limits = brood.Limits(
        max_concurrency=CONCURRENCY,
        max_children=2 * CHILDREN,
        max_children_per_run=2 * CHILDREN,
        step_timeout=None,
        shutdown_grace=0.5,
        term_grace=0.5,
    )
    first = captured_messages(limits)
    floor = median([floor_seconds(model, first) for _ in range(FLOOR_REPEATS)])
    forks = [fork_all_seconds(CHILDREN, CONCURRENCY) for _ in range(FORK_FLOOR_REPEATS)]
    results = {key: fan_out(key, model, limits) for key in ("batched", "spawn-wait-all")}
    forks += [fork_all_seconds(CHILDREN, CONCURRENCY) for _ in range(FORK_FLOOR_REPEATS)]
    fork_floor = median(forks)
    left = no_leftovers(BENCH)

    print(
        f"floor  asyncio, {CHILDREN} ScriptedModel.complete calls, {CONCURRENCY} at a time: "
        f"{floor * MS:.1f} ms = {CHILDREN / floor:,.0f} calls/s"
    )
    print(
        f"floor  fork-all, {CHILDREN} bare forks + pipe byte + reap, {CONCURRENCY} at a time: "
        f"median {fork_floor * MS:.0f} ms (" + ", ".join(f"{x * MS:.0f}" for x in forks) + ")"
    )
    rows = []
    per_floor = floor / CHILDREN
    for key, r in results.items():
        per_child = r["inside"] / CHILDREN
        print(
            f"{key:<15} {CHILDREN} children in {r['inside'] * MS:.0f} ms "
            f"(sup.run wall {r['wall'] * MS:.0f} ms) = {CHILDREN / r['inside']:,.0f} children/s, "
            f"{per_child / per_floor:.0f}x the floor; CPU per child: supervisor "
            f"{r['sup_cpu'] / CHILDREN * MS:.2f} ms, zygote + workers "
            f"{r['worker_cpu'] / CHILDREN * MS:.2f} ms"
        )
        ratio = fork_floor / r["inside"]
        share = r["journal_busy"] / r["wall"]
        print(
            f"{'':<15} fork-all floor / brood = {ratio:.2f}x; journal: "
            f"{r['statements'] / CHILDREN:.1f} statements and {r['commits'] / CHILDREN:.2f} "
            f"commits per child, writer busy {share:.1%} of the wall time "
            f"(its CPU {r['journal_cpu'] / r['wall']:.1%})"
        )
        rows += [
            Row(
                BENCH,
                f"fork-all floor / fan-out time ({key})",
                ratio,
                "x",
                None,
                f">= {TARGET_FORK_RATIO:g}x",
                ratio >= TARGET_FORK_RATIO,
            ),
            Row(
                BENCH,
                f"  journal writer busy, share of wall ({key})",
                share * 100,
                "%",
                None,
                f"< {TARGET_JOURNAL_SHARE:.0%}",
                share < TARGET_JOURNAL_SHARE,
            ),
            Row(BENCH, f"  journal statements per child ({key})", r["statements"] / CHILDREN, ""),
            Row(BENCH, f"  journal commits per child ({key})", r["commits"] / CHILDREN, ""),
            Row(BENCH, f"children/s ({key})", CHILDREN / r["inside"], "/s"),
            Row(BENCH, f"time per child ({key})", per_child, "s", per_floor),
            Row(
                BENCH,
                f"  supervisor CPU per child ({key})",
                r["sup_cpu"] / CHILDREN,
                "s",
                None,
                f"<= {TARGET_SUPERVISOR_CPU_S * MS:g} ms",
                r["sup_cpu"] / CHILDREN <= TARGET_SUPERVISOR_CPU_S,
            ),
            Row(
                BENCH,
                f"  worker CPU per child ({key})",
                r["worker_cpu"] / CHILDREN,
                "s",
                None,
                f"<= {TARGET_WORKER_CPU_S * MS:g} ms",
                r["worker_cpu"] / CHILDREN <= TARGET_WORKER_CPU_S,
            ),
        ]
    finish(BENCH, rows, left, args.json)


if __name__ == "__main__":
    main()

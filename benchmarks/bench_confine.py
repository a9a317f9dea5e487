"""Confinement on vs off: what kernel confinement of workers costs (DESIGN.md section 14).

Two supervisors are open side by side, one with Limits(confine=True) (the default: rlimits,
Landlock, capability drop, private network, a cgroup per worker) and one with
Limits(confine=False); the series below alternate between them, in the same process and
in alternating order, so drift of the machine falls on both alike. Confine off is the floor.

  spawn    rlm_spawn -> the child's first line runs, children started one at a time with a
           pause between them (bench_spawn's settled series: both ends stamped with
           time.time() inside model code). Target: median on <= 1.2x off.
  fan-out  a root starts 200 children at once with rlm_query_batched and collects their
           answers (max_concurrency=16), timed inside its own code. Target: median on
           <= 1.2x off. CPU per child is split as in bench_fanout: this process (loop,
           journal) and the zygote with every worker it forked and reaped (where the
           confinement itself is paid), user and system time.
  memory   USS of warm idle workers in each supervisor's pool, once every worker has
           confined itself and started its reader thread, before and after the runs. The
           design target for an idle worker is under 12 MiB; the on/off ratio is reported.
"""

from __future__ import annotations

import ast
import logging
import time

import psutil

import brood
from _common import (
    MIB,
    MS,
    Row,
    finish,
    idle_worker_pids,
    median,
    no_leftovers,
    parse_args,
    run_completed,
    spread_ms,
    wait_until,
    zygote_pid,
)
from bench_spawn import CHILD_REPLY, child_series, parent_reply
from brood.backends.local import WARM_WORKERS

BENCH = "confine"
ROUNDS = 4  # alternating spawn series per mode
SPAWNS = 25  # children per spawn series: ROUNDS * SPAWNS samples per mode
SETTLE_S = 0.02  # pause between spawns, as in bench_spawn's settled series
FANOUT = 200  # children of one fan-out root
FANOUT_ROUNDS = 3  # alternating fan-outs per mode
CONCURRENCY = 16
WARM_UP = 20  # children of an untimed first spawn series and fan-out, per mode
POOL_SETTLE_S = 0.5  # after the pool is full, before its workers are measured
TARGET_RATIO = 1.2
TARGET_BYTES = 12 * MIB

FANOUT_REPLY = """```repl
import time
t0 = time.perf_counter()
answers = rlm_query_batched([f'leaf {{i}}' for i in range({n})])
FINAL(repr((time.perf_counter() - t0, len(answers), sorted(set(answers)))))
```"""
LEAF_REPLY = "```repl\nFINAL('x')\n```"

MODES = ("on", "off")


def uss(pid: int) -> int:
    return int(psutil.Process(pid).memory_full_info().uss)


def pool_ready(sup: brood.Supervisor) -> bool:
    """The warm pool is full and every worker in it has confined itself (confinement runs
    before the worker starts its first thread, the reader of its link)."""
    pids = idle_worker_pids(sup)
    try:
        return len(pids) >= WARM_WORKERS and all(psutil.Process(p).num_threads() >= 2 for p in pids)
    except psutil.NoSuchProcess:
        return False


def wait_pool(sup: brood.Supervisor) -> None:
    wait_until(lambda: pool_ready(sup), 30.0, "a full warm pool")


def idle_uss(sup: brood.Supervisor) -> list[int]:
    wait_pool(sup)
    time.sleep(POOL_SETTLE_S)
    wait_pool(sup)
    return [uss(pid) for pid in idle_worker_pids(sup)]


def cpu(proc: psutil.Process, *, children: bool) -> tuple[float, float]:
    """User and system CPU seconds of `proc` (with its reaped children when `children`)."""
    t = proc.cpu_times()
    if children:
        return t.user + t.children_user, t.system + t.children_system
    return t.user, t.system


def fan_out(sup: brood.Supervisor, key: str) -> dict[str, float]:
    """Seconds inside the root's code from the call to the last answer, of sup.run, and the
    CPU seconds (user, system) of the supervisor and of the zygote with its workers."""
    wait_pool(sup)
    me, zygote = psutil.Process(), psutil.Process(zygote_pid(sup))
    sup0, zyg0 = cpu(me, children=False), cpu(zygote, children=True)
    t0 = time.perf_counter()
    res = run_completed(sup, f"{key}: fan out")
    wall = time.perf_counter() - t0
    wait_pool(sup)  # the last workers reaped, the pool refilled: their CPU is counted
    sup1, zyg1 = cpu(me, children=False), cpu(zygote, children=True)
    inside, count, answers = ast.literal_eval(res.answer or "")
    if count != (WARM_UP if key.startswith("warm-up") else FANOUT) or answers != ["x"]:
        raise RuntimeError(f"the {key} root collected {count} answers {answers}")
    return {
        "inside": inside,
        "wall": wall,
        "sup_user": sup1[0] - sup0[0],
        "sup_sys": sup1[1] - sup0[1],
        "zyg_user": zyg1[0] - zyg0[0],
        "zyg_sys": zyg1[1] - zyg0[1],
    }


def spawn_series(sup: brood.Supervisor, key: str) -> list[float]:
    wait_pool(sup)
    return child_series(sup, key)["total"]


def main() -> None:
    args = parse_args(__doc__ or "")
    logging.getLogger("brood").setLevel(logging.ERROR)  # confine=False warns: expected here
    model = brood.ScriptedModel(
        {
            "warm-up spawns": [parent_reply(WARM_UP, SETTLE_S)],
            "spawns": [parent_reply(SPAWNS, SETTLE_S)],
            "warm-up fan-out": [FANOUT_REPLY.format(n=WARM_UP)],
            "fan-out": [FANOUT_REPLY.format(n=FANOUT)],
            "child": [CHILD_REPLY],
            "leaf": [LEAF_REPLY],
        }
    )

    def limits(confine: bool) -> brood.Limits:
        return brood.Limits(
            confine=confine,
            max_concurrency=CONCURRENCY,
            max_children=2 * FANOUT,
            max_children_per_run=FANOUT,
            step_timeout=None,
            shutdown_grace=0.5,
            term_grace=0.5,
        )

    spawn: dict[str, list[float]] = {m: [] for m in MODES}
    fans: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    with (
        brood.Supervisor(model=model, limits=limits(True)) as on,
        brood.Supervisor(model=model, limits=limits(False)) as off,
    ):
        sups = {"on": on, "off": off}
        idle = {m: idle_uss(s) for m, s in sups.items()}
        for m, s in sups.items():
            child_series(s, f"warm-up spawns {m}")
            fan_out(s, f"warm-up fan-out {m}")
        for r in range(ROUNDS):
            for m in MODES if r % 2 == 0 else MODES[::-1]:
                spawn[m] += spawn_series(sups[m], f"spawns {m} {r}")
        for r in range(FANOUT_ROUNDS):
            for m in MODES if r % 2 == 0 else MODES[::-1]:
                fans[m].append(fan_out(sups[m], f"fan-out {m} {r}"))
        for m, s in sups.items():
            idle[m] += idle_uss(s)
    left = no_leftovers(BENCH)

    sp = {m: median(spawn[m]) for m in MODES}
    inside = {m: [f["inside"] for f in fans[m]] for m in MODES}
    fo = {m: median(inside[m]) for m in MODES}

    def per_child(m: str, what: str) -> float:
        return median([f[what] for f in fans[m]]) / FANOUT

    mem = {m: median(idle[m]) for m in MODES}
    for m in MODES:
        print(f"spawn -> running, confine {m:<3}  {spread_ms(spawn[m])}")
    print(f"  on/off {sp['on'] / sp['off']:.2f}x")
    for m in MODES:
        walls = [f["wall"] for f in fans[m]]
        print(
            f"fan-out of {FANOUT}, confine {m:<3}  "
            f"{', '.join(f'{x * MS:.0f}' for x in inside[m])} ms inside the root "
            f"(sup.run wall {', '.join(f'{w * MS:.0f}' for w in walls)} ms); "
            f"{median(inside[m]) / FANOUT * MS:.2f} ms per child"
        )
        print(
            f"  CPU per child: supervisor {per_child(m, 'sup_user') * MS:.2f} user + "
            f"{per_child(m, 'sup_sys') * MS:.2f} sys ms; zygote + workers "
            f"{per_child(m, 'zyg_user') * MS:.2f} user + {per_child(m, 'zyg_sys') * MS:.2f} sys ms"
        )
    print(f"  on/off {fo['on'] / fo['off']:.2f}x")
    for m in MODES:
        sizes = ", ".join(f"{b / MIB:.2f}" for b in idle[m])
        print(f"idle worker USS, confine {m:<3}  {sizes} MiB")
    print(f"  on/off {mem['on'] / mem['off']:.2f}x")

    rows = [
        Row(
            BENCH,
            "rlm_spawn -> child running, on vs off",
            sp["on"],
            "s",
            sp["off"],
            f"<= {TARGET_RATIO:g}x off",
            sp["on"] / sp["off"] <= TARGET_RATIO,
        ),
        Row(
            BENCH,
            f"fan-out of {FANOUT} children, on vs off",
            fo["on"],
            "s",
            fo["off"],
            f"<= {TARGET_RATIO:g}x off",
            fo["on"] / fo["off"] <= TARGET_RATIO,
        ),
        Row(
            BENCH,
            "  zygote + worker CPU per child, on vs off",
            per_child("on", "zyg_user") + per_child("on", "zyg_sys"),
            "s",
            per_child("off", "zyg_user") + per_child("off", "zyg_sys"),
        ),
        Row(
            BENCH,
            "  supervisor CPU per child, on vs off",
            per_child("on", "sup_user") + per_child("on", "sup_sys"),
            "s",
            per_child("off", "sup_user") + per_child("off", "sup_sys"),
        ),
        Row(
            BENCH,
            "idle worker USS, on vs off",
            mem["on"],
            "B",
            mem["off"],
            f"< {TARGET_BYTES // MIB} MiB",
            max(idle["on"]) < TARGET_BYTES,
        ),
        Row(
            BENCH,
            "idle worker USS, confine off",
            mem["off"],
            "B",
        ),
    ]
    finish(BENCH, rows, left, args.json)


if __name__ == "__main__":
    main()

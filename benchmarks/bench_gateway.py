"""The model gateway's hop: what one `llm_query` costs now that the supervisor makes it.

A worker holds no model (DESIGN.md section 14): its `llm_query` sends a ModelReq frame to
the supervisor, whose loop validates it, runs the chat_fn in the gateway's thread pool,
journals the call and sends the Reply back. Model code in a root run makes 2,000
sequential `llm_query("q")` calls against a scripted, instant chat_fn, timed inside the
REPL block with time.perf_counter; then `llm_query_batched(["q"] * 64)` 30 times, timed
the same way (per call amortized). Each series runs in runs of its own, three times; the
median run is reported.

Two references are measured in this process, before and after the runs:

  floor       the same chat_fn called directly 2,000 times, building the same message list
              each call: what the worker did before the gateway (an in-process call)
  socketpair  a bare request/reply round trip between two processes: a ModelReq frame
              (brood.protocol SyncChannel, msgspec) sent over a socketpair and a Reply
              frame sent back by a forked echo process

Reported: per-call time through the gateway, its ratio to the in-process call, the hop's
added cost (the difference) and that as a multiple of the socketpair round trip, and the
supervisor's CPU per call. Targets: supervisor CPU per llm_query <= TARGET_CPU_US, and
the hop <= TARGET_HOP_RATIO x the socketpair round trip.
"""

from __future__ import annotations

import ast
import os
import socket
import time
from typing import Any

import psutil

import brood
from _common import Row, finish, median, no_leftovers, parse_args, run_completed
from brood.protocol import ModelReq, Reply, SyncChannel

BENCH = "gateway"
CALLS = 2000  # sequential llm_query calls per run
BATCH = 64  # prompts per llm_query_batched call
BATCHES = 30  # llm_query_batched calls per run
WARM_UP = 50  # untimed calls at the start of each run's block
REPEATS = 3  # runs per series; the median is reported
FLOOR_SAMPLES = 5  # per half (before and after the runs), each of CALLS calls
US = 1e6
TARGET_CPU_US = 100.0  # supervisor CPU per llm_query: ~10,000 model calls/s per core
TARGET_HOP_RATIO = 4.0  # the hop's added cost, in bare socketpair round trips

SINGLE = f"""```repl
import time
for _ in range({WARM_UP}):
    llm_query('q')
t0 = time.perf_counter()
replies = set()
for _ in range({CALLS}):
    replies.add(llm_query('q'))
elapsed = time.perf_counter() - t0
FINAL(repr((elapsed / {CALLS} * 1e6, sorted(replies))))
```"""

BATCHED = f"""```repl
import time
llm_query_batched(['q'] * {BATCH})
t0 = time.perf_counter()
replies = set()
for _ in range({BATCHES}):
    replies.update(llm_query_batched(['q'] * {BATCH}))
elapsed = time.perf_counter() - t0
FINAL(repr((elapsed / ({BATCHES} * {BATCH}) * 1e6, sorted(replies))))
```"""


def chat_fn(messages: list[dict[str, Any]], model: str | None = None) -> str:
    """Instant: "a" to every plain call; the root's one turn gets its REPL block."""
    content = messages[-1]["content"]
    if content == "q":
        return "a"
    return BATCHED if content.startswith("batched") else SINGLE


def in_process_seconds() -> float:
    """Seconds per call of CALLS direct chat_fn calls, each building its message list."""
    t0 = time.perf_counter()
    for _ in range(CALLS):
        reply = chat_fn([{"role": "user", "content": "q"}])
    elapsed = time.perf_counter() - t0
    assert reply == "a"
    return elapsed / CALLS


def socketpair_seconds() -> float:
    """Seconds per round trip of CALLS ModelReq -> Reply frames to a forked echo process."""
    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        ours.close()
        chan = SyncChannel.over_socket(theirs)
        while (msg := chan.recv()) is not None:
            assert isinstance(msg, ModelReq)
            chan.send(Reply(msg.req_id, value="a"))
        os._exit(0)
    theirs.close()
    chan = SyncChannel.over_socket(ours)
    try:
        t0 = 0.0
        for i in range(WARM_UP + CALLS):
            if i == WARM_UP:
                t0 = time.perf_counter()
            chan.send(
                ModelReq(
                    req_id=i + 1,
                    kind="llm_query",
                    messages=[{"role": "user", "content": "q"}],
                )
            )
            reply = chan.recv()
            assert isinstance(reply, Reply) and reply.value == "a"
        return (time.perf_counter() - t0) / CALLS
    finally:
        chan.close()
        ours.close()
        os.waitpid(pid, 0)


def references() -> tuple[list[float], list[float]]:
    return (
        [in_process_seconds() for _ in range(FLOOR_SAMPLES)],
        [socketpair_seconds() for _ in range(FLOOR_SAMPLES)],
    )


def series(sup: brood.Supervisor, key: str) -> tuple[list[float], list[float]]:
    """Seconds per call inside the model code, and supervisor CPU seconds per call, of
    REPEATS runs of one series."""
    calls = CALLS if key == "single" else BATCH * BATCHES
    me = psutil.Process()
    per_call, cpu = [], []
    for i in range(REPEATS):
        t = me.cpu_times()
        res = run_completed(sup, f"{key} {i}: sequential model calls")
        t2 = me.cpu_times()
        us, replies = ast.literal_eval(res.answer or "")
        if replies != ["a"]:
            raise RuntimeError(f"the {key} run got replies {replies}")
        per_call.append(us / US)
        cpu.append((t2.user + t2.system - t.user - t.system) / calls)
    return per_call, cpu


def main() -> None:
    args = parse_args(__doc__ or "")
    floor, pair = references()
    limits = brood.Limits(step_timeout=None, shutdown_grace=0.5, term_grace=0.5)
    with brood.Supervisor(model=chat_fn, limits=limits) as sup:
        run_completed(sup, "single warm-up: first-use costs on both sides")
        single, single_cpu = series(sup, "single")
        batched, batched_cpu = series(sup, "batched")
    more_floor, more_pair = references()
    floor += more_floor
    pair += more_pair
    left = no_leftovers(BENCH)

    f, p = median(floor), median(pair)
    g, b = median(single), median(batched)
    hop = g - f
    print(f"floor       chat_fn called in-process      {f * US:8.3f} us/call")
    print(f"reference   socketpair ModelReq -> Reply   {p * US:8.3f} us/round trip")
    print(
        f"llm_query through the gateway              {g * US:8.3f} us/call "
        f"(runs: {', '.join(f'{x * US:.1f}' for x in single)}) = {g / f:,.0f}x the floor"
    )
    print(
        f"  hop's added cost                         {hop * US:8.3f} us/call "
        f"= {hop / p:.2f}x the socketpair round trip"
    )
    print(f"  supervisor CPU                           {median(single_cpu) * US:8.3f} us/call")
    print(
        f"llm_query_batched([q] * {BATCH}), amortized     {b * US:8.3f} us/call "
        f"(runs: {', '.join(f'{x * US:.1f}' for x in batched)})"
    )
    print(f"  supervisor CPU                           {median(batched_cpu) * US:8.3f} us/call")

    def us(x: float) -> float:
        return round(x * US, 3)

    rows = [
        Row(BENCH, "llm_query via gateway, per call", us(g), "us", us(f)),
        Row(
            BENCH,
            "  hop's added cost per call (vs socketpair)",
            us(hop),
            "us",
            us(p),
            f"<= {TARGET_HOP_RATIO:g}x",
            hop <= TARGET_HOP_RATIO * p,
        ),
        Row(
            BENCH,
            "  supervisor CPU per call",
            us(median(single_cpu)),
            "us",
            None,
            f"<= {TARGET_CPU_US:g} us",
            median(single_cpu) * US <= TARGET_CPU_US,
        ),
        Row(BENCH, f"llm_query_batched x{BATCH}, per call", us(b), "us", us(f)),
        Row(BENCH, "  supervisor CPU per call (batched)", us(median(batched_cpu)), "us"),
        Row(BENCH, "socketpair ModelReq/Reply round trip", us(p), "us"),
    ]
    print(
        f"\nheadline: {g * US:.1f} us per llm_query, {hop * US:.1f} us of it the hop "
        f"({hop / p:.1f}x a bare socketpair round trip of {p * US:.1f} us)"
    )
    finish(BENCH, rows, left, args.json)


if __name__ == "__main__":
    main()

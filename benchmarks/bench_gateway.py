"""The model gateway's hop: what one `llm_query` costs now that the supervisor makes it.

A worker holds no model (DESIGN.md section 14): its `llm_query` sends a ModelReq frame to
the supervisor, whose loop validates it, makes the call, journals it and sends the Reply
back. A model is called one of two ways, and both are measured:

  awaited   the model's `acomplete` (or an `async def` chat_fn) is awaited on the
            supervisor's loop: the path of every provider (openai:, anthropic:, gemini:,
            and so vLLM, Ollama, llama.cpp's server). Here an instant `async def` chat_fn.
  threaded  a plain `def` chat_fn runs in the gateway's threads (it may block), so each
            call hops to a thread and back. Here the same instant chat_fn as a `def`.

Model code in a root run makes 2,000 sequential `llm_query("q")` calls, timed inside the
REPL block with time.perf_counter; then `llm_query_batched(["q"] * 64)` 30 times, timed
the same way (per call amortized). Each series runs in runs of its own, three times; the
median run is reported. Supervisor CPU is this process's (every thread: loop, gateway
threads, journal writer) over the run, per call.

References measured in this process, before and after the runs:

  floor       the chat_fn called directly 2,000 times, building the same message list
              each call: what the worker did before the gateway (an in-process call)
  socketpair  a bare request/reply round trip between two processes: a ModelReq frame
              (brood.protocol SyncChannel, msgspec) sent over a socketpair and a Reply
              frame sent back by a forked echo process
  loop        the supervisor's side with nothing of brood's: an asyncio loop answering
              ModelReq frames from a forked process (read into one buffer, decoded and
              encoded as brood does), directly, and with one thread hop (a queue to a
              thread, call_soon_threadsafe back): the CPU this process spends per call.
              What a loop and a thread cost on this machine, which brood's supervisor CPU
              is compared with

Targets, for the awaited path (the path a served model's calls take): supervisor CPU per
llm_query <= TARGET_CPU_US, and the hop <= TARGET_HOP_RATIO x the socketpair round trip.
The threaded path is reported against its own floor (the loop with a thread hop).
"""

from __future__ import annotations

import ast
import asyncio
import os
import queue
import socket
import threading
import time
from typing import Any

import psutil

import brood
from _common import Row, finish, median, no_leftovers, parse_args, run_completed
from brood.protocol import HEADER, ModelReq, Reply, SyncChannel, decode_worker, encode

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


async def async_chat_fn(messages: list[dict[str, Any]], model: str | None = None) -> str:
    """chat_fn, awaited on the supervisor's loop (the path of a provider's client)."""
    return chat_fn(messages, model)


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


class _Answering(asyncio.BufferedProtocol):
    """The loop floor's server: reads into one buffer (as brood's WorkerFrames does), cuts
    frames, decodes each as the supervisor does and sends a Reply, at once or after a hop
    to `hop`'s thread and back."""

    def __init__(self, done: asyncio.Future[None], hop: queue.SimpleQueue[Any] | None) -> None:
        self.done, self.hop = done, hop
        self.buf = memoryview(bytearray(256 * 1024))
        self.have = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.buf[self.have :]

    def buffer_updated(self, nbytes: int) -> None:
        self.have += nbytes
        pos = 0
        while self.have - pos >= HEADER.size:
            end = pos + HEADER.size + HEADER.unpack_from(self.buf, pos)[0]
            if self.have < end:
                break
            msg = decode_worker(self.buf[pos + HEADER.size : end])
            pos = end
            assert isinstance(msg, ModelReq)
            if self.hop is None:
                self.transport.write(encode(Reply(msg.req_id, value="a")))
            else:
                self.hop.put((asyncio.get_running_loop(), self._answer, msg.req_id))
        rest = self.have - pos
        self.buf[:rest] = self.buf[pos : self.have]
        self.have = rest

    def _answer(self, req_id: int, value: str) -> None:
        self.transport.write(encode(Reply(req_id, value=value)))

    def connection_lost(self, exc: Exception | None) -> None:
        self.done.set_result(None)


def _hop_thread(jobs: queue.SimpleQueue[Any]) -> None:
    while (job := jobs.get()) is not None:
        loop, answer, req_id = job
        loop.call_soon_threadsafe(answer, req_id, "a")


def loop_cpu_seconds(hop: bool) -> float:
    """This process's CPU seconds per call of an asyncio loop answering CALLS ModelReq
    frames from a forked process, directly or through a thread."""
    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        ours.close()
        chan = SyncChannel.over_socket(theirs)
        for i in range(WARM_UP + CALLS):
            chan.send(
                ModelReq(
                    req_id=i + 1, kind="llm_query", messages=[{"role": "user", "content": "q"}]
                )
            )
            assert isinstance(chan.recv(), Reply)
        os._exit(0)
    theirs.close()
    jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
    thread = threading.Thread(target=_hop_thread, args=(jobs,), daemon=True)
    thread.start()

    async def serve() -> None:
        done = asyncio.get_running_loop().create_future()
        await asyncio.get_running_loop().connect_accepted_socket(
            lambda: _Answering(done, jobs if hop else None), ours
        )
        await done

    try:
        t = time.process_time()
        asyncio.run(serve())
        return (time.process_time() - t) / (WARM_UP + CALLS)
    finally:
        jobs.put(None)
        thread.join()
        os.waitpid(pid, 0)


def references() -> dict[str, list[float]]:
    return {
        "floor": [in_process_seconds() for _ in range(FLOOR_SAMPLES)],
        "pair": [socketpair_seconds() for _ in range(FLOOR_SAMPLES)],
        "loop": [loop_cpu_seconds(hop=False) for _ in range(FLOOR_SAMPLES)],
        "loop_hop": [loop_cpu_seconds(hop=True) for _ in range(FLOOR_SAMPLES)],
    }


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


def path(model: Any) -> dict[str, list[float]]:
    """The four series of one way of calling the model: seconds per call (in the model
    code) and supervisor CPU seconds per call, single and batched."""
    limits = brood.Limits(step_timeout=None, shutdown_grace=0.5, term_grace=0.5)
    with brood.Supervisor(model=model, limits=limits) as sup:
        run_completed(sup, "single warm-up: first-use costs on both sides")
        single, single_cpu = series(sup, "single")
        batched, batched_cpu = series(sup, "batched")
    return {
        "single": single,
        "single_cpu": single_cpu,
        "batched": batched,
        "batched_cpu": batched_cpu,
    }


def main() -> None:
    args = parse_args(__doc__ or "")
    refs = references()
    paths = {"awaited": path(async_chat_fn), "threaded": path(chat_fn)}
    for key, more in references().items():
        refs[key] += more
    left = no_leftovers(BENCH)

    f, p = median(refs["floor"]), median(refs["pair"])
    loop, loop_hop = median(refs["loop"]), median(refs["loop_hop"])
    print(f"floor       chat_fn called in-process      {f * US:8.3f} us/call")
    print(f"reference   socketpair ModelReq -> Reply   {p * US:8.3f} us/round trip")
    print(f"loop floor  asyncio loop answering frames  {loop * US:8.3f} us CPU/call")
    print(f"            ... with one thread hop        {loop_hop * US:8.3f} us CPU/call")

    def us(x: float) -> float:
        return round(x * US, 3)

    rows: list[Row] = []
    for name, r in paths.items():
        g, b = median(r["single"]), median(r["batched"])
        cpu, hop = median(r["single_cpu"]), g - f
        cpu_floor = loop if name == "awaited" else loop_hop
        print(
            f"{name:9s} llm_query through the gateway    {g * US:8.3f} us/call "
            f"(runs: {', '.join(f'{x * US:.1f}' for x in r['single'])})"
        )
        print(
            f"            hop's added cost               {hop * US:8.3f} us/call "
            f"= {hop / p:.2f}x the socketpair round trip"
        )
        print(
            f"            supervisor CPU                 {cpu * US:8.3f} us/call "
            f"= {cpu / cpu_floor:.2f}x its loop floor"
        )
        print(
            f"            llm_query_batched x{BATCH}, amortized {b * US:8.3f} us/call, "
            f"supervisor CPU {median(r['batched_cpu']) * US:.3f} us/call"
        )
        held = name == "awaited"  # the targets: the path a served model's calls take
        rows += [
            Row(BENCH, f"llm_query via gateway, per call ({name})", us(g), "us", us(f)),
            Row(
                BENCH,
                f"  hop's added cost per call, vs socketpair ({name})",
                us(hop),
                "us",
                us(p),
                f"<= {TARGET_HOP_RATIO:g}x" if held else "",
                hop <= TARGET_HOP_RATIO * p if held else None,
            ),
            Row(
                BENCH,
                f"  supervisor CPU per call, vs its loop floor ({name})",
                us(cpu),
                "us",
                us(cpu_floor),
                f"<= {TARGET_CPU_US:g} us" if held else "",
                cpu * US <= TARGET_CPU_US if held else None,
            ),
            Row(BENCH, f"llm_query_batched x{BATCH}, per call ({name})", us(b), "us", us(f)),
            Row(
                BENCH,
                f"  supervisor CPU per call, batched ({name})",
                us(median(r["batched_cpu"])),
                "us",
            ),
        ]
    rows.append(Row(BENCH, "socketpair ModelReq/Reply round trip", us(p), "us"))
    a = paths["awaited"]
    g, cpu = median(a["single"]), median(a["single_cpu"])
    print(
        f"\nheadline: {g * US:.1f} us per awaited llm_query, {(g - f) * US:.1f} us of it the hop "
        f"({(g - f) / p:.1f}x a bare socketpair round trip of {p * US:.1f} us); supervisor "
        f"CPU {cpu * US:.1f} us per call"
    )
    finish(BENCH, rows, left, args.json)


if __name__ == "__main__":
    main()

"""What checking a worker's frames costs the supervisor.

Every frame a worker sends is hostile input (DESIGN.md section 14): the supervisor decodes
it against the protocol's types and bounds (`brood.protocol.decode_worker`), then checks it
against what it knows of the run (`brood.supervisor.frames`) before acting on it. This
benchmark prices that work for the frames of the two busiest paths:

  llm_query     a plain model call (ModelReq "llm_query", a 200-character prompt)
  turn 10       the tenth model turn of a run (ModelReq "turn": 20 messages of 2,000
                characters, checked against the conversation the supervisor answered)
  step          a REPL step's end (StepDone with 4,000 characters of output)
  spawn         a child asked for (SpawnReq with one 500-character prompt)
  final         a run's answer with products (Final: a small JSON object)

Each is timed as the supervisor handles it: the bytes decoded with the worker's typed,
bounded decoder, then the frame's own checks. The floor is decoding the same bytes with no
types at all (msgpack to plain Python), the least a supervisor that checked nothing would
do. Then a run makes 2,000 sequential `llm_query` calls through the gateway and the
supervisor's CPU per call is measured in the same process: the checks' share of it, and
the supervisor's CPU per call with the checks against without them (what the checks add
to an untyped decode taken off), which is held to at most 1.1x.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import msgspec
import psutil

import brood
from _common import Row, finish, median, no_leftovers, parse_args, run_completed
from brood.protocol import (
    HEADER,
    Final,
    ModelReq,
    Msg,
    SpawnReq,
    StepDone,
    decode_worker,
    encode,
)
from brood.supervisor import frames

BENCH = "frames"
LOOPS = 5_000  # frames handled per sample
SAMPLES = 7
CALLS = 2_000  # sequential llm_query calls of the gateway run
US = 1e6
TARGET = 1.1

LIMITS = brood.Limits(step_timeout=None, shutdown_grace=0.5, term_grace=0.5)
TURN = 10
WORDS = "the quick brown fox jumps over the lazy dog " * 50  # 2,250 characters


def turn_request() -> tuple[ModelReq, frames.Conversation]:
    """The tenth turn of a run, and the conversation the supervisor holds for it."""
    replies = [f"reply {k}: " + WORDS[:1990] for k in range(TURN - 1)]
    messages = [{"role": "system", "content": "system prompt " * 100}]
    for k in range(TURN):
        messages.append({"role": "user", "content": f"user {k}: " + WORDS[:1990]})
        if k < TURN - 1:
            messages.append({"role": "assistant", "content": replies[k]})
    sizes = [len(messages[1 + 2 * k]["content"]) for k in range(TURN - 1)]
    convo = frames.Conversation(replies=replies, user_sizes=sizes)
    return ModelReq(2, "turn", messages, new_from=2 * (TURN - 1)), convo


def body_of(msg: Msg) -> bytes:
    """A frame's body as the supervisor's reader hands it on: without its length header."""
    return encode(msg)[HEADER.size :]


def cases() -> dict[str, tuple[bytes, Callable[[object], object]]]:
    """Each frame's bytes, and the supervisor's checks of it once decoded."""
    cap = frames.output_cap(LIMITS.output_limit)
    turn, convo = turn_request()

    def check_turn(msg: object) -> None:
        assert isinstance(msg, ModelReq)
        convo.open = False
        convo.check(
            msg,
            max_iterations=30,
            first_cap=LIMITS.max_prompt_chars,
            cap=LIMITS.max_prompt_chars,
        )

    def check_call(msg: object) -> int:
        assert isinstance(msg, ModelReq)
        frames.check_call(msg, LIMITS)
        return frames.weight(msg.messages)

    def check_step(msg: object) -> int:
        assert isinstance(msg, StepDone)
        return frames.weight(frames.clipped_step(msg, cap).stdout)

    def check_spawn(msg: object) -> None:
        assert isinstance(msg, SpawnReq)
        frames.check_prompts(msg.prompts, LIMITS)

    def check_final(msg: object) -> object:
        assert isinstance(msg, Final)
        return frames.checked_products(msg.products, cap)

    call = ModelReq(1, "llm_query", [{"role": "user", "content": WORDS[:200]}])
    step = StepDone(3, "print(x)\n" * 20, WORDS[:4000], "", None, 0.01)
    spawn = SpawnReq(4, [WORDS[:500]], step=3)
    final = Final("42", products={"rows": [1, 2, 3], "name": "total", "ok": True})
    return {
        "llm_query": (body_of(call), check_call),
        f"turn {TURN}": (body_of(turn), check_turn),
        "step": (body_of(step), check_step),
        "spawn": (body_of(spawn), check_spawn),
        "final": (body_of(final), check_final),
    }


def handled(body: bytes, check: Callable[[object], object]) -> object:
    """A frame as the supervisor takes it: decoded against the protocol, then checked."""
    return check(decode_worker(body))


def per_frame(work: Callable[[], object]) -> float:
    """Median seconds per frame of SAMPLES samples of LOOPS frames each."""
    samples = []
    for _ in range(SAMPLES):
        t0 = time.perf_counter()
        for _ in range(LOOPS):
            work()
        samples.append((time.perf_counter() - t0) / LOOPS)
    return median(samples)


def chat_fn(messages: list[dict[str, str]], model: str | None = None) -> str:
    """Instant: "a" to every plain call; the root's one turn gets its REPL block."""
    if messages[-1]["content"] == "q":
        return "a"
    return f"```repl\nfor _ in range({CALLS}):\n    llm_query('q')\nFINAL('done')\n```"


def gateway_cpu_per_call() -> float:
    """The supervisor's CPU seconds per llm_query of one run of CALLS calls (median of 3)."""
    me = psutil.Process()
    cpu = []
    with brood.Supervisor(model=chat_fn, limits=LIMITS) as sup:
        run_completed(sup, "warm-up: first-use costs on both sides")
        for i in range(3):
            t = me.cpu_times()
            run_completed(sup, f"calls {i}")
            t2 = me.cpu_times()
            cpu.append((t2.user + t2.system - t.user - t.system) / CALLS)
    return median(cpu)


def main() -> None:
    args = parse_args(__doc__ or "")
    plain = msgspec.msgpack.Decoder()
    rows: list[Row] = []
    costs: dict[str, float] = {}
    floors: dict[str, float] = {}
    print(f"{'frame':10}  {'untyped decode':>15}  {'decode + checks':>15}  ratio")
    for name, (body, check) in cases().items():
        floor = per_frame(functools.partial(plain.decode, body))
        checked = per_frame(functools.partial(handled, body, check))
        costs[name], floors[name] = checked, floor
        print(f"{name:10}  {floor * US:12.2f} us  {checked * US:12.2f} us  {checked / floor:5.2f}x")
        rows.append(
            Row(
                BENCH,
                f"{name}: decode + checks",
                round(checked * US, 3),
                "us",
                round(floor * US, 3),
            )
        )
    cpu = gateway_cpu_per_call()
    left = no_leftovers(BENCH)
    checks = costs["llm_query"] - floors["llm_query"]  # what checking adds to decoding
    share = checks / cpu
    ratio = cpu / (cpu - checks)
    print(
        f"\nsupervisor CPU per llm_query through the gateway: {cpu * US:.1f} us, of which "
        f"checking its frame {checks * US:.2f} us ({share:.1%}); "
        f"with the checks / without: {ratio:.3f}x (target <= {TARGET}x)"
    )
    rows += [
        Row(BENCH, "supervisor CPU per llm_query", round(cpu * US, 3), "us"),
        Row(
            BENCH,
            "  with the frame's checks / without",
            round(ratio, 4),
            "x",
            None,
            f"<= {TARGET}x",
            ratio <= TARGET,
        ),
    ]
    finish(BENCH, rows, left, args.json)


if __name__ == "__main__":
    main()

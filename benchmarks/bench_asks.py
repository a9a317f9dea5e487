"""Asks to a person: how long an answer given from outside takes to reach the run's next step.

A supervisor with a file journal runs one root whose model (a `chat_fn`) writes a loop:
each round the root blocks in `ask_person('qI', options=['go'])` and, right after it
returns, writes one line to a named pipe that this benchmark reads. That line is "the
run's next step". The benchmark waits (untimed) until the ask is open in `sup.asks()`,
then times from just before the answer to the line arriving:

  brood answer path   `Journal(url).answer(ask_id, 'go', by)`, what `brood answer` does:
                      find the ask's run in the journal, check that its supervisor is
                      alive, and answer through that supervisor's control socket. The
                      Journal stays open across rounds (opening it is not measured) ...
  fresh Journal       ... and the same with a `Journal(url)` opened per answer, inside
                      the timed region, as each CLI invocation pays (its close is not
                      timed: the run goes on whether or not the CLI has closed it).

The floor is the same path without the journal lookup and the control socket:
`sup.answer(ask_id, 'go')` in-process. Both paths commit the ask's `answered` event
before the run hears of it, so the ratio is what the CLI path adds on top. No target is
set; the figures are reported.

ROUNDS asks of each kind are answered, interleaved (the order rotates per round so a drift
of the machine touches all three alike), after one untimed warm-up ask of each kind, all
in one run. The figures are the medians and p90 over the rounds. A line also compares the
first and last ten rounds of each kind: the CLI path finds an ask by reading every ask
event in the journal, so its cost may grow with the asks the journal holds.
"""

from __future__ import annotations

import os
import select
import tempfile
import threading
import time
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
    spread_ms,
)
from brood.journal import Journal

BENCH = "asks"
ROUNDS = 30  # timed asks of each kind
WARMUP = 1  # untimed asks of each kind first: the first socket connect, cold pages
ASK_TIMEOUT_S = 30.0  # only stops a hung set-up: each ask opens within milliseconds
LINE_TIMEOUT_S = 30.0  # only stops a hung run: the line follows the answer at once
RUN_TIMEOUT_S = 120.0  # the root's own wall clock; only stops a hung run
POLL_S = 0.002

IN_PROCESS, JOURNAL, FRESH = "in-process", "brood answer path", "fresh Journal"
KINDS = (IN_PROCESS, JOURNAL, FRESH)
TOTAL = (WARMUP + ROUNDS) * len(KINDS)
BY = {IN_PROCESS: "bench-in-process", JOURNAL: "bench", FRESH: "bench"}

F = "```"


def root_model(pipe: str) -> Callable[[list[dict[str, Any]]], str]:
    """A chat_fn whose one reply asks TOTAL times, one line to `pipe` after each answer."""
    code = (
        f"for i in range({TOTAL}):\n"
        "    ask_person(f'q{i}', options=['go'])\n"
        f"    with open({pipe!r}, 'w') as f:\n"
        "        f.write('x\\n')\n"
        "FINAL('done')"
    )

    def chat_fn(messages: list[dict[str, Any]]) -> str:
        return f"{F}repl\n{code}\n{F}"

    return chat_fn


class Pipe:
    """The read end of a named pipe, held open for the whole run. The benchmark holds a
    write end too, so the pipe never reads as ended between the worker's opens, and the
    worker's `open(PIPE, 'w')` never blocks waiting for a reader."""

    def __init__(self, path: str) -> None:
        self.path = path
        os.mkfifo(path)
        # Non-blocking to open the read end without a writer yet; blocking afterwards.
        self.r = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        self.w = os.open(path, os.O_WRONLY)
        os.set_blocking(self.r, True)

    def wait_line(self, timeout: float) -> None:
        ready, _, _ = select.select([self.r], [], [], timeout)
        if not ready:
            raise TimeoutError(f"the run wrote no line within {timeout:g} s of the answer")
        got = os.read(self.r, 64)
        if got != b"x\n":
            raise RunFailed(f"the run wrote {got!r} to the pipe, expected one line b'x\\n'")

    def close(self) -> None:
        os.close(self.r)
        os.close(self.w)


def wait_for_ask(sup: brood.Supervisor, root: brood.RunHandle, question: str) -> str:
    """The id of the open ask `question` (untimed set-up between rounds)."""
    pause = threading.Event()
    deadline = time.monotonic() + ASK_TIMEOUT_S
    while True:
        for ask in sup.asks():
            if ask["question"] == question:
                return str(ask["id"])
        if root.done:
            res = root.outcome()
            raise RunFailed(f"run {res.run_id} ended {res.state} before {question!r}: {res.error}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"ask {question!r} was not opened within {ASK_TIMEOUT_S:g} s")
        pause.wait(POLL_S)


def answer_once(
    kind: str, ask_id: str, sup: brood.Supervisor, journal: Journal, url: str, pipe: Pipe
) -> tuple[float, float]:
    """Answer one ask the `kind` way; seconds until the answer call returned and until the
    run's line arrived, both from just before the call."""
    fresh: Journal | None = None
    t0 = time.perf_counter()
    if kind == IN_PROCESS:
        result = sup.answer(ask_id, "go", by=BY[kind])
    elif kind == JOURNAL:
        result = journal.answer(ask_id, "go", BY[kind])
    else:
        fresh = Journal(url)
        result = fresh.answer(ask_id, "go", BY[kind])
    t_returned = time.perf_counter()
    pipe.wait_line(LINE_TIMEOUT_S)
    t_line = time.perf_counter()
    if fresh is not None:
        fresh.close()
    if result["answer"]["id"] != "go" or result["resolved_by"] != BY[kind]:
        raise RunFailed(f"ask {ask_id} answered {kind}: unexpected result {result}")
    return t_returned - t0, t_line - t0


def measure(tmp: str) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """One run of TOTAL asks; per kind, the timed rounds' (to return, to the line)."""
    url = f"sqlite:///{tmp}/j.db"
    pipe = Pipe(os.path.join(tmp, "steps"))
    limits = brood.Limits(shutdown_grace=0.3, term_grace=0.3, step_timeout=None, fs_write=(tmp,))
    returned: dict[str, list[float]] = {k: [] for k in KINDS}
    line: dict[str, list[float]] = {k: [] for k in KINDS}
    try:
        with brood.Supervisor(root_model(pipe.path), limits=limits, store=url) as sup:
            root = sup.spawn("answer every ask", timeout=RUN_TIMEOUT_S)
            with Journal(url) as journal:
                i = 0
                for n in range(WARMUP + ROUNDS):
                    order = KINDS[n % len(KINDS) :] + KINDS[: n % len(KINDS)]
                    for kind in order:
                        ask_id = wait_for_ask(sup, root, f"q{i}")
                        i += 1
                        took_return, took_line = answer_once(kind, ask_id, sup, journal, url, pipe)
                        if n >= WARMUP:
                            returned[kind].append(took_return)
                            line[kind].append(took_line)
            res = root.wait_result(timeout=RUN_TIMEOUT_S)
            if res.state != "completed":
                raise RunFailed(f"run {res.run_id} ended {res.state}: {res.error}")
    finally:
        pipe.close()
    return returned, line


def main() -> None:
    args = parse_args(__doc__ or "")
    with tempfile.TemporaryDirectory(prefix="brood-bench-asks-") as tmp:
        returned, line = measure(tmp)
    left = no_leftovers(BENCH)

    for kind in KINDS:
        print(f"{kind:<17} answer call returns  {spread_ms(returned[kind])}")
        print(f"{kind:<17} line from the run    {spread_ms(line[kind])}")
    # The CLI path finds the ask by reading every ask event of the journal, so it may slow
    # down as asks pile up: the first and last rounds side by side show whether it does.
    drift = "  ".join(
        f"{k} {median(xs[:10]) * MS:.3f} -> {median(xs[-10:]) * MS:.3f} ms"
        for k, xs in line.items()
    )
    print(f"first 10 vs last 10 rounds (median, to the line): {drift}")
    med = {k: median(xs) for k, xs in line.items()}
    p90 = {k: quantile(xs, 0.9) for k, xs in line.items()}
    print(
        f"\nheadline: an answer through the journal and the control socket reaches the run's "
        f"next step in {med[JOURNAL] * MS:.3f} ms = {med[JOURNAL] / med[IN_PROCESS]:.2f}x "
        f"sup.answer in-process ({med[IN_PROCESS] * MS:.3f} ms); with a fresh Journal per "
        f"answer {med[FRESH] * MS:.3f} ms = {med[FRESH] / med[IN_PROCESS]:.2f}x"
    )

    rows = [
        Row(BENCH, "brood answer to next step (median)", med[JOURNAL], "s", med[IN_PROCESS]),
        Row(BENCH, "brood answer to next step (p90)", p90[JOURNAL], "s", p90[IN_PROCESS]),
        Row(BENCH, "  same, fresh Journal per answer (median)", med[FRESH], "s", med[IN_PROCESS]),
        Row(BENCH, "  same, fresh Journal per answer (p90)", p90[FRESH], "s", p90[IN_PROCESS]),
        Row(BENCH, "  floor: sup.answer in-process (median)", med[IN_PROCESS], "s"),
        Row(BENCH, "  floor: sup.answer in-process (p90)", p90[IN_PROCESS], "s"),
    ]
    finish(BENCH, rows, left, args.json)


if __name__ == "__main__":
    main()

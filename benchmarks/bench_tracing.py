"""Tracing's overhead: the 1,000-child fan-out of bench_fanout (rlm_query_batched, one
scripted turn per child, max_concurrency=16) with OpenTelemetry spans on, against the
same fan-out with tracing off, on supervisors alike in all else. Needs the [otel] extra.

With tracing on, each child makes a run span, a model call span and a step span, and
journals its span's ids (a `trace` event). The spans go through the SDK's
BatchSpanProcessor (as with a real exporter) to an exporter that keeps them in memory, so
what is measured is brood's share and the SDK's, not a collector's network.

Off and on alternate, REPEATS times each, each after an untimed warm-up root; the time is
the root's own clock from the batched call to its last answer, and the ratio is the median
on over the median off (target <= 1.1x). The supervisor process's CPU time per child (its
loop, journal writer and span processor threads; workers do nothing more with tracing) is
printed beside it: on a busy machine it says more than the wall time.
"""

from __future__ import annotations

import ast
import time

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import brood
from _common import MS, Row, finish, median, no_leftovers, parse_args, run_completed
from bench_fanout import BATCHED, CHILD_REPLY, CHILDREN, CONCURRENCY, WARM_UP

BENCH = "tracing"
REPEATS = 3
TARGET_RATIO = 1.1


def fan_out(model: brood.ScriptedModel, limits: brood.Limits, tracing: bool) -> tuple[float, float]:
    """One fan-out's time (the root's own clock) and the CPU this process (the supervisor:
    its loop, journal writer and span processor threads) spent on it; with tracing, its
    spans are checked."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter))
    with brood.Supervisor(
        model=model, limits=limits, tracing=provider if tracing else False
    ) as sup:
        run_completed(sup, "warm-up: fan out")
        cpu = time.process_time()
        res = run_completed(sup, "batched: fan out")
        cpu = time.process_time() - cpu
    provider.shutdown()
    inside, count, answers = ast.literal_eval(res.answer or "")
    if count != CHILDREN or answers != ["x"]:
        raise RuntimeError(f"the root collected {count} answers {answers}")
    if tracing:  # a run span per run of both trees (2 roots, their children)
        runs = [s for s in exporter.get_finished_spans() if s.name == "brood.run"]
        if len(runs) != 2 + CHILDREN + WARM_UP:
            raise RuntimeError(f"{len(runs)} run spans for {2 + CHILDREN + WARM_UP} runs")
    return float(inside), cpu


def main() -> None:
    args = parse_args(__doc__ or "")
    model = brood.ScriptedModel(
        {
            "warm-up": [BATCHED.format(n=WARM_UP)],
            "batched": [BATCHED.format(n=CHILDREN)],
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
    times: dict[bool, list[float]] = {False: [], True: []}
    cpus: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(REPEATS):
        for tracing in (False, True):
            took, cpu = fan_out(model, limits, tracing)
            times[tracing].append(took)
            cpus[tracing].append(cpu)
    left = no_leftovers(BENCH)
    off, on = median(times[False]), median(times[True])
    ratio = on / off
    cpu_off, cpu_on = median(cpus[False]), median(cpus[True])
    for tracing, label in ((False, "off"), (True, "on")):
        runs = ", ".join(f"{t * MS:.0f}" for t in times[tracing])
        took = median(times[tracing]) * MS
        cpu = median(cpus[tracing]) / CHILDREN * MS
        print(
            f"tracing {label:<3} {CHILDREN} children: median {took:.0f} ms ({runs}); "
            f"supervisor CPU per child {cpu:.2f} ms"
        )
    print(
        f"tracing on / off = {ratio:.2f}x (target <= {TARGET_RATIO:g}x); supervisor CPU "
        f"{cpu_on / cpu_off:.2f}x"
    )
    rows = [
        Row(
            BENCH,
            "fan-out with tracing / without",
            ratio,
            "x",
            None,
            f"<= {TARGET_RATIO:g}x",
            ratio <= TARGET_RATIO,
        ),
        Row(BENCH, "time per child, tracing on", on / CHILDREN, "s", off / CHILDREN),
        Row(
            BENCH,
            "  supervisor CPU per child, tracing on",
            cpu_on / CHILDREN,
            "s",
            cpu_off / CHILDREN,
        ),
    ]
    finish(BENCH, rows, left, args.json)


if __name__ == "__main__":
    main()

"""Flows: a 10,000-item foreach under Limits(max_concurrency=16, max_depth=2).

The flow has two states: `split`, whose one scripted turn FINALs the JSON list of 10,000
items, and `each`, a foreach over that list (max 10,000) whose children each FINAL at once.
Its wall time, from `flow_run` to `wait()` returning "finished", is compared with a floor:
the same 10,000 children started without a flow, by a root whose one step is
`rlm_query_batched` over the same prompts, timed the same way (from `run` to its result).

Why that floor and not 10,000 `Supervisor.spawn` roots: the batched root gives the same tree
shape (one parent, 10,000 children at depth 1, so the same child prompts and system
prompt) admitted through the same start queue, and it also costs one extra worker turn (the
root's, where the flow has `split`'s). 10,000 roots would add what a flow never pays: a
blocking call from this thread into the loop per spawn and per wait, and 10,000 trees. The
floor does carry one cost the flow does not (a ChildUpdate message to the root's worker per
child state change, where the flow's controller has no worker), so the ratio leans, if at
all, in the flow's favour.

The executor's own time per settled instance is measured by instrumenting it in this
process only: each step of every `FlowExecutor.run_instance` coroutine (the code between
two awaits: rendering, the ledger, reading outputs, `instance_done`, `settle`, `pump`,
`check_quiescence`) is timed, minus the steps of `Core.start_child` that run inside them
(the supervisor's work to journal and queue a child, which the floor does as well). The
inclusive times of a few methods are printed too, with how the per-call cost of
`instance_done` grows from the first tenth of the settles to the last (flat if the control
loop is linear in the number of instances).
"""

from __future__ import annotations

import ast
import functools
import json
import time
from collections.abc import Callable, Generator
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
)
from brood.flow.executor import FlowExecutor
from brood.supervisor.core import Core

BENCH = "flow"
ITEMS = 10_000
CONCURRENCY = 16
WARM_UP = 50  # items (children) of a first, untimed flow or root on each supervisor
WAIT_S = 600.0  # only stops a hung flow; a run takes well under a minute here
CHILD_REPLY = "```repl\nFINAL('x')\n```"
US = 1e6

BATCHED = """```repl
import time
t0 = time.perf_counter()
answers = rlm_query_batched([f'each-item {{i}}' for i in range({n})])
FINAL(repr((time.perf_counter() - t0, len(answers), sorted(set(answers)))))
```"""

# Methods whose inclusive time is printed; nested calls are counted in each (settle runs
# inside instance_done, pump inside settle), so they do not add up.
METHODS = ("instance_done", "check_quiescence", "settle", "pump", "ledger")


def foreach_spec(n: int) -> dict[str, Any]:
    return {
        "name": "bench-foreach",
        "states": [
            {
                "id": "split",
                "entry": True,
                "prompt": "split-items",
                "outputs": [{"name": "items", "type": "json"}],
            },
            {
                "id": "each",
                "prompt": "each-item {item}",
                "inputs": [{"name": "item", "from": "split.items", "type": "json"}],
                "foreach": {"over": "item", "max": n},
                "outputs": ["text"],
            },
        ],
        "transitions": [{"from": "split", "to": "each"}],
    }


def make_model() -> brood.ScriptedModel:
    # The items render as "each-item 0" ... "each-item 9999": the floor's prompts exactly.
    items = json.dumps(list(range(ITEMS)))
    return brood.ScriptedModel(
        {
            "split-items": [f"```repl\nFINAL({items!r})\n```"],
            "each-item": [CHILD_REPLY],
            "warm-up: batched": [BATCHED.format(n=WARM_UP)],
            "floor: batched": [BATCHED.format(n=ITEMS)],
        }
    )


def own_cpu() -> float:
    t = psutil.Process().cpu_times()
    return t.user + t.system


# ---- instrumentation (this process only; undone before the supervisor closes) -----------
class Clock:
    """Seconds accumulated by instrumented code, and how many times it ran."""

    def __init__(self) -> None:
        self.total = 0.0
        self.calls = 0
        self.samples: list[float] | None = None  # per call, when kept

    def add(self, dt: float) -> None:
        self.total += dt
        self.calls += 1
        if self.samples is not None:
            self.samples.append(dt)


class TimedSteps:
    """Awaits a coroutine, adding the time of each of its steps (each resumption up to its
    next suspension) to `clock`; the time spent suspended is not counted."""

    def __init__(self, coro: Any, clock: Clock) -> None:
        self.coro = coro
        self.clock = clock

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, clock = self.coro, self.clock
        send: Any = None
        throw: BaseException | None = None
        while True:
            t0 = time.perf_counter()
            try:
                yielded = coro.send(send) if throw is None else coro.throw(throw)
            except StopIteration as stop:
                return stop.value
            finally:
                clock.add(time.perf_counter() - t0)
            send, throw = None, None
            try:
                send = yield yielded
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # a cancel: handed on to the coroutine
                throw = exc


def timed_coroutine(fn: Callable[..., Any], clock: Clock) -> Callable[..., Any]:
    @functools.wraps(fn)
    async def timed(*args: Any, **kwargs: Any) -> Any:
        return await TimedSteps(fn(*args, **kwargs), clock)

    return timed


def timed_call(fn: Callable[..., Any], clock: Clock) -> Callable[..., Any]:
    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            clock.add(time.perf_counter() - t0)

    return timed


class Instrumented:
    """Patches FlowExecutor and Core.start_child with timing wrappers while in the block."""

    def __init__(self) -> None:
        self.instances = Clock()  # every step of every run_instance
        self.start_child = Clock()  # Core.start_child's steps (nested in the above)
        self.methods = {name: Clock() for name in METHODS}
        self.methods["instance_done"].samples = []
        self._saved: list[tuple[type, str, Any]] = []

    def _patch(self, cls: type, name: str, wrapped: Any) -> None:
        self._saved.append((cls, name, cls.__dict__[name]))
        setattr(cls, name, wrapped)

    def __enter__(self) -> Instrumented:
        self._patch(
            FlowExecutor,
            "run_instance",
            timed_coroutine(FlowExecutor.run_instance, self.instances),
        )
        self._patch(Core, "start_child", timed_coroutine(Core.start_child, self.start_child))
        for name, clock in self.methods.items():
            self._patch(FlowExecutor, name, timed_call(getattr(FlowExecutor, name), clock))
        return self

    def __exit__(self, *exc: object) -> None:
        for cls, name, original in reversed(self._saved):
            setattr(cls, name, original)
        self._saved.clear()

    def executor_seconds(self) -> float:
        return self.instances.total - self.start_child.total


def timer_overhead() -> tuple[float, float]:
    """Seconds one instrumented call and one instrumented coroutine step add by themselves
    (measured on no-ops), to bound what the instrumentation adds to the flow's wall time."""
    n = 20_000
    clock = Clock()
    noop = timed_call(lambda: None, clock)
    t0 = time.perf_counter()
    for _ in range(n):
        noop()
    per_call = (time.perf_counter() - t0) / n

    async def empty() -> None:
        return None

    step = timed_coroutine(empty, clock)
    t0 = time.perf_counter()
    for _ in range(n):
        coro = step()
        try:
            coro.send(None)
        except StopIteration:
            pass
    per_step = (time.perf_counter() - t0) / n
    return per_call, per_step


# ---- the two runs -----------------------------------------------------------------------
def floor_run(limits: brood.Limits) -> dict[str, float]:
    """10,000 children of one root's rlm_query_batched, after an untimed warm-up root."""
    with brood.Supervisor(model=make_model(), limits=limits) as sup:
        run_completed(sup, "warm-up: batched")
        cpu = own_cpu()
        t0 = time.perf_counter()
        res = run_completed(sup, "floor: batched")
        wall = time.perf_counter() - t0
        cpu = own_cpu() - cpu
    inside, count, answers = ast.literal_eval(res.answer or "")
    if count != ITEMS or answers != ["x"]:
        raise RuntimeError(f"the floor's root collected {count} answers {answers}")
    return {"wall": wall, "inside": inside, "sup_cpu": cpu}


def flow_run(limits: brood.Limits) -> tuple[dict[str, float], Instrumented]:
    """The 10,000-item foreach, instrumented, after an untimed 50-item flow."""
    with brood.Supervisor(model=make_model(), limits=limits) as sup:
        warm = sup.flow_run(foreach_spec(WARM_UP))
        if warm.wait(timeout=WAIT_S) != "finished":
            raise RuntimeError(f"the warm-up flow ended {warm.status()}")
        with Instrumented() as inst:
            cpu = own_cpu()
            t0 = time.perf_counter()
            flow = sup.flow_run(foreach_spec(ITEMS))
            status = flow.wait(timeout=WAIT_S)
            wall = time.perf_counter() - t0
            cpu = own_cpu() - cpu
        if status != "finished":
            raise RuntimeError(f"the flow ended {status}: {flow.status()['reason']}")
        texts = flow.outputs()["each"]["text"]
        read, rebuild, events = rebuild_times(sup, flow.id)
    if texts != ["x"] * ITEMS:
        raise RuntimeError(f"the flow settled {len(texts)} outputs, {sorted(set(texts))}")
    return {"wall": wall, "sup_cpu": cpu, "read": read, "rebuild": rebuild, "events": events}, inst


def rebuild_times(sup: brood.Supervisor, flow_id: str) -> tuple[float, float, int]:
    """What a resume after a crash does for this flow: read its ledger (the floor), and
    rebuild the executor from it (on the supervisor's loop, as a resume does)."""
    sup.store.flush()
    t0 = time.perf_counter()
    events = sup.store.events(flow_id, "flow")
    read = time.perf_counter() - t0
    core = sup._engine.core

    async def rebuild() -> float:
        t0 = time.perf_counter()
        rebuilt = FlowExecutor.from_ledger(core, core.runs[flow_id], events)
        took = time.perf_counter() - t0
        if rebuilt.outputs != sup._engine.flow(flow_id).outputs:
            raise RuntimeError("the flow rebuilt from its ledger differs from the live one")
        return took

    return read, sup._engine.call(rebuild()), len(events)


def growth(samples: list[float]) -> tuple[float, float]:
    """Median seconds per call over the first and the last tenth of `samples` (medians, so
    that split's settle, which expands and starts all 10,000 instances, is not averaged
    into the first tenth)."""
    tenth = max(len(samples) // 10, 1)
    return median(samples[:tenth]), median(samples[-tenth:])


def main() -> None:
    args = parse_args(__doc__ or "")
    limits = brood.Limits(
        max_concurrency=CONCURRENCY,
        max_depth=2,
        max_children=2 * ITEMS,
        max_children_per_run=2 * ITEMS,
        step_timeout=None,
        shutdown_grace=0.5,
        term_grace=0.5,
    )
    floor = floor_run(limits)
    flow, inst = flow_run(limits)
    left = no_leftovers(BENCH)
    per_call, per_step = timer_overhead()

    settled = inst.methods["instance_done"].calls
    executor = inst.executor_seconds()
    wrapped_calls = sum(c.calls for c in inst.methods.values())
    steps = inst.instances.calls + inst.start_child.calls
    instrumentation = wrapped_calls * per_call + steps * per_step
    first, last = growth(inst.methods["instance_done"].samples or [0.0])

    print(
        f"floor  rlm_query_batched, {ITEMS:,} children: {floor['wall']:.1f} s "
        f"(inside the root's step {floor['inside']:.1f} s) = {ITEMS / floor['wall']:,.0f}/s; "
        f"supervisor CPU {floor['sup_cpu'] / ITEMS * MS:.2f} ms per child"
    )
    print(
        f"flow   foreach over {ITEMS:,} items: {flow['wall']:.1f} s = "
        f"{ITEMS / flow['wall']:,.0f}/s, {flow['wall'] / floor['wall']:.2f}x the floor; "
        f"supervisor CPU {flow['sup_cpu'] / ITEMS * MS:.2f} ms per child"
    )
    print(
        f"executor on the loop: {executor:.2f} s over {settled:,} settled instances = "
        f"{executor / settled * US:.0f} us each (run_instance steps {inst.instances.total:.2f} s "
        f"minus Core.start_child {inst.start_child.total:.2f} s); instrumentation adds "
        f"~{instrumentation * MS:.0f} ms"
    )
    print(
        f"resume: rebuilding the flow from its {flow['events']:,}-event ledger takes "
        f"{flow['rebuild'] * MS:.0f} ms = {flow['rebuild'] / flow['read']:.2f}x reading it "
        f"({flow['read'] * MS:.0f} ms)"
    )
    for name, clock in inst.methods.items():
        print(
            f"  {name:<17} {clock.total:7.3f} s inclusive, {clock.calls:>6,} calls, "
            f"{clock.total / max(clock.calls, 1) * US:8.1f} us per call"
        )
    print(
        f"  instance_done, median per call: {first * US:.1f} us over the first tenth of settles, "
        f"{last * US:.1f} us over the last ({last / first if first else 0:.0f}x)"
    )
    extra = (flow["wall"] - floor["wall"]) / ITEMS
    rows = [
        Row(BENCH, "children/s (foreach)", ITEMS / flow["wall"], "/s"),
        Row(BENCH, "children/s (floor: batched)", ITEMS / floor["wall"], "/s"),
        Row(BENCH, "wall per child (foreach)", flow["wall"] / ITEMS, "s", floor["wall"] / ITEMS),
        Row(BENCH, "  extra wall per instance", extra, "s"),
        Row(BENCH, "  executor time per settled instance", executor / settled, "s"),
        Row(BENCH, "  instance_done, last tenth", last, "s", first),
        Row(BENCH, "  supervisor CPU per child (foreach)", flow["sup_cpu"] / ITEMS, "s"),
        Row(BENCH, "  supervisor CPU per child (floor)", floor["sup_cpu"] / ITEMS, "s"),
        Row(BENCH, "rebuild from the ledger (resume)", flow["rebuild"], "s", flow["read"]),
    ]
    finish(BENCH, rows, left, args.json)


if __name__ == "__main__":
    main()

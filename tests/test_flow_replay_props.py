"""Random flows, driven against a fake host, rebuild from their ledgers exactly.

A `FlowExecutor` decides only from its input events (`flow_started`, `spawned`,
`deferred`, `settled`, `resumed`, `stopping`, `budget_expired`, `run_ended`); every derived
event follows synchronously. Here
Hypothesis draws a flow from a small family of specs (chains, guarded fan-out and back
edges, foreach over json lists, retries, the three failure policies, `max_entries`,
`max_transitions`, `max_parallel`, a run budget) and drives it on an in-memory host (no
processes, no supervisor): each step settles a running child (completed with its outputs,
completed with a broken output, failed, timed out, cancelled from outside, rate limited at
its first model call: deferred, with backoff on a fake clock), resumes a paused flow,
stops it or lets its budget run out (a pause), and lets the loop run for a drawn number of
turns, so the executor's tasks interleave with the actions in many orders. Starts may be
refused (for capacity or a rate limit, retried with backoff; or for good).

Then:

1. after every step and at the end, the flow rebuilt from its whole ledger so far writes
   nothing and holds what the live executor holds (outputs, entries, fires, milestones,
   held fires, ending; while it is not ending also its status, instances, waiting and
   queued entries; once it has ended, its final status);
2. at the end, the flow rebuilt from every prefix of its ledger (every point a crash can
   leave behind) does not raise, and what the prefix holds plus what the rebuild wrote is
   how the live flow went on.

The two regression tests at the end pin bugs this property found: an empty foreach
settling inside `try_waiting`, and a flow whose own run was ended from outside.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from brood.errors import RATE_LIMITED_REASON, BroodError, LimitExceeded, RateLimited
from brood.flow import compile_spec, load_spec
from brood.flow.executor import DERIVED, INPUTS, FlowExecutor
from brood.lifecycle import FailureKind, RunState

FENCE = "```"
MAX_ACTIONS = 40
DRAIN_TURNS = 60  # loop turns that let every task of the executor reach its next wait
RUN_BUDGET = 1000.0  # a run budget that never runs out by itself (the test expires it)
MIN_ITEMS = 0  # lists (the flow input `xs`, every `items` output) may be empty
END_FROM_OUTSIDE = True  # a step may end the flow's own run from outside

# Guards on a state's outputs `v` (a JSON object {ok, n}) and `items` (a JSON list).
GUARDS: list[dict[str, Any] | None] = [
    None,
    {"output": "v", "path": "ok", "op": "eq", "value": True},
    {"output": "v", "path": "ok", "op": "eq", "value": False},
    {"output": "v", "path": "n", "op": "gt", "value": 1},
    {"output": "v", "path": "n", "op": "lte", "value": 1},
    {"output": "items", "op": "exists"},
    {"output": "items", "op": "contains", "value": 1},
]


# ---- specs ---------------------------------------------------------------------------------
@st.composite
def specs(draw: st.DrawFn) -> tuple[dict[str, Any], dict[str, Any]]:
    """A valid flow spec and its inputs: states s0..sN-1, each with json outputs `v` and
    `items`; a state may take an earlier state's `items` (required or optional, maybe as a
    foreach), s0 may run a foreach over the flow input `xs`; every state is reachable from
    s0 along forward edges, and extra edges (self-loops, back edges, fan-out) may be
    guarded."""
    n = draw(st.integers(1, 5), label="states")
    states: list[dict[str, Any]] = []
    params: dict[str, Any] = {}
    policies = st.sampled_from(["fail_fast", "continue", "escalate"])
    for i in range(n):
        state: dict[str, Any] = {
            "id": f"s{i}",
            "entry": i == 0 or draw(st.integers(0, 5)) == 0,
            "prompt": f"Do s{i}",
            "outputs": [{"name": "v", "type": "json"}, {"name": "items", "type": "json"}],
            "max_entries": draw(st.integers(1, 3)),
            "retries": draw(st.integers(0, 2)),
        }
        if draw(st.booleans()):
            state["failure_policy"] = draw(policies)
        if i == 0 and draw(st.integers(0, 3)) == 0:
            state["inputs"] = [{"name": "xs", "type": "json"}]
            state["foreach"] = {"over": "xs", "max": draw(st.integers(1, 3))}
            params["xs"] = draw(st.lists(st.integers(0, 3), min_size=MIN_ITEMS, max_size=4))
        elif i > 0 and draw(st.booleans()):
            source = draw(st.integers(0, i - 1))
            optional = draw(st.integers(0, 3)) == 0
            state["inputs"] = [{"name": "x", "from": f"s{source}.items", "optional": optional}]
            if not optional and draw(st.booleans()):
                state["foreach"] = {"over": "x", "max": draw(st.integers(1, 3))}
        states.append(state)
    edges: dict[tuple[str, str], dict[str, Any] | None] = {}
    for i in range(1, n):  # reachability (guards are ignored for it)
        source = draw(st.integers(0, i - 1))
        edges[(f"s{source}", f"s{i}")] = draw(st.sampled_from(GUARDS))
    for _ in range(draw(st.integers(0, 4))):
        source, target = draw(st.integers(0, n - 1)), draw(st.integers(0, n - 1))
        edges.setdefault((f"s{source}", f"s{target}"), draw(st.sampled_from(GUARDS)))
    transitions = [
        {"from": a, "to": b, **({"when": guard} if guard else {})}
        for (a, b), guard in edges.items()
    ]
    run: dict[str, Any] = {"failure_policy": draw(policies)}
    if draw(st.booleans()):
        run["max_parallel"] = draw(st.integers(1, 3))
    if draw(st.booleans()):
        run["max_transitions"] = draw(st.integers(1, 4))
    if draw(st.booleans()):
        run["budget"] = RUN_BUDGET
    return {"name": "prop", "run": run, "states": states, "transitions": transitions}, params


# ---- the fake host -------------------------------------------------------------------------
@dataclass
class FakeRec:
    state: RunState
    answer: str | None = None
    reason: str | None = None
    usage: dict[str, float] = field(default_factory=dict)
    created_at: float = 0.0
    started_at: float | None = 0.0


@dataclass(eq=False)
class FakeRun:
    id: str
    rec: FakeRec
    parent: FakeRun | None = None
    key: str | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    ending: Any = None
    children: list[FakeRun] = field(default_factory=list)
    failure_kind: FailureKind | None = None  # as the host decided it, when it failed


class FakeHost:
    """The supervisor as the executor sees it, in memory. Starts are decided by `starts`
    (one per start, in order: "ok", "capacity" or "refuse"; then "ok"). `finish` works as
    the supervisor's does: the first caller decides how a run ends (`ending` is set at
    once), its open children are cancelled first, and the exit is confirmed a loop turn
    later."""

    def __init__(self, starts: list[str]) -> None:
        self.runs: dict[str, FakeRun] = {}
        self.ledger: list[dict[str, Any]] = []
        self.starts = deque(starts)  # drawn beforehand: no draw happens inside a task
        self.ids = itertools.count(1)
        self.ended_outside = False  # the flow's own run was ended by another than its flow

    def _new(self, state: RunState, parent: FakeRun | None, key: str | None = None) -> FakeRun:
        run = FakeRun(f"r-{next(self.ids)}", FakeRec(state), parent, key)
        self.runs[run.id] = run
        if parent is not None:
            parent.children.append(run)
        return run

    async def create_controller(
        self, prompt: str, parent: Any = None, run_id: str | None = None
    ) -> FakeRun:
        return self._new(RunState.RUNNING, parent)

    async def start_child(
        self,
        parent: FakeRun,
        prompt: str,
        *,
        key: str,
        model_name: str | None = None,
        timeout: float | None = None,
        pool: str | None = None,
    ) -> FakeRun:
        how = self.starts.popleft() if self.starts else "ok"
        if how == "capacity":
            raise LimitExceeded("max_concurrency", 9, 8)
        if how == "rate_limited":
            raise RateLimited("429 at start")
        if how == "refuse" or parent.ending is not None or parent.rec.state.terminal:
            raise BroodError(f"start of {key} refused")
        child = self._new(RunState.QUEUED, parent, key)
        child.rec.state = RunState.RUNNING
        await asyncio.sleep(0)  # the start lands a turn later (a stop may come between)
        return child

    async def finish(
        self,
        run: FakeRun,
        state: RunState,
        reason: str,
        *,
        answer: str | None = None,
        error: str | None = None,
    ) -> RunState:
        if run.rec.state.terminal:
            return run.rec.state
        if run.ending is None:
            run.ending = asyncio.ensure_future(self._end(run, state, reason, answer))
        return await asyncio.shield(run.ending)

    async def _end(self, run: FakeRun, state: RunState, reason: str, answer: str | None) -> Any:
        why = "parent finished" if state is RunState.COMPLETED else "parent cancelled"
        open_children = [c for c in run.children if not c.rec.state.terminal]
        await asyncio.gather(*(self.finish(c, RunState.CANCELLED, why) for c in open_children))
        await asyncio.sleep(0)  # the exit is confirmed a turn later
        end(run, state, reason, answer)
        return state

    def event(self, run: Any, kind: str, data: dict[str, Any]) -> None:
        assert kind == "flow"
        self.ledger.append({"data": dict(data), "at": 0.0})

    def adopt_child(
        self, parent: Any, key: str, timeout: float | None = None, *, launch: bool = True
    ) -> Any:
        return None

    def run_of(self, run_id: str) -> FakeRun:
        return self.runs[run_id]

    def children_left(self, run: FakeRun) -> int | None:
        return None  # a flow the user started: its own settings bound it


def open_children(run: FakeRun) -> list[FakeRun]:
    """The children of `run` that have not ended and are not being ended."""
    return [c for c in run.children if not c.rec.state.terminal and c.ending is None]


def end(run: FakeRun, state: RunState, reason: str, answer: str | None = None) -> None:
    """`run` ends now (a child that answers or dies on its own, or the end of `finish`)."""
    run.rec.state, run.rec.reason, run.rec.answer = state, reason, answer
    run.done.set()


class ReplayHost:
    """Just enough for `from_ledger`: the live host's runs; the events written are kept."""

    def __init__(self, live: FakeHost) -> None:
        self.live = live
        self.written: list[dict[str, Any]] = []

    def event(self, run: Any, kind: str, data: dict[str, Any]) -> None:
        assert kind == "flow"
        self.written.append(dict(data))

    def run_of(self, run_id: str) -> FakeRun:
        return self.live.run_of(run_id)


def answer(v: dict[str, Any] | str, items: list[int] | None) -> str:
    """An answer carrying output `v` (a string: broken JSON) and, unless None, `items`."""
    body = v if isinstance(v, str) else json.dumps(v)
    text = f"Done.\n{FENCE}json v\n{body}\n{FENCE}\n"
    if items is not None:
        text += f"{FENCE}json items\n{json.dumps(items)}\n{FENCE}\n"
    return text


# ---- driving -------------------------------------------------------------------------------
async def drain(turns: int = DRAIN_TURNS) -> None:
    for _ in range(turns):
        await asyncio.sleep(0)


async def fast_sleep(seconds: float) -> None:
    """The start backoff's clock: no real waiting."""
    await asyncio.sleep(0)


# Weighted choices: Hypothesis draws an index (and shrinks it towards the first entry).
OUTCOMES = ["completed"] * 6 + [
    "broken_output",
    "failed",
    "timed_out",
    "cancelled",
    "rate_limited",
    "rate_limited",
]
STARTS = ["ok"] * 8 + ["capacity", "rate_limited", "refuse"]
TURNS = [DRAIN_TURNS, DRAIN_TURNS, 0, 1, 2, 3]


def pick(data: st.DataObject, choices: list[Any], label: str) -> Any:
    return choices[data.draw(st.integers(0, len(choices) - 1), label=label)]


async def launch(
    spec: dict[str, Any], params: dict[str, Any], starts: list[str] | None = None
) -> tuple[FlowExecutor, FakeHost, list[asyncio.Future[Any]]]:
    """A flow started on a fake host; returns it, its host, and a list that gathers every
    task the executor spawns (see `reraise`)."""
    host = FakeHost(starts or [])
    ex = FlowExecutor(host, compile_spec(load_spec(spec)), params, sleep=fast_sleep)
    tasks: list[asyncio.Future[Any]] = []
    spawn = ex._spawn

    def spawn_kept(coro: Any) -> None:
        spawn(coro)
        tasks.extend(t for t in ex.running if t not in tasks)

    ex._spawn = spawn_kept
    await ex.start("prop", spec=spec)
    return ex, host, tasks


def reraise(tasks: list[asyncio.Future[Any]]) -> None:
    """An exception that ended one of the executor's tasks (which asyncio would only log)."""
    for t in tasks:
        if t.done() and not t.cancelled() and t.exception() is not None:
            raise t.exception()  # type: ignore[misc]


async def drive(
    data: st.DataObject, spec: dict[str, Any], params: dict[str, Any]
) -> tuple[FlowExecutor, FakeHost, list[str]]:
    """Run the flow, with Hypothesis choosing every step; returns the executor, its host
    and the steps taken (for a failure's report)."""
    starts = data.draw(st.lists(st.sampled_from(STARTS), max_size=12), label="starts")
    ex, host, tasks = await launch(spec, params, starts)
    steps: list[str] = []
    waits: list[asyncio.Future[Any]] = []  # stops, and ends of the flow's run
    await drain(pick(data, TURNS, "turns"))
    for _ in range(MAX_ACTIONS):
        if ex.done.is_set():
            break
        running = open_children(ex.run)
        if not running and ex.status_value == "running":
            await drain()  # the starts have not landed yet: let them
            running = open_children(ex.run)
        actions = ["settle"] * 12 if running else []
        if ex.status_value == "paused":
            actions += ["resume"] * 4
        actions.append("stop")
        if ex.m.run.budget is not None:
            actions += ["budget"] * 2
        if END_FROM_OUTSIDE and ex.run.ending is None:
            actions.append("end_run")
        action = pick(data, actions, "action")
        if action == "settle":
            child = data.draw(st.sampled_from(running), label="child")
            outcome = pick(data, OUTCOMES, "outcome")
            steps.append(f"settle {child.key} {outcome}")
            if outcome == "completed":
                v = {"ok": data.draw(st.booleans()), "n": data.draw(st.integers(0, 3))}
                items = data.draw(st.lists(st.integers(0, 3), min_size=MIN_ITEMS, max_size=3))
                steps[-1] += f" v={json.dumps(v)} items={items}"
                end(child, RunState.COMPLETED, "answered", answer(v, items))
            elif outcome == "broken_output":
                end(child, RunState.COMPLETED, "answered", answer("{not json", None))
            elif outcome == "rate_limited":  # at its first model call: the flow defers it
                child.rec.usage["model_calls"] = 1
                child.failure_kind = FailureKind.RATE_LIMITED
                end(child, RunState.FAILED, f"{RATE_LIMITED_REASON}429 Too Many Requests")
            else:
                end(child, RunState(outcome), f"{outcome} on purpose")
        elif action == "resume":
            steps.append("resume")
            await ex.resume()
        elif action == "stop":
            steps.append("stop")
            waits.append(asyncio.ensure_future(ex.stop()))
        elif action == "end_run":  # the flow's run is cancelled (its parent ended, say)
            steps.append("end_run")
            host.ended_outside = True
            ending = host.finish(ex.run, RunState.CANCELLED, "cancelled from outside")
            waits.append(asyncio.ensure_future(ending))
        else:
            steps.append("budget_expired")
            ex._budget_expired()
        turns = pick(data, TURNS, "turns")
        if turns != DRAIN_TURNS:
            steps.append(f"{turns} turns")
        await drain(turns)
        reraise(tasks)
        check_whole(ex, host, steps)  # also mid-flight: a crash may come at any point
    await drain()
    await asyncio.wait_for(asyncio.gather(*waits), timeout=5)  # a stop ends the flow
    await drain()
    reraise(tasks)
    return ex, host, steps


# ---- checking ------------------------------------------------------------------------------
def marks(events: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """The derived events, as a replay compares them."""
    return [
        (e["kind"], e.get("state"), e.get("target"), e.get("milestone"))
        for e in events
        if e["kind"] in DERIVED
    ]


def rebuild(host: FakeHost, run: FakeRun, cut: int | None = None) -> tuple[FlowExecutor, list]:
    replay = ReplayHost(host)
    events = [{"data": dict(e["data"]), "at": e["at"]} for e in host.ledger[:cut]]
    rebuilt = FlowExecutor.from_ledger(replay, run, events, sleep=fast_sleep)
    return rebuilt, replay.written


def progress(ex: FlowExecutor) -> dict[str, Any]:
    """What a flow that is not ending holds besides its decisions: its status, its
    instances (started, in order, with their outcomes), its waiting and queued entries,
    the escalated entries a resume runs again."""
    return {
        "status": ex.status_value,
        "reason": ex.reason,
        "instances": [(i.key, i.tries, i.outcome) for i in ex.live.values()],
        "active": ex.active,
        "waiting": [(e.state, e.number) for e in ex.waiting],
        "queue": [i.key for i in ex.queue],
        "failed_entries": [(e.state, e.number) for e in ex.failed_entries],
    }


def check_whole(live: FlowExecutor, host: FakeHost, steps: list[str]) -> None:
    """Property 1: the flow rebuilt from its whole ledger (so far) writes nothing and
    holds what the live flow holds."""
    rebuilt, written = rebuild(host, live.run)
    why = f"steps: {steps}"
    assert written == [], why
    assert rebuilt.outputs == live.outputs, why
    assert rebuilt.entries == live.entries, why
    assert rebuilt.fired == live.fired, why
    assert rebuilt.milestones == live.milestones, why
    assert list(rebuilt.held) == list(live.held), why
    assert rebuilt.ending == live.ending, why
    if host.ended_outside:  # the live flow stops deciding once it notices
        if live.done.is_set() and live.ending is None:
            rebuilt.go_live()
            assert (rebuilt.status_value, rebuilt.done.is_set()) == ("stopped", True), why
        return
    if live.ending is None:
        assert progress(rebuilt) == progress(live), why
    if live.done.is_set():
        assert live.ending is not None and live.status_value == live.ending[0], why
        assert rebuilt.ended_journaled, why
        rebuilt.go_live()  # the flow's run has ended: the rebuild only takes its status
        assert (rebuilt.status_value, rebuilt.done.is_set()) == (live.status_value, True), why


def check_prefixes(live: FlowExecutor, host: FakeHost, steps: list[str]) -> None:
    """Property 2: rebuilt from any prefix of its ledger (what a crash can leave behind),
    the flow does not raise, and the prefix plus what the rebuild wrote is how the live
    flow went on."""
    full = [e["data"] for e in host.ledger]
    assert full[0]["kind"] == "spec"
    assert {e["kind"] for e in full} <= DERIVED | INPUTS | {"spec", "flow_ended", "start_retry"}
    for cut in range(1, len(full) + 1):
        _, written = rebuild(host, live.run, cut)
        so_far = marks(full[:cut]) + marks(written)
        assert so_far == marks(full)[: len(so_far)], f"cut {cut}; steps: {steps}"
        assert all(e["kind"] in DERIVED for e in written), f"cut {cut}; steps: {steps}"


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(flow=specs(), data=st.data())
def test_a_randomly_driven_flow_rebuilds_from_every_prefix_of_its_ledger(flow, data):
    spec, params = flow

    async def main() -> None:
        live, host, steps = await drive(data, spec, params)
        for kind in ("deferred", "start_retry", "budget_expired", "resumed"):
            if any(e["data"]["kind"] == kind for e in host.ledger):
                event(kind)  # how often each input was reached (--hypothesis-show-statistics)
        check_whole(live, host, steps)
        check_prefixes(live, host, steps)

    asyncio.run(main())


# ---- regressions the property found -------------------------------------------------------
def json_outputs(*names: str) -> list[dict[str, str]]:
    return [{"name": n, "type": "json"} for n in names]


def test_an_empty_foreach_that_settles_while_another_entry_becomes_ready_does_not_crash():
    # `each` and `after` both wait for plan.items; plan answers an empty list, so `each`
    # (a foreach over it) settles at once, inside the pass that starts `after`.
    spec = {
        "states": [
            {"id": "plan", "entry": True, "prompt": "Plan", "outputs": json_outputs("items")},
            {
                "id": "each",
                "entry": True,
                "prompt": "Each",
                "inputs": [{"name": "x", "from": "plan.items"}],
                "foreach": {"over": "x"},
                "outputs": json_outputs("v"),
            },
            {
                "id": "after",
                "entry": True,
                "prompt": "After",
                "inputs": [{"name": "x", "from": "plan.items"}],
                "outputs": json_outputs("v"),
            },
        ]
    }

    async def main() -> None:
        ex, host, tasks = await launch(spec, {})
        await drain()
        (plan,) = open_children(ex.run)
        end(plan, RunState.COMPLETED, "answered", answer({"ok": True}, []))
        await drain()
        reraise(tasks)  # once, the task that settled plan died here (ValueError)
        steps = ["settle plan#1 completed items=[]"]
        check_prefixes(ex, host, steps)
        (after,) = open_children(ex.run)
        assert after.key == "after#1" and ex.outputs["each"] == {"v": []}
        end(after, RunState.COMPLETED, "answered", answer({"ok": True}, [1]))
        await drain()
        assert ex.done.is_set() and ex.status_value == "finished"
        check_whole(ex, host, steps)

    asyncio.run(main())


def test_a_flow_whose_run_was_ended_from_outside_rebuilds_without_deciding_more():
    spec = {"states": [{"id": "a", "entry": True, "prompt": "A", "outputs": json_outputs("v")}]}

    async def main() -> None:
        ex, host, tasks = await launch(spec, {})
        await drain()
        assert [c.key for c in open_children(ex.run)] == ["a#1"]
        host.ended_outside = True
        # As the supervisor ends a run: `ending` at once, its children cancelled, then it.
        await host.finish(ex.run, RunState.CANCELLED, "parent cancelled")
        await drain()
        reraise(tasks)
        # Live: the end is journaled (run_ended) before `a` settles, and the flow is
        # stopped, deciding nothing more; a rebuild stops deciding at the same point.
        rebuilt, written = rebuild(host, ex.run)
        assert written == [], "a rebuild decided what the live flow did not"
        assert (rebuilt.ending, rebuilt.milestones) == (ex.ending, ex.milestones)
        rebuilt.go_live()
        assert (rebuilt.status_value, ex.status_value) == ("stopped", "stopped")

    asyncio.run(main())

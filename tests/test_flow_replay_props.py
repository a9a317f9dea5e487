"""Random flows, driven against a fake host, rebuild from their ledgers exactly.

A `FlowExecutor` decides only from its input events (`flow_started`, `spawned`, `settled`,
`resumed`, `stopping`, `budget_expired`); every derived event follows synchronously. Here
Hypothesis draws a flow from a small family of specs (chains, guarded fan-out and back
edges, foreach over json lists, retries, the three failure policies, `max_entries`,
`max_transitions`, `max_parallel`, a run budget) and drives it on an in-memory host (no
processes, no supervisor): each step settles a running child (completed with its outputs,
completed with a broken output, failed, timed out, cancelled from outside), resumes a
paused flow, stops it or lets its budget run out, and lets the loop run for a drawn number
of turns, so the executor's tasks interleave with the actions in many orders. Starts may be
refused (for capacity, retried with backoff on a fake clock; or for good).

Then:

1. the flow rebuilt from its whole ledger writes nothing and holds what the live executor
   holds (outputs, entries, fires, milestones, held fires, status / ending);
2. the flow rebuilt from every prefix of its ledger (every point a crash can leave behind)
   does not raise, and what the prefix holds plus what the rebuild wrote is how the live
   flow went on.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from brood.errors import BroodError, LimitExceeded
from brood.flow.executor import DERIVED, INPUTS, FlowExecutor
from brood.flow.spec import compile_spec, load_spec
from brood.lifecycle import RunState

FENCE = "```"
MAX_ACTIONS = 40
DRAIN_TURNS = 60  # loop turns that let every task of the executor reach its next wait
RUN_BUDGET = 1000.0  # a run budget that never runs out by itself (the test expires it)

# Guards on a state's outputs `v` (a JSON object {ok, n}) and `items` (a JSON list).
GUARDS = [
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
            params["xs"] = draw(st.lists(st.integers(0, 3), max_size=4))
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
        edges[(f"s{source}", f"s{i}")] = draw(st.none() | st.sampled_from(GUARDS))
    for _ in range(draw(st.integers(0, 4))):
        source, target = draw(st.integers(0, n - 1)), draw(st.integers(0, n - 1))
        edges.setdefault((f"s{source}", f"s{target}"), draw(st.none() | st.sampled_from(GUARDS)))
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


class FakeHost:
    """The supervisor as the executor sees it, in memory. Starts are decided by `starts`
    (one per start, in order: "ok", "capacity" or "refuse"; then "ok"); every await yields to the loop
    once, as a real start or exit confirmation would."""

    def __init__(self, starts: list[str]) -> None:
        self.runs: dict[str, FakeRun] = {}
        self.ledger: list[dict[str, Any]] = []
        self.starts = deque(starts)  # drawn beforehand: no draw happens inside a task
        self.ids = itertools.count(1)

    def _new(self, state: RunState, parent: FakeRun | None, key: str | None = None) -> FakeRun:
        run = FakeRun(f"r-{next(self.ids)}", FakeRec(state), parent, key)
        self.runs[run.id] = run
        if parent is not None:
            parent.children.append(run)
        return run

    async def create_controller(self, prompt: str, parent: Any = None) -> FakeRun:
        return self._new(RunState.RUNNING, parent)

    async def start_child(
        self,
        parent: FakeRun,
        prompt: str,
        *,
        key: str,
        model_name: str | None = None,
        timeout: float | None = None,
    ) -> FakeRun:
        how = self.starts.popleft() if self.starts else "ok"
        if how == "capacity":
            raise LimitExceeded("max_concurrency", 9, 8)
        if how == "refuse":
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
        await asyncio.sleep(0)  # the exit is confirmed a turn later
        if run.rec.state.terminal:
            return run.rec.state
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


def end(run: FakeRun, state: RunState, reason: str, answer: str | None = None) -> None:
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
OUTCOMES = ["completed"] * 6 + ["broken_output", "failed", "timed_out", "cancelled"]
STARTS = ["ok"] * 8 + ["capacity", "refuse"]
TURNS = [DRAIN_TURNS, DRAIN_TURNS, 0, 1, 2, 3]


def pick(data: st.DataObject, choices: list[Any], label: str) -> Any:
    return choices[data.draw(st.integers(0, len(choices) - 1), label=label)]


async def drive(
    data: st.DataObject, spec: dict[str, Any], params: dict[str, Any]
) -> tuple[FlowExecutor, FakeHost, list[str]]:
    """Run the flow, with Hypothesis choosing every step; returns the executor, its host
    and the steps taken (for a failure's report)."""
    starts = data.draw(st.lists(st.sampled_from(STARTS), max_size=12), label="starts")
    host = FakeHost(starts)
    ex = FlowExecutor(host, compile_spec(load_spec(spec)), params, sleep=fast_sleep)
    tasks: list[asyncio.Future[Any]] = []
    spawn = ex._spawn

    def spawn_kept(coro: Any) -> None:  # every task of the executor, to check how it ended
        spawn(coro)
        tasks.extend(t for t in ex.running if t not in tasks)

    ex._spawn = spawn_kept  # type: ignore[method-assign]
    steps: list[str] = []
    await ex.start("prop", spec=spec)
    await drain(pick(data, TURNS, "turns"))
    for _ in range(MAX_ACTIONS):
        if ex.done.is_set():
            break
        running = [c for c in ex.run.children if not c.rec.state.terminal]
        if not running and ex.status_value == "running":
            await drain()  # the starts have not landed yet: let them
            running = [c for c in ex.run.children if not c.rec.state.terminal]
        actions = ["settle"] * 12 if running else []
        if ex.status_value == "paused":
            actions += ["resume"] * 4
        actions.append("stop")
        if ex.m.run.budget is not None:
            actions.append("budget")
        action = pick(data, actions, "action")
        if action == "settle":
            child = data.draw(st.sampled_from(running), label="child")
            outcome = pick(data, OUTCOMES, "outcome")
            steps.append(f"settle {child.key} {outcome}")
            if outcome == "completed":
                v = {"ok": data.draw(st.booleans()), "n": data.draw(st.integers(0, 3))}
                items = data.draw(st.lists(st.integers(0, 3), max_size=3))
                steps[-1] += f" v={json.dumps(v)} items={items}"
                end(child, RunState.COMPLETED, "answered", answer(v, items))
            elif outcome == "broken_output":
                end(child, RunState.COMPLETED, "answered", answer("{not json", None))
            else:
                end(child, RunState(outcome), f"{outcome} on purpose")
        elif action == "resume":
            steps.append("resume")
            await ex.resume()
        elif action == "stop":
            steps.append("stop")
            tasks.append(asyncio.ensure_future(ex.stop()))
        else:
            steps.append("budget_expired")
            ex._budget_expired()
        turns = pick(data, TURNS, "turns")
        if turns != DRAIN_TURNS:
            steps.append(f"{turns} turns")
        await drain(turns)
    await drain()
    if any(not t.done() for t in tasks if t not in ex.running):  # a stop still waiting
        await asyncio.wait_for(ex.done.wait(), timeout=5)
        await drain()
    for t in tasks:
        if t.done() and not t.cancelled():
            assert t.exception() is None, f"a task failed: {t.exception()!r}; steps: {steps}"
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
    rebuilt = FlowExecutor.from_ledger(replay, run, events, sleep=fast_sleep)  # type: ignore[arg-type]
    return rebuilt, replay.written


def instances(ex: FlowExecutor) -> list[tuple[Any, ...]]:
    return [(i.key, i.outcome) for i in ex.live]


def check_whole(live: FlowExecutor, host: FakeHost, steps: list[str]) -> None:
    rebuilt, written = rebuild(host, live.run)
    why = f"steps: {steps}"
    assert written == [], why
    assert rebuilt.outputs == live.outputs, why
    assert rebuilt.entries == live.entries, why
    assert rebuilt.fired == live.fired, why
    assert rebuilt.milestones == live.milestones, why
    assert list(rebuilt.held) == list(live.held), why
    assert rebuilt.ending == live.ending, why
    assert rebuilt.ended_journaled == live.done.is_set(), why
    if live.done.is_set():
        assert live.ending is not None and live.status_value == live.ending[0], why
        rebuilt.go_live()  # the flow's run has ended: the rebuild only takes its status
        assert (rebuilt.status_value, rebuilt.done.is_set()) == (live.status_value, True), why
    elif live.ending is None:
        assert rebuilt.status_value == live.status_value, why
        assert rebuilt.reason == live.reason, why
        assert instances(rebuilt) == instances(live), why
        assert [(e.state, e.number) for e in rebuilt.waiting] == [
            (e.state, e.number) for e in live.waiting
        ], why
        assert [i.key for i in rebuilt.queue] == [i.key for i in live.queue], why


def check_prefixes(live: FlowExecutor, host: FakeHost, steps: list[str]) -> None:
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
        check_whole(live, host, steps)
        check_prefixes(live, host, steps)

    asyncio.run(main())

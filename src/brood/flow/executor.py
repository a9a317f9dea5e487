"""The flow executor: runs a compiled `Machine` on the supervisor, one child run per state
instance (DESIGN.md section 8).

Everything here runs on the supervisor's loop. A flow is a controller run (a root with no
worker) whose children are the state instances. Each settle fires every transition whose
guard passes; re-entry is bounded by `max_entries`; the flow finishes at quiescence (nothing
running, nothing waiting to start). Every step goes to the flow's ledger (journal events).

A flow survives a crash by replay. The executor decides only from its inputs, and each
input is a ledger event: an instance settling (`settled`, with its outcome), a pause lifted
(`resumed`), a stop (`stopping`), the flow's budget running out (`budget_expired`).
Everything else (entries, fires, retries, milestones) follows from the inputs, in the same
order. `FlowExecutor.from_ledger` feeds a journaled ledger back through the same code with
the ledger muted, which rebuilds the flow exactly; `go_live` then starts what the crash
interrupted (a journaled child is adopted by its key, never started twice).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic

from brood.errors import (
    BackendError,
    BroodError,
    InvalidArgument,
    LimitExceeded,
    RateLimited,
    ReplayDiverged,
)
from brood.flow.compile import compile_spec
from brood.flow.guards import evaluate
from brood.flow.host import FlowHost, FlowRun, R
from brood.flow.load import load_spec
from brood.flow.machine import Machine, MachineState
from brood.flow.render import OutputError, read_output, render_prompt
from brood.lifecycle import FailureKind, FlowStatus, RunState, add_usage

STATUS_INSTANCES = 50  # instances per state that status() lists (counts cover them all)
# A start refused for capacity or a rate limit, or a run whose first model call was rate
# limited, is tried this many times in all, waiting 1 s, doubling to 60 s, in between.
START_TRIES = 5
START_BACKOFF_FIRST_S = 1.0  # first wait before trying again, doubled each time
START_BACKOFF_MAX_S = 60.0
# Ledger kinds that follow from the inputs (a replay makes them again, in the same order).
DERIVED = frozenset(
    {
        "state_entry",
        "entry_joined",
        "transition_blocked",
        "transition_fired",
        "retry",
        "state_failed",
        "instance_cancelled",
        "milestone",
    }
)
# Ledger kinds that are the executor's inputs (a replay feeds them back, in order).
INPUTS = frozenset(
    {
        "flow_started",
        "spawned",
        "deferred",
        "settled",
        "resumed",
        "stopping",
        "budget_expired",
        "run_ended",
    }
)
ENDS = {
    FlowStatus.FINISHED: RunState.COMPLETED,
    FlowStatus.FAILED: RunState.FAILED,
    FlowStatus.STOPPED: RunState.CANCELLED,
}
# Limits of a tree a start can be refused for, when a run's code started the flow (its
# instances are that run's children). The counts they compare never go down, so a start
# refused for one would be refused again: the instance fails at once, not tried again.
TREE_LIMITS = frozenset({"max_depth", "max_children", "max_children_per_run"})


def _mark(d: dict[str, Any]) -> tuple[Any, ...]:
    """What identifies a derived ledger event when a replay compares it."""
    return (d["kind"], d.get("state"), d.get("target"), d.get("milestone"))


@dataclass
class Instance:
    state: str
    entry: int  # which entry of the state (1-based)
    item: int | None  # foreach index
    attempt: int
    inputs: dict[str, Any]
    run: FlowRun | None = None  # its child run, once started (or adopted)
    outcome: str | None = None  # completed / failed / cancelled
    outputs: dict[str, Any] = field(default_factory=dict)
    tries: int = 0  # runs of this attempt ended by a rate limit at their first model call

    @property
    def key(self) -> tuple[str, int, int | None, int]:
        return (self.state, self.entry, self.item, self.attempt)

    @property
    def slot(self) -> tuple[str, int, int | None]:
        """The place it fills, whatever its attempt."""
        return (self.state, self.entry, self.item)

    @property
    def where(self) -> dict[str, Any]:
        """Which instance, as its ledger events name it."""
        return {
            "state": self.state,
            "entry": self.entry,
            "item": self.item,
            "attempt": self.attempt,
        }

    @property
    def child_key(self) -> str:
        """The key of its child run, STATE#ENTRY[ITEM]~ATTEMPT/rTRIES (one child per key)."""
        key = f"{self.state}#{self.entry}" + (f"[{self.item}]" if self.item is not None else "")
        key += f"~{self.attempt}" if self.attempt else ""
        return key + (f"/r{self.tries}" if self.tries else "")


@dataclass
class Entry:
    """One entry of a state: waiting for inputs, then its instances, then settled."""

    state: str
    number: int
    instances: list[Instance] = field(default_factory=list)
    expected: int = 1
    completed: int = 0
    failed: bool = False
    settled: bool = False
    unexpanded: bool = False  # failed before any instance: its foreach input is not a list


class FlowExecutor(Generic[R]):
    def __init__(
        self,
        host: FlowHost[R],
        machine: Machine,
        params: dict[str, Any] | None = None,
        *,
        sleep: Any = asyncio.sleep,
    ) -> None:
        self.host = host
        self.m = machine
        self.params = dict(params or {})
        missing = [
            p.name for p in machine.params.values() if not p.optional and p.name not in self.params
        ]
        if missing:
            raise InvalidArgument(
                f"flow inputs missing: {', '.join(missing)}; pass them as inputs={{name: value}}"
            )
        unknown = sorted(set(self.params) - set(machine.params))
        if unknown:
            raise InvalidArgument(
                f"unknown flow inputs: {', '.join(unknown)} (the flow takes: "
                f"{', '.join(machine.params) or 'none'})"
            )
        for name, value in self.params.items():
            try:
                json.dumps(value, allow_nan=False)
            except (TypeError, ValueError) as exc:
                raise InvalidArgument(
                    f"flow input {name!r} is not JSON ({exc}); pass text or JSON values"
                ) from None
        self.sleep = sleep  # how start retries wait (tests pass a fake clock)
        self.run: R  # the flow's own run: set by start(), or from_ledger()
        self.status_value = FlowStatus.RUNNING
        self.reason: str | None = None
        self.outputs: dict[str, dict[str, Any]] = {}  # state -> its latest settled outputs
        self.entries: dict[str, int] = dict.fromkeys(machine.states, 0)
        self.waiting: deque[Entry] = deque()  # entered, waiting for required inputs
        self.queue: deque[Instance] = deque()  # ready, waiting for a max_parallel slot
        self.running: set[asyncio.Task[None]] = set()
        # Every instance started, in start order, by (state, entry, item): a retry's new
        # attempt takes its failed one's place (removing it is O(1), also for 10,000 items).
        self.live: dict[tuple[str, int, int | None], Instance] = {}
        self.active = 0  # started and not yet ended
        self.settles = 0  # instance ends (each attempt's), as ledger `settled` events count
        self.residents = 0  # of those, instances of resident states (they hold nothing open)
        self.fired = 0
        self.held: deque[str] = deque()  # fires held by a max_transitions pause
        self.milestones: list[str] = []
        self.recent: deque[dict[str, Any]] = deque(maxlen=50)
        self.done = asyncio.Event()
        self.changed = asyncio.Event()  # set at every change of status_value
        # Called with one line per milestone (a parent's notice), when a run started it.
        self.on_milestone: Callable[[str], None] | None = None
        self.failed_entries: list[Entry] = []  # escalated, retried on resume
        self.continued: dict[str, str] = {}  # states failed under `continue`, with why
        # States whose latest entry failed under `continue` (until one of theirs settles):
        # an entry that reads a required output of one fails at binding instead of running.
        self.failed_sources: dict[str, str] = {}
        self.cascade: deque[str] = deque()  # failed states whose transitions are firing
        self._budget_timer: asyncio.TimerHandle | None = None
        self.entries_by_key: dict[tuple[str, int], Entry] = {}
        self.spec: dict[str, Any] = {}  # as journaled (a resumed parent's replay compares it)
        # At most this many instances per foreach entry (None: foreach.max alone): what the
        # tree's limits left when a run's code started the flow, plus one, so that a list
        # longer than the limits allow fails its entry naming the limit rather than being
        # cut short in silence, and a foreach.max of millions makes no millions of
        # instances. Journaled with the spec: a rebuild from the ledger clamps the same.
        self.foreach_cap: int | None = None
        self.started: list[str] = []  # the states the flow started with
        # Ending: (final status, reason, milestone) once the flow has begun to end.
        self.ending: tuple[FlowStatus, str, str | None] | None = None
        self.ended_journaled = False  # flow_ended is in the ledger (a resume found it there)
        self.ended_outside = False  # the flow's run was ended from outside (run_ended)
        # While a resume replays the ledger: what the replay made of the derived kinds, and
        # the instances started and not yet settled, by key.
        self.replaying = False
        self.made: list[dict[str, Any]] = []
        self.pending: dict[tuple[str, int, int | None, int], Instance] = {}
        # Instances waiting out a backoff (no child of theirs runs), with their tasks.
        self.sleepers: dict[tuple[str, int, int | None], asyncio.Task[Any]] = {}

    # ---- the ledger ------------------------------------------------------------------------
    def ledger(self, kind: str, **data: Any) -> None:
        data = {"kind": kind, **data}
        if self.replaying:  # already journaled (or about to be compared with the journal)
            if kind in DERIVED:
                self.made.append(data)
            return
        # The factory's delivery stage, in memory only (the journal's row never changes):
        # arrived (a settle captured) or recorded, then shown (a milestone's notice went to
        # the parent), then delivered (a status() read after it).
        stage = "arrived" if kind == "settled" else "recorded"
        self.recent.append(data | {"at": time.time(), "stage": stage})
        self.host.event(self.run, "flow", data)

    def milestone(self, kind: str, **data: Any) -> None:
        if kind in self.milestones:
            return  # one notice per kind
        self.milestones.append(kind)
        self.ledger("milestone", milestone=kind, **data)
        if self.on_milestone is not None and not self.replaying:
            why = data.get("reason")
            self.on_milestone(f"flow {self.run.id} {kind}" + (f": {why}" if why else ""))
            if self.recent:
                self.recent[-1]["stage"] = "shown"

    # ---- starting --------------------------------------------------------------------------
    async def start(
        self,
        title: str,
        parent: R | None = None,
        spec: dict[str, Any] | None = None,
        run_id: str | None = None,
    ) -> list[str]:
        """Create the flow's run (a child of `parent`, a run whose code started the flow;
        a root under `run_id` when the caller chose it), journal the spec and inputs (what
        a resume rebuilds it from), enter its entry states; returns the states started."""
        self.run = await self.host.create_controller(title, parent, run_id)
        self.spec = dict(spec or {})
        left = self.host.children_left(self.run)
        self.foreach_cap = None if left is None else left + 1
        capped = {} if self.foreach_cap is None else {"foreach_cap": self.foreach_cap}
        self.ledger("spec", spec=self.spec, params=self.params, **capped)
        self.ledger("flow_started", entry=list(self.m.entry), params=sorted(self.params))
        self._arm_budget(self.m.run.budget)
        self._spawn(self._watch_run())
        return self._begin()

    def _begin(self) -> list[str]:
        for state in self.m.entry:
            self.enter(state, cause=None)
        self.pump()
        self.started = sorted({i.state for i in self.live.values()} | {i.state for i in self.queue})
        self.check_quiescence()
        return self.started

    def _arm_budget(self, seconds: float | None) -> None:
        if seconds is not None:
            self._budget_timer = asyncio.get_running_loop().call_later(
                max(seconds, 0.0), self._budget_expired
            )

    def enter(self, state: str, cause: str | None) -> None:
        st = self.m.states[state]
        if any(e.state == state for e in self.waiting):
            # An entry is already waiting for its inputs (a join): this fire joins it.
            self.ledger("entry_joined", state=state, cause=cause)
            return
        if self.entries[state] >= st.max_entries:
            self.ledger(
                "transition_blocked",
                state=state,
                cause=cause,
                reason=f"max_entries {st.max_entries} reached",
            )
            return
        self.entries[state] += 1
        entry = Entry(state, self.entries[state])
        self.ledger("state_entry", state=state, entry=entry.number, cause=cause)
        self.waiting.append(entry)
        self.try_waiting()

    def inputs_of(self, st: MachineState) -> dict[str, Any] | None:
        """The state's input values, or None while a required one has not settled. An
        input from a state that failed under `continue` has no value (see `unbindable`)."""
        values: dict[str, Any] = {}
        for inp in st.inputs:
            if inp.source is None:  # a flow input
                values[inp.name] = self.params.get(inp.name)
                continue
            produced = {} if inp.source in self.failed_sources else self.outputs.get(inp.source, {})
            if inp.output in produced:
                values[inp.name] = produced[inp.output]
            elif inp.optional:
                values[inp.name] = None
            else:
                return None
        return values

    def unbindable(self, st: MachineState) -> str | None:
        """Why the state cannot bind its inputs: a required one reads an output of a state
        that failed under `continue` (a data dependent of it). None when it can, or may."""
        for inp in st.inputs:
            if inp.source in self.failed_sources and not inp.optional:
                return (
                    f"binding failure: input {inp.name!r} of state {st.id!r} reads "
                    f"{inp.source}.{inp.output}, but state {inp.source!r} failed "
                    f"({self.failed_sources[inp.source]}); {st.id!r} does not run"
                )
        return None

    def try_waiting(self) -> None:
        """Start every waiting entry whose required inputs have settled; fail at binding
        every one that reads a required output of a state failed under `continue`."""
        if self.status_value is not FlowStatus.RUNNING:
            return
        for entry in list(self.waiting):
            if entry not in self.waiting:
                continue  # started meanwhile (an empty foreach settled and started it)
            st = self.m.states[entry.state]
            why = self.unbindable(st)
            if why is not None:
                self.waiting.remove(entry)
                self.entries_by_key[(entry.state, entry.number)] = entry
                # Like a foreach input that is no list: a resume reads its inputs again.
                entry.expected, entry.unexpanded = 0, True
                where = {"state": entry.state, "entry": entry.number, "item": None, "attempt": 0}
                self._entry_failed(entry, st, where, why)
                if self.status_value is not FlowStatus.RUNNING:
                    return
                continue
            values = self.inputs_of(st)
            if values is None:
                continue
            self.waiting.remove(entry)
            self.expand(entry, st, values)
        self.pump()

    def expand(self, entry: Entry, st: MachineState, values: dict[str, Any]) -> None:
        """The entry's instances: one, or one per item of its foreach input (clamped)."""
        self.entries_by_key[(entry.state, entry.number)] = entry
        if st.foreach is None:
            items: list[tuple[int | None, dict[str, Any]]] = [(None, values)]
        else:
            over = values.get(st.foreach.over)
            if not isinstance(over, list):
                entry.expected, entry.unexpanded = 0, True
                where = {"state": entry.state, "entry": entry.number, "item": None, "attempt": 0}
                got = "null" if over is None else type(over).__name__
                why = (
                    f"foreach over input {st.foreach.over!r} of state {entry.state!r} needs a "
                    f"JSON list, got {got}: {_short(over)}"
                )
                self._entry_failed(entry, st, where, why)
                return
            most = st.foreach.max
            if self.foreach_cap is not None:
                most = min(most, self.foreach_cap)
            seq = over[:most]
            items = [(i, values | {st.foreach.over: v}) for i, v in enumerate(seq)]
        entry.expected = len(items)
        for item, vals in items:
            self.queue.append(Instance(entry.state, entry.number, item, 0, vals))
        if not items:  # an empty foreach settles at once with no outputs
            self.settle(entry)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self.running.add(task)
        task.add_done_callback(self.running.discard)

    def pump(self) -> None:
        """Start queued instances while max_parallel allows."""
        limit = self.m.run.max_parallel
        while (
            self.queue
            and self.status_value is FlowStatus.RUNNING
            and (limit is None or self.active < limit)
        ):
            inst = self.queue.popleft()
            self.live[inst.slot] = inst
            self.active += 1
            if self.m.states[inst.state].lifecycle == "resident":
                self.residents += 1
            if self.replaying:  # its outcome is in the ledger further on (or go_live runs it)
                self.pending[inst.key] = inst
            else:
                self._spawn(self.run_instance(inst))

    async def run_instance(self, inst: Instance) -> None:
        st = self.m.states[inst.state]
        while True:
            child = await self._child_of(inst, st)
            if child is None:
                return
            await child.done.wait()
            rec = child.rec
            if _rate_limited_at_first_call(child) and self.ending is None:
                if await self._defer(inst, rec.reason):
                    continue  # a new run of the same attempt, under its next key
                return
            if rec.state is RunState.COMPLETED:
                try:
                    outputs = self._outputs(st, rec.answer)
                except OutputError as exc:
                    # A binding failure: the same answer would fail the same way on every
                    # retry, so the state's retries are not spent on it (they are for
                    # children that fail); the failure policy applies at once.
                    why = f"binding failure (not retried): state {inst.state!r}: {exc}"
                    self._settled(inst, "failed", why, retry=False)
                    return
                self._settled(inst, "completed", outputs=outputs)
            elif rec.state is RunState.CANCELLED and self.status_value is not FlowStatus.RUNNING:
                self._settled(inst, "cancelled")
            elif rec.state is RunState.TIMED_OUT and st.budget is not None:
                # Over the state's budget: this attempt ends timed_out, and is not retried
                # (another attempt would run into the same budget).
                self._settled(inst, "failed", f"{rec.state.value}: {rec.reason}", retry=False)
            else:
                self._settled(inst, "failed", f"{rec.state.value}: {rec.reason}")
            return

    async def _child_of(self, inst: Instance, st: MachineState) -> R | None:
        """The instance's child: adopted from the journal after a resume, else started.
        None when none runs (the instance is settled, or waits no more)."""
        key = inst.child_key
        child = self.host.adopt_child(self.run, key, st.budget, launch=self.ending is None)
        if child is None:
            if self.ending is not None:  # the flow is ending: nothing more starts
                self._settled(inst, "cancelled")
                return None
            try:
                prompt = render_prompt(st.prompt, inst.inputs)
            except BroodError as exc:
                self._settled(inst, "failed", f"could not render its prompt: {exc}")
                return None
            child = await self._start_with_backoff(inst, prompt, key, st)
            if child is None:
                return None
        if inst.run is None:  # not in the ledger yet
            inst.run = child
            self.ledger("spawned", **inst.where, run_id=child.id)
        if self.status_value in (FlowStatus.STOPPING, FlowStatus.STOPPED):  # started after stop
            await self.host.finish(child, RunState.CANCELLED, "flow stopped")
        return child

    async def _defer(self, inst: Instance, reason: str | None) -> bool:
        """The instance's run ended on a rate limit at its first model call: the factory's
        backoff, then a new run (True), or after START_TRIES runs the failure policy."""
        tries = inst.tries + 1
        if tries >= START_TRIES:
            why = f"rate limited at its first model call, {tries} runs in all: {reason}"
            self._settled(inst, "failed", why, retry=False)
            return False
        wait = min(START_BACKOFF_FIRST_S * 2 ** (tries - 1), START_BACKOFF_MAX_S)
        self.ledger("deferred", **inst.where, tries=tries, wait=wait, reason=reason)
        inst.tries, inst.run = tries, None
        return await self._backoff(inst, wait)

    async def _backoff(self, inst: Instance, wait: float) -> bool:
        """Wait out a backoff in the instance's own task (the control loop goes on), then
        until the flow runs (a paused flow starts nothing). False when the flow ended
        meanwhile: a backoff that wakes in a stopped flow does nothing."""
        if self.ending is not None or self.ended_outside:  # it ended before this began
            if inst.outcome is None:
                self._settled(inst, "cancelled")
            return False
        task = asyncio.current_task()
        assert task is not None
        self.sleepers[inst.slot] = task
        try:
            await self.sleep(wait)
            while self.status_value is FlowStatus.PAUSED:
                await self.changed.wait()
                self.changed.clear()
        finally:
            self.sleepers.pop(inst.slot, None)
        return (
            inst.outcome is None and self.ending is None and self.status_value is FlowStatus.RUNNING
        )

    def _cancel_sleepers(self) -> None:
        """The flow ends: instances waiting out a backoff are cancelled (they never run)."""
        for slot, task in list(self.sleepers.items()):
            inst = self.live.get(slot)
            if inst is not None and inst.outcome is None:
                self._settled(inst, "cancelled")
            task.cancel()
        self.sleepers.clear()

    @staticmethod
    def _outputs(st: MachineState, answer: str | None) -> dict[str, Any]:
        return {o.name: read_output(answer or "", o.name, o.type) for o in st.outputs}

    def _settled(
        self,
        inst: Instance,
        outcome: str,
        reason: str | None = None,
        outputs: dict[str, Any] | None = None,
        *,
        retry: bool = True,
    ) -> None:
        """An instance ended (completed / failed / cancelled): the ledger's input event,
        then every decision that follows from it; none once the flow's run was ended from
        outside (noticed, and journaled, before the settle)."""
        ended = self._controller_ended()
        if inst.outcome is None:
            self.active -= 1  # the counter keeps pump and quiescence O(1)
            if self.m.states[inst.state].lifecycle == "resident":
                self.residents -= 1
        inst.outcome = outcome
        inst.outputs = outputs or {}
        self.settles += 1
        self.ledger(
            "settled",
            **inst.where,
            run_id=getattr(inst.run, "id", None),
            outcome=outcome,
            **({"reason": reason} if reason else {}),
            **({} if retry else {"retry": False}),
        )
        if ended:
            return
        if outcome == "completed":
            self.instance_done(inst)
        elif outcome == "cancelled":
            self.check_quiescence()
        else:
            self.instance_failed(inst, reason or "failed", retry=retry)

    async def _start_with_backoff(
        self, inst: Instance, prompt: str, key: str, st: MachineState
    ) -> R | None:
        """Start the instance's child. A start refused for capacity (LimitExceeded,
        BackendError) or a rate limit is tried again after 1 s, doubling to 60 s, 5 tries
        in all; the wait is this instance's own task, so the control loop goes on. One
        refused for a tree limit (TREE_LIMITS) fails the instance at once, and is not
        retried (nor are its state's retries spent on it): it would be refused again."""
        delay = START_BACKOFF_FIRST_S
        for tries in range(1, START_TRIES + 1):
            try:
                return await self.host.start_child(
                    self.run,
                    prompt,
                    key=key,
                    model_name=st.settings.model,
                    timeout=st.budget,
                    pool=st.pool,
                )
            except (LimitExceeded, BackendError, RateLimited) as exc:
                if isinstance(exc, LimitExceeded) and exc.kind in TREE_LIMITS:
                    self._settled(inst, "failed", f"could not start: {exc}", retry=False)
                    return None
                if tries == START_TRIES:
                    why = f"could not start after {tries} tries: {exc}"
                else:
                    self.ledger(
                        "start_retry", **inst.where, tries=tries, wait=delay, reason=str(exc)
                    )
                    if not await self._backoff(inst, delay):
                        return None
                    delay = min(delay * 2, START_BACKOFF_MAX_S)
                    continue
            except BroodError as exc:
                why = f"could not start: {exc}"
            self._settled(inst, "failed", why)
            return None
        return None

    # ---- settling -------------------------------------------------------------------------
    def instance_done(self, inst: Instance) -> None:
        entry = self.entries_by_key[(inst.state, inst.entry)]
        entry.instances.append(inst)
        entry.completed += 1
        if self.ending is not None:
            return  # a flow that is ending admits nothing more
        if not entry.failed and entry.completed == entry.expected:
            self.settle(entry)
        self.pump()
        self.check_quiescence()

    def settle(self, entry: Entry) -> None:
        st = self.m.states[entry.state]
        done = sorted(
            (i for i in entry.instances if i.outcome == "completed"), key=lambda i: i.item or 0
        )
        if st.foreach is None:
            outputs = done[0].outputs if done else {}
        else:  # each output becomes a list, in item order
            outputs = {o.name: [i.outputs.get(o.name) for i in done] for o in st.outputs}
        entry.settled = True
        self.outputs[entry.state] = outputs
        self.failed_sources.pop(entry.state, None)  # its latest entry settled after all
        for t in self.m.transitions_from(entry.state):
            if t.guard is not None and not evaluate(t.guard, outputs):
                continue
            self.fire(entry.state, t.target)
        self.try_waiting()

    def fire(self, source: str, target: str, *, failed: bool = False) -> None:
        """`source` settled (or, `failed`, failed under `continue`): enter `target`."""
        if self.fired >= self.m.run.max_transitions:
            self.held.append(target)
            if self.status_value is FlowStatus.RUNNING:
                self.pause(
                    "max_transitions_exceeded",
                    f"max_transitions {self.m.run.max_transitions} reached",
                )
            return
        self.fired += 1
        on = {"on": "failed"} if failed else {}
        self.ledger("transition_fired", source=source, target=target, fired=self.fired, **on)
        self.enter(target, cause=source)

    def _controller_ended(self) -> bool:
        """The flow's own run was ended from outside (its parent ended, a cancel): the flow
        is over, and what its instances do now changes nothing. Noticed once, as the
        ledger input `run_ended` (a replay stops deciding at the same point)."""
        if self.ended_outside:
            return True
        if self.replaying or self.ending is not None:
            return False  # a replay learns it from the ledger; an ending of its own is no news
        if self.run.ending is None and not self.run.rec.state.terminal:
            return False
        self._run_ended(self.run.rec.reason or "the flow's run ended")
        return True

    def _run_ended(self, reason: str) -> None:
        self.ended_outside = True
        self.ledger("run_ended", reason=reason)
        self._cancel_sleepers()
        if not self.status_value.ended:
            self.set_status(FlowStatus.STOPPED)
            self.reason = reason
        self.done.set()

    async def _watch_run(self) -> None:
        """Notice the flow's run ending from outside while no instance settles (a paused
        flow, one waiting for a start)."""
        await self.run.done.wait()
        self._controller_ended()

    def instance_failed(self, inst: Instance, why: str, *, retry: bool = True) -> None:
        st = self.m.states[inst.state]
        if retry and inst.attempt < st.retries and self.status_value is FlowStatus.RUNNING:
            self.ledger(
                "retry",
                state=inst.state,
                entry=inst.entry,
                item=inst.item,
                attempt=inst.attempt + 1,
                reason=why,
            )
            del self.live[inst.slot]
            self.queue.appendleft(
                Instance(inst.state, inst.entry, inst.item, inst.attempt + 1, inst.inputs)
            )
            self.pump()
            return
        entry = self.entries_by_key[(inst.state, inst.entry)]
        entry.instances.append(inst)
        self._entry_failed(entry, st, inst.where, why)

    def _entry_failed(
        self, entry: Entry, st: MachineState, where: dict[str, Any], why: str
    ) -> None:
        """An entry failed (an instance, after its retries, or its foreach input): none of
        its queued instances start, and the failure policy applies once."""
        first = not entry.failed
        entry.failed = True
        if first:
            self._cancel_queued(entry)
        if first and self.ending is None:
            self.ledger("state_failed", **where, reason=why)
            policy = st.failure_policy
            if policy == "fail_fast":
                self.fail(f"state {entry.state} failed: {why}")
                return
            if policy == "escalate":
                self.failed_entries.append(entry)
                self.pause("paused", f"state {entry.state} failed: {why}; resume to retry it")
                return
            # continue: the rest goes on, and the flow ends failed once it has settled
            self.continued.setdefault(entry.state, why)
            self._fire_failed(entry.state, why)
        self.pump()
        self.check_quiescence()

    def _fire_failed(self, state: str, why: str) -> None:
        """A state failed under `continue`: its dependents still run where they need
        nothing of it. Every unguarded transition from it fires (a guard reads its output,
        which it has none of, so a guarded one does not); an entered state that reads none
        of its outputs runs (a control-only dependent), one that reads a required output
        fails at binding (`unbindable`) and its own failure policy applies."""
        self.failed_sources[state] = why
        self.cascade.append(state)
        if len(self.cascade) > 1:
            return  # an outer call is firing: it fires this one's too (no deep recursion)
        while self.cascade:
            for t in self.m.transitions_from(self.cascade[0]):
                if t.guard is None:
                    self.fire(self.cascade[0], t.target, failed=True)
            self.cascade.popleft()
        self.try_waiting()

    def _cancel_queued(self, entry: Entry) -> None:
        """The instances of a failed entry still waiting for a slot never start: recorded
        cancelled (an escalated entry's resume runs them again)."""
        mine: list[Instance] = []
        kept: deque[Instance] = deque()
        for inst in self.queue:
            (mine if (inst.state, inst.entry) == (entry.state, entry.number) else kept).append(inst)
        self.queue = kept
        for inst in mine:
            inst.outcome = "cancelled"
            entry.instances.append(inst)
            self.ledger("instance_cancelled", **inst.where, reason="its entry failed")

    # ---- quiescence, pause, stop ------------------------------------------------------------
    def check_quiescence(self) -> None:
        if self.status_value is not FlowStatus.RUNNING or self.done.is_set():
            return
        if self.queue or self.active > self.residents or self.cascade:
            return  # work still going; residents alone do not hold the flow open
        if self.waiting:
            entry = self.waiting[0]
            st = self.m.states[entry.state]
            missing = [
                f"{i.name} (from {i.source}.{i.output})"
                for i in st.inputs
                if i.source and not i.optional and i.output not in self.outputs.get(i.source, {})
            ]
            self.fail(
                f"stalled: state {entry.state} waits for input {', '.join(missing)}, "
                "which never settled"
            )
            return
        if self.continued:  # the work is done, but some of it failed: the parent must know
            failed = "; ".join(f"{state}: {why}" for state, why in self.continued.items())
            self.fail(f"states failed (failure_policy continue): {failed}")
            return
        self.end_with(FlowStatus.FINISHED, "flow finished")

    def set_status(self, value: FlowStatus) -> None:
        self.status_value = value
        self.changed.set()

    def pause(self, milestone: str, why: str) -> None:
        self.set_status(FlowStatus.PAUSED)
        self.reason = why
        self.milestone(milestone, reason=why)
        if milestone != "paused":
            self.milestone("paused", reason=why)

    async def resume(self) -> None:
        """Go on after a pause: held fires fire (a max_transitions pause allows as many
        again), failed escalated entries run again."""
        if self.status_value is not FlowStatus.PAUSED:
            raise BroodError(
                f"flow {self.run.id} is {self.status_value}; only a paused flow resumes"
            )
        self.ledger("resumed")
        self._go_on()

    def _go_on(self) -> None:
        self.set_status(FlowStatus.RUNNING)
        self.reason = None
        self.milestones = [
            m
            for m in self.milestones
            if m not in ("paused", "max_transitions_exceeded", "budget_exceeded")
        ]
        if self.held:
            self.fired = 0
        while self.held and self.fired < self.m.run.max_transitions:
            self.fired += 1
            target = self.held.popleft()
            self.ledger("transition_fired", source=None, target=target, fired=self.fired)
            self.enter(target, cause="resume")
        for entry in self.failed_entries:
            if entry.unexpanded:  # its foreach input is read again (and fails again)
                entry.failed = entry.unexpanded = False
                self.waiting.append(entry)
                continue
            # Items that completed keep their outputs; each failed one runs again, under a
            # new attempt (one child per key and attempt).
            failed = [i for i in entry.instances if i.outcome != "completed"]
            entry.instances = [i for i in entry.instances if i.outcome == "completed"]
            entry.completed = len(entry.instances)
            entry.failed = False
            for i in failed:
                self.live.pop(i.slot, None)
                self.queue.append(Instance(i.state, i.entry, i.item, i.attempt + 1, i.inputs))
        self.failed_entries.clear()
        self.pump()
        self.try_waiting()
        self.check_quiescence()

    async def wait(self, timeout: float | None = None) -> FlowStatus:
        """Until the flow ends (finished, failed, stopped) or pauses; returns that status.
        On timeout raises TimeoutError and the flow keeps going."""

        async def paused() -> None:
            while self.status_value is not FlowStatus.PAUSED:
                await self.changed.wait()
                self.changed.clear()

        waits = [asyncio.ensure_future(self.done.wait()), asyncio.ensure_future(paused())]
        try:
            finished, _ = await asyncio.wait(
                waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for w in waits:
                w.cancel()
        if not finished:
            raise TimeoutError(
                f"flow {self.run.id} is still {self.status_value} after {timeout} s; it keeps going"
            )
        return self.status_value

    async def stop(self, reason: str = "stopped") -> FlowStatus:
        """Stop admitting, cancel every running instance (exit confirmed), end `stopped`.
        Idempotent: a second stop waits for the first."""
        if self.ending is None and not self.done.is_set():
            self.ledger("stopping", reason=reason)
            self.end_with(FlowStatus.STOPPED, reason)
        await self.done.wait()
        return self.status_value

    async def stop_report(self, reason: str = "stopped") -> dict[str, Any]:
        """`stop`, and what it cancelled, as the factory reports it: {"state": the final
        state, "cancelled": the states whose instances it cancelled, "instances": those
        instances (state, entry, item, attempt, run_id)}; a second stop cancels nothing."""
        going = [i for i in self.live.values() if i.outcome is None] + list(self.queue)
        if self.ending is not None or self.done.is_set():
            going = []
        state = await self.stop(reason)
        cancelled = [i for i in going if i.outcome in (None, "cancelled")]
        return {
            "state": state,
            "cancelled": list(dict.fromkeys(i.state for i in cancelled)),
            "instances": [dict(i.where, run_id=getattr(i.run, "id", None)) for i in cancelled],
        }

    def fail(self, why: str) -> None:
        self.end_with(FlowStatus.FAILED, why, milestone="failed")

    def end_with(self, final: FlowStatus, reason: str, milestone: str | None = None) -> None:
        """Begin to end the flow as `final` (finished, failed or stopped). What is decided
        is decided now: a failing or stopping flow is `stopping` at once (it admits and
        finalizes nothing more); the cancelling and the journaling run as a task."""
        if self.ending is not None or self.done.is_set():
            return
        self.ending = (final, reason, milestone)
        self.queue.clear()
        if final is FlowStatus.FINISHED:
            self.set_status(FlowStatus.FINISHED)
            self.milestone("finished")
        else:
            self.set_status(FlowStatus.STOPPING)
            if milestone is not None:
                self.reason = reason
                self.milestone(milestone, reason=reason)
        if not self.replaying:
            self._spawn(self._complete_ending())

    async def _complete_ending(self) -> None:
        assert self.ending is not None
        final, reason, _ = self.ending
        if final is FlowStatus.FINISHED:
            why = "flow finished: its resident states are stopped"
        else:
            why = "flow stopped" if final is FlowStatus.STOPPED else f"flow failed: {reason}"
        self._cancel_sleepers()
        await self._cancel_all(why)
        self.set_status(final)
        answer = json.dumps(self.outputs, default=str) if final is FlowStatus.FINISHED else None
        await self._end(ENDS[final], reason, answer)

    async def _cancel_all(self, why: str) -> None:
        """Cancel every unfinished child of the flow's run (instances, and after a resume
        journaled children not asked for again), exit confirmed."""
        runs = [c for c in self.run.children if not c.rec.state.terminal]
        await asyncio.gather(*(self.host.finish(r, RunState.CANCELLED, why) for r in runs))

    def _budget_expired(self) -> None:
        if self.status_value in (FlowStatus.RUNNING, FlowStatus.PAUSED) and self.ending is None:
            self.ledger("budget_expired", budget=self.m.run.budget)
            self._over_budget()

    def _over_budget(self) -> None:
        """The run's budget ran out: nothing new starts, the running instances finish, and
        the flow pauses (milestone budget_exceeded); resume() goes on."""
        why = (
            f"budget: {self.m.run.budget:g} s of wall clock used; running instances finish, "
            "nothing new starts; resume to go on"
        )
        if self.status_value is FlowStatus.RUNNING:
            self.pause("budget_exceeded", why)
        else:  # already paused: say why too
            self.milestone("budget_exceeded", reason=why)

    async def _end(self, state: RunState, reason: str, answer: str | None = None) -> None:
        if self._budget_timer is not None:
            self._budget_timer.cancel()
        if not self.ended_journaled:
            self.ended_journaled = True
            self.ledger("flow_ended", status=self.status_value, reason=reason)
        await self.host.finish(self.run, state, reason, answer=answer)
        self.done.set()

    # ---- after a crash -----------------------------------------------------------------------
    @classmethod
    def from_ledger(
        cls, host: FlowHost[R], run: R, events: list[dict[str, Any]], *, sleep: Any = asyncio.sleep
    ) -> FlowExecutor[R]:
        """Rebuild the flow whose run is `run` from its journaled ledger (`events`, in
        order): the same code decides again from the same inputs, with the ledger muted.
        Derived events the crash kept from the journal are written now."""
        ledger = [e["data"] for e in events]
        head = next((d for d in ledger if d["kind"] == "spec"), None)
        if head is None or not head.get("spec"):
            raise BroodError(f"flow {run.id}: its ledger holds no spec, so it cannot be rebuilt")
        ex = cls(host, compile_spec(load_spec(head["spec"])), head.get("params"), sleep=sleep)
        ex.run, ex.spec, ex.foreach_cap = run, head["spec"], head.get("foreach_cap")
        ex.replaying = True
        journaled: list[dict[str, Any]] = []  # the derived events of the ledger
        for d in ledger:
            if d["kind"] in DERIVED:
                journaled.append(d)
            elif d["kind"] in INPUTS:
                ex.replay_input(d)
            ex.ended_journaled |= d["kind"] == "flow_ended"
        ex.replaying = False
        made, ex.made = ex.made, []
        # The rebuilt flow must have decided what the ledger holds, in order; what it
        # decided beyond is what the crash kept from the journal.
        for n, (old, new) in enumerate(zip(journaled, made, strict=False)):
            if _mark(old) != _mark(new):
                raise ReplayDiverged(
                    f"flow {run.id}: rebuilt from its ledger, it decided {_mark(new)} where "
                    f"the ledger holds {_mark(old)} (derived event {n})"
                )
        if len(made) < len(journaled):
            raise ReplayDiverged(
                f"flow {run.id}: rebuilt from its ledger, it made {len(made)} of the "
                f"{len(journaled)} decisions the ledger holds"
            )
        ex.recent.extend(
            e["data"] | {"at": e["at"], "stage": "recorded"}
            for e in events[-(ex.recent.maxlen or 0) :]
        )
        for d in made[len(journaled) :]:
            ex.ledger(d.pop("kind"), **d)
        return ex

    def replay_input(self, d: dict[str, Any]) -> None:
        """Feed one journaled input back to the executor."""
        kind = d["kind"]
        if kind == "flow_started":
            self._begin()
        elif kind == "resumed":
            self._go_on()
        elif kind == "stopping":
            self.end_with(FlowStatus.STOPPED, d.get("reason") or "stopped")
        elif kind == "budget_expired":
            self._over_budget()
        elif kind == "run_ended":
            self._run_ended(d.get("reason") or "the flow's run ended")
        else:  # spawned, deferred, settled
            key = (d["state"], d["entry"], d["item"], d.get("attempt", 0))
            inst = self.pending.get(key)
            if inst is None:
                raise ReplayDiverged(
                    f"flow {self.run.id}: the ledger has {kind} {d['state']} entry "
                    f"{d['entry']} item {d['item']}, which the replay never started"
                )
            if kind == "spawned":
                inst.run = self.host.run_of(d["run_id"])
                return
            if kind == "deferred":  # its run was rate limited: the next one has a new key
                inst.tries, inst.run = d["tries"], None
                return
            del self.pending[key]
            outputs = None
            if d["outcome"] == "completed":
                answer = inst.run.rec.answer if inst.run is not None else None
                outputs = self._outputs(self.m.states[inst.state], answer)
            self._settled(inst, d["outcome"], d.get("reason"), outputs, retry=d.get("retry", True))

    def go_live(self) -> None:
        """After `from_ledger`: start what the crash interrupted, and go on."""
        if self.run.rec.state.terminal or self.run.ending is not None:
            # The flow's run has ended: nothing more happens (a parent's replay may still
            # ask for the flow's status).
            final = self.ending[0] if self.ending else FlowStatus.STOPPED
            self.set_status(final)
            self.reason = self.reason or self.run.rec.reason
            self.done.set()
            return
        if self.ended_outside:  # its run was being ended from outside at the crash
            self._spawn(self.host.finish(self.run, RunState.CANCELLED, self.reason or "ended"))
            return
        pending, self.pending = list(self.pending.values()), {}
        for inst in pending:
            self._spawn(self.run_instance(inst))
        self._spawn(self._watch_run())
        if self.ending is not None:
            self._spawn(self._complete_ending())
            return
        if self.m.run.budget is not None:
            began = self.run.rec.started_at or self.run.rec.created_at
            self._arm_budget(self.m.run.budget - (time.time() - began))
        self.pump()
        self.try_waiting()
        self.check_quiescence()

    # ---- status ---------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """Per state: entries used / max, each entry's breakdown (`per_entry`: its status,
        its instance count and their outcomes) and the instances (the last
        STATUS_INSTANCES of each, with counts of them all); usage; recent events."""
        states: dict[str, dict[str, Any]] = {
            sid: {
                "entries": self.entries[sid],
                "entries_used": self.entries[sid],  # the factory's name for it
                "max_entries": st.max_entries,
                "instances": [],
                "counts": {},
            }
            for sid, st in self.m.states.items()
        }
        entries: dict[tuple[str, int], dict[str, Any]] = {}
        for e in [*self.entries_by_key.values(), *self.waiting]:
            entries[(e.state, e.number)] = {
                "entry": e.number,
                "status": (
                    "waiting"
                    if e in self.waiting
                    else "failed"
                    if e.failed
                    else "settled"
                    if e.settled
                    else "running"
                ),
                "instances": e.expected,
                "counts": {},
            }
        for i in self.live.values():  # one pass: instances by state and by entry
            row = states[i.state]
            outcome = i.outcome or "running"
            row["counts"][outcome] = row["counts"].get(outcome, 0) + 1
            per = entries.get((i.state, i.entry))
            if per is not None:
                per["counts"][outcome] = per["counts"].get(outcome, 0) + 1
            row["instances"].append(
                {
                    "entry": i.entry,
                    "item": i.item,
                    "attempt": i.attempt,
                    "rate_limited_runs": i.tries,
                    "run_id": getattr(i.run, "id", None),
                    "state": outcome,
                }
            )
        for (state, _), per in sorted(entries.items()):
            states[state].setdefault("per_entry", []).append(per)
        for row in states.values():
            row["instances"] = row["instances"][-STATUS_INSTANCES:]
            row["per_entry"] = row.get("per_entry", [])[-STATUS_INSTANCES:]
        # Usage of every run the flow started (failed attempts and deferred runs too).
        usage: dict[str, Any] = {}
        for child in self.run.children:
            add_usage(usage, child.rec.usage)
        usage |= {
            "tokens": usage.get("input_tokens", 0) + usage.get("output_tokens", 0),
            "spawns": len(self.run.children),
            "settled": self.settles,
            "running": self.active,
            "transitions_fired": self.fired,
        }
        rec = self.run.rec
        began = rec.started_at or rec.created_at
        elapsed = ((rec.ended_at or time.time()) - began) if began else 0.0
        return {
            "run_id": self.run.id,
            "state": self.status_value,  # the factory's name for `status`
            "usage": usage,
            "status": self.status_value,
            "reason": self.reason,
            "elapsed_ms": int(elapsed * 1000),
            "transitions_fired": self.fired,
            "states": states,
            "milestones": list(self.milestones),
            "events": self._deliver(),  # the last 50 ledger events
        }

    def _deliver(self) -> list[dict[str, Any]]:
        """The recent events as they stand, then marked delivered (this read delivered
        them); a shown one stays shown, so that stage can be seen."""
        events = [dict(e) for e in self.recent]
        for e in self.recent:
            if e.get("stage") in ("recorded", "arrived"):
                e["stage"] = "delivered"
        return events


def _rate_limited_at_first_call(run: FlowRun) -> bool:
    """The run failed on a rate limit at its first model call (its start, in effect), as
    its host decided (`run.failure_kind`), never as its worker's words said."""
    return (
        run.rec.state is RunState.FAILED
        and run.failure_kind is FailureKind.RATE_LIMITED
        and run.rec.usage.get("model_calls", 0) <= 1
    )


def _short(value: Any, n: int = 80) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= n else text[: n - 3] + "..."

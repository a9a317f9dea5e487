"""The run state machine: one table of legal moves, one function that performs them."""

from __future__ import annotations

import dataclasses
from collections import deque

import pytest
from hypothesis import given
from hypothesis import strategies as st

from brood.errors import BroodError
from brood.lifecycle import TERMINAL, TRANSITIONS, IllegalTransition, RunRecord, RunState, move

STATES = list(RunState)
LEGAL = [(frm, to) for frm in STATES for to in sorted(TRANSITIONS[frm])]
ILLEGAL = [(frm, to) for frm in STATES for to in STATES if to not in TRANSITIONS[frm]]


def new_record() -> RunRecord:
    return RunRecord(
        id="r-8f3a2c", root_id="r-8f3a2c", parent_id=None, depth=0, key=None, prompt="task"
    )


def path_to(target: RunState) -> list[RunState]:
    """The shortest chain of legal moves from queued to `target` (breadth-first)."""
    came_from: dict[RunState, RunState | None] = {RunState.QUEUED: None}
    todo = deque([RunState.QUEUED])
    while todo:
        state = todo.popleft()
        for nxt in sorted(TRANSITIONS[state]):
            if nxt not in came_from:
                came_from[nxt] = state
                todo.append(nxt)
    assert target in came_from, f"{target} cannot be reached from queued"
    chain: list[RunState] = []
    state: RunState | None = target
    while state is not None and state is not RunState.QUEUED:
        chain.append(state)
        state = came_from[state]
    return chain[::-1]


def record_in(state: RunState) -> RunRecord:
    """A record brought to `state` through legal moves only."""
    rec = new_record()
    for step in path_to(state):
        move(rec, step, reason="setup" if step.terminal else None)
    assert rec.state is state
    return rec


def snapshot(rec: RunRecord) -> dict[str, object]:
    return dataclasses.asdict(rec)


# ---- the table ----------------------------------------------------------------------------
def test_table_covers_every_state_and_names_design_states() -> None:
    assert set(TRANSITIONS) == set(RunState)
    assert {s.value for s in RunState} == {
        "queued",
        "running",
        "cancelling",
        "completed",
        "failed",
        "cancelled",
        "timed_out",
    }
    for targets in TRANSITIONS.values():
        assert targets <= set(RunState)


def test_terminal_states_are_exactly_those_without_moves() -> None:
    assert {s for s in STATES if not TRANSITIONS[s]} == TERMINAL
    assert {
        RunState.COMPLETED,
        RunState.FAILED,
        RunState.CANCELLED,
        RunState.TIMED_OUT,
    } == TERMINAL
    for s in STATES:
        assert s.terminal == (s in TERMINAL)


def test_every_state_is_reachable_from_queued() -> None:
    for state in STATES:
        assert record_in(state).state is state


def test_no_state_moves_to_itself() -> None:
    for state in STATES:
        assert state not in TRANSITIONS[state]


# ---- legal moves --------------------------------------------------------------------------
@pytest.mark.parametrize(("frm", "to"), LEGAL, ids=[f"{a}->{b}" for a, b in LEGAL])
def test_every_legal_move_works(frm: RunState, to: RunState) -> None:
    rec = record_in(frm)
    reason = "because" if to.terminal else None
    assert move(rec, to, reason) == (frm, to)
    assert rec.state is to
    if to.terminal:
        assert rec.reason == "because"
        assert rec.ended_at is not None
        assert rec.started_at is not None


def test_running_stamps_start_and_terminal_stamps_end() -> None:
    rec = new_record()
    assert rec.started_at is None and rec.ended_at is None and rec.duration is None
    move(rec, RunState.RUNNING)
    started = rec.started_at
    assert started is not None and rec.ended_at is None
    move(rec, RunState.CANCELLING, "cancelled by parent")
    assert rec.started_at == started, "cancelling must not restart the clock"
    assert rec.reason == "cancelled by parent"
    move(rec, RunState.CANCELLED, "cancelled by parent")
    assert rec.started_at == started
    assert rec.ended_at is not None and rec.ended_at >= started
    assert rec.duration == rec.ended_at - started


def test_a_run_cancelled_while_queued_gets_both_stamps() -> None:
    rec = new_record()
    move(rec, RunState.CANCELLED, "cancelled by parent")
    assert rec.started_at is not None
    assert rec.started_at == rec.ended_at
    assert rec.duration == 0


# ---- illegal moves ------------------------------------------------------------------------
@pytest.mark.parametrize(("frm", "to"), ILLEGAL, ids=[f"{a}->{b}" for a, b in ILLEGAL])
def test_every_illegal_move_is_refused_and_changes_nothing(frm: RunState, to: RunState) -> None:
    rec = record_in(frm)
    before = snapshot(rec)
    with pytest.raises(IllegalTransition) as info:
        move(rec, to, reason="because")
    assert snapshot(rec) == before
    message = str(info.value)
    assert rec.id in message and frm.value in message and to.value in message


@pytest.mark.parametrize("frm", sorted(TERMINAL))
def test_terminal_states_are_immutable(frm: RunState) -> None:
    rec = record_in(frm)
    before = snapshot(rec)
    for to in STATES:
        with pytest.raises(IllegalTransition, match="a terminal run never changes"):
            move(rec, to, reason="again")
        assert snapshot(rec) == before


@pytest.mark.parametrize(("frm", "to"), [(a, b) for a, b in LEGAL if b.terminal])
@pytest.mark.parametrize("reason", [None, ""])
def test_terminal_move_without_reason_is_refused(
    frm: RunState, to: RunState, reason: str | None
) -> None:
    rec = record_in(frm)
    before = snapshot(rec)
    with pytest.raises(IllegalTransition, match="needs a reason"):
        move(rec, to, reason)
    assert snapshot(rec) == before


def test_illegal_transition_is_a_brood_error() -> None:
    assert issubclass(IllegalTransition, BroodError)


def test_a_state_given_as_text_is_coerced_or_refused_clearly() -> None:
    rec = new_record()
    try:
        move(rec, "running")  # type: ignore[arg-type]
    except IllegalTransition:
        assert rec.state is RunState.QUEUED
    else:
        assert rec.state is RunState.RUNNING


# ---- random sequences ---------------------------------------------------------------------
@given(
    st.lists(st.tuples(st.sampled_from(STATES), st.sampled_from([None, "", "why"])), max_size=12)
)
def test_random_move_sequences_follow_the_table(moves: list[tuple[RunState, str | None]]) -> None:
    rec = new_record()
    for to, reason in moves:
        frm = rec.state
        before = snapshot(rec)
        allowed = to in TRANSITIONS[frm] and (not to.terminal or bool(reason))
        if allowed:
            assert move(rec, to, reason) == (frm, to)
            assert rec.state is to
        else:
            with pytest.raises(IllegalTransition):
                move(rec, to, reason)
            assert snapshot(rec) == before
        if rec.state.terminal:
            assert rec.reason and rec.ended_at is not None


def test_the_dashboard_script_knows_the_same_terminal_states() -> None:
    """dash.js cannot import brood.lifecycle: its copy of the set is held to the one here."""
    import re
    from pathlib import Path

    import brood
    from brood.lifecycle import TERMINAL_VALUES

    script = (Path(brood.__file__).parent / "serve" / "static" / "dash.js").read_text()
    found = re.search(r"const TERMINAL = new Set\(\[([^\]]*)\]\)", script)
    assert found is not None
    assert set(re.findall(r'"(\w+)"', found.group(1))) == TERMINAL_VALUES

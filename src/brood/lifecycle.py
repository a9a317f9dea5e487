"""Run states and the one table of legal moves between them; the other states brood keeps
(a flow's, an ask's), the kinds of a run's failure, and how a run's usage adds up (a cost
may be unknown), each defined once here.

`move` is the only function that changes a run's state; the supervisor calls it and journals
the move before anyone is told of it. Terminal states never change.

Every enum here is a `StrEnum`: a member is the very string the journal, the wire, the
dashboard and the public API carry, so readers compare either. This module imports nothing
heavier than `brood.errors`: the worker side, the journal's readers and `import brood` all
import it.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from brood.errors import IllegalTransition

__all__ = [
    "ASK_OPENED",
    "COUNT_KEYS",
    "FLOW_ENDED",
    "HIBERNATING",
    "TERMINAL",
    "TERMINAL_VALUES",
    "TRANSITIONS",
    "USAGE_KEYS",
    "AskState",
    "FailureKind",
    "FlowStatus",
    "IllegalTransition",
    "RunRecord",
    "RunState",
    "add_cost",
    "add_usage",
    "is_hibernating",
    "move",
]


class RunState(enum.StrEnum):
    """The states of a run; `TRANSITIONS` holds the legal moves between them."""

    QUEUED = "queued"
    RUNNING = "running"
    CANCELLING = "cancelling"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"

    @property
    def terminal(self) -> bool:
        """Whether the state is an end: completed, failed, cancelled or timed_out."""
        return self in TERMINAL


TERMINAL = frozenset({RunState.COMPLETED, RunState.FAILED, RunState.CANCELLED, RunState.TIMED_OUT})
# The same states as the journal, the wire and the dashboard spell them. The one definition:
# the worker side, the journal's readers and the cluster import it from here.
TERMINAL_VALUES: frozenset[str] = frozenset(s.value for s in TERMINAL)
# How the reason of a `running` run's journal row begins while it is hibernating (its
# worker stopped for a long wait, to be rebuilt by replay): readers show it as such.
HIBERNATING = "hibernating"


def is_hibernating(state: str, reason: str | None) -> bool:
    """Whether a journal row (its state and reason) is that of a hibernating run."""
    return state == RunState.RUNNING.value and (reason or "").startswith(HIBERNATING)


class FlowStatus(enum.StrEnum):
    """A flow's status (`FlowHandle.status()["status"]`, `wait()`, the `flow_ended` ledger
    event). `stopping` is on the way to `stopped` or `failed`."""

    RUNNING = "running"
    PAUSED = "paused"
    STOPPING = "stopping"
    FINISHED = "finished"
    FAILED = "failed"
    STOPPED = "stopped"

    @property
    def ended(self) -> bool:
        return self in FLOW_ENDED


# The statuses a flow ends in: it never leaves one.
FLOW_ENDED = frozenset({FlowStatus.FINISHED, FlowStatus.FAILED, FlowStatus.STOPPED})


class AskState(enum.StrEnum):
    """An ask to a person: open until answered (by someone, or its deadline's default) or
    cancelled (withdrawn, its deadline passed with no default, or its run ended)."""

    OPEN = "open"
    ANSWERED = "answered"
    CANCELLED = "cancelled"


# The journal's `ask` events: op "opened" opens an ask; the op of each later one is the
# AskState the ask moved to (answered, cancelled).
ASK_OPENED = "opened"


class FailureKind(enum.StrEnum):
    """Why a failed run failed, as the supervisor decided it (never from a worker's words):
    its journal failed a write (`store`), its model call was refused by a rate limit and the
    run then failed (`rate_limited`), its replay of the journal diverged (`diverged`), or
    anything else (`error`). The reason's text says the rest."""

    ERROR = "error"
    STORE = "store"
    RATE_LIMITED = "rate_limited"
    DIVERGED = "diverged"


TRANSITIONS: dict[RunState, frozenset[RunState]] = {
    RunState.QUEUED: frozenset(
        {RunState.RUNNING, RunState.CANCELLING, RunState.CANCELLED, RunState.FAILED}
    ),
    RunState.RUNNING: frozenset(
        {
            RunState.COMPLETED,
            RunState.FAILED,
            RunState.CANCELLING,
            RunState.TIMED_OUT,
        }
    ),
    # A cancel in progress can still end another way: the worker's answer or crash may
    # land before exit is confirmed, or the run's own timer may have started the cancel.
    RunState.CANCELLING: frozenset(
        {RunState.CANCELLED, RunState.FAILED, RunState.TIMED_OUT, RunState.COMPLETED}
    ),
    RunState.COMPLETED: frozenset(),
    RunState.FAILED: frozenset(),
    RunState.CANCELLED: frozenset(),
    RunState.TIMED_OUT: frozenset(),
}


@dataclass
class RunRecord:
    """What the journal keeps of one run (DESIGN.md section 2)."""

    id: str
    root_id: str
    parent_id: str | None
    depth: int
    key: str | None
    prompt: str
    model: str | None = None
    pool: str | None = None
    context_ref: str | None = None
    attempt: int = 0
    state: RunState = RunState.QUEUED
    reason: str | None = None
    answer: str | None = None
    error: str | None = None
    usage: dict[str, Any] = field(default_factory=dict)
    products: dict[str, Any] | None = None  # FINAL(answer, products=...), kept beside it
    created_at: float = field(default_factory=time.time)
    started_at: float | None = None
    ended_at: float | None = None
    pid: int | None = None

    @property
    def duration(self) -> float | None:
        if self.started_at is None:
            return None
        return (self.ended_at or time.time()) - self.started_at


def move(record: RunRecord, to: RunState, reason: str | None = None) -> tuple[RunState, RunState]:
    """Move `record` to state `to`, checking the table; returns (from, to).

    A terminal move needs a reason. Raises `IllegalTransition` for a move the table does
    not allow; the record is unchanged then.
    """
    frm = record.state
    try:
        to = RunState(to)
    except ValueError:
        raise IllegalTransition(
            f"run {record.id}: {to!r} is not a state; states are "
            + ", ".join(s.value for s in RunState)
        ) from None
    if to not in TRANSITIONS[frm]:
        raise IllegalTransition(
            f"run {record.id} is {frm.value}; it cannot move to {to.value}"
            + (" (a terminal run never changes)" if frm.terminal else "")
        )
    if to.terminal and not reason:
        raise IllegalTransition(f"run {record.id}: a move to {to.value} needs a reason")
    now = time.time()
    record.state = to
    if reason is not None:
        record.reason = reason
    if to is RunState.RUNNING:
        record.started_at = now
    if to.terminal:
        record.ended_at = now
        if record.started_at is None:
            record.started_at = now
    return frm, to


# ---- a run's usage -------------------------------------------------------------------------
COUNT_KEYS = ("model_calls", "input_tokens", "output_tokens", "unpriced_calls")
USAGE_KEYS = (*COUNT_KEYS[:3], "cost", COUNT_KEYS[3])


def add_cost(total: float | None, more: float | None) -> float | None:
    """Two costs added, where None is unknown: unknown plus unknown stays unknown, and
    what is known of either is kept."""
    if total is None:
        return more
    if more is None:
        return total
    return total + more


def add_usage(into: dict[str, Any], usage: Mapping[str, Any]) -> None:
    """Add a usage (a run's, a subtree's) into `into`: counts are summed, and costs with
    `add_cost` (a usage without a cost, one that made no call, adds nothing to it)."""
    for k in COUNT_KEYS:
        if k in usage or k in into:
            into[k] = into.get(k, 0) + (usage.get(k) or 0)
    if "cost" in usage:
        into["cost"] = add_cost(into["cost"], usage["cost"]) if "cost" in into else usage["cost"]

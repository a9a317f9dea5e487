"""Flows rebuilt from their ledgers must decide exactly what they decided live.

`replay_checked` wraps `Supervisor.close`: before a supervisor closes, every flow it ran to
its end is rebuilt with `FlowExecutor.from_ledger` (what a resume after a crash does) and
compared with the live executor. Every flow test of the modules that use the fixture is
then also a test of crash-resume determinism.
"""

from __future__ import annotations

from typing import Any

import pytest

import brood
from brood.flow.executor import FlowExecutor


class LedgerHost:
    """Just enough of a supervisor for `from_ledger`: runs from the journal; the events a
    rebuild writes are kept in `written`."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.written: list[dict[str, Any]] = []

    def event(self, run: Any, kind: str, data: dict[str, Any]) -> None:
        self.written.append(data)

    def run_of(self, run_id: str) -> Any:
        return JournaledRun(self.store.get_run(run_id))


class JournaledRun:
    def __init__(self, row: dict[str, Any]) -> None:
        self.id = row["id"]
        self.rec = self  # what the executor reads of a run's record
        self.answer = row["answer"]


def rebuild(store: Any, flow_id: str, cut: int | None = None) -> tuple[FlowExecutor, list]:
    """The flow rebuilt from the first `cut` events of its ledger (all by default), and
    the events the rebuild wrote."""
    host = LedgerHost(store)
    events = store.events(flow_id, "flow")[:cut]
    run = JournaledRun(store.get_run(flow_id))
    return FlowExecutor.from_ledger(host, run, events), host.written  # type: ignore[arg-type]


def assert_flows_replay(sup: brood.Supervisor) -> int:
    """Rebuild every flow `sup` ran to its end and compare; returns how many."""
    sup.store.flush()
    checked = 0
    for flow_id in sup._engine.flow_ids():
        live = sup._engine.flow(flow_id)
        if not live.done.is_set():
            continue
        rebuilt, written = rebuild(sup.store, flow_id)
        assert written == [], f"flow {flow_id}: a whole ledger needs nothing written"
        assert rebuilt.outputs == live.outputs, flow_id
        assert rebuilt.entries == live.entries, flow_id
        assert rebuilt.fired == live.fired, flow_id
        assert rebuilt.milestones == live.milestones, flow_id
        assert list(rebuilt.held) == list(live.held), flow_id
        if rebuilt.ending is not None:  # None: the flow's run was ended from outside
            assert rebuilt.ending[0] == live.status_value, flow_id
        checked += 1
    return checked


@pytest.fixture
def replay_checked(monkeypatch: pytest.MonkeyPatch) -> Any:
    real_close = brood.Supervisor.close

    def close(self: brood.Supervisor) -> None:
        if not self._engine.closed:
            assert_flows_replay(self)
        real_close(self)

    monkeypatch.setattr(brood.Supervisor, "close", close)
    yield

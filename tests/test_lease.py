"""Ownership of a tree is a lease in the journal (brood.lease): renewed while its supervisor
lives, lapsed or revoked when it is gone, and a supervisor that finds its lease gone is
fenced (it writes nothing more). Real supervisors, workers and SQLite journals."""

from __future__ import annotations

import sqlite3
import threading
import time
from typing import Any

import pytest

import brood
from brood import lease
from brood.journal import Journal
from brood.store.base import open_store
from tests.test_resume import CHILD_A, PLAIN, ROOT, crashed_tree, repl
from tests.test_serve import until
from tests.util import FAST


def alive(url: str, token: str) -> bool:
    with Journal(url) as journal:
        return journal.supervisor_alive(token)


def supervisor_row(url: str, token: str) -> dict[str, Any]:
    with Journal(url) as journal:
        row = journal.store.supervisor(token)
    assert row is not None
    return row


def set_row(url: str, token: str, **values: Any) -> None:
    """Change a supervisor's row as another host's supervisor would have written it."""
    path = url.removeprefix("sqlite:///")
    with sqlite3.connect(path) as conn:
        for column, value in values.items():
            conn.execute(f"UPDATE supervisors SET {column}=? WHERE id=?", (value, token))


@pytest.fixture
def quick_lease(monkeypatch):
    monkeypatch.setattr(lease, "RENEW_S", 0.05)
    monkeypatch.setattr(lease, "LEASE_S", 5.0)


def test_a_supervisor_holds_a_lease_and_renews_it(tmp_path, quick_lease):
    url = f"sqlite:///{tmp_path}/j.db"
    with brood.Supervisor(brood.ScriptedModel([]), store=url, limits=FAST) as sup:
        token = sup._engine.core.owner
        first = supervisor_row(url, token)["lease_until"]
        assert first > time.time()
        until(lambda: supervisor_row(url, token)["lease_until"] > first)
        assert alive(url, token)
    assert supervisor_row(url, token)["closed_at"] is not None


def test_a_supervisor_whose_lease_is_revoked_is_fenced_and_writes_nothing_more(
    tmp_path, quick_lease
):
    url = f"sqlite:///{tmp_path}/j.db"
    held, release = threading.Event(), threading.Event()

    def hold(messages: list[dict[str, Any]]) -> str:
        held.set()
        release.wait(30)
        return repl("FINAL('too late')")

    sup = brood.Supervisor(brood.ScriptedModel([hold]), store=url, limits=FAST)
    try:
        h = sup.spawn("task")
        assert held.wait(30)
        with Journal(url) as journal:
            written = len(journal.store.events(root_id=h.id))
        revoker = open_store(url)
        revoker.revoke_lease(sup._engine.core.owner).result()  # another node resumes its trees
        revoker.close()
        result = h.wait_result(timeout=30)
        assert result.state == "failed" and "fenced" in (result.error or result.reason or "")
        release.set()
        with pytest.raises(brood.StoreError, match="fenced"):
            sup.spawn("more")
    finally:
        release.set()
        with pytest.raises(brood.StoreError, match="fenced"):
            sup.close()  # every worker stopped, then the fence is raised
    with Journal(url) as journal:
        assert len(journal.store.events(root_id=h.id)) == written  # nothing after the fence
        assert journal.store.get_run(h.id)["state"] == "running"  # left for its new owner
        assert not journal.supervisor_alive(sup._engine.core.owner)


def test_a_tree_of_another_host_is_resumed_only_once_its_lease_is_gone(tmp_path):
    url, root_id = crashed_tree(tmp_path)
    with Journal(url) as journal:
        token = journal.store.get_run(root_id)["supervisor"]
    # As if its supervisor ran on another host: its pid means nothing here, its lease holds.
    set_row(url, token, host="node-b", lease_until=time.time() + 60)
    assert alive(url, token)
    model = brood.ScriptedModel(
        {"root": ROOT, "child A": CHILD_A, "plain:": PLAIN, "child B": [repl("FINAL('B done')")]}
    )
    with brood.Supervisor(model, store=url, limits=FAST) as sup:
        with pytest.raises(brood.BroodError, match=r"node-b.*lease"):
            sup.resume(root_id)
        with Journal(url) as journal:
            assert journal.store.events(root_id=root_id, kind="resume") == []
        set_row(url, token, lease_until=time.time() - 1)  # lapsed: no renewal came
        assert not alive(url, token)
        assert sup.resume(root_id).wait(timeout=60) == "A done|B done|4"

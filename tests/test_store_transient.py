"""A journal write that fails for a passing reason (a locked SQLite database, a dropped
Postgres connection) is tried again with backoff, not raised into model code; a refusal
still fails alone."""

from __future__ import annotations

import sqlite3

import pytest

import brood
from brood.store import sql
from tests.util import FAST

FENCE = "```"


def code(source: str) -> str:
    return f"{FENCE}repl\n{source}\n{FENCE}"


def tree_model() -> brood.ScriptedModel:
    return brood.ScriptedModel(
        {
            "root": [code("FINAL(rlm_query('child: answer'))")],
            "child": [code("FINAL('child done')")],
        }
    )


@pytest.fixture(autouse=True)
def quick_waits(monkeypatch):
    monkeypatch.setattr(sql, "TRANSIENT_WAIT_S", 0.01)


def test_a_locked_sqlite_journal_is_waited_out(tmp_path, monkeypatch, caplog):
    url = f"sqlite:///{tmp_path}/j.db"
    with brood.Supervisor(tree_model(), store=url, limits=FAST) as sup:
        store = sup.store
        real = store._transaction
        locked = {"left": 3}

        def transaction(conn):
            if locked["left"]:
                locked["left"] -= 1
                raise sqlite3.OperationalError("database is locked")
            return real(conn)

        monkeypatch.setattr(store, "_transaction", transaction)
        result = sup.run("root")
        assert store.failure is None
    assert result.answer == "child done", result
    assert locked["left"] == 0
    assert caplog.text.count("database is locked); trying again") == 3


def test_a_journal_locked_for_good_still_fails_loudly(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path}/j.db"
    monkeypatch.setattr(sql, "TRANSIENT_TRIES", 3)
    sup = brood.Supervisor(tree_model(), store=url, limits=FAST)

    def transaction(conn):
        raise sqlite3.OperationalError("database is locked")

    monkeypatch.setattr(sup.store, "_transaction", transaction)
    try:
        with pytest.raises(brood.StoreError, match="database is locked"):
            sup.run("root")  # the root's start could not be journaled: nothing started
    finally:
        with pytest.raises(brood.StoreError, match="database is locked"):
            sup.close()  # every worker stopped first, then the journal's error once


def test_a_dropped_postgres_connection_is_reopened(fresh_pg_url, caplog):
    import psycopg

    model = brood.ScriptedModel(
        {
            "root": [
                code("print('first step')"),
                code("FINAL(rlm_query('child: answer'))"),
            ],
            "child": [code("FINAL('child done')")],
        }
    )
    with brood.Supervisor(model, store=fresh_pg_url, limits=FAST) as sup:
        writer_pid = sup.store._writer.info.backend_pid
        with psycopg.connect(fresh_pg_url, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (writer_pid,))
        result = sup.run("root")
        assert sup.store.failure is None
        assert sup.store._writer.info.backend_pid != writer_pid
    assert result.answer == "child done", result
    assert "trying again" in caplog.text

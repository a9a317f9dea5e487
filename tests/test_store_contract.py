"""One contract suite for the journal stores (DESIGN.md 1, 2, 7, 10, 11).

Every test here that takes `target` runs against SQLite (a file under tmp_path) and against
Postgres (an empty database on the test server, see tests/pg.py). `Target` is the test's own
view of the database, through a plain DB-API connection (what tables exist, what they hold),
so a test checks what the store did without trusting the store's own reads; with `opened`
it also tells which of the store's connections are still open.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import glob
import json
import math
import os
import random
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import brood
import brood.store.postgres
import brood.store.sqlite
from brood.journal import Journal
from brood.lifecycle import RunRecord, RunState, move
from brood.store.base import Store, open_store
from brood.store.sql import BATCH_MAX, SCHEMA_VERSION, SQLStore

TABLES = {"meta", "supervisors", "runs", "transitions", "events"}
FENCE = "```"


def repl(code: str) -> str:
    return f"{FENCE}repl\n{code}\n{FENCE}"


class Recording:
    """Stands in for the driver module inside a store module, and keeps every connection
    the store opens: only the client side knows at once whether a connection is closed
    (Postgres lists a backend in pg_stat_activity until it has exited, a moment after its
    client closed it)."""

    def __init__(self, module: Any, opened: list[Any]) -> None:
        self._module = module
        self._opened = opened

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    def connect(self, *args: Any, **kwargs: Any) -> Any:
        conn = self._module.connect(*args, **kwargs)
        self._opened.append(conn)
        return conn


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """Every connection a store opens during the test."""
    conns: list[Any] = []
    monkeypatch.setattr(brood.store.sqlite, "sqlite3", Recording(sqlite3, conns))
    if brood.store.postgres.psycopg is not None:
        monkeypatch.setattr(
            brood.store.postgres, "psycopg", Recording(brood.store.postgres.psycopg, conns)
        )
    yield conns
    for conn in conns:  # what a store might leak must not warn in a later test
        conn.close()


class Target:
    """A journal database under test, and a side door into it that bypasses the store."""

    def __init__(self, kind: str, url: str, opened: list[Any], path: str | None = None) -> None:
        self.kind = kind
        self.url = url
        self.path = path
        self.opened = opened

    @contextlib.contextmanager
    def raw(self) -> Iterator[Any]:
        if self.path is not None:
            with contextlib.closing(sqlite3.connect(self.path, isolation_level=None)) as conn:
                yield conn
        else:
            import psycopg

            with psycopg.connect(self.url, autocommit=True) as conn:
                yield conn

    def query(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        if self.path is None:
            sql = sql.replace("?", "%s")
        with self.raw() as conn:
            cur = conn.execute(sql, args)
            return [tuple(r) for r in cur.fetchall()] if cur.description else []

    def tables(self) -> set[str]:
        if self.path is not None:
            rows = self.query("SELECT name FROM sqlite_master WHERE type='table'")
        else:
            rows = self.query("SELECT tablename FROM pg_tables WHERE schemaname='public'")
        return {r[0] for r in rows}

    def contents(self) -> dict[str, list[tuple[Any, ...]]]:
        return {t: self.query(f'SELECT * FROM "{t}" ORDER BY 1') for t in sorted(self.tables())}

    def fingerprint(self) -> object:
        """What must not change while only read-only stores are open on the journal: the
        file itself for SQLite (a read through SQLite could hide a rewrite), every row for
        Postgres."""
        if self.path is not None:
            st = os.stat(self.path)
            return Path(self.path).read_bytes(), st.st_mtime_ns, st.st_size
        return self.contents()

    @contextlib.contextmanager
    def writes_held(self) -> Iterator[None]:
        """Hold a lock that blocks the store's writer: its queue grows meanwhile."""
        with self.raw() as conn:
            if self.path is not None:
                conn.execute("BEGIN IMMEDIATE")
                try:
                    yield
                finally:
                    conn.execute("COMMIT")
            else:
                with conn.transaction():
                    conn.execute("LOCK TABLE events IN EXCLUSIVE MODE")
                    yield

    def open_connections(self) -> list[str]:
        """Connections to the journal that stores opened and did not close: for SQLite, the
        files this process still has open; for Postgres, the connections stores made."""
        if self.path is not None:
            mine = os.path.realpath(self.path)
            held = []
            for fd in os.listdir("/proc/self/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/self/fd/{fd}").startswith(mine):
                        held.append(os.readlink(f"/proc/self/fd/{fd}"))
            return sorted(held)
        return [
            repr(c) for c in self.opened if not isinstance(c, sqlite3.Connection) and not c.closed
        ]


@pytest.fixture(params=["sqlite", "postgres"])
def target(request: pytest.FixtureRequest, tmp_path: Path, opened: list[Any]) -> Target:
    if request.param == "sqlite":
        path = str(tmp_path / "j.db")
        return Target("sqlite", f"sqlite:///{path}", opened, path)
    return Target("postgres", request.getfixturevalue("fresh_pg_url"), opened)


@pytest.fixture
def store(target: Target) -> Iterator[Store]:
    s = open_store(target.url)
    yield s
    s.close()


@contextlib.contextmanager
def reader(target: Target) -> Iterator[Store]:
    with contextlib.closing(open_store(target.url, readonly=True)) as s:
        yield s


def record(run_id: str, *, parent: RunRecord | None = None, **kw: Any) -> RunRecord:
    """A run record shaped like the supervisor's: a root, or the next child of `parent`."""
    if parent is None:
        return RunRecord(id=run_id, root_id=run_id, parent_id=None, depth=0, key=None, **kw)
    return RunRecord(
        id=run_id,
        root_id=parent.root_id,
        parent_id=parent.id,
        depth=parent.depth + 1,
        **{"key": "1:0", "prompt": f"child {run_id}"} | kw,
    )


def refused(target: Target, *, readonly: bool) -> tuple[str, list[str]]:
    """Open a store that must be refused; returns the StoreError's message and the
    connections to the journal it left open."""
    try:
        s = open_store(target.url, readonly=readonly)
    except brood.StoreError as exc:
        message = str(exc)
    else:
        s.close()
        pytest.fail(f"{target.url} opened (readonly={readonly}); expected StoreError")
    return message, target.open_connections()  # `opened` keeps a leaked one alive


# ---- opening ---------------------------------------------------------------------------------


def test_open_store_creates_the_schema_once(target: Target):
    with contextlib.closing(open_store(target.url)) as s:
        assert s.url == target.url and not s.readonly
        assert target.tables() == TABLES
        assert target.query("SELECT key, value FROM meta") == [("schema", str(SCHEMA_VERSION))]
        s.insert_run(record("r-keep", prompt="kept"), "sup").result()
    # Opening again keeps what is there and does not add a second version row.
    with contextlib.closing(open_store(target.url)) as s:
        assert s.get_run("r-keep")["prompt"] == "kept"
    assert target.query("SELECT key, value FROM meta") == [("schema", str(SCHEMA_VERSION))]
    assert target.open_connections() == []


def test_writers_opening_one_fresh_journal_at_once_create_its_schema_once(target: Target):
    # Supervisors of a cluster open one new journal together; before the schema lock, the
    # Postgres ones raced on CREATE TABLE and some failed with UniqueViolation.
    writers = 6
    together = threading.Barrier(writers)
    opened: list[Store] = []
    failed: list[BaseException] = []

    def open_one() -> None:
        together.wait()
        try:
            opened.append(open_store(target.url))
        except BaseException as exc:
            failed.append(exc)

    threads = [threading.Thread(target=open_one) for _ in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        assert failed == [] and len(opened) == writers
        assert target.tables() == TABLES
        assert target.query("SELECT key, value FROM meta") == [("schema", str(SCHEMA_VERSION))]
    finally:
        for s in opened:
            s.close()


def test_supervisor_rows(store: Store):
    before = time.time()
    store.insert_supervisor("4242:abc", 4242, "host-a", "/run/ctl.sock").result()
    store.insert_supervisor("4343:def", 4343, "host-b", None).result()
    row = store.supervisor("4242:abc")
    assert row is not None
    assert {k: row[k] for k in ("id", "pid", "host", "control", "closed_at")} == {
        "id": "4242:abc",
        "pid": 4242,
        "host": "host-a",
        "control": "/run/ctl.sock",
        "closed_at": None,
    }
    assert before <= row["started_at"] <= time.time()
    store.close_supervisor("4242:abc").result()
    closed = store.supervisor("4242:abc")
    assert closed is not None and row["started_at"] <= closed["closed_at"] <= time.time()
    other = store.supervisor("4343:def")
    assert other is not None and other["closed_at"] is None and other["control"] is None
    assert store.supervisor("9:nobody") is None


# ---- runs and transitions --------------------------------------------------------------------


def test_insert_run_then_transitions_are_reflected_in_the_row_and_in_order(store: Store):
    rec = record("r-aaaaaa", prompt="add 2 and 2", model="m1", pool="gpu", context_ref="ctx:1")
    store.insert_run(rec, "sup-1").result()
    row = store.get_run("r-aaaaaa")
    assert row == {
        "id": "r-aaaaaa",
        "root_id": "r-aaaaaa",
        "parent_id": None,
        "depth": 0,
        "key": None,
        "attempt": 0,
        "prompt": "add 2 and 2",
        "model": "m1",
        "pool": "gpu",
        "context_ref": "ctx:1",
        "state": "queued",
        "reason": None,
        "answer": None,
        "error": None,
        "usage": {},
        "last_line": None,
        "created_at": rec.created_at,
        "started_at": None,
        "ended_at": None,
        "pid": None,
        "supervisor": "sup-1",
        "products": None,
    }

    rec.pid = 31337
    move(rec, RunState.RUNNING)
    store.transition(rec, "queued", "running").result()
    row = store.get_run("r-aaaaaa")
    assert (row["state"], row["pid"], row["started_at"]) == ("running", 31337, rec.started_at)
    assert row["ended_at"] is None

    rec.usage = {"model_calls": 2, "input_tokens": 14, "output_tokens": 6, "cost": 0.5}
    rec.answer = "4"
    rec.products = {"files": ["a.py"], "ok": True}
    move(rec, RunState.COMPLETED, "answer")
    store.transition(rec, "running", "completed").result()
    row = store.get_run("r-aaaaaa")
    keys = ("state", "reason", "answer", "products", "error", "usage", "pid")
    assert {k: row[k] for k in keys} == {
        "state": "completed",
        "reason": "answer",
        "answer": "4",
        "products": {"files": ["a.py"], "ok": True},
        "error": None,
        "usage": {"model_calls": 2, "input_tokens": 14, "output_tokens": 6, "cost": 0.5},
        "pid": 31337,
    }
    assert (row["started_at"], row["ended_at"]) == (rec.started_at, rec.ended_at)

    # A child that is cancelled while running, then fails with an error.
    child = record("r-bbbbbb", parent=rec)
    store.insert_run(child, "sup-1").result()
    move(child, RunState.RUNNING)
    store.transition(child, "queued", "running").result()
    move(child, RunState.CANCELLING, "cancelled by parent")
    store.transition(child, "running", "cancelling").result()
    child.error = "Traceback: boom"
    move(child, RunState.FAILED, "worker exited with signal 9")
    store.transition(child, "cancelling", "failed").result()
    crow = store.get_run("r-bbbbbb")
    assert (crow["parent_id"], crow["root_id"], crow["depth"], crow["key"]) == (
        "r-aaaaaa",
        "r-aaaaaa",
        1,
        "1:0",
    )
    assert (crow["state"], crow["reason"], crow["error"], crow["answer"]) == (
        "failed",
        "worker exited with signal 9",
        "Traceback: boom",
        None,
    )

    def moves(run_id: str) -> list[tuple[Any, ...]]:
        rows = store.transitions(run_id)
        assert [r["seq"] for r in rows] == sorted(r["seq"] for r in rows)
        assert [r["at"] for r in rows] == sorted(r["at"] for r in rows)
        assert {r["run_id"] for r in rows} == {run_id}
        return [(r["frm"], r["to"], r["reason"]) for r in rows]

    assert moves("r-aaaaaa") == [("queued", "running", None), ("running", "completed", "answer")]
    assert moves("r-bbbbbb") == [
        ("queued", "running", None),
        ("running", "cancelling", "cancelled by parent"),
        ("cancelling", "failed", "worker exited with signal 9"),
    ]
    assert store.transitions("r-unknown") == []


def test_events_update_usage_and_last_line_only_when_they_should(store: Store):
    rec = record("r-ev0001", prompt="p")
    store.insert_run(rec, "sup").result()

    rec.usage = {"model_calls": 1, "input_tokens": 7, "output_tokens": 3, "cost": 0.0}
    store.event(rec, "model_call", {"kind": "turn", "request": [{"role": "user"}]}).result()
    row = store.get_run(rec.id)
    assert (row["usage"], row["last_line"]) == (rec.usage, None)

    rec.usage = {"model_calls": 1, "input_tokens": 7, "output_tokens": 3, "cost": 0.0, "x": 1}
    store.event(rec, "step", {"step": 1, "stdout": "a\nb\n"}, progress="b").result()
    row = store.get_run(rec.id)
    assert (row["usage"], row["last_line"]) == (rec.usage, "b")

    # Neither a model call nor progress: the row keeps what it had.
    journaled = dict(rec.usage)
    rec.usage = {"model_calls": 99}
    store.event(rec, "message", {"message": "hi", "delivered": True}).result()
    row = store.get_run(rec.id)
    assert (row["usage"], row["last_line"]) == (journaled, "b")

    store.event(rec, "step", {"step": 2, "stdout": ""}, progress="").result()
    row = store.get_run(rec.id)
    assert (row["usage"], row["last_line"]) == ({"model_calls": 99}, "")

    assert [(e["kind"], e["data"]) for e in store.events(rec.id)] == [
        ("model_call", {"kind": "turn", "request": [{"role": "user"}]}),
        ("step", {"step": 1, "stdout": "a\nb\n"}),
        ("message", {"message": "hi", "delivered": True}),
        ("step", {"step": 2, "stdout": ""}),
    ]


def test_events_filter_by_run_kind_seq_and_tree(store: Store):
    a = record("r-a00000", prompt="tree a", created_at=1.0)
    a1 = record("r-a10000", parent=a, created_at=2.0)
    b = record("r-b00000", prompt="tree b", created_at=3.0)
    for r in (a, a1, b):
        store.insert_run(r, "sup").result()
    plan = [
        (a, "step", 1),
        (a1, "model_call", 2),
        (b, "step", 3),
        (a, "model_call", 4),
        (a1, "step", 5),
        (b, "message", 6),
        (a, "step", 7),
    ]
    for rec, kind, n in plan:
        store.event(rec, kind, {"n": n})
    store.flush()

    every = store.events()
    assert [e["data"]["n"] for e in every] == [1, 2, 3, 4, 5, 6, 7]
    seqs = [e["seq"] for e in every]
    assert seqs == sorted(set(seqs))
    assert all(e["at"] > 0 for e in every)
    assert [(e["run_id"], e["root_id"], e["kind"]) for e in every] == [
        (rec.id, rec.root_id, kind) for rec, kind, _ in plan
    ]
    seq_of = {e["data"]["n"]: e["seq"] for e in every}

    def ns(events: list[dict[str, Any]]) -> list[int]:
        return [e["data"]["n"] for e in events]

    assert ns(store.events(a.id)) == [1, 4, 7]
    assert ns(store.events(a.id, "step")) == [1, 7]
    assert ns(store.events(a.id, after=seq_of[1])) == [4, 7]
    assert ns(store.events(a.id, "step", after=seq_of[4])) == [7]
    assert ns(store.events(a.id, after=seq_of[7])) == []
    assert ns(store.events(kind="step")) == [1, 3, 5, 7]
    assert ns(store.events(after=seq_of[5])) == [6, 7]
    assert ns(store.events(root_id=a.id)) == [1, 2, 4, 5, 7]
    assert ns(store.events(root_id=a.id, kind="model_call")) == [2, 4]
    assert ns(store.events(root_id=a.id, after=seq_of[2])) == [4, 5, 7]
    assert ns(store.events(root_id=b.id)) == [3, 6]
    assert ns(store.events(a1.id, root_id=a.id)) == [2, 5]
    assert ns(store.events(a1.id, root_id=b.id)) == []
    assert store.events("r-unknown") == []
    # A reader pages through events (an export): `limit` of them, on from the last seq.
    assert ns(store.events(a.id, limit=2)) == [1, 4]
    assert ns(store.events(a.id, after=seq_of[4], limit=2)) == [7]
    assert ns(store.events(a.id, "step", limit=1)) == [1]
    assert ns(store.events(root_id=a.id, kind="model_call", limit=5)) == [2, 4]
    assert ns(store.events(limit=3)) == [1, 2, 3]


def test_an_outline_of_a_tree_holds_its_runs_ids_and_states_in_creation_order(store: Store):
    root = record("r-out000", prompt="root " * 1000, created_at=1.0)
    child = record("r-out100", parent=root, created_at=2.0)
    grand = record("r-out110", parent=child, created_at=3.0)
    other = record("r-other0", prompt="another tree", created_at=1.5)
    for r in (grand, other, child, root):  # insertion order is not time
        store.insert_run(r, "sup")
    move(child, RunState.RUNNING)
    store.transition(child, "queued", "running")
    store.flush()
    assert store.outline(root.id) == [
        {"id": "r-out000", "parent_id": None, "depth": 0, "state": "queued", "supervisor": "sup"},
        {
            "id": "r-out100",
            "parent_id": root.id,
            "depth": 1,
            "state": "running",
            "supervisor": "sup",
        },
        {
            "id": "r-out110",
            "parent_id": child.id,
            "depth": 2,
            "state": "queued",
            "supervisor": "sup",
        },
    ]
    assert store.outline("r-nothing") == []


def test_roots_newest_first_and_runs_by_tree(store: Store):
    roots = [record(f"r-root{i}", prompt=f"tree {i}", created_at=100.0 * i) for i in (1, 2, 3)]
    child = record("r-child1", parent=roots[0], created_at=400.0)
    grandchild = record("r-grand1", parent=child, created_at=500.0)
    for r in (roots[1], child, roots[0], grandchild, roots[2]):  # insertion order is not time
        store.insert_run(r, "sup")
    store.flush()
    assert [r["id"] for r in store.roots()] == ["r-root3", "r-root2", "r-root1"]
    assert [r["id"] for r in store.roots(2)] == ["r-root3", "r-root2"]
    assert [r["id"] for r in store.roots(1)] == ["r-root3"]
    assert all(isinstance(r["usage"], dict) for r in store.roots())
    assert [r["id"] for r in store.runs("r-root1")] == ["r-root1", "r-child1", "r-grand1"]
    assert [r["id"] for r in store.runs("r-root2")] == ["r-root2"]
    assert [r["id"] for r in store.runs()] == [
        "r-root1",
        "r-root2",
        "r-root3",
        "r-child1",
        "r-grand1",
    ]
    assert store.runs("r-nothing") == []


def test_context_and_model_name_are_kept_for_resume_but_left_out_of_reads(store: Store):
    root = record("r-ctx000", prompt="p")
    child = record("r-ctx001", parent=root)
    blob = bytes(range(256)) * 4
    assert store.insert_run(root, "sup", context=blob, model_name="big-model").result() == 1
    assert store.insert_run(child, "sup").result() == 1
    assert store.resume_data(root.id) == {
        root.id: {"context": blob, "model_name": "big-model"},
        child.id: {"context": None, "model_name": None},
    }
    assert store.resume_data("r-other") == {}
    for row in [store.get_run(root.id), *store.runs(root.id), *store.roots()]:
        assert "context" not in row and "model_name" not in row


def test_one_child_per_parent_key_and_attempt(store: Store):
    root = record("r-keys00", prompt="p")
    store.insert_run(root, "sup").result()
    assert store.insert_run(record("r-keys01", parent=root, key="2:0"), "sup").result() == 1
    with pytest.raises(brood.StoreError, match=r"journal write to journal .* failed"):
        store.insert_run(record("r-keys02", parent=root, key="2:0"), "sup").result()
    again = record("r-keys03", parent=root, key="2:0", attempt=1)
    assert store.insert_run(again, "sup").result() == 1
    assert store.insert_run(record("r-keys04", parent=root, key="2:1"), "sup").result() == 1
    # Roots have no parent and no key: any number of them.
    assert store.insert_run(record("r-keys05", prompt="p"), "sup").result() == 1
    assert [r["id"] for r in store.runs(root.id)] == [
        "r-keys00",
        "r-keys01",
        "r-keys03",
        "r-keys04",
    ]


def test_claim_tree_takes_over_the_runs_that_have_not_ended(store: Store):
    root = record("r-clm000", prompt="p")
    done = record("r-clm001", parent=root, key="1:0")
    waiting = record("r-clm002", parent=root, key="1:1")
    other = record("r-clm100", prompt="another tree")
    for rec in (root, done, waiting, other):
        store.insert_run(rec, "old").result()
    for rec in (root, done):
        move(rec, RunState.RUNNING)
        store.transition(rec, "queued", "running")
    done.answer = "a"
    move(done, RunState.COMPLETED, "answer")
    store.transition(done, "running", "completed")
    assert store.claim_tree(root.id, "new").result() == 2
    owners = {r["id"]: r["supervisor"] for r in store.runs()}
    assert owners == {root.id: "new", done.id: "old", waiting.id: "new", other.id: "old"}


def test_get_run_of_an_unknown_id_names_it_and_brood_ps(target: Target, store: Store):
    store.insert_run(record("r-known", prompt="p"), "sup").result()
    with pytest.raises(brood.StoreError, match=r"r-f00f00.*`brood ps`"):
        store.get_run("r-f00f00")
    with reader(target) as ro, pytest.raises(brood.StoreError, match=r"r-f00f00.*`brood ps`"):
        ro.get_run("r-f00f00")


# ---- commits, batches ------------------------------------------------------------------------


def test_a_write_future_resolves_only_once_the_write_is_committed(target: Target, store: Store):
    rec = record("r-commit", prompt="p")
    seen_at_resolution: list[object] = []

    def look(_: object) -> None:
        # Runs the moment the future resolves (in the writer thread): the row must be there
        # for any other connection already.
        try:
            with reader(target) as other:
                seen_at_resolution.append(other.get_run(rec.id)["state"])
        except brood.StoreError as exc:
            seen_at_resolution.append(exc)

    with reader(target) as ro:
        fut = store.insert_run(rec, "sup")
        fut.add_done_callback(look)
        assert fut.result() == 1
        assert ro.get_run(rec.id)["state"] == "queued"

        move(rec, RunState.RUNNING)
        fut = store.transition(rec, "queued", "running")
        fut.add_done_callback(look)
        fut.result()
        assert ro.get_run(rec.id)["state"] == "running"
        assert [t["to"] for t in ro.transitions(rec.id)] == ["running"]

        fut = store.event(rec, "step", {"step": 1}, progress="out")
        fut.result()
        assert ro.get_run(rec.id)["last_line"] == "out"
        assert [e["data"] for e in ro.events(rec.id)] == [{"step": 1}]
    assert seen_at_resolution == ["queued", "running"]


def test_inserting_a_run_id_the_journal_holds_resolves_to_0_and_keeps_the_first(store: Store):
    assert store.insert_run(record("r-dup", prompt="first"), "sup-1").result() == 1
    assert store.insert_run(record("r-dup", prompt="second"), "sup-2").result() == 0
    row = store.get_run("r-dup")
    assert (row["prompt"], row["supervisor"]) == ("first", "sup-1")
    assert len(store.runs()) == 1


def test_a_failed_write_fails_alone_even_inside_a_batch(target: Target, store: Store):
    rec = record("r-good", prompt="p")
    store.insert_run(rec, "sup").result()
    bad = record("r-bad", prompt=None)  # the journal requires a prompt
    # While the writer is held, the writes queue up and go in together.
    with target.writes_held():
        before = [store.event(rec, "step", {"n": n}) for n in range(3)]
        failing = store.insert_run(bad, "sup")
        after = [store.event(rec, "step", {"n": n}, progress=str(n)) for n in range(3, 6)]
    with pytest.raises(brood.StoreError, match=r"journal write to journal .* failed"):
        failing.result()
    for f in before + after:
        assert f.exception() is None
    assert [e["data"]["n"] for e in store.events(rec.id)] == [0, 1, 2, 3, 4, 5]
    assert store.get_run(rec.id)["last_line"] == "5"
    with pytest.raises(brood.StoreError, match="r-bad"):
        store.get_run("r-bad")
    assert store.insert_run(record("r-after", prompt="p"), "sup").result() == 1


def test_flush_waits_for_everything_queued(target: Target, store: Store):
    rec = record("r-flush", prompt="p")
    store.insert_run(rec, "sup")
    futures = [store.event(rec, "step", {"i": i}, progress=str(i)) for i in range(50)]
    store.flush()
    assert all(f.done() and f.exception() is None for f in futures)
    with reader(target) as ro:
        assert len(ro.events(rec.id)) == 50
        assert ro.get_run(rec.id)["last_line"] == "49"


def test_events_nobody_waits_on_ride_with_the_next_waited_write_in_order(
    target: Target, store: Store
):
    rec = record("r-note", prompt="p")
    store.insert_run(rec, "sup").result()
    assert isinstance(store, SQLStore)
    stats = store.statistics()
    for i in range(200):  # a model call's and a step's events: no future, no commit alone
        rec.usage = {"model_calls": i + 1}
        assert store.note(rec, "model_call" if i % 2 else "step", {"i": i}) is None
    waited = store.event(rec, "message", {"i": 200})
    waited.result()  # committed after every note queued before it
    with reader(target) as ro:
        assert [e["data"]["i"] for e in ro.events(rec.id)] == list(range(201))
        assert ro.get_run(rec.id)["usage"] == {"model_calls": 200}
    # 201 writes in a few transactions, not one each: the notes waited for company.
    assert store.statistics()["batches"] - stats["batches"] <= 3
    # A note with no waited write after it is committed all the same (within the linger).
    store.note(rec, "step", {"i": 201}, progress="last")
    store.flush()
    with reader(target) as ro:
        assert len(ro.events(rec.id)) == 202
        assert ro.get_run(rec.id)["last_line"] == "last"


def test_writes_queued_on_the_bound_loop_are_settled_on_it_and_others_block(
    target: Target, store: Store
):
    rec = record("r-loop", prompt="p")

    async def on_the_loop() -> list[object]:
        store.bind_loop()
        written = [store.insert_run(rec, "sup")]
        written += [store.event(rec, "message", {"i": i}) for i in range(50)]
        assert all(isinstance(w, asyncio.Future) for w in written)
        return await asyncio.gather(*written)

    results = asyncio.run(on_the_loop())
    assert results[0] == 1 and len(results) == 51
    with reader(target) as ro:  # each was committed before its future resolved
        assert [e["data"]["i"] for e in ro.events(rec.id)] == list(range(50))
    # Another thread's writes (and this one's, its loop gone) give futures to block on.
    other = store.event(rec, "message", {"i": 50})
    assert isinstance(other, concurrent.futures.Future)
    other.result()
    with reader(target) as ro:
        assert len(ro.events(rec.id)) == 51


def test_two_thousand_writes_queued_while_the_journal_is_busy_land_in_order(
    target: Target, store: Store
):
    n = 2000
    rec = record("r-many", prompt="p")
    store.insert_run(rec, "sup").result()
    assert isinstance(store, SQLStore)
    stats = store.statistics()
    with target.writes_held():
        futures = []
        for i in range(n):
            rec.usage = {"model_calls": i + 1}
            kind = "model_call" if i % 2 else "step"
            progress = f"line {i}" if i % 3 else None
            futures.append(store.event(rec, kind, {"i": i}, progress=progress))
            if i == n // 2:
                move(rec, RunState.RUNNING)
                futures.append(store.transition(rec, "queued", "running"))
        assert not any(f.done() for f in futures), "a write resolved before it could commit"
    for f in futures:
        assert f.exception() is None
    with reader(target) as ro:
        events = ro.events(rec.id)
        assert [e["data"]["i"] for e in events] == list(range(n))
        assert [e["kind"] for e in events] == ["model_call" if i % 2 else "step" for i in range(n)]
        assert [e["seq"] for e in events] == sorted({e["seq"] for e in events})
        row = ro.get_run(rec.id)
        assert (row["state"], row["usage"], row["last_line"]) == (
            "running",
            {"model_calls": n},
            f"line {n - 1}",
        )
        assert len(ro.transitions(rec.id)) == 1
    # The queue went in a few batches of at most BATCH_MAX writes (one more for the batch
    # that waited for the lock).
    done = store.statistics()
    assert done["writes"] - stats["writes"] == len(futures)
    assert done["batches"] - stats["batches"] <= 1 + math.ceil(len(futures) / BATCH_MAX)
    if target.kind == "postgres":
        # Postgres itself shows which transaction wrote each row.
        per_transaction = Counter(x for (x,) in target.query("SELECT xmin::text FROM events"))
        assert len(per_transaction) <= 1 + math.ceil(n / BATCH_MAX)
        assert max(per_transaction.values()) <= BATCH_MAX


# ---- read-only stores ------------------------------------------------------------------------


def _journal_with_one_of_everything(target: Target) -> RunRecord:
    with contextlib.closing(open_store(target.url)) as w:
        w.insert_supervisor("1:tok", 1, "h", None)
        rec = record("r-ro0001", prompt="p")
        w.insert_run(rec, "1:tok")
        move(rec, RunState.RUNNING)
        w.transition(rec, "queued", "running")
        w.event(rec, "step", {"step": 1}, progress="x")
        w.close_supervisor("1:tok")
        w.flush()
    return rec


def _get_unknown_run(store: Store) -> None:
    with pytest.raises(brood.StoreError, match="r-none"):
        store.get_run("r-none")


def test_a_read_only_store_refuses_writes_and_never_changes_the_journal(target: Target):
    rec = _journal_with_one_of_everything(target)
    before = target.fingerprint()
    reads: list[tuple[str, Any]] = [
        ("get_run", lambda s: s.get_run(rec.id)),
        ("get_run unknown", _get_unknown_run),
        ("runs", lambda s: s.runs()),
        ("runs of a tree", lambda s: s.runs(rec.id)),
        ("roots", lambda s: s.roots()),
        ("roots(1)", lambda s: s.roots(1)),
        ("supervisor", lambda s: s.supervisor("1:tok")),
        ("transitions", lambda s: s.transitions(rec.id)),
        ("events", lambda s: s.events()),
        ("events filtered", lambda s: s.events(rec.id, "step", after=0)),
        ("events of a tree", lambda s: s.events(root_id=rec.id)),
        ("resume_data", lambda s: s.resume_data(rec.id)),
        ("flush", lambda s: s.flush()),
    ]
    writes: list[tuple[str, Any]] = [
        ("insert_supervisor", lambda s: s.insert_supervisor("2:tok", 2, "h", None)),
        ("close_supervisor", lambda s: s.close_supervisor("1:tok")),
        ("insert_run", lambda s: s.insert_run(record("r-new", prompt="p"), "1:tok")),
        ("transition", lambda s: s.transition(rec, "running", "completed")),
        ("event", lambda s: s.event(rec, "step", {"step": 2})),
        ("event with progress", lambda s: s.event(rec, "step", {}, progress="y")),
        ("claim_tree", lambda s: s.claim_tree(rec.id, "2:tok")),
    ]
    ro = open_store(target.url, readonly=True)
    try:
        assert ro.readonly and ro.url == target.url
        assert target.fingerprint() == before, "opening read-only changed the journal"
        for name, call in reads:
            call(ro)
            assert target.fingerprint() == before, f"{name} changed the journal"
        for name, call in writes:
            with pytest.raises(brood.StoreError, match="opened read-only"):
                call(ro)
            assert target.fingerprint() == before, f"a refused {name} changed the journal"
        assert ro.get_run(rec.id)["last_line"] == "x"
    finally:
        ro.close()
    assert target.fingerprint() == before, "closing a read-only store changed the journal"
    assert target.open_connections() == []


def test_a_read_only_open_of_a_database_that_is_not_a_journal(
    target: Target, request: pytest.FixtureRequest
):
    with target.raw() as conn:
        conn.execute("CREATE TABLE other (x INTEGER)")
    before = target.contents()
    message, left = refused(target, readonly=True)
    assert "brood journal" in message
    assert target.contents() == before
    assert left == []


def test_close_closes_the_connections_every_reading_thread_opened(target: Target):
    _journal_with_one_of_everything(target)
    ro = open_store(target.url, readonly=True)
    has_read, release = threading.Event(), threading.Event()

    def read_then_hold() -> None:
        ro.runs()
        has_read.set()
        release.wait()

    thread = threading.Thread(target=read_then_hold)
    thread.start()
    has_read.wait()
    ro.close()
    left = target.open_connections()
    release.set()
    thread.join()
    assert left == []


# ---- schema versions -------------------------------------------------------------------------


@pytest.mark.parametrize("readonly", [True, False], ids=["read-only", "writable"])
def test_a_journal_from_a_newer_brood_is_refused(target: Target, readonly: bool):
    _journal_with_one_of_everything(target)
    newer = str(SCHEMA_VERSION + 1)
    target.query("UPDATE meta SET value=? WHERE key='schema'", (newer,))
    before = target.contents()
    bytes_before = target.fingerprint() if readonly else None
    message, left = refused(target, readonly=readonly)
    assert f"schema version {newer}, newer than this brood's {SCHEMA_VERSION}" in message
    assert "upgrade brood" in message
    assert target.contents() == before
    if readonly:
        assert target.fingerprint() == bytes_before
    assert left == []


def test_refusing_a_newer_journal_leaves_its_tables_alone(target: Target):
    _journal_with_one_of_everything(target)
    # A newer schema that, say, renamed `events`: an older brood must not recreate it.
    target.query("DROP TABLE events")
    target.query("UPDATE meta SET value=? WHERE key='schema'", (str(SCHEMA_VERSION + 1),))
    message, _ = refused(target, readonly=False)
    assert "upgrade brood" in message
    assert target.tables() == TABLES - {"events"}


# The schema of journals written by brood before schema 2, as it was.
SCHEMA_1 = [
    "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    """CREATE TABLE supervisors (
        id TEXT PRIMARY KEY, pid BIGINT NOT NULL, host TEXT, control TEXT,
        started_at {real} NOT NULL, closed_at {real})""",
    """CREATE TABLE runs (
        id TEXT PRIMARY KEY, root_id TEXT NOT NULL, parent_id TEXT, depth INTEGER NOT NULL,
        key TEXT, attempt INTEGER NOT NULL DEFAULT 0, prompt TEXT NOT NULL, model TEXT,
        pool TEXT, context_ref TEXT, state TEXT NOT NULL, reason TEXT, answer TEXT,
        error TEXT, usage TEXT NOT NULL DEFAULT '{{}}', last_line TEXT,
        created_at {real} NOT NULL, started_at {real}, ended_at {real}, pid BIGINT,
        supervisor TEXT)""",
    "CREATE INDEX runs_root ON runs(root_id)",
    "CREATE INDEX runs_parent ON runs(parent_id)",
    """CREATE TABLE transitions (
        seq {serial}, run_id TEXT NOT NULL, frm TEXT NOT NULL, "to" TEXT NOT NULL,
        reason TEXT, at {real} NOT NULL)""",
    "CREATE INDEX transitions_run ON transitions(run_id)",
    """CREATE TABLE events (
        seq {serial}, run_id TEXT NOT NULL, root_id TEXT NOT NULL, kind TEXT NOT NULL,
        data TEXT NOT NULL, at {real} NOT NULL)""",
    "CREATE INDEX events_run ON events(run_id, seq)",
    "CREATE INDEX events_root ON events(root_id, seq)",
    "INSERT INTO meta VALUES ('schema', '1')",
    "INSERT INTO runs (id, root_id, depth, prompt, state, created_at, supervisor)"
    " VALUES ('r-old001', 'r-old001', 0, 'from schema 1', 'completed', 1.0, 'gone')",
]


def _journal_of_schema_1(target: Target) -> None:
    if target.kind == "sqlite":
        fill = {"real": "REAL", "serial": "INTEGER PRIMARY KEY"}
    else:
        fill = {"real": "DOUBLE PRECISION", "serial": "BIGSERIAL PRIMARY KEY"}
    for stmt in SCHEMA_1:
        target.query(stmt.format(**fill))


def test_a_journal_of_schema_1_is_read_as_it_is_and_migrated_by_a_writer(target: Target):
    _journal_of_schema_1(target)
    before = target.fingerprint()
    with reader(target) as ro:
        assert ro.get_run("r-old001")["prompt"] == "from schema 1"
        assert [r["id"] for r in ro.roots()] == ["r-old001"]
    assert target.fingerprint() == before, "a read-only open migrated the journal"
    assert target.query("SELECT value FROM meta") == [("1",)]

    with contextlib.closing(open_store(target.url)) as s:
        assert target.query("SELECT value FROM meta") == [(str(SCHEMA_VERSION),)]
        assert s.get_run("r-old001")["state"] == "completed"
        assert s.resume_data("r-old001") == {"r-old001": {"context": None, "model_name": None}}
        root = record("r-new001", prompt="p")
        assert s.insert_run(root, "sup", context=b"ctx", model_name="m").result() == 1
        assert s.resume_data(root.id)[root.id] == {"context": b"ctx", "model_name": "m"}
        s.insert_run(record("r-new002", parent=root), "sup").result()
        with pytest.raises(brood.StoreError, match="failed"):
            s.insert_run(record("r-new003", parent=root), "sup").result()  # same key
    with contextlib.closing(open_store(target.url)) as s:  # a second open migrates nothing
        assert [r["id"] for r in s.runs()] == ["r-old001", "r-new001", "r-new002"]
    assert target.query("SELECT value FROM meta") == [(str(SCHEMA_VERSION),)]


# ---- bad input -------------------------------------------------------------------------------


def _sqlite(tmp_path: Path, opened: list[Any], name: str = "j.db") -> Target:
    path = str(tmp_path / name)
    return Target("sqlite", f"sqlite:///{path}", opened, path)


@pytest.mark.parametrize("readonly", [True, False], ids=["read-only", "writable"])
def test_sqlite_path_under_a_file_cannot_be_opened(
    tmp_path: Path, opened: list[Any], readonly: bool
):
    (tmp_path / "afile").write_text("not a folder")
    bad = _sqlite(tmp_path, opened, "afile/x.db")
    message, left = refused(bad, readonly=readonly)
    assert f"{tmp_path}/afile/x.db" in message
    assert ("no journal at" if readonly else "cannot create the folder") in message
    assert left == []
    assert (tmp_path / "afile").read_text() == "not a folder"


def test_sqlite_read_only_open_of_a_missing_file(tmp_path: Path, opened: list[Any]):
    missing = _sqlite(tmp_path, opened, "nothing/here.db")
    message, _ = refused(missing, readonly=True)
    assert f"no journal at {missing.path}" in message
    assert "run something first" in message and "--store" in message
    assert not (tmp_path / "nothing").exists(), "a read created the journal's folder"


@pytest.mark.parametrize(
    "readonly",
    [
        True,
        False,
    ],
    ids=["read-only", "writable"],
)
def test_sqlite_corrupted_journal_is_refused_and_kept(
    tmp_path: Path, opened: list[Any], readonly: bool
):
    bad = _sqlite(tmp_path, opened)
    garbage = random.Random(7).randbytes(8192)
    Path(bad.path or "").write_bytes(garbage)
    message, left = refused(bad, readonly=readonly)
    assert bad.path in message and "move it aside" in message
    assert Path(bad.path or "").read_bytes() == garbage, "a refused open changed the file"
    assert left == []


@pytest.mark.parametrize(
    "url, says",
    [
        ("mysql://u@host/db", r"unknown scheme 'mysql'; use sqlite:///PATH or postgresql://"),
        ("s3://bucket/j.db", r"unknown scheme 's3'"),
        ("brood.db", r"'brood.db' is not a URL; use 'sqlite:///PATH'"),
        ("/tmp/brood.db", r"is not a URL; use 'sqlite:///PATH'"),
        ("", r"'' is not a URL"),
        ("sqlite:/one-slash.db", r"is not a URL"),
    ],
)
def test_store_urls_that_are_not_journals(url: str, says: str):
    with pytest.raises(brood.StoreError, match=says):
        open_store(url)
    with pytest.raises(brood.StoreError, match=says):
        open_store(url, readonly=True)


def test_a_store_that_is_not_a_string():
    with pytest.raises(brood.StoreError, match=r"must be a URL string.*got PosixPath"):
        open_store(Path("/tmp/x.db"))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://u:secret@/brood?host=/nonexistent",
        "postgres://u:secret@localhost:1/brood?host=/nonexistent&connect_timeout=5",
        "postgresql:///brood?host=/nonexistent&user=u&password=secret",
    ],
    ids=["user-info", "postgres-scheme", "query-parameter"],
)
def test_postgres_unreachable_server_is_named_without_the_password(url: str):
    with pytest.raises(brood.StoreError) as caught:
        open_store(url)
    message = str(caught.value)
    assert message.startswith("cannot open journal postgres")
    assert "/nonexistent" in message and "check the URL, the server and its credentials" in message
    assert "secret" not in message


def test_a_keyword_dsn_is_refused_without_showing_its_password():
    with pytest.raises(brood.StoreError, match="is not a URL") as caught:
        open_store("host=/nonexistent dbname=brood user=u password=secret")
    assert "secret" not in str(caught.value)


# ---- a real tree, journaled and read back ----------------------------------------------------


# The code of each REPL step of the tree, by run, and what each step prints.
ROOT_STEPS = [
    (
        "xs = rlm_query_batched(['TASK-ALPHA one', 'TASK-BETA two'])\nprint('got', xs)",
        "got ['A:hi', 'B']\n",
    ),
    ("FINAL('|'.join(xs))", ""),
]
ALPHA_STEPS = [
    ("y = llm_query('TASK-GAMMA say hi')\nprint('gamma said', y)", "gamma said hi\n"),
    ("FINAL('A:' + y)", ""),
]
BETA_STEPS = [("print('beta here')\nFINAL('B')", "beta here\n")]


def _tree_script(calls_dir: Path) -> dict[str, list[Any]]:
    """The tree: a root starts two children in one batch; one of them asks a plain model.
    Every reply records the messages the model received, per run (alpha asks gamma)."""

    def said(text: str, run: str) -> Any:
        folder = str(calls_dir)

        def reply(messages: list[dict[str, Any]]) -> str:
            with open(os.path.join(folder, f"{run}.jsonl"), "a") as f:
                f.write(json.dumps({"messages": messages, "reply": text}) + "\n")
            return text

        return reply

    return {
        "TASK-ROOT": [said(repl(code), "root") for code, _ in ROOT_STEPS],
        "TASK-ALPHA": [said(repl(code), "alpha") for code, _ in ALPHA_STEPS],
        "TASK-BETA": [said(repl(code), "beta") for code, _ in BETA_STEPS],
        "TASK-GAMMA": [said("hi", "alpha")],
    }


def _usage(calls: int) -> dict[str, Any]:
    return {"model_calls": calls, "input_tokens": 7 * calls, "output_tokens": 3 * calls}


def _steps(journal: Journal, run_id: str) -> list[tuple[int, str, str]]:
    return [(s["step"], s["code"], s["stdout"]) for s in journal.steps(run_id)]


def test_a_real_tree_is_reproduced_exactly_from_the_journal(target: Target, tmp_path: Path):
    calls_dir = tmp_path / "calls"
    calls_dir.mkdir()
    model = brood.ScriptedModel(_tree_script(calls_dir), tokens_per_call=(7, 3))
    limits = brood.Limits(shutdown_grace=0.3, term_grace=0.3)
    with brood.Supervisor(model, store=target.url, limits=limits) as sup:
        result = sup.run("TASK-ROOT go")
    assert (result.state, result.answer) == ("completed", "A:hi|B")

    with Journal(target.url) as journal:
        root = journal.tree(result.run_id)
        assert (root["parent_id"], root["key"], root["depth"], root["prompt"]) == (
            None,
            None,
            0,
            "TASK-ROOT go",
        )
        kids = {c["key"]: c for c in root["children"]}
        assert sorted(kids) == ["1:0", "1:1"]
        alpha, beta = kids["1:0"], kids["1:1"]
        for kid, prompt in ((alpha, "TASK-ALPHA one"), (beta, "TASK-BETA two")):
            assert (kid["parent_id"], kid["root_id"], kid["depth"], kid["prompt"]) == (
                root["id"],
                root["id"],
                1,
                prompt,
            )
            assert kid["children"] == []
        runs = {"root": root, "alpha": alpha, "beta": beta}

        assert {n: r["answer"] for n, r in runs.items()} == {
            "root": "A:hi|B",
            "alpha": "A:hi",
            "beta": "B",
        }
        for r in runs.values():
            assert (r["state"], r["reason"], r["error"], r["stale"]) == (
                "completed",
                "answer",
                None,
                False,
            )
            assert [(t["frm"], t["to"]) for t in journal.store.transitions(r["id"])] == [
                ("queued", "running"),
                ("running", "completed"),
            ]
            assert r["started_at"] <= r["ended_at"] and r["duration"] >= 0
            assert r["pid"] is not None

        steps = {n: _steps(journal, r["id"]) for n, r in runs.items()}
        assert steps == {
            name: [(i, code, out) for i, (code, out) in enumerate(expected, 1)]
            for name, expected in (
                ("root", ROOT_STEPS),
                ("alpha", ALPHA_STEPS),
                ("beta", BETA_STEPS),
            )
        }

        own = {n: {k: r["usage"].get(k) for k in _usage(0)} for n, r in runs.items()}
        assert own == {"root": _usage(2), "alpha": _usage(3), "beta": _usage(1)}
        assert {k: root["subtree_usage"][k] for k in _usage(0)} == _usage(6)
        assert {k: alpha["subtree_usage"][k] for k in _usage(0)} == _usage(3)
        assert result.usage["model_calls"] == 2
        assert sorted(journal.run(root["id"])["children"]) == sorted([alpha["id"], beta["id"]])
        assert journal.roots()[0]["id"] == root["id"] and journal.roots()[0]["runs"] == 3

        # What the model received for each run, in order, against what the export says.
        received: dict[str, list[dict[str, Any]]] = {}
        for path in glob.glob(str(calls_dir / "*.jsonl")):
            with open(path) as f:
                received[Path(path).stem] = [json.loads(line) for line in f]
        name_of = {r["id"]: name for name, r in runs.items()}
        assert set(received) == set(runs)
        exported: dict[str, list[dict[str, Any]]] = {}
        for rec in journal.export(root["id"]):
            exported.setdefault(rec["run_id"], []).append(rec)
        assert set(exported) == set(name_of)
        for run_id, records in exported.items():
            calls = received[name_of[run_id]]
            assert [r["messages"] for r in records] == [c["messages"] for c in calls]
            assert [r["response"] for r in records] == [c["reply"] for c in calls]
            usage = {"input_tokens": 7, "output_tokens": 3, "cost": None}  # nobody prices it
            assert all(r["usage"] == usage for r in records)
            assert all(r["error"] is None and r["root_id"] == root["id"] for r in records)
        assert [(r["kind"], r["turn"]) for r in exported[alpha["id"]]] == [
            ("turn", 1),
            ("llm_query", None),
            ("turn", 2),
        ]
        assert exported[alpha["id"]][1]["messages"] == [
            {"role": "user", "content": "TASK-GAMMA say hi"}
        ]
        assert [(r["kind"], r["turn"]) for r in exported[root["id"]]] == [("turn", 1), ("turn", 2)]
        assert [r["depth"] for r in exported[beta["id"]]] == [1]

        sup_row = journal.store.supervisor(root["supervisor"])
        assert sup_row is not None and sup_row["closed_at"] is not None
    assert target.open_connections() == []


def test_roots_page_newest_first_and_filter_by_state(store: Store):
    for i in range(5):
        rec = record(f"r-root0{i}", prompt=f"task {i}", created_at=1000.0 + i)
        store.insert_run(rec, "sup-1").result()
        if i % 2 == 0:
            move(rec, RunState.RUNNING)
            store.transition(rec, "queued", "running").result()
    assert [r["id"] for r in store.roots(2)] == ["r-root04", "r-root03"]
    assert [r["id"] for r in store.roots(2, offset=2)] == ["r-root02", "r-root01"]
    running = store.roots(10, state="running")
    assert [r["id"] for r in running] == ["r-root04", "r-root02", "r-root00"]
    assert store.roots(10, offset=5) == []


def test_an_unknown_run_is_its_own_error(store: Store):
    with pytest.raises(brood.UnknownRun) as info:
        store.get_run("r-nothere")
    assert info.value.run_id == "r-nothere"
    assert isinstance(info.value, brood.StoreError) and isinstance(info.value, LookupError)
    assert "no run 'r-nothere'" in str(info.value)

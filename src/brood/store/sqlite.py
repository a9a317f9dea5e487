"""The SQLite journal: WAL mode, one writer thread that commits what is queued together."""

from __future__ import annotations

import json
import os
import queue
import shutil
import sqlite3
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from brood.errors import StoreError
from brood.lifecycle import RunRecord
from brood.store.base import SCHEMA_VERSION

BATCH_MAX = 500  # writes committed in one transaction at most

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS runs (
    id TEXT PRIMARY KEY, root_id TEXT NOT NULL, parent_id TEXT, depth INTEGER NOT NULL,
    key TEXT, attempt INTEGER NOT NULL DEFAULT 0, prompt TEXT NOT NULL, model TEXT, pool TEXT,
    context_ref TEXT, state TEXT NOT NULL, reason TEXT, answer TEXT, error TEXT,
    usage TEXT NOT NULL DEFAULT '{}', created_at REAL NOT NULL, started_at REAL,
    ended_at REAL, pid INTEGER, supervisor TEXT
);
CREATE INDEX IF NOT EXISTS runs_root ON runs(root_id);
CREATE INDEX IF NOT EXISTS runs_parent ON runs(parent_id);
CREATE TABLE IF NOT EXISTS transitions (
    seq INTEGER PRIMARY KEY, run_id TEXT NOT NULL, frm TEXT NOT NULL, "to" TEXT NOT NULL,
    reason TEXT, at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS transitions_run ON transitions(run_id);
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY, run_id TEXT NOT NULL, kind TEXT NOT NULL, data TEXT NOT NULL,
    at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS events_run ON events(run_id);
"""

Write = Callable[[sqlite3.Connection], object]


class SQLiteStore:
    def __init__(self, path: str, *, url: str, remove_dir: str | None = None) -> None:
        self.url = url
        self.path = path
        self._remove_dir = remove_dir
        self._queue: queue.Queue[tuple[Write, Future[None]] | None] = queue.Queue()
        self._local = threading.local()
        parent = os.path.dirname(os.path.abspath(path))
        try:
            os.makedirs(parent, exist_ok=True)
            conn = self._connect()
            with conn:
                conn.executescript(SCHEMA)
                row = conn.execute("SELECT value FROM meta WHERE key='schema'").fetchone()
                if row is None:
                    conn.execute("INSERT INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
                elif int(row[0]) > SCHEMA_VERSION:
                    raise StoreError(
                        f"journal {path} has schema version {row[0]}, newer than this brood's "
                        f"{SCHEMA_VERSION}; upgrade brood (pip install -U rlm-brood)"
                    )
        except (sqlite3.Error, OSError) as exc:
            raise StoreError(
                f"cannot open journal {path}: {exc}; check the path and that the "
                "file is a brood journal"
            ) from exc
        self._writer_conn = conn
        self._thread = threading.Thread(target=self._write_loop, name="brood-journal", daemon=True)
        self._thread.start()

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, check_same_thread=False, timeout=30.0)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.row_factory = sqlite3.Row
        return conn

    # ---- writes ------------------------------------------------------------------------
    def _write_loop(self) -> None:
        conn = self._writer_conn
        stop = False
        while not stop:
            item = self._queue.get()
            batch = []
            if item is None:
                stop = True
            else:
                batch.append(item)
            while len(batch) < BATCH_MAX:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                    break
                batch.append(nxt)
            if not batch:
                continue
            try:
                with conn:
                    for write, _ in batch:
                        write(conn)
            except sqlite3.Error as exc:
                err = StoreError(f"journal write to {self.path} failed: {exc}")
                for _, fut in batch:
                    fut.set_exception(err)
                continue
            for _, fut in batch:
                fut.set_result(None)
        conn.close()

    def _submit(self, write: Write) -> Future[None]:
        fut: Future[None] = Future()
        self._queue.put((write, fut))
        return fut

    def insert_run(self, rec: RunRecord, supervisor: str) -> Future[None]:
        row = (
            rec.id,
            rec.root_id,
            rec.parent_id,
            rec.depth,
            rec.key,
            rec.attempt,
            rec.prompt,
            rec.model,
            rec.pool,
            rec.context_ref,
            rec.state.value,
            rec.reason,
            json.dumps(rec.usage),
            rec.created_at,
            supervisor,
        )
        return self._submit(
            lambda c: c.execute(
                "INSERT INTO runs (id, root_id, parent_id, depth, key, attempt, prompt, model,"
                " pool, context_ref, state, reason, usage, created_at, supervisor)"
                " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                row,
            )
        )

    def transition(self, rec: RunRecord, frm: str, to: str) -> Future[None]:
        now = time.time()
        fields = (
            to,
            rec.reason,
            rec.answer,
            rec.error,
            json.dumps(rec.usage),
            rec.started_at,
            rec.ended_at,
            rec.pid,
            rec.id,
        )

        def write(c: sqlite3.Connection) -> None:
            c.execute(
                "UPDATE runs SET state=?, reason=?, answer=?, error=?, usage=?,"
                " started_at=?, ended_at=?, pid=? WHERE id=?",
                fields,
            )
            c.execute(
                'INSERT INTO transitions (run_id, frm, "to", reason, at) VALUES (?,?,?,?,?)',
                (rec.id, frm, to, rec.reason, now),
            )

        return self._submit(write)

    def event(self, run_id: str, kind: str, data: dict[str, Any]) -> Future[None]:
        row = (run_id, kind, json.dumps(data, default=str), time.time())
        return self._submit(
            lambda c: c.execute("INSERT INTO events (run_id, kind, data, at) VALUES (?,?,?,?)", row)
        )

    # ---- reads (one connection per reading thread; WAL lets them run beside the writer) --
    def _reader(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = self._connect()
        return conn

    def _rows(self, sql: str, args: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
        try:
            return [dict(r) for r in self._reader().execute(sql, args).fetchall()]
        except sqlite3.Error as exc:
            raise StoreError(f"journal read from {self.path} failed: {exc}") from exc

    def get_run(self, run_id: str) -> dict[str, Any]:
        rows = self._rows("SELECT * FROM runs WHERE id=?", (run_id,))
        if not rows:
            raise StoreError(f"no run {run_id!r} in journal {self.path}")
        return _decode_run(rows[0])

    def runs(self, root_id: str | None = None) -> list[dict[str, Any]]:
        if root_id is None:
            rows = self._rows("SELECT * FROM runs ORDER BY created_at")
        else:
            rows = self._rows("SELECT * FROM runs WHERE root_id=? ORDER BY created_at", (root_id,))
        return [_decode_run(r) for r in rows]

    def transitions(self, run_id: str) -> list[dict[str, Any]]:
        return self._rows("SELECT * FROM transitions WHERE run_id=? ORDER BY seq", (run_id,))

    def events(self, run_id: str, kind: str | None = None) -> list[dict[str, Any]]:
        sql = "SELECT * FROM events WHERE run_id=?" + (" AND kind=?" if kind else "")
        rows = self._rows(sql + " ORDER BY seq", (run_id, kind) if kind else (run_id,))
        for r in rows:
            r["data"] = json.loads(r["data"])
        return rows

    def flush(self) -> None:
        self._submit(lambda c: None).result()

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        self._queue.put(None)
        self._thread.join()
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
        if self._remove_dir:
            shutil.rmtree(self._remove_dir, ignore_errors=True)


def _decode_run(row: dict[str, Any]) -> dict[str, Any]:
    row["usage"] = json.loads(row["usage"] or "{}")
    return row

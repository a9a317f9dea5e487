"""What the SQLite and Postgres journals share: the schema, batched writes, reads.

Writes go through one writer thread that commits everything queued so far in one
transaction (a batch), and return futures that resolve once that commit is done: the
supervisor waits on a transition's future before it tells anyone of the transition.
A write nobody waits on (`note`: a model call, a step's output) does not start a
transaction of its own, has no future, and does not wake the writer while it lingers: the
writer holds it for up to LAZY_LINGER_S, until a write that someone waits on comes to
commit with it. Batches keep the order of the writes, so anything waited on is committed
after every write queued before it.

A write that fails (a damaged file, a full disk, a journal file deleted or replaced) fails
the journal: that write's future and every later one raise the same StoreError, and
`on_failure` is called once, so no event is ever dropped without a word. A write the
journal refuses by design (a second child under the same key) is not a failure. Reads
use one connection per reading thread. A store opened read-only (the CLI's read commands)
starts no writer and never changes the journal.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, InvalidStateError
from contextlib import AbstractContextManager
from typing import Any, TypeVar

from brood.errors import StoreError, UnknownRun
from brood.lifecycle import TERMINAL_VALUES, RunRecord
from brood.store.base import Written

log = logging.getLogger("brood")
T = TypeVar("T")

SCHEMA_VERSION = 4
# The states a claim leaves alone, as an SQL list: fixed words of brood's, never user text.
_TERMINAL_SQL = ", ".join(f"'{state}'" for state in sorted(TERMINAL_VALUES))
BATCH_MAX = 500  # writes committed in one transaction at most
# How long a batch of lazy writes waits for a write someone waits on before it commits
# alone. A child's model call and step output then share the commit of its next step's
# start and of its end: a fan-out's commits per child drop from ~3.4 to ~2.5. The cost:
# a crash can lose this much more of the work nobody was told of (a resume redoes it).
LAZY_LINGER_S = 0.005

# {real} and {serial} are filled in per database.
SCHEMA = [
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    """CREATE TABLE IF NOT EXISTS supervisors (
        id TEXT PRIMARY KEY, pid BIGINT NOT NULL, host TEXT, control TEXT,
        started_at {real} NOT NULL, closed_at {real}, lease_until {real})""",
    """CREATE TABLE IF NOT EXISTS runs (
        id TEXT PRIMARY KEY, root_id TEXT NOT NULL, parent_id TEXT, depth INTEGER NOT NULL,
        key TEXT, attempt INTEGER NOT NULL DEFAULT 0, prompt TEXT NOT NULL, model TEXT,
        pool TEXT, context_ref TEXT, state TEXT NOT NULL, reason TEXT, answer TEXT,
        error TEXT, usage TEXT NOT NULL DEFAULT '{{}}', last_line TEXT,
        created_at {real} NOT NULL, started_at {real}, ended_at {real}, pid BIGINT,
        supervisor TEXT, context {blob}, model_name TEXT, products TEXT)""",
    "CREATE INDEX IF NOT EXISTS runs_root ON runs(root_id)",
    "CREATE INDEX IF NOT EXISTS runs_parent ON runs(parent_id)",
    # Exactly-once child starts: one child per key and attempt inside its parent.
    "CREATE UNIQUE INDEX IF NOT EXISTS runs_key ON runs(parent_id, key, attempt)",
    """CREATE TABLE IF NOT EXISTS transitions (
        seq {serial}, run_id TEXT NOT NULL, frm TEXT NOT NULL, "to" TEXT NOT NULL,
        reason TEXT, at {real} NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS transitions_run ON transitions(run_id)",
    """CREATE TABLE IF NOT EXISTS events (
        seq {serial}, run_id TEXT NOT NULL, root_id TEXT NOT NULL, kind TEXT NOT NULL,
        data TEXT NOT NULL, at {real} NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS events_run ON events(run_id, seq)",
    "CREATE INDEX IF NOT EXISTS events_root ON events(root_id, seq)",
    # `brood asks` / `brood answer` read one kind of event across every tree.
    "CREATE INDEX IF NOT EXISTS events_kind ON events(kind, seq)",
]

# What turns a journal of version N-1 into version N (the key).
MIGRATIONS: dict[int, list[str]] = {
    2: [
        "ALTER TABLE runs ADD COLUMN context {blob}",  # what resume needs to restart a run
        "ALTER TABLE runs ADD COLUMN model_name TEXT",  # rlm_query(model=...) of a child
        "CREATE UNIQUE INDEX IF NOT EXISTS runs_key ON runs(parent_id, key, attempt)",
    ],
    3: [
        "ALTER TABLE runs ADD COLUMN products TEXT",  # FINAL(answer, products=...)
        "CREATE INDEX IF NOT EXISTS events_kind ON events(kind, seq)",
    ],
    4: ["ALTER TABLE supervisors ADD COLUMN lease_until {real}"],  # ownership (brood.lease)
}

# A write that fails for a passing reason (a locked database, a dropped connection) is tried
# this many times in all, waiting TRANSIENT_WAIT_S, doubling to TRANSIENT_WAIT_MAX_S.
TRANSIENT_TRIES = 6
TRANSIENT_WAIT_S = 0.05
TRANSIENT_WAIT_MAX_S = 2.0

# What reads of runs return: every column but the context, which can be large.
RUN_COLUMNS = (
    "id, root_id, parent_id, depth, key, attempt, prompt, model, pool, context_ref, state,"
    " reason, answer, error, usage, last_line, created_at, started_at, ended_at, pid,"
    " supervisor"
)

Conn = Any  # a DB-API connection of the database at hand
Write = Callable[[Any], Any]  # given a cursor; returns the write's result


class _Unwaited:
    """What stands for the future of a write nobody waits on (`note`): it may wait for
    company, and its outcome goes nowhere (a failed write fails the journal loudly)."""

    __slots__ = ()

    def set_result(self, result: Any) -> None:
        pass

    def set_exception(self, error: BaseException) -> None:
        pass


_UNWAITED = _Unwaited()


class _LoopWaiter:
    """The future of a write queued on the loop the store is bound to (`bind_loop`): the
    writer keeps its outcome, and settles it there with every other of its batch in one
    call onto the loop (one wake, no future to chain per write)."""

    __slots__ = ("fut", "outcome")

    def __init__(self, fut: asyncio.Future[Any]) -> None:
        self.fut = fut
        self.outcome: tuple[Any, BaseException | None] | None = None

    def set_result(self, result: Any) -> None:
        self.outcome = (result, None)

    def set_exception(self, error: BaseException) -> None:
        self.outcome = (None, error)


def _settle_on_loop(waiters: list[_LoopWaiter]) -> None:
    for w in waiters:
        if w.fut.done():  # its caller stopped waiting (a cancelled task)
            continue
        result, error = w.outcome or (None, StoreError("the journal closed before this write"))
        if error is not None:
            w.fut.set_exception(error)
            # Heard by whoever awaits it; a failed journal is said once, loudly, by
            # on_failure, so a write nobody awaited is not logged again when collected.
            w.fut.exception()
        else:
            w.fut.set_result(result)


Waiter = Future[Any] | _LoopWaiter | _Unwaited


# json.dumps(value, default=str)'s own text (", " and ": "), not a compact encoder's: the
# journal is read by people and by their SQL (`data LIKE '{"kind": "spec"%'`). One encoder
# made once (json.dumps with an argument builds a new one at every call), called without
# JSONEncoder's Python layers where the C one is there: every model call's event goes
# through it on the supervisor's loop. Journaled values are brood's own, never cyclic.
_c_encoder = getattr(json.encoder, "c_make_encoder", None)
_encode_json: Callable[[Any, int], Iterable[str]] = (
    _c_encoder(None, str, json.encoder.encode_basestring_ascii, None, ": ", ", ", 0, 0, 1)
    if _c_encoder is not None
    else lambda value, _: (json.JSONEncoder(default=str).encode(value),)
)


def _json(value: Any) -> str:
    return "".join(_encode_json(value, 0))


# A batch's consecutive events go in one INSERT of up to this many rows (5 values each:
# under SQLite's oldest limit of 999 bound values per statement).
EVENT_ROWS = 150
_INSERT_EVENTS = "INSERT INTO events (run_id, root_id, kind, data, at) VALUES "
_UPDATE_USAGE = "UPDATE runs SET usage=?, last_line=COALESCE(?, last_line) WHERE id=?"


class _Usage:
    """A run's usage (and last line of output) as an event left it to be written. Only the
    latest one of a run is written: an event's UPDATE of the run is skipped when a later
    write of the same run (an event, a transition) is queued behind it and writes newer
    values. A child's model call and step then cost one statement each, not two, and the
    usage (a copy) is encoded by the writer, once, for the write that is kept."""

    __slots__ = ("line", "usage")

    def __init__(self, usage: dict[str, Any], line: str | None) -> None:
        self.usage, self.line = usage, line


def _settle(fut: Waiter, result: Any = None, error: BaseException | None = None) -> None:
    """Give a write's future its outcome, unless its caller stopped waiting (cancelled it:
    an interrupted caller, a cancelled task); the write itself was committed or failed."""
    with contextlib.suppress(InvalidStateError):
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)


class _EventWrite:
    """An event to journal (its `row`), and the run's usage it leaves to write: kept as data
    so that the writer can insert a batch's consecutive events in one statement."""

    __slots__ = ("row", "store", "usage")

    def __init__(self, store: SQLStore, row: tuple[Any, ...], usage: _Usage | None) -> None:
        self.store, self.row, self.usage = store, row, usage

    def __call__(self, cur: Any) -> int:
        self.store.write_events(cur, [self])
        return 1


class SQLStore:
    """Base of the SQL journals; subclasses connect, and say how a transaction is opened."""

    placeholder = "?"
    blob = "BLOB"
    real = "REAL"
    serial = "INTEGER PRIMARY KEY"
    errors: tuple[type[BaseException], ...] = ()
    refusals: tuple[type[BaseException], ...] = ()  # a constraint refused the write

    def _transient(self, exc: BaseException) -> bool:
        """Whether a failed write may succeed if tried again (a locked database, a dropped
        connection): the writer then waits and tries again before it calls it a failure."""
        return False

    def _revive(self, conn: Conn) -> Conn:
        """The connection to try again on after a transient failure (a new one if it
        broke)."""
        return conn

    where = ""  # how messages name this journal

    def open_error(self, exc: BaseException) -> StoreError:
        """Why the journal cannot be opened; a store that knows better says more."""
        return StoreError(
            f"{self.where} cannot be read as a brood journal: {exc}; if the file is "
            "damaged, move it aside and brood starts a new one"
        )

    def write_error(self, exc: BaseException) -> StoreError:
        return StoreError(f"journal write to {self.where} failed: {exc}")

    def __init__(self, url: str, *, readonly: bool = False) -> None:
        self.url = url
        self.readonly = readonly
        self._local = threading.local()
        # A SimpleQueue (C, no Condition): a put costs the caller (the loop) a few times less.
        self._queue: queue.SimpleQueue[tuple[Write, Waiter] | None] = queue.SimpleQueue()
        # Set by a write someone waits on (and by close): it ends the writer's lingering
        # over a batch of unwaited ones. Unwaited writes never set it.
        self._urgent = threading.Event()
        # The supervisor's loop (`bind_loop`), and the thread that runs it.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        # Writes made on that loop, held until its current callbacks have run (`_release`):
        # queued together, they wake the writer once, not once each. (write, waiter, urgent)
        self._held: collections.deque[tuple[Write, Waiter, bool]] = collections.deque()
        self._releasing = threading.Lock()  # one thread queues them at a time: in order
        self._thread: threading.Thread | None = None
        # busy_s: the writer's wall time in transactions (GIL waits included); cpu_s: its
        # CPU time in them; statements: SQL statements executed (benchmarks read these).
        self._stats = {"writes": 0, "batches": 0, "statements": 0, "busy_s": 0.0, "cpu_s": 0.0}
        self._readers: list[Conn] = []
        self._readers_lock = threading.Lock()
        # Each run's latest usage an event is to write (_Usage); set on the caller's thread
        # (the supervisor's loop), looked at by the writer: under this lock.
        self._usage: dict[str, _Usage] = {}
        self._usage_lock = threading.Lock()
        self._closed = False
        # The first failed write, for good; `on_failure` hears of it once (writer thread).
        self.failure: StoreError | None = None
        self.on_failure: Callable[[StoreError], None] | None = None
        conn = self._open(readonly)
        # A reader of an older journal (not migrated: it is read as it is) has no products.
        products = "products" if self.version >= 3 else "NULL AS products"
        self._columns = f"{RUN_COLUMNS}, {products}"
        if readonly:
            self._local.conn = conn
            self._readers.append(conn)
            return
        self._writer = conn
        self._thread = threading.Thread(target=self._write_loop, name="brood-journal", daemon=True)
        self._thread.start()

    # ---- subclass hooks ------------------------------------------------------------------
    def _connect(self, readonly: bool) -> Conn:
        raise NotImplementedError

    def _lost(self) -> StoreError | None:
        """Why the journal can no longer be written though no write failed yet (SQLite: its
        file was deleted or replaced); None when it can."""
        return None

    def _transaction(self, conn: Conn) -> AbstractContextManager[Any]:
        raise NotImplementedError

    # ---- opening -------------------------------------------------------------------------
    def _open(self, readonly: bool) -> Conn:
        conn = self._connect(readonly)
        try:
            if not readonly:
                self._create_or_migrate_retried(conn)
            version = self.version = self._retrying(
                lambda: self.read_schema_version(conn), "opening"
            )
        except StoreError:
            conn.close()
            raise
        except self.errors as exc:
            conn.close()
            raise self.open_error(exc) from exc
        if version > SCHEMA_VERSION:
            conn.close()
            raise StoreError(
                f"{self.where} has schema version {version}, newer than this brood's "
                f"{SCHEMA_VERSION}; upgrade brood (git pull in its clone, then make venv)"
            )
        return conn

    def _create_or_migrate_retried(self, conn: Conn) -> None:
        """`_create_or_migrate` in a transaction of its own, tried again like a write
        (writers opening one new journal at once: SQLite may answer `database is locked` at
        once rather than wait, to avoid a deadlock)."""

        def attempt() -> None:
            with self._transaction(conn) as cur:
                self._create_or_migrate(cur)

        self._retrying(attempt, "opening")

    def _create_or_migrate(self, cur: Any) -> None:
        """Create a new journal, or bring an older one up to SCHEMA_VERSION. A newer one is
        left as it is (and refused by the caller)."""
        fill = {"real": self.real, "serial": self.serial, "blob": self.blob}
        self._lock_schema(cur)
        cur.execute(SCHEMA[0])
        cur.execute("SELECT value FROM meta WHERE key='schema'")
        row = cur.fetchone()
        if row is None:
            for stmt in SCHEMA[1:]:
                cur.execute(stmt.format(**fill))
            cur.execute(self.q("INSERT INTO meta VALUES ('schema', ?)"), (str(SCHEMA_VERSION),))
            return
        version = int(row[0] if not isinstance(row, dict) else row["value"])
        for target in range(version + 1, SCHEMA_VERSION + 1):
            for stmt in MIGRATIONS[target]:
                cur.execute(stmt.format(**fill))
            cur.execute(self.q("UPDATE meta SET value=? WHERE key='schema'"), (str(target),))

    def _lock_schema(self, cur: Any) -> None:
        """Hold the schema lock until this transaction ends, so that writers opening one
        journal at once create or migrate it once (SQLite's BEGIN IMMEDIATE already does)."""

    def read_schema_version(self, conn: Conn) -> int:
        cur = conn.cursor()
        try:
            cur.execute("SELECT value FROM meta WHERE key='schema'")
            row = cur.fetchone()
        finally:
            cur.close()
        if row is None:
            raise StoreError(f"{self.where} is not a brood journal (no schema version)")
        return int(row[0] if not isinstance(row, dict) else row["value"])

    def q(self, sql: str) -> str:
        return sql if self.placeholder == "?" else sql.replace("?", self.placeholder)

    # ---- writes ----------------------------------------------------------------------------
    def _write_loop(self) -> None:
        """The writer thread. It never dies of one write: a caller that stopped waiting (its
        future cancelled) still has its write committed, and an error of the writer itself
        fails the journal loudly (`failure`, `on_failure`) instead of dropping what follows."""
        stop = False
        while not stop:
            batch, stop = self._gather(self._queue.get())
            if not batch:
                continue
            try:
                self._commit(batch)
            except Exception as exc:  # a bug of the writer, not of one write
                log.exception("brood: %s: the journal writer failed", self.where)
                if self.failure is None:
                    self._fail(self.write_error(exc))
                for _, fut in batch:
                    _settle(fut, error=self.failure)
            _wake_loops(batch)
        with contextlib.suppress(*self.errors):
            self._writer.close()

    def _gather(
        self, first: tuple[Write, Waiter] | None
    ) -> tuple[list[tuple[Write, Waiter]], bool]:
        """The next batch: `first` and what is queued behind it; when `first` is a write
        nobody waits on, what comes within LAZY_LINGER_S too (the writer sleeps meanwhile,
        woken early only by a write someone waits on). True with it when the writer stops."""
        if first is None:
            return [], True
        if first[1] is _UNWAITED:
            self._urgent.wait(LAZY_LINGER_S)
        self._urgent.clear()  # a write queued before this is taken below
        batch = [first]
        while len(batch) < BATCH_MAX:
            try:
                nxt = self._queue.get_nowait()
            except queue.Empty:
                break
            if nxt is None:
                return batch, True
            batch.append(nxt)
        return batch, False

    def _commit(self, batch: list[tuple[Write, Waiter]]) -> None:
        if self.failure is None and (lost := self._lost()) is not None:
            self._fail(lost)
        if self.failure is not None:
            for _, fut in batch:
                _settle(fut, error=self.failure)
            return
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            results = self._write_batch(batch)
        except self.errors as exc:
            if len(batch) > 1:
                # One refused write must not take the others down with it: each alone.
                for item in batch:
                    self._commit([item])
                return
            if isinstance(exc, self.refusals):
                _settle(batch[0][1], error=self.write_error(exc))  # this write only
                return
            self._fail(self.write_error(exc))
            _settle(batch[0][1], error=self.failure)
            return
        self._stats["batches"] += 1
        self._stats["writes"] += len(batch)
        self._stats["busy_s"] += time.perf_counter() - start
        self._stats["cpu_s"] += time.thread_time() - cpu
        for (_, fut), result in zip(batch, results, strict=True):
            _settle(fut, result)

    def _write_batch(self, batch: list[tuple[Write, Waiter]]) -> list[Any]:
        """One transaction of the batch's writes, tried again on a passing failure
        (`_retrying`), the writer's connection reopened between tries."""

        def attempt() -> list[Any]:
            results: list[Any] = []
            events: list[_EventWrite] = []  # consecutive event writes, inserted together
            with self._transaction(self._writer) as cur:
                for write, _ in batch:
                    if isinstance(write, _EventWrite):
                        events.append(write)
                        results.append(1)
                        continue
                    if events:
                        self.write_events(cur, events)
                        events = []
                    results.append(write(cur))
                if events:
                    self.write_events(cur, events)
            return results

        def revive() -> None:
            with contextlib.suppress(*self.errors, StoreError):
                self._writer = self._revive(self._writer)

        return self._retrying(attempt, "write", revive)

    def _retrying(
        self, attempt: Callable[[], T], what: str, between: Callable[[], None] | None = None
    ) -> T:
        """`attempt()`; a transient failure is tried again, after TRANSIENT_WAIT_S doubling,
        TRANSIENT_TRIES times in all (said in the log), so a locked database or a dropped
        connection is not a failure of the journal. The calling thread's own wait."""
        wait = TRANSIENT_WAIT_S
        for tries in range(1, TRANSIENT_TRIES + 1):
            try:
                return attempt()
            except self.errors as exc:
                if tries == TRANSIENT_TRIES or not self._transient(exc):
                    raise
                log.warning(
                    "brood: %s: %s failed (%s); trying again in %.2f s (%d of %d)",
                    self.where,
                    what,
                    exc,
                    wait,
                    tries,
                    TRANSIENT_TRIES,
                )
                time.sleep(wait)  # the journal is unavailable: this thread waits
                wait = min(wait * 2, TRANSIENT_WAIT_MAX_S)
                if between is not None:
                    between()
        raise AssertionError("unreachable")

    def _fail(self, exc: StoreError) -> None:
        self.failure = exc
        if self.on_failure is not None:
            self.on_failure(exc)

    def statistics(self) -> dict[str, float]:
        """Writes, batches (transactions) and statements committed so far, and the writer
        thread's time spent on them (wall time and CPU time)."""
        return dict(self._stats)

    def _submit(self, sql: str, args: tuple[Any, ...]) -> Written:
        return self._submit_many([(sql, args)])

    def _submit_many(self, statements: list[tuple[str, tuple[Any, ...]]]) -> Written:
        return self._submit_prepared([(self.q(sql), args) for sql, args in statements])

    def _submit_prepared(self, stmts: list[tuple[str, tuple[Any, ...]]]) -> Written:
        """Queue statements whose placeholders are this database's already."""
        return self._enqueue(self._statements(stmts))

    def _statements(self, stmts: list[tuple[str, tuple[Any, ...]]]) -> Write:
        def write(cur: Any) -> int:
            count = 0
            for sql, args in stmts:
                cur.execute(sql, args)
                count = cur.rowcount
            self._stats["statements"] += len(stmts)  # writer thread only
            return count  # rows the last statement touched

        return write

    def bind_loop(self) -> None:
        """Called on the supervisor's loop: the writes queued from it from now on give
        asyncio futures of that loop, settled a batch at a time."""
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()

    def _on_loop(self) -> bool:
        """Whether this is the supervisor's loop, running (`bind_loop`)."""
        loop = self._loop
        return loop is not None and threading.get_ident() == self._loop_thread and loop.is_running()

    def _enqueue(self, write: Write) -> Written:
        fut: Written
        if self._on_loop():
            assert self._loop is not None
            fut = self._loop.create_future()
            self._put(write, _LoopWaiter(fut), urgent=True)
        else:
            fut = Future()
            self._put(write, fut, urgent=True)  # someone waits on it: committed now
        return fut

    def _hurry(self) -> None:
        """End the writer's lingering: what is queued is committed now. Set once per batch
        (the writer clears it as it takes one), not once per write."""
        if not self._urgent.is_set():
            self._urgent.set()

    def _put(self, write: Write, waiter: Waiter, *, urgent: bool) -> None:
        """Queue a write; `urgent` (someone waits on it) ends a lingering writer's wait.
        On the supervisor's loop, an urgent write nobody blocks a thread on is held until
        the loop's current callbacks have run, then queued with the others they made, so
        the writer commits once for them. A lazy one (a model call's event) is queued at
        once, after what the loop holds: the writer lingers for it anyway, and holding it
        cost every model call a turn of the loop."""
        if self.readonly:
            raise StoreError(f"{self.where} was opened read-only")
        if self._closed:
            raise StoreError(f"the journal {self.where} is closed; it takes no more writes")
        # A _LoopWaiter is only made on the loop; a Future may be blocked on by a thread,
        # so its write is queued now.
        if isinstance(waiter, _LoopWaiter) or (urgent and waiter is _UNWAITED and self._on_loop()):
            assert self._loop is not None
            held = self._held
            held.append((write, waiter, urgent))
            if len(held) == 1:
                self._loop.call_soon(self._release)
            return
        self._release()  # what the loop holds goes first: writes keep their order
        self._queue.put((write, waiter))
        if urgent:
            self._hurry()

    def _release(self) -> None:
        """Queue the writes held on the loop, in order (any thread may)."""
        held, urgent = self._held, False
        if not held:
            return
        with self._releasing:
            while held:
                write, waiter, now = held.popleft()
                self._queue.put((write, waiter))  # wakes a waiting writer once, not each
                urgent = urgent or now
        if urgent:
            self._hurry()

    def insert_supervisor(
        self, token: str, pid: int, host: str, control: str | None, lease_until: float | None = None
    ) -> Written:
        return self._submit(
            "INSERT INTO supervisors (id, pid, host, control, started_at, lease_until)"
            " VALUES (?,?,?,?,?,?)",
            (token, pid, host, control, time.time(), lease_until),
        )

    def close_supervisor(self, token: str) -> Written:
        return self._submit("UPDATE supervisors SET closed_at=? WHERE id=?", (time.time(), token))

    def renew_lease(self, token: str, until: float) -> Written:
        """Extend a supervisor's lease to `until`. Resolves to 1, or to 0 when the lease
        had lapsed, was revoked or the row is closed: the supervisor is fenced then."""
        return self._submit(
            "UPDATE supervisors SET lease_until=? WHERE id=? AND closed_at IS NULL"
            " AND lease_until >= ?",
            (until, token, time.time()),
        )

    def revoke_lease(self, token: str) -> Written:
        """End a supervisor's lease now (its host is known dead): its trees may be resumed
        at once, and it is fenced if it comes back."""
        return self._submit("UPDATE supervisors SET lease_until=0 WHERE id=?", (token,))

    def fence(self, reason: str) -> None:
        """Refuse every write from now on, and tell `on_failure` why (once)."""
        if self.failure is None:
            self._fail(StoreError(f"{self.where}: {reason}"))

    def insert_run(
        self,
        rec: RunRecord,
        supervisor: str,
        context: bytes | None = None,
        model_name: str | None = None,
    ) -> Written:
        """Resolves to 1 once the run is journaled, or 0 if its id is already taken. A
        second child under the same parent, key and attempt fails (exactly-once starts)."""
        return self._submit(
            "INSERT INTO runs (id, root_id, parent_id, depth, key, attempt, prompt, model,"
            " pool, context_ref, state, reason, usage, created_at, supervisor, context,"
            " model_name) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?) ON CONFLICT (id) DO NOTHING",
            (
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
                _json(rec.usage),
                rec.created_at,
                supervisor,
                context,
                model_name,
            ),
        )

    def claim_tree(self, root_id: str, supervisor: str) -> Written:
        """Make `supervisor` the owner of the tree's runs that have not ended (resume)."""
        return self._submit(
            f"UPDATE runs SET supervisor=? WHERE root_id=? AND state NOT IN ({_TERMINAL_SQL})",
            (supervisor, root_id),
        )

    def claim_run(self, run_id: str, supervisor: str) -> Written:
        """Make `supervisor` the owner of one run (a child placed on another node)."""
        return self._submit("UPDATE runs SET supervisor=? WHERE id=?", (supervisor, run_id))

    def resume_data(self, root_id: str) -> dict[str, dict[str, Any]]:
        """What resume needs per run of a tree, that reads leave out: context, model name."""
        rows = self._rows("SELECT id, context, model_name FROM runs WHERE root_id=?", (root_id,))
        return {
            r["id"]: {"context": _bytes(r["context"]), "model_name": r["model_name"]} for r in rows
        }

    def note_reason(self, run_id: str, reason: str | None) -> None:
        """Journal why a run waits, without a move (a queued run waiting for a pool), at
        once; nobody waits on it (a failure fails the journal, as any write's)."""
        stmt = (self.q("UPDATE runs SET reason=? WHERE id=?"), (reason, run_id))
        self._put(self._statements([stmt]), _UNWAITED, urgent=True)

    def transition(self, rec: RunRecord, frm: str, to: str) -> Written:
        # This write carries the run's usage: an event's UPDATE queued before it is not
        # needed any more (its last line of output rides here).
        with self._usage_lock:
            pending = self._usage.pop(rec.id, None)
        return self._submit_many(
            [
                (
                    "UPDATE runs SET state=?, reason=?, answer=?, error=?, usage=?, started_at=?,"
                    " ended_at=?, pid=?, products=?, last_line=COALESCE(?, last_line)"
                    " WHERE id=?",
                    (
                        to,
                        rec.reason,
                        rec.answer,
                        rec.error,
                        _json(rec.usage),
                        rec.started_at,
                        rec.ended_at,
                        rec.pid,
                        None if rec.products is None else _json(rec.products),
                        None if pending is None else pending.line,
                        rec.id,
                    ),
                ),
                (
                    'INSERT INTO transitions (run_id, frm, "to", reason, at) VALUES (?,?,?,?,?)',
                    (rec.id, frm, to, rec.reason, time.time()),
                ),
            ]
        )

    def event(
        self, rec: RunRecord, kind: str, data: dict[str, Any], progress: str | None = None
    ) -> Written:
        """Journal an event; with it the run's usage so far (and its last line of output,
        when `progress` is given), so readers in other processes see a live tree. The
        future resolves once it is committed."""
        return self._enqueue(self._event_write(rec, kind, data, progress))

    def note(
        self,
        rec: RunRecord,
        kind: str,
        data: dict[str, Any],
        progress: str | None = None,
        *,
        at_once: bool = False,
    ) -> None:
        """`event`, for one nobody waits on (a model call, a step's output): it is
        committed with the next write someone waits on, or within LAZY_LINGER_S (at once
        with `at_once`); if that fails, the journal fails (`on_failure`), as for any
        write."""
        self._put(self._event_write(rec, kind, data, progress), _UNWAITED, urgent=at_once)

    def _event_write(
        self, rec: RunRecord, kind: str, data: dict[str, Any], progress: str | None
    ) -> _EventWrite:
        row = (rec.id, rec.root_id, kind, _json(data), time.time())
        mine: _Usage | None = None
        if progress is not None or kind == "model_call":
            with self._usage_lock:
                before = self._usage.get(rec.id)
                line = progress if progress is not None or before is None else before.line
                mine = self._usage[rec.id] = _Usage(dict(rec.usage), line)
        return _EventWrite(self, row, mine)

    def write_events(self, cur: Any, writes: list[_EventWrite]) -> None:
        """Insert the rows of consecutive event writes, EVENT_ROWS to a statement (their
        order, and so their seq, kept), then the run updates that are still the latest."""
        for start in range(0, len(writes), EVENT_ROWS):
            chunk = writes[start : start + EVENT_ROWS]
            cur.execute(
                self.q(_INSERT_EVENTS + ",".join(["(?,?,?,?,?)"] * len(chunk))),
                [v for w in chunk for v in w.row],
            )
            self._stats["statements"] += 1
        for w in writes:
            if w.usage is None:
                continue
            with self._usage_lock:
                latest = self._usage.get(w.row[0]) is w.usage
            if latest:  # else a write queued behind this one writes newer values
                cur.execute(self.q(_UPDATE_USAGE), (_json(w.usage.usage), w.usage.line, w.row[0]))
                self._stats["statements"] += 1

    def flush(self) -> None:
        """Block until everything queued so far is committed (at once once closed: closing
        committed it all)."""
        if not self.readonly and not self._closed:
            done: Future[Any] = Future()  # blocked on, whichever thread this is
            self._put(lambda cur: None, done, urgent=True)
            done.result()

    def committed(self) -> Written:
        """A future that resolves once everything queued so far is committed (writes are
        committed in the order they were queued)."""
        return self._submit_many([])

    # ---- reads -----------------------------------------------------------------------------
    def _reader(self) -> Conn:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = self._connect(self.readonly)
            with self._readers_lock:
                self._readers.append(conn)
        return conn

    def _rows(self, sql: str, args: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
        conn = self._reader()
        try:
            cur = conn.cursor()
            try:
                cur.execute(self.q(sql), args)
                cols = [d[0] for d in cur.description]
                rows = [
                    r if isinstance(r, dict) else dict(zip(cols, r, strict=True))
                    for r in cur.fetchall()
                ]
            finally:
                cur.close()
        except self.errors as exc:
            raise StoreError(f"journal read from {self.where} failed: {exc}") from exc
        return rows

    def get_run(self, run_id: str) -> dict[str, Any]:
        rows = self._rows(f"SELECT {self._columns} FROM runs WHERE id=?", (run_id,))
        if not rows:
            raise UnknownRun(
                f"no run {run_id!r} in {self.where}; `brood ps` lists the recent trees",
                run_id=run_id,
            )
        return _decode_run(rows[0])

    def runs(self, root_id: str | None = None) -> list[dict[str, Any]]:
        if root_id is None:
            rows = self._rows(f"SELECT {self._columns} FROM runs ORDER BY created_at")
        else:
            rows = self._rows(
                f"SELECT {self._columns} FROM runs WHERE root_id=? ORDER BY created_at", (root_id,)
            )
        return [_decode_run(r) for r in rows]

    def roots(
        self, limit: int = 20, *, offset: int = 0, state: str | None = None
    ) -> list[dict[str, Any]]:
        """Roots newest first, `limit` of them from `offset`, in `state` only if given."""
        where, args = "parent_id IS NULL", []
        if state is not None:
            where += " AND state = ?"
            args.append(state)
        rows = self._rows(
            f"SELECT {self._columns} FROM runs WHERE {where}"
            " ORDER BY created_at DESC LIMIT ? OFFSET ?",
            (*args, limit, offset),
        )
        return [_decode_run(r) for r in rows]

    def supervisor(self, token: str) -> dict[str, Any] | None:
        rows = self._rows("SELECT * FROM supervisors WHERE id=?", (token,))
        return rows[0] if rows else None

    def transitions(self, run_id: str) -> list[dict[str, Any]]:
        return self._rows("SELECT * FROM transitions WHERE run_id=? ORDER BY seq", (run_id,))

    def events(
        self,
        run_id: str | None = None,
        kind: str | None = None,
        *,
        after: int = 0,
        root_id: str | None = None,
        limit: int | None = None,
    ) -> list[dict[str, Any]]:
        """Events of a run (or of a whole tree with `root_id`) with seq > `after`; the
        first `limit` of them when given (a reader pages on by the last one's seq)."""
        where, args = ["seq > ?"], [after]
        if run_id is not None:
            where.append("run_id = ?")
            args.append(run_id)  # type: ignore[arg-type]
        if root_id is not None:
            where.append("root_id = ?")
            args.append(root_id)  # type: ignore[arg-type]
        if kind is not None:
            # Of one run, its own index (run_id, seq) finds the few events to filter; SQLite's
            # planner, with no statistics, would walk every event of the kind instead (all
            # the journal's model calls): `kind || ''` keeps it off the kind index.
            where.append("kind || '' = ?" if run_id is not None else "kind = ?")
            args.append(kind)  # type: ignore[arg-type]
        sql = "SELECT * FROM events WHERE " + " AND ".join(where) + " ORDER BY seq"
        if limit is not None:
            sql += " LIMIT ?"
            args.append(limit)
        rows = self._rows(sql, tuple(args))
        for r in rows:
            r["data"] = json.loads(r["data"])
        return rows

    def outline(self, root_id: str) -> list[dict[str, Any]]:
        """`id`, `parent_id`, `depth`, `state` and `supervisor` of a tree's runs in the order
        they were made, without their text: what a reader of a large tree (an export of
        10,000 runs) holds of all of it at once."""
        return self._rows(
            "SELECT id, parent_id, depth, state, supervisor FROM runs WHERE root_id = ?"
            " ORDER BY created_at, id",
            (root_id,),
        )

    def event_marks(self, root_id: str, after: int = 0) -> list[dict[str, Any]]:
        """`seq` and `run_id` of a tree's events with seq > `after`, without their data:
        which runs wrote since a reader last looked."""
        return self._rows(
            "SELECT seq, run_id FROM events WHERE root_id = ? AND seq > ? ORDER BY seq",
            (root_id, after),
        )

    def close(self) -> None:
        self._closed = True
        self._release()  # held on a loop that may run no more callbacks: committed too
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._urgent.set()
            self._thread.join()
        while True:  # a write queued as it closed is refused, never left waiting
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                _settle(
                    item[1], error=StoreError(f"the journal {self.where} closed before this write")
                )
                _wake_loops([item])
        with self._readers_lock:  # every reading thread's connection, not just this one's
            readers, self._readers = self._readers, []
        for conn in readers:
            conn.close()
        self._local = threading.local()


def _wake_loops(batch: list[tuple[Write, Waiter]]) -> None:
    """Settle a batch's loop waiters, with one call onto each loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list[_LoopWaiter]] = {}
    for _, w in batch:
        if type(w) is _LoopWaiter:
            by_loop.setdefault(w.fut.get_loop(), []).append(w)
    for loop, waiters in by_loop.items():
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits
            loop.call_soon_threadsafe(_settle_on_loop, waiters)


def _bytes(value: Any) -> bytes | None:
    return None if value is None else bytes(value)  # Postgres returns memoryview


def _decode_run(row: dict[str, Any]) -> dict[str, Any]:
    row["usage"] = json.loads(row["usage"] or "{}")
    if "products" in row:
        row["products"] = None if row["products"] is None else json.loads(row["products"])
    return row

"""The SQLite journal (embedded default): WAL mode, one writer thread, batched commits."""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
from collections.abc import Iterator
from typing import Any

from brood.errors import StoreError
from brood.store.sql import SQLStore


class SQLiteStore(SQLStore):
    errors = (sqlite3.Error,)
    refusals = (sqlite3.IntegrityError,)

    def _transient(self, exc: BaseException) -> bool:
        # Locked or busy past the busy timeout: another process holds the database a while.
        text = str(exc).lower()
        return isinstance(exc, sqlite3.OperationalError) and ("locked" in text or "busy" in text)

    def __init__(
        self, path: str, *, url: str, readonly: bool = False, remove_dir: str | None = None
    ) -> None:
        self.path = path
        self.where = f"journal {path}"
        self._remove_dir = remove_dir
        if readonly:
            if not os.path.exists(path):
                raise StoreError(
                    f"no journal at {path}; run something first "
                    "(brood run / brood demo), or pass --store URL"
                )
        else:
            try:
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            except OSError as exc:
                raise StoreError(f"cannot create the folder of journal {path}: {exc}") from exc
        super().__init__(url, readonly=readonly)
        self._identity = None if readonly else _identity(path)

    def _lost(self) -> StoreError | None:
        now = _identity(self.path)
        if now == self._identity:
            return None
        what = "deleted" if now is None else "replaced by another file"
        return StoreError(
            f"{self.where} was {what} while brood was writing it; writes from then on "
            "cannot be journaled. Put the journal back (or move it aside) and resume the "
            "trees (brood resume) with a new supervisor"
        )

    def _connect(self, readonly: bool) -> sqlite3.Connection:
        try:
            if readonly:
                return self._connect_readonly()
            conn = sqlite3.connect(
                self.path, check_same_thread=False, timeout=30.0, isolation_level=None
            )

            def set_up() -> None:
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("PRAGMA synchronous=NORMAL")

            try:
                # A new file's switch to WAL takes its lock: writers opening it at once may
                # be told `database is locked` at once, which is tried again, not damage.
                self._retrying(set_up, "opening")
            except sqlite3.DatabaseError as exc:
                conn.close()
                raise self._damaged(exc) from exc
        except sqlite3.Error as exc:
            raise self._unwritable(exc) or StoreError(
                f"cannot open {self.where}: {exc}; check the path and its permissions"
            ) from exc
        return conn

    def _connect_readonly(self) -> sqlite3.Connection:
        """mode=ro: a read command cannot change the journal, not even its WAL mode. Reading
        a WAL journal still needs its -shm file; in a folder the reader may not write to,
        and with no writer (so no -wal file), the file is opened as immutable instead."""
        uri = f"file:{os.path.abspath(self.path)}?mode=ro"
        conn = sqlite3.connect(uri, uri=True, check_same_thread=False, timeout=30.0)
        try:
            conn.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchall()
        except sqlite3.DatabaseError as exc:
            if not isinstance(exc, sqlite3.OperationalError):  # not a database at all
                conn.close()
                raise self._damaged(exc) from exc
            if os.path.exists(self.path + "-wal") and os.access(self.path + "-wal", os.W_OK):
                conn.close()
                raise
            conn.close()
            conn = sqlite3.connect(uri + "&immutable=1", uri=True, check_same_thread=False)
        return conn

    def _damaged(self, exc: Exception) -> StoreError:
        return self.open_error(exc)

    def open_error(self, exc: BaseException) -> StoreError:
        return self._unwritable(exc) or super().open_error(exc)

    def write_error(self, exc: BaseException) -> StoreError:
        return self._unwritable(exc) or super().write_error(exc)

    def _unwritable(self, exc: BaseException) -> StoreError | None:
        """The error for a journal this supervisor cannot write (a reader needs not)."""
        if self.readonly or self._writable():
            return None
        return StoreError(
            f"{self.where} cannot be written: {exc}; it is on a read-only filesystem or in "
            "a folder this user may not write; a supervisor writes its journal, so pass "
            "--store (or BROOD_STORE) with a writable place (read commands such as "
            "`brood ps` open it read-only)"
        )

    def _writable(self) -> bool:
        folder = os.path.dirname(os.path.abspath(self.path))
        try:
            if os.statvfs(folder).f_flag & os.ST_RDONLY:
                return False
        except OSError:
            return True  # cannot tell: the plain message
        return os.access(folder, os.W_OK) and (
            not os.path.exists(self.path) or os.access(self.path, os.W_OK)
        )

    @contextlib.contextmanager
    def _transaction(self, conn: sqlite3.Connection) -> Iterator[Any]:
        cur = conn.cursor()
        cur.execute("BEGIN IMMEDIATE")
        try:
            yield cur
        except BaseException:
            cur.execute("ROLLBACK")
            raise
        else:
            cur.execute("COMMIT")
        finally:
            cur.close()

    def close(self) -> None:
        super().close()
        if self._remove_dir:
            shutil.rmtree(self._remove_dir, ignore_errors=True)


def _identity(path: str) -> tuple[int, int] | None:
    """Which file `path` is (device and inode); None when there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino

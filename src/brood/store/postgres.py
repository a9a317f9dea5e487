"""The Postgres journal (psycopg 3): the same schema and calls as the SQLite one."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from brood.errors import StoreError, install_hint
from brood.store.base import redact
from brood.store.sql import SQLStore

try:
    import psycopg
except ImportError:  # pragma: no cover - depends on the install
    psycopg = None  # type: ignore[assignment]

CONNECT_TIMEOUT_S = 10
# The advisory lock that makes schema creation and migration happen once: supervisors
# opening one fresh journal at once would otherwise race on CREATE TABLE (UniqueViolation).
SCHEMA_LOCK = 0x62726F6F64  # "brood"


class PostgresStore(SQLStore):
    placeholder = "%s"
    real = "DOUBLE PRECISION"
    blob = "BYTEA"
    serial = "BIGSERIAL PRIMARY KEY"

    def __init__(self, url: str, *, readonly: bool = False) -> None:
        if psycopg is None:
            raise StoreError(f"store {redact(url)!r} needs psycopg: {install_hint('postgres')}")
        self.errors = (psycopg.Error,)
        self.refusals = (psycopg.IntegrityError,)
        self.where = f"journal {redact(url)}"
        super().__init__(url, readonly=readonly)

    def _connect(self, readonly: bool) -> Any:
        assert psycopg is not None
        try:
            conn = psycopg.connect(self.url, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S)
        except psycopg.Error as exc:
            raise StoreError(
                f"cannot open {self.where}: {exc}".strip()
                + "; check the URL, the server and its credentials"
            ) from exc
        if readonly:
            conn.execute("SET default_transaction_read_only = on")
        return conn

    def _transient(self, exc: BaseException) -> bool:
        # A dropped connection or a server restarting (OperationalError), a serialization
        # failure or a deadlock: a new try may succeed.
        assert psycopg is not None
        return isinstance(
            exc,
            psycopg.OperationalError
            | psycopg.errors.SerializationFailure
            | psycopg.errors.DeadlockDetected,
        )

    def _revive(self, conn: Any) -> Any:
        if not conn.broken and not conn.closed:
            return conn
        with contextlib.suppress(Exception):
            conn.close()
        return self._connect(False)

    @contextlib.contextmanager
    def _transaction(self, conn: Any) -> Iterator[Any]:
        with conn.transaction(), conn.cursor() as cur:
            yield cur

    def _lock_schema(self, cur: Any) -> None:
        cur.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK,))

    def read_schema_version(self, conn: Any) -> int:
        try:
            return super().read_schema_version(conn)
        except StoreError:
            raise
        except Exception as exc:  # the meta table is missing: not a brood journal yet
            raise StoreError(f"{self.where} is not a brood journal: {exc}") from exc

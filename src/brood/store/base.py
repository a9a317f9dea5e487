"""The store interface: a journal of runs, their transitions and their events."""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

from brood.errors import StoreError
from brood.lifecycle import RunRecord


class Store(Protocol):
    """A journal. Writes return futures that resolve once the write is committed; reads
    return plain dicts. See `brood.store.sql.SQLStore` for the full set of calls."""

    url: str
    readonly: bool
    failure: StoreError | None  # the first failed write: every later write raises it too
    on_failure: Callable[[StoreError], None] | None  # told once, from the writer thread

    def insert_supervisor(
        self, token: str, pid: int, host: str, control: str | None, lease_until: float | None = None
    ) -> Future[Any]: ...

    def close_supervisor(self, token: str) -> Future[Any]: ...

    def renew_lease(self, token: str, until: float) -> Future[Any]: ...

    def revoke_lease(self, token: str) -> Future[Any]: ...

    def fence(self, reason: str) -> None: ...

    def insert_run(
        self,
        rec: RunRecord,
        supervisor: str,
        context: bytes | None = None,
        model_name: str | None = None,
    ) -> Future[Any]: ...

    def claim_tree(self, root_id: str, supervisor: str) -> Future[Any]: ...

    def claim_run(self, run_id: str, supervisor: str) -> Future[Any]: ...

    def resume_data(self, root_id: str) -> dict[str, dict[str, Any]]: ...

    def note_reason(self, run_id: str, reason: str | None) -> Future[Any]: ...

    def transition(self, rec: RunRecord, frm: str, to: str) -> Future[Any]: ...

    def event(
        self, rec: RunRecord, kind: str, data: dict[str, Any], progress: str | None = None
    ) -> Future[Any]: ...

    def note(
        self, rec: RunRecord, kind: str, data: dict[str, Any], progress: str | None = None
    ) -> None: ...

    def flush(self) -> None: ...

    def committed(self) -> Future[Any]: ...

    def get_run(self, run_id: str) -> dict[str, Any]: ...

    def runs(self, root_id: str | None = None) -> list[dict[str, Any]]: ...

    def roots(
        self, limit: int = 20, *, offset: int = 0, state: str | None = None
    ) -> list[dict[str, Any]]: ...

    def supervisor(self, token: str) -> dict[str, Any] | None: ...

    def transitions(self, run_id: str) -> list[dict[str, Any]]: ...

    def events(
        self,
        run_id: str | None = None,
        kind: str | None = None,
        *,
        after: int = 0,
        root_id: str | None = None,
        limit: int | None = None,
    ) -> list[dict[str, Any]]: ...

    def outline(self, root_id: str) -> list[dict[str, Any]]: ...

    def event_marks(self, root_id: str, after: int = 0) -> list[dict[str, Any]]: ...

    def close(self) -> None: ...


_PASSWORD_PARAM = re.compile(r"(password\s*=\s*)('[^']*'|[^&\s]*)", re.IGNORECASE)
_USERINFO = re.compile(r"(://[^:/@]*:)([^@/]*)(@)")


def redact(url: str) -> str:
    """A store URL (or libpq key=value string) fit for a message: passwords masked."""
    return _USERINFO.sub(r"\1***\3", _PASSWORD_PARAM.sub(r"\1***", url))


def open_store(url: str | None, *, readonly: bool = False) -> Store:
    """Open the store a URL names. None gives a private temporary SQLite file.

    `readonly` opens an existing journal for reading only (the CLI's read commands)."""
    from brood.store.sqlite import SQLiteStore

    if url is None:
        tmp = tempfile.mkdtemp(prefix="brood-journal-")
        path = os.path.join(tmp, "brood.db")
        return SQLiteStore(path, url=f"sqlite:///{path}", remove_dir=tmp)
    if not isinstance(url, str):
        raise StoreError(
            f"store must be a URL string like 'sqlite:///.brood/brood.db', got {type(url).__name__}"
        )
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise StoreError(
            f"store {redact(url)!r} is not a URL; use 'sqlite:///PATH' "
            "(e.g. sqlite:///.brood/brood.db)"
        )
    if scheme == "sqlite":
        path = rest[1:] if rest.startswith("/") else rest
        if path in ("", ":memory:"):
            return open_store(None)
        return SQLiteStore(path, url=url, readonly=readonly)
    if scheme in ("postgresql", "postgres"):
        from brood.store.postgres import PostgresStore

        return PostgresStore(url, readonly=readonly)
    raise StoreError(
        f"store {redact(url)!r} has an unknown scheme {scheme!r}; use sqlite:///PATH or "
        "postgresql://USER@HOST/DB"
    )

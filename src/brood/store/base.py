"""The store interface: a journal of runs, their transitions and their events."""

from __future__ import annotations

import os
import tempfile
from concurrent.futures import Future
from typing import Any, Protocol

from brood.errors import StoreError
from brood.lifecycle import RunRecord

SCHEMA_VERSION = 1


class Store(Protocol):
    """Writes return futures that resolve once the write is committed."""

    url: str

    def insert_run(self, rec: RunRecord, supervisor: str) -> Future[None]: ...

    def transition(self, rec: RunRecord, frm: str, to: str) -> Future[None]: ...

    def event(self, run_id: str, kind: str, data: dict[str, Any]) -> Future[None]: ...

    def get_run(self, run_id: str) -> dict[str, Any]: ...

    def runs(self, root_id: str | None = None) -> list[dict[str, Any]]: ...

    def transitions(self, run_id: str) -> list[dict[str, Any]]: ...

    def events(self, run_id: str, kind: str | None = None) -> list[dict[str, Any]]: ...

    def close(self) -> None: ...


def open_store(url: str | None) -> Store:
    """Open the store a URL names. None gives a private temporary SQLite file."""
    from brood.store.sqlite import SQLiteStore

    if url is None:
        tmp = tempfile.mkdtemp(prefix="brood-journal-")
        return SQLiteStore(
            os.path.join(tmp, "brood.db"), url="sqlite://(temporary)", remove_dir=tmp
        )
    if not isinstance(url, str):
        raise StoreError(
            f"store must be a URL string like 'sqlite:///.brood/brood.db', got {type(url).__name__}"
        )
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise StoreError(
            f"store {url!r} is not a URL; use 'sqlite:///PATH' (e.g. sqlite:///.brood/brood.db)"
        )
    if scheme == "sqlite":
        path = rest[1:] if rest.startswith("/") else rest
        if path in ("", ":memory:"):
            return open_store(None)
        return SQLiteStore(path, url=url)
    if scheme in ("postgresql", "postgres"):
        raise StoreError(f"store {url!r}: the Postgres store is not built yet; use sqlite:///PATH")
    raise StoreError(f"store {url!r} has an unknown scheme {scheme!r}; use sqlite:///PATH")

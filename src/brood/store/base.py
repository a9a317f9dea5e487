"""The store interface: a journal of runs, their transitions and their events."""

from __future__ import annotations

import asyncio
import os
import re
import tempfile
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

from brood.errors import StoreError
from brood.lifecycle import RunRecord

# What a write gives its caller: on the loop a store is bound to (`bind_loop`), an asyncio
# future of that loop (await it, or hand it to asyncio.wrap_future, which takes it as it
# is); from any other thread, a concurrent.futures.Future (block on its result()).
Written = Future[Any] | asyncio.Future[Any]


class Store(Protocol):
    """A journal. Writes return futures that resolve once the write is committed; reads
    return plain dicts. See `brood.store.sql.SQLStore` for the full set of calls."""

    url: str
    readonly: bool
    failure: StoreError | None  # the first failed write: every later write raises it too
    on_failure: Callable[[StoreError], None] | None  # told once, from the writer thread

    def insert_supervisor(
        self, token: str, pid: int, host: str, control: str | None, lease_until: float | None = None
    ) -> Written: ...

    def close_supervisor(self, token: str) -> Written: ...

    def renew_lease(self, token: str, until: float) -> Written: ...

    def revoke_lease(self, token: str) -> Written: ...

    def fence(self, reason: str) -> None: ...

    def insert_run(
        self,
        rec: RunRecord,
        supervisor: str,
        context: bytes | None = None,
        model_name: str | None = None,
    ) -> Written: ...

    def claim_tree(self, root_id: str, supervisor: str) -> Written: ...

    def claim_run(self, run_id: str, supervisor: str) -> Written: ...

    def resume_data(self, root_id: str) -> dict[str, dict[str, Any]]: ...

    def note_reason(self, run_id: str, reason: str | None) -> None: ...

    def transition(self, rec: RunRecord, frm: str, to: str) -> Written: ...

    def event(
        self, rec: RunRecord, kind: str, data: dict[str, Any], progress: str | None = None
    ) -> Written: ...

    def note(
        self,
        rec: RunRecord,
        kind: str,
        data: dict[str, Any],
        progress: str | None = None,
        *,
        at_once: bool = False,
    ) -> None: ...

    def bind_loop(self) -> None: ...

    def flush(self) -> None: ...

    def committed(self) -> Written: ...

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

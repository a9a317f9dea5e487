"""How the server answers when something is wrong: always JSON, never a traceback.

`{"error": {"message": ..., "field": ..., "fix": ...}}` (field and fix when known) with a
4xx status for what the client can change, and a 5xx for what it cannot. Brood's own errors
are translated here, at the boundary, by their class: the message brood wrote (what
happened, the values, the fix) is passed on as it is.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from starlette.responses import JSONResponse

import brood
from brood.errors import UnknownRun

# The one message of the store's that is the client's doing rather than the journal's.


class Json(JSONResponse):
    """A JSON response whose values brood's rows may hold (a `bytes` context ref, say)
    come out as text instead of failing the response."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=False, default=str).encode("utf-8")


class ApiError(Exception):
    """A refusal with its HTTP status; `field` names the bad field, `fix` says what to do."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        field: str | None = None,
        fix: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.field = field
        self.fix = fix
        self.headers = dict(headers or {})

    def response(self) -> Json:
        return error_response(
            self.status, self.message, field=self.field, fix=self.fix, headers=self.headers
        )


def error_response(
    status: int,
    message: str,
    *,
    field: str | None = None,
    fix: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> Json:
    error: dict[str, Any] = {"message": message}
    if field is not None:
        error["field"] = field
    if fix is not None:
        error["fix"] = fix
    return Json({"error": error}, status_code=status, headers=headers)


def unknown_run(run_id: str) -> ApiError:
    return ApiError(
        404,
        f"no run {run_id!r} in this server's journal",
        fix="GET /v1/runs lists the recent trees",
    )


def from_brood(exc: brood.BroodError) -> ApiError:
    """The HTTP refusal for an error brood raised on purpose."""
    message = str(exc)
    if isinstance(exc, brood.InvalidArgument | brood.InvalidSpec):
        return ApiError(422, message)
    if isinstance(exc, UnknownRun):
        return unknown_run(exc.run_id or "?")
    if isinstance(exc, brood.StoreError):
        return ApiError(503, message, fix="check the journal the server was started with")
    if isinstance(exc, brood.SupervisorClosed):
        return ApiError(503, message)
    if isinstance(exc, brood.ChildCleanupError):
        return ApiError(500, message)
    # A run or ask that has ended, a stale tree, a flow that is not paused, a limit: the
    # request is sound, the state of what it acts on refuses it.
    return ApiError(409, message)

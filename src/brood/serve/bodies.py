"""Request bodies: read within a size bound, parsed as one JSON object, checked field by
field. A body that is not JSON is a 400; a field of the wrong type or value is a 422 naming
the field."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from itertools import accumulate
from typing import Any

from starlette.requests import Request

from brood.serve.errors import ApiError

MAX_BODY_BYTES = 1 << 20  # a request carries a task and its context, not a data set
# Python's json (and PyYAML) parse nested values by recursion: a body of 100,000 `[` would
# end in a RecursionError. A task's context nests a few levels; 64 leaves room for any
# real one and stays far below the interpreter's recursion limit.
MAX_JSON_DEPTH = 64
# JSON strings (their brackets are text, escaped quotes included), and what is not a bracket.
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}

_JSON_TYPES: dict[type, str] = {
    str: "a string",
    bool: "true or false",
    int: "a number",
    float: "a number",
    list: "a list",
    dict: "an object",
    type(None): "null",
}


def json_type(value: object) -> str:
    return _JSON_TYPES.get(type(value), type(value).__name__)


def too_large(size: int) -> ApiError:
    return ApiError(
        413,
        f"the request body is {size:,} bytes or more, over the {MAX_BODY_BYTES:,}-byte bound",
        fix="send a smaller body; pass large data as a file the run reads (Limits.fs_read)",
    )


async def read_body(request: Request) -> bytes:
    """The body, refused with 413 past MAX_BODY_BYTES whatever Content-Length said."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise ApiError(400, f"Content-Length {declared!r} is not a number of bytes")
        if int(declared) > MAX_BODY_BYTES:
            raise too_large(int(declared))
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:  # a chunked body, or one longer than it said
            raise too_large(size)
        chunks.append(chunk)
    return b"".join(chunks)


def json_depth(text: str) -> int:
    """How deep JSON text nests (0 for a scalar, 1 for `[]`), read without parsing it, so
    that text too deep to parse is refused with its depth rather than failing the parser.

    The depth is the highest count of open brackets outside strings. In text that is not
    JSON the count can be off, but never below the depth of the valid part a parser reads
    before it stops at the error, so nothing too deep reaches a parser. (C-speed passes:
    a MiB of `[` is read in milliseconds, on the event loop.)"""
    marks = _NOT_BRACKET.sub("", _STRING.sub("", text))
    return max(0, max(accumulate(map(_STEP.__getitem__, marks)), default=0))


def check_depth(text: str, what: str, *, field: str | None = None) -> None:
    """Refuse (400, or 422 for a field) JSON text nested deeper than MAX_JSON_DEPTH."""
    depth = json_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise ApiError(
            422 if field else 400,
            f"{what} nests {depth:,} levels deep, over the bound of {MAX_JSON_DEPTH} levels",
            field=field,
            fix=f"send values nested {MAX_JSON_DEPTH} levels deep at most",
        )


async def read_object(request: Request, allowed: Iterable[str] | None = None) -> dict[str, Any]:
    """The body as a JSON object. With `allowed`, a field not in it is refused (a typo
    must not be ignored)."""
    raw = await read_body(request)
    if not raw.strip():
        raise ApiError(400, "the request has no body", fix="send a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ApiError(400, "the body is not UTF-8 text", fix="send a JSON object") from None
    check_depth(text, "the body")  # before json.loads, which would recurse that deep
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ApiError(400, f"the body is not JSON: {exc}", fix="send a JSON object") from None
    if not isinstance(value, dict):
        raise ApiError(422, f"the body must be a JSON object, got {json_type(value)}")
    if allowed is not None:
        names = list(allowed)
        for key in value:
            if key not in names:
                raise ApiError(
                    422,
                    f"unknown field {key!r}; this endpoint takes {', '.join(names)}",
                    field=key,
                )
    return value


def text_field(body: dict[str, Any], name: str, *, required: bool = True) -> str | None:
    """A string field; a required one must not be blank."""
    value = body.get(name)
    if value is None:
        if required:
            raise ApiError(422, f"{name} is required (a string)", field=name)
        return None
    if not isinstance(value, str):
        raise ApiError(422, f"{name} must be a string, got {json_type(value)}", field=name)
    if required and not value.strip():
        raise ApiError(422, f"{name} must not be blank", field=name)
    return value


def seconds_field(body: dict[str, Any], name: str, default: float) -> float:
    """A number of seconds > 0 (absent or null: `default`)."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ApiError(422, f"{name} must be a number of seconds > 0, got {value!r}", field=name)
    return float(value)


def object_field(body: dict[str, Any], name: str) -> dict[str, Any] | None:
    value = body.get(name)
    if value is not None and not isinstance(value, dict):
        raise ApiError(422, f"{name} must be an object, got {json_type(value)}", field=name)
    return value


def int_param(request: Request, name: str, default: int, low: int, high: int) -> int:
    """A whole-number query parameter within [low, high]."""
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or not low <= value <= high:
        raise ApiError(
            422, f"{name} must be a whole number from {low} to {high}, got {raw!r}", field=name
        )
    return value

"""Transition guards: `when {output, path, op, value}` evaluated JSON-strictly.

JSON-strict means values compare the way JSON defines them, not the way Python does:
`true` is not `1` and `false` is not `0` (Python's `True == 1` is never used), an integer and
a float with the same value are the same JSON number (`1 == 1.0`), `null` equals only
`null`, arrays compare element by element and objects key by key with the same rules.

A guard that cannot be decided is false: an output that was not produced, a path that does
not lead anywhere, a numeric comparison on something that is not a number, `contains` on
something that is neither a string nor a list. Only `exists` looks at presence itself.
"""

from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass
from typing import Any, Final, Literal, Protocol

__all__ = [
    "MISSING",
    "NUMERIC_OPS",
    "OPS",
    "Condition",
    "GuardLike",
    "Op",
    "evaluate",
    "json_equal",
    "parse_path",
    "resolve",
]

Op = Literal["eq", "ne", "gt", "gte", "lt", "lte", "exists", "contains"]
OPS: Final = ("eq", "ne", "gt", "gte", "lt", "lte", "exists", "contains")
NUMERIC_OPS: Final = frozenset({"gt", "gte", "lt", "lte"})

# A path is dotted keys and bracketed indexes: `a.b[0].c`, `[2].name`, `a["key.with dots"]`.
_KEY = re.compile(r"[^.\[\]\"]+")
_INDEX = re.compile(r"\[(\d+)\]")
_QUOTED = re.compile(r'\[("(?:[^"\\]|\\.)*")\]')


class _Missing:
    """The value of a path that leads nowhere (distinct from a JSON `null`)."""

    def __repr__(self) -> str:
        return "<missing>"


MISSING: Final = _Missing()


class GuardLike(Protocol):
    """What `evaluate` reads: the spec's `Guard` model and the machine's `Condition` both fit."""

    @property
    def output(self) -> str: ...
    @property
    def path(self) -> str | None: ...
    @property
    def op(self) -> str: ...
    @property
    def value(self) -> Any: ...


@dataclass(frozen=True, kw_only=True)
class Condition:
    """A validated guard in the compiled machine: `output` (a declared output of the
    transition's source state), `path` into it (None: the output itself), `op`, `value`
    (None for `exists`)."""

    output: str
    op: str
    path: str | None = None
    value: Any = None


def parse_path(path: str) -> tuple[str | int, ...]:
    """Split `a.b[0].c` into `("a", "b", 0, "c")`.

    Keys are separated by dots; `[N]` indexes a list; `["..."]` is a key written as a JSON
    string (for keys holding dots, brackets or quotes). A key made of digits after a dot
    (`a.0`) is an object key `"0"`, not a list index. Raises ValueError, saying where, for
    anything else (an empty key, an unclosed bracket, a negative index).
    """
    if not path:
        raise ValueError("the path is empty; leave `path` out to test the output itself")
    parts: list[str | int] = []
    pos = 0
    expect_key = True  # at the start, or right after a dot
    while pos < len(path):
        char = path[pos]
        if char == "[":
            if expect_key and parts:
                raise ValueError(f"'.' before '[' at character {pos} of {path!r}; write a[0]")
            if m := _INDEX.match(path, pos):
                parts.append(int(m.group(1)))
            elif m := _QUOTED.match(path, pos):
                parts.append(json.loads(m.group(1)))
            else:
                raise ValueError(
                    f"'[' at character {pos + 1} of {path!r} is not an index like [0] "
                    'or a quoted key like ["a.b"]'
                )
            pos = m.end()
            expect_key = False
        elif char == ".":
            if expect_key:
                raise ValueError(f"empty key at character {pos + 1} of {path!r}")
            pos += 1
            expect_key = True
        elif expect_key and (m := _KEY.match(path, pos)):
            parts.append(m.group(0))
            pos = m.end()
            expect_key = False
        else:
            raise ValueError(
                f"unexpected {char!r} at character {pos + 1} of {path!r}; "
                "separate keys with '.' and write indexes as [0]"
            )
    if expect_key:
        raise ValueError(f"{path!r} ends with '.'; remove it or add the missing key")
    return tuple(parts)


@functools.lru_cache(maxsize=1024)
def _parsed(path: str) -> tuple[str | int, ...]:
    return parse_path(path)


def resolve(value: Any, path: str | None) -> Any:
    """The part of `value` that `path` names, or MISSING if the path leads nowhere.

    A key step needs a JSON object holding that key, an index step a JSON array long
    enough; anything else (a key into a list, an index into a string) leads nowhere.
    """
    if path is None:
        return value
    for step in _parsed(path):
        if isinstance(step, int):
            if not isinstance(value, list) or step >= len(value):
                return MISSING
            value = value[step]
        else:
            if not isinstance(value, dict) or step not in value:
                return MISSING
            value = value[step]
    return value


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def json_equal(a: Any, b: Any) -> bool:
    """Equality as JSON defines it: booleans never equal numbers, `1 == 1.0`, arrays and
    objects compare deeply with the same rules, and any non-JSON value equals nothing."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a is b
    if _is_number(a) or _is_number(b):
        return _is_number(a) and _is_number(b) and a == b and not math.isnan(a)
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, str) or isinstance(b, str):
        return isinstance(a, str) and isinstance(b, str) and a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    return False


def evaluate(guard: GuardLike, outputs: dict[str, Any]) -> bool:
    """Whether `guard` passes on a settled state's `outputs` (output name -> value: a str for
    a text output, the parsed JSON for a json output).

    `exists` is true when the output was produced and the path leads to a value (a JSON
    `null` counts as a value). Every other op is false when the output or the path is
    missing — `ne` included, so a missing value never passes by accident. `eq`/`ne` use
    `json_equal`. `gt`/`gte`/`lt`/`lte` are true only when both sides are numbers (a
    boolean is not a number). `contains` is a substring test when both sides are strings
    and a `json_equal` element test when the actual value is a list; otherwise false.
    """
    actual = resolve(outputs[guard.output], guard.path) if guard.output in outputs else MISSING
    op = guard.op
    if op == "exists":
        return actual is not MISSING
    if actual is MISSING:
        return False
    expected = guard.value
    if op == "eq":
        return json_equal(actual, expected)
    if op == "ne":
        return not json_equal(actual, expected)
    if op in NUMERIC_OPS:
        if not (_is_number(actual) and _is_number(expected)):
            return False
        if op == "gt":
            return bool(actual > expected)
        if op == "gte":
            return bool(actual >= expected)
        if op == "lt":
            return bool(actual < expected)
        return bool(actual <= expected)
    if op == "contains":
        if isinstance(actual, str):
            return isinstance(expected, str) and expected in actual
        if isinstance(actual, list):
            return any(json_equal(item, expected) for item in actual)
        return False
    raise ValueError(f"unknown guard op {op!r}; use one of {', '.join(OPS)}")

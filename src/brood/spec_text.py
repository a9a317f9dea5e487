"""A flow spec's text as both sides of the trust boundary know it: the bound on its size,
and the rule that tells the name of a spec file from spec text.

`flow_run(path)` in a REPL is read by the worker, under the worker's own confinement, and
sent as text (`brood.worker.verbs.flows`); the supervisor parses the text of a worker and never
opens a path a worker named (`brood.flow.load.load_spec_text`). Only the user's own calls
(`Supervisor.flow_run(path)`, `brood flow validate PATH`, `brood flow run PATH`) read a
path on the supervisor's side. Like `brood.protocol`, this module belongs to neither side:
it imports only `brood.errors`, so a worker imports it without the flow package.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO, Final

from brood.errors import InvalidSpec

__all__ = ["MAX_SPEC_BYTES", "SPEC_SUFFIXES", "looks_like_path", "over_bound", "read_bounded"]

SPEC_SUFFIXES: Final = (".yaml", ".yml", ".json")
MAX_SPEC_BYTES: Final = 1 << 20  # a spec's text; a real one is a few KB


def looks_like_path(source: str) -> bool:
    """A one-line string is a path if it names an existing file, or ends in .yaml, .yml or
    .json and holds no ': ' or '{' (which one-line YAML or JSON would); else it is text.
    A relative path is taken from the caller's working directory (a worker's: its scratch)."""
    if "\n" in source or not source.strip():
        return False
    try:
        if Path(source).is_file():
            return True
    except (OSError, ValueError):  # a name too long for the OS, a NUL byte
        return False
    return source.strip().lower().endswith(SPEC_SUFFIXES) and not (": " in source or "{" in source)


def over_bound(label: str, size: int | None) -> str:
    """The message for a spec of `size` bytes past MAX_SPEC_BYTES (`label` names it; None:
    a stream whose size is not known, read up to the bound)."""
    held = f"{size:,} bytes, over" if size is not None else "more than"
    return (
        f"invalid flow spec {label}: {held} the {MAX_SPEC_BYTES:,}-byte bound of a spec; a "
        "spec describes states, it does not carry data (pass data as inputs)"
    )


def read_bounded(f: BinaryIO, label: str) -> bytes:
    """The bytes of the open spec file `f`, refused with InvalidSpec past MAX_SPEC_BYTES: by
    its size where it has one, else once a byte past the bound is read (a pipe, /dev/zero
    or a file growing meanwhile is never read further)."""
    size = os.fstat(f.fileno()).st_size
    if size > MAX_SPEC_BYTES:
        raise InvalidSpec(over_bound(label, size))
    data = f.read(MAX_SPEC_BYTES + 1)
    if len(data) > MAX_SPEC_BYTES:
        raise InvalidSpec(over_bound(label, None))
    return data

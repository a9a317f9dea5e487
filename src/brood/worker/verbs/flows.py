"""Flows started from a REPL: `flow_run` (from a spec: a dict, YAML/JSON text or a file
this worker reads under its own confinement), `flow_status`, `flow_wait`, `flow_stop`,
`flow_resume`. A flow's states' runs are children of this run for every limit."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
from typing import Any

from brood.errors import InvalidArgument, InvalidSpec, LimitExceeded
from brood.protocol import FlowReq
from brood.spec_text import MAX_SPEC_BYTES, looks_like_path, over_bound, read_bounded
from brood.worker.handles import check_timeout
from brood.worker.runtime import Runtime
from brood.worker.verbs.base import verb


def _flow(rt: Runtime, op: str, **fields: Any) -> Any:
    rt.check_open()
    waits = op in ("stop", "wait")
    with rt.blocked(fields.get("timeout")) if waits else contextlib.nullcontext():
        return rt.link.request(
            FlowReq(
                req_id=rt.link.next_id(),
                op=op,  # type: ignore[arg-type]
                replaying=rt.replaying,
                **fields,
            )
        )


@verb
def flow_run(spec: Any, inputs: dict[str, Any] | None = None, *, rt: Runtime) -> str:
    """Start a flow (a state-machine workflow of sub-agents) from a spec: a dict, or
    YAML/JSON text, or a path to a spec file (read here, as your code reads any file).
    Its states' runs are children of this run for every limit. Returns its id at once;
    its milestones (finished, failed, paused, ...) are announced in your next turns.
    A spec with problems raises InvalidSpec listing every one."""
    if not isinstance(spec, dict | str):
        raise InvalidArgument("flow_run(spec): pass a dict, YAML/JSON text or a file path")
    if inputs is not None and not isinstance(inputs, dict):
        raise InvalidArgument(
            f"flow_run(spec, inputs): inputs must be a dict {{name: value}}, "
            f"got {type(inputs).__name__}"
        )
    if not rt.can_spawn:  # the supervisor refuses it too; this saves the trip
        raise LimitExceeded(
            "max_depth",
            rt.depth + 2,
            rt.max_depth,
            hint=f"this run is at depth {rt.depth} of max_depth={rt.max_depth}; a flow's "
            "states are this run's children, and it may start none",
        )
    if isinstance(spec, dict):
        text = _json("spec", spec)
    elif looks_like_path(spec):
        text = _read_spec_file(spec)
    else:
        text = spec
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_SPEC_BYTES:
        raise InvalidSpec(over_bound("(text)", size))
    result: dict[str, Any] = _flow(rt, "run", spec=text, inputs=_json("inputs", inputs or {}))
    flow_id = str(result["id"])
    # Its run is a child of this one, but no handle collects it: its milestones are
    # announced instead, never "collect it with rlm_result".
    rt.seen.add(flow_id)
    return flow_id


def _json(what: str, value: Any) -> str:
    try:
        return json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidArgument(
            f"flow_run: {what} must hold only JSON values (dict, list, str, finite "
            f"numbers, bool, None), nested less deeply than Python recurses: {exc}"
        ) from None


@verb
def flow_status(flow_id: str, *, rt: Runtime) -> dict[str, Any]:
    """A flow's status: per-state entries and instances, milestones, recent events."""
    status: dict[str, Any] = _flow(rt, "status", ref=flow_id)
    return status


@verb
def flow_wait(flow_id: str, timeout: float | None = None, *, rt: Runtime) -> str:
    """Block until the flow ends or pauses and return its status (finished, failed,
    stopped, paused). On timeout raises TimeoutError and the flow keeps going."""
    return str(_flow(rt, "wait", ref=flow_id, timeout=check_timeout(timeout, "flow_wait")))


@verb
def flow_stop(flow_id: str, *, rt: Runtime) -> str:
    """Stop a flow: it admits nothing more and its running children are cancelled."""
    return str(_flow(rt, "stop", ref=flow_id))


@verb
def flow_resume(flow_id: str, *, rt: Runtime) -> str:
    """Let a paused flow go on."""
    return str(_flow(rt, "resume", ref=flow_id))


_NOT_A_FILE = (
    "not a regular file (a spec is read from a .yaml, .yml or .json file; a FIFO, a device "
    "or a directory is not read)"
)


def _read_spec_file(name: str) -> str:
    """The text of the spec file `name` (relative to this worker's cwd, its scratch), read
    by this worker under its own confinement: a file the run may not read raises the
    OSError naming it. Only a regular file is read (a FIFO would block, a device would not
    end), and only up to MAX_SPEC_BYTES."""
    try:
        if not stat.S_ISREG(os.stat(name).st_mode):
            raise InvalidSpec(f"flow_run({name!r}): {_NOT_A_FILE}")
        # O_NONBLOCK: if a FIFO took the file's place since the stat, opening it does not
        # wait for a writer (and fstat tells).
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise FileNotFoundError(
            errno.ENOENT,
            "no such spec file (a relative path is read from the run's scratch "
            "directory, its working directory)",
            name,
        ) from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InvalidSpec(f"flow_run({name!r}): {_NOT_A_FILE}")
        data = read_bounded(f, repr(name))
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidSpec(
            f"flow_run({name!r}): not UTF-8 text (byte {exc.start}); a spec is a YAML or JSON file"
        ) from None

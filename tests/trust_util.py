"""Helpers of the escape catalogue (test_trust.py): a model that runs the code a test puts
in its task, a prelude that records what each attempt got, and the checks every case ends
with (the supervisor still serves a run; the journal still opens and lists the runs)."""

from __future__ import annotations

import json
from typing import Any

import pytest

import brood
from brood.backends.confinement import unenforced, worker_settings
from brood.journal import Journal
from brood.supervisor.engine import Engine

FENCE = "```"
GRACE: dict[str, Any] = dict(shutdown_grace=0.3, term_grace=0.3)
NO_FINAL = "__no_final__"


def limits(**kw: Any) -> brood.Limits:
    """brood's default confinement with small cleanup graces (no test paths made writable)."""
    return brood.Limits(**{**GRACE, **kw})


def repl(code: str) -> str:
    return f"{FENCE}repl\n{code}\n{FENCE}"


def task(code: str) -> str:
    """A task whose first model turn answers exactly `code` (see `coder`)."""
    return f"<<<\n{code}\n>>>"


def coder(messages: list[dict[str, Any]]) -> str:
    """The model of every case: its first turn is the code between the task's markers, as a
    model would write it; a task starting "trivial" answers FINAL('alive'); a later turn
    (the code did not FINAL) answers NO_FINAL; a plain llm_query gets "plain"."""
    users = [m["content"] for m in messages if m.get("role") == "user"]
    first = users[0] if users else ""
    if first.startswith("trivial"):
        return repl("FINAL('alive')")
    if "<<<\n" not in first:
        return "plain"
    if any(m.get("role") == "assistant" for m in messages):
        return repl(f"FINAL({NO_FINAL!r})")
    return repl(first.split("<<<\n", 1)[1].split("\n>>>", 1)[0])


# Model code that finds the worker's own channel to the supervisor and can write raw bytes
# on it (what a model that read brood's source would do): `raw(bytes)`, `frame(dict)`.
CHANNEL = """import gc, struct, msgspec
from brood.worker.link import Link
link = next(o for o in gc.get_objects() if isinstance(o, Link))
def raw(data):
    with link.chan._lock:
        link.chan._w.write(data)
def frame(obj):
    body = msgspec.msgpack.encode(obj)
    raw(struct.pack('>I', len(body)) + body)
"""

# Model code: `tr(name, fn)` records fn's value or the exception it raised; `R` is FINALed
# as JSON by `probe_code`.
PRELUDE = """import json, os, errno
R = {}
def tr(name, fn):
    try:
        R[name] = ["ok", repr(fn())[:300]]
    except BaseException as e:
        R[name] = [type(e).__name__, getattr(e, "errno", None), str(e)[:300]]
"""


def probe_code(body: str) -> str:
    return PRELUDE + body + "\nFINAL(json.dumps(R))"


def outcome(sup: brood.Supervisor, body: str) -> tuple[brood.RunResult, dict[str, Any]]:
    """Run `body` (after PRELUDE) as a root run's model code; its completed run and `R`."""
    result = sup.run(task(probe_code(body)))
    assert result.state == "completed", result
    return result, json.loads(result.answer)


def refused(entry: list[Any], *types: str) -> None:
    """The attempt `entry` (an `R` value) raised one of `types` (PermissionError if none)."""
    types = types or ("PermissionError",)
    assert entry[0] in types, f"expected {' or '.join(types)}, got {entry}"


def still_serves(sup: brood.Supervisor | Engine, store: str, *run_ids: str) -> None:
    """The supervisor (or a Session's engine) completes a trivial run, and the journal
    opens and lists `run_ids` (with the trivial run)."""
    if isinstance(sup, Engine):
        run = sup.call(sup.create_root("trivial task", None, None, coder, driven=False))
        result = brood.RunHandle(sup, run).wait_result()
    else:
        result = sup.run("trivial task", model=coder)
    assert (result.state, result.answer) == ("completed", "alive"), result
    with Journal(store) as journal:
        listed = {r["id"] for r in journal.roots(1000)}
        for rid in (*run_ids, result.run_id):
            assert rid in listed, f"{rid} is not listed by the journal"
            assert journal.run(rid)["id"] == rid


def require(lim: brood.Limits, *prefixes: str) -> None:
    """Skip, naming brood's own line, when brood reports a mechanism this case needs is not
    enforced on this machine."""
    lines = [line for line in unenforced(worker_settings(lim)) if line.split(":", 1)[0] in prefixes]
    if lines:
        pytest.skip("; ".join(lines))


def as_seen_by(engine: Engine, run_id: str, path: str) -> str:
    """`path` as the live worker of run `run_id` sees it: its scratch may be a tmpfs in a
    mount namespace of its own, which only its processes (and /proc/PID/root) see."""
    pid = engine.core.runs[run_id].rec.pid
    return f"/proc/{pid}/root{path}"

"""What the zygote does once so that each worker does less at its start, and that the
worker still ends up exactly as confined and as independent as one that did it all itself.

The zygote's side (`confine.prepare`, `verbs.prebind`, `repl.prebuild_builtins`) changes the
process it runs in (its capability bounding set, held descriptors), so each case runs it in
a forked child that then forks the "worker", as the zygote does; both are reaped, and what
the worker saw comes back through a pipe."""

from __future__ import annotations

import _thread
import ast
import ctypes
import inspect
import io
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import brood
from brood.limits import Limits
from brood.protocol import SyncChannel, WorkerLimits
from brood.worker import confine, repl, verbs
from brood.worker.link import Link
from brood.worker.repl import Repl, StepClock
from brood.worker.runtime import Runtime
from brood.worker.verbs.base import verb_of
from brood.worker.zygote import _fork_without_hooks

SUPPORT = confine.probe()
_PR_CAPBSET_READ = 23
_PR_GET_SECUREBITS = 27


def _in_zygote_and_worker(zygote: Callable[[], None], worker: Callable[[], Any]) -> Any:
    """Fork a 'zygote' that runs `zygote` and forks a 'worker' that runs `worker`; the
    worker's result (JSON), after both are reaped."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the zygote
        code = 1
        try:
            os.close(r)
            zygote()
            # As the zygote forks: libc's fork, without the interpreter's at-fork hooks. A
            # library an earlier test loaded (OpenTelemetry's span processor) restarts its
            # thread in every os.fork() child, and a worker must start single-threaded.
            child = _fork_without_hooks()
            if child == 0:
                out: Any
                try:
                    out = {"value": worker()}
                except BaseException as exc:
                    out = {"error": f"{type(exc).__name__}: {exc}"}
                os.write(w, json.dumps(out).encode())
                os._exit(0)
            os.close(w)
            _, status = os.waitpid(child, 0)
            code = os.waitstatus_to_exitcode(status)
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, data
    result = json.loads(data)
    assert "error" not in result, result["error"]
    return result["value"]


def _open_fds() -> list[int]:
    fds = []
    for fd in range(3, 256):
        try:
            os.fstat(fd)
        except OSError:
            continue
        fds.append(fd)
    return fds


def test_a_prepared_worker_is_confined_as_one_that_did_it_all(tmp_path: Path) -> None:
    if not (SUPPORT.landlock_abi and SUPPORT.drop_caps):
        pytest.skip("needs Landlock and CAP_SETPCAP (root) to compare both ways")
    outside = tmp_path / "outside.txt"
    outside.write_text("not yours")
    (tmp_path / "scratch").mkdir()
    policy = confine.Policy(scratch=str(tmp_path / "scratch"))

    def worker() -> dict[str, Any]:
        held = confine.held_fds()
        confine.apply(policy, SUPPORT)
        libc = ctypes.CDLL(None, use_errno=True)
        try:
            with open(outside) as f:
                f.read()
            outside_read = "read"
        except PermissionError:
            outside_read = "refused"
        return {
            "held": len(held),
            "held_open_after": [fd for fd in held if fd in _open_fds()],
            "bounding": sum(libc.prctl(_PR_CAPBSET_READ, c, 0, 0, 0) == 1 for c in range(64)),
            "securebits": libc.prctl(_PR_GET_SECUREBITS, 0, 0, 0, 0),
            "outside": outside_read,
            "stdlib": os.path.getsize(os.__file__) > 0 and _readable(os.__file__),
        }

    got = _in_zygote_and_worker(lambda: confine.prepare(policy, SUPPORT), worker)
    alone = _in_zygote_and_worker(lambda: None, worker)
    assert got["held"] > 0 and alone["held"] == 0
    assert got["held_open_after"] == [], "held descriptors were left for model code"
    for key in ("bounding", "securebits", "outside", "stdlib"):
        assert got[key] == alone[key], (key, got, alone)
    assert got["bounding"] == 0 and got["outside"] == "refused" and got["stdlib"]


def _readable(path: str) -> bool:
    with open(path, "rb") as f:
        return bool(f.read(1))


def _runtime(run_id: str) -> Runtime:
    link = Link(SyncChannel(io.BytesIO(), io.BytesIO()))
    return Runtime(
        link,
        run_id=run_id,
        depth=0,
        can_spawn=True,
        clock=StepClock(),
        max_depth=2,
        limits=WorkerLimits.from_limits(Limits(max_depth=2)),
    )


def test_a_worker_that_runs_a_second_thread_is_refused_confinement(tmp_path: Path) -> None:
    (tmp_path / "scratch").mkdir()
    policy = confine.Policy(scratch=str(tmp_path / "scratch"))

    def worker() -> dict[str, Any]:
        counts = {"alone": confine._thread_count()}
        hold = _thread.allocate_lock()
        hold.acquire()
        _thread.start_new_thread(hold.acquire, ())  # a bare thread, as the link's reader
        counts["with a thread"] = confine._thread_count()
        try:
            confine.apply(policy, SUPPORT)
            counts["refused"] = ""
        except brood.ConfinementError as exc:
            counts["refused"] = str(exc)
        return counts

    got = _in_zygote_and_worker(lambda: None, worker)
    assert got["alone"] == 1 and got["with a thread"] == 2
    assert "runs 2 threads" in got["refused"]


def test_prebound_helpers_serve_one_run_and_the_next_binds_its_own() -> None:
    def worker() -> list[Any]:
        first, second = _runtime("r-first"), _runtime("r-second")
        first.namespace, second.namespace = {"in_first": 1}, {"in_second": 2}
        a, b = verbs.make_helpers(first), verbs.make_helpers(second)
        # Each set reaches its own run (SHOW_VARS reads the run's namespace), and a helper
        # bound ahead looks to the model as one bound at the start.
        return [
            a["SHOW_VARS"](),
            b["SHOW_VARS"](),
            a["rlm_query"].__name__ == b["rlm_query"].__name__ == "rlm_query",
            a["rlm_query"].__doc__ == b["rlm_query"].__doc__,
            str(inspect.signature(a["rlm_query"])) == str(inspect.signature(b["rlm_query"])),
            verb_of(a["spawn"]) is verb_of(b["spawn"]) is not None,
        ]

    got = _in_zygote_and_worker(verbs.prebind, worker)
    assert got == [{"in_first": "int"}, {"in_second": "int"}, True, True, True, True]


def test_prebuilt_builtins_go_to_one_repl_only() -> None:
    def worker() -> list[bool]:
        one = Repl({}, None, blocked=("eval",))
        two = Repl({}, None)
        b1, b2 = one.namespace["__builtins__"], two.namespace["__builtins__"]
        one.run("x = 1", None)
        return [b1 is not b2, b1["eval"] is not b2["eval"], "input" in b2, b2["len"] is len]

    assert _in_zygote_and_worker(repl.prebuild_builtins, worker) == [True, True, True, True]


def test_workers_of_one_zygote_draw_different_random_numbers(tmp_path: Path) -> None:
    code = "import random\nFINAL(str(random.getrandbits(64)))"
    model = brood.ScriptedModel(
        {
            "root": ["```repl\nFINAL(repr(rlm_query_batched(['child a', 'child b'])))\n```"],
            "child": ["```repl\n" + code + "\n```"],
        }
    )
    with brood.Supervisor(model=model, store=f"sqlite:///{tmp_path}/j.db") as sup:
        result = sup.run("root")
    assert result.state == "completed", result
    a, b = ast.literal_eval(result.answer or "")
    assert a != b

"""The cleanup contract (DESIGN.md section 6) against real processes and signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import brood
from brood.journal import Journal
from brood.supervisor import ending
from tests.util import FAST, Gate, Signal, fast, pid_alive

FENCE = "```"
# Model code for a child that ignores SIGTERM and starts a grandchild that ignores it too,
# then records both pids in the file named by `pidfile`.
STUBBORN = """import signal, subprocess, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)
gc = subprocess.Popen([sys.executable, '-c',
    'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(10**6)'])
import os
open({pidfile!r}, 'w').write(f'{{os.getpid()}} {{gc.pid}}')"""


def repl(code: str) -> str:
    return f"{FENCE}repl\n{code}\n{FENCE}"


def read_pids(path) -> list[int]:
    return [int(x) for x in path.read_text().split()]


def test_cancel_confirms_exit_of_blocked_stubborn_child_and_grandchild(tmp_path):
    pidfile = tmp_path / "pids"
    in_model = Signal(tmp_path, "in-model")
    never = Gate(tmp_path, "never")
    model = brood.ScriptedModel(
        {
            "child:": [
                repl(STUBBORN.format(pidfile=str(pidfile))),
                # The second model call announces itself and then blocks for good.
                in_model.notify_then(never.blocking_reply("unreachable")),
            ],
        }
    )
    with brood.Session(model, limits=FAST) as env:
        env.reset("root")
        env.step("h = rlm_spawn('child: stubborn')")
        in_model.wait()
        worker, grandchild = read_pids(pidfile)
        assert pid_alive(worker) and pid_alive(grandchild)
        obs = env.step("print(rlm_cancel(h), rlm_status(h))")
        assert obs.stdout.split() == ["cancelled", "cancelled"]
        # rlm_cancel returned only after both processes were gone (reaped).
        assert not pid_alive(worker)
        assert not pid_alive(grandchild)


@pytest.mark.parametrize("how", ["close", "reset"])
def test_close_or_reset_with_stubborn_children_leaves_nothing(tmp_path, how):
    signals = [Signal(tmp_path, f"s{i}") for i in range(3)]
    never = Gate(tmp_path, "never")
    pidfiles = [tmp_path / f"pids{i}" for i in range(3)]
    model = brood.ScriptedModel(
        {
            f"child {i}:": [
                repl(STUBBORN.format(pidfile=str(pidfiles[i]))),
                signals[i].notify_then(never.blocking_reply("x")),
            ]
            for i in range(3)
        }
    )
    env = brood.Session(model, limits=FAST)
    env.reset("root")
    env.step("hs = [rlm_spawn(f'child {i}: stubborn') for i in range(3)]")
    for s in signals:
        s.wait()
    pids = [p for f in pidfiles for p in read_pids(f)]
    assert all(pid_alive(p) for p in pids)
    if how == "reset":
        env.reset("a new episode")
        assert not any(pid_alive(p) for p in pids)
    env.close()
    assert not any(pid_alive(p) for p in pids)


def test_a_callback_that_blocks_or_raises_does_not_stop_cleanup(tmp_path):
    release = threading.Event()
    seen = []

    def blocking_start(info):
        seen.append(info.run_id)
        release.wait(30)

    def raising_end(info):
        raise RuntimeError("observer bug")

    model = brood.ScriptedModel(
        {
            "root": [
                repl("h = rlm_spawn('child: loop')\nprint(rlm_status(h))"),
                repl("FINAL('root done')"),
            ],
            "child:": [repl("import time\nwhile True:\n    time.sleep(1)")],
        }
    )
    with brood.Supervisor(model, limits=FAST, on_start=blocking_start, on_end=raising_end) as sup:
        result = sup.run("root")
        assert result.answer == "root done"
        runs = sup.store.runs(result.run_id)
        assert {r["state"] for r in runs} == {"completed", "cancelled"}
    release.set()
    assert seen  # the blocking callback ran (and was still blocked while cleanup went on)


def test_sigkill_of_a_worker_fails_its_run_and_cancels_its_subtree(tmp_path):
    pidfile = tmp_path / "pid"
    grandchild_running = Signal(tmp_path, "gc")
    never = Gate(tmp_path, "never")
    model = brood.ScriptedModel(
        {
            "child:": [
                repl(
                    f"import os\nopen({str(pidfile)!r}, 'w').write(str(os.getpid()))\n"
                    "g = rlm_spawn('grandchild: block')\nrlm_wait(g)"
                )
            ],
            "grandchild:": [grandchild_running.notify_then(never.blocking_reply("x"))],
        }
    )
    with brood.Session(model, limits=FAST) as env:
        env.reset("root")
        env.step("h = rlm_spawn('child: parent of one')")
        grandchild_running.wait()
        os.kill(read_pids(pidfile)[0], signal.SIGKILL)
        obs = env.step("try:\n    rlm_wait(h)\nexcept ChildFailed as e:\n    print(e.reason)")
        assert obs.stdout.strip() == "worker exited with signal 9"
        store = env._engine.store
        (grandchild,) = [r for r in store.runs(env.run_id) if r["depth"] == 2]
        assert grandchild["state"] == "cancelled"
        assert grandchild["reason"] == "parent failed"


def test_depth_three_tree_completes_with_one_slot():
    model = brood.ScriptedModel(
        {
            "root": [repl("FINAL('root<' + rlm_query('child: go') + '>')")],
            "child:": [
                repl(
                    "FINAL('child<' + ','.join(rlm_query_batched("
                    "['grandchild: a', 'grandchild: b'])) + '>')"
                )
            ],
            "grandchild: a": [repl("FINAL('a')")],
            "grandchild: b": [repl("FINAL('b')")],
        }
    )
    with brood.Supervisor(model, limits=fast(max_depth=3, max_concurrency=1)) as sup:
        assert sup.run("root").answer == "root<child<a,b>>"


def test_at_max_depth_rlm_query_is_a_plain_call_and_the_model_is_told():
    model = brood.ScriptedModel(
        {
            "root": [repl("print(rlm_query('leaf question'))"), repl("FINAL('ok')")],
            "leaf question": ["plain answer"],
        }
    )
    with brood.Session(model, limits=fast(max_depth=1)) as env:
        env.reset("root")
        obs = env.step("print(rlm_query('leaf question'))")
        assert obs.stdout.strip() == "plain answer"
        assert "rlm_query answers with a plain model call" in obs.stderr
        assert env.children() == []


def test_a_stuck_worker_is_quarantined_loudly_and_other_trees_are_still_served(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(ending, "KILL_CONFIRM_S", 0.3)
    monkeypatch.setattr(ending, "QUARANTINE_RETRY_S", 0.1)
    url = f"sqlite:///{tmp_path}/j.db"
    started = Signal(tmp_path, "started")
    never = Gate(tmp_path, "never")
    model = brood.ScriptedModel(
        {
            "stuck": [started.notify_then(never.blocking_reply("x"))],
            "healthy": [repl("FINAL('served')")],
        }
    )
    sup = brood.Supervisor(model, limits=FAST, store=url)
    h = sup.spawn("stuck")
    started.wait()
    zygote = sup._engine.backend._zygote
    os.kill(zygote.pid, signal.SIGSTOP)  # nothing can be reaped, so no exit is confirmed
    try:
        assert h.cancel() == "cancelled"  # the run ends; its cleanup failed
        ps = cli("ps", "--store", url, "--json")
        assert [r["quarantined"] for r in ps if r["run_id"] == h.id] == [1]
        (q,) = cli("doctor", "--store", url, "--json")["quarantined"]
        assert q["run_id"] == h.id and q["present"], q
        assert "could not be confirmed" in q["error"]
    finally:
        os.kill(zygote.pid, signal.SIGCONT)
    assert sup.run("healthy").answer == "served"  # the supervisor goes on serving
    with Journal(url) as journal:
        deadline = time.monotonic() + 60
        while journal.quarantined():  # its group is killed again until its exit is confirmed
            assert time.monotonic() < deadline, journal.quarantined()
            sup.store.flush()
        assert [e["kind"] for e in journal.events(h.id) if e["kind"] in KINDS] == KINDS
    with pytest.raises(brood.ChildCleanupError) as info:
        sup.close()  # the failure is still said at close
    assert info.value.pids


KINDS = ["quarantined", "released"]


def cli(*args: str) -> Any:
    out = subprocess.run(
        [sys.executable, "-m", "brood.cli.main", *args], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_child_cleanup_error_keeps_the_answer(tmp_path, monkeypatch):
    monkeypatch.setattr(ending, "KILL_CONFIRM_S", 0.3)
    model = brood.ScriptedModel({"root": [repl("FINAL('the answer')")]})
    sup = brood.Supervisor(model, limits=FAST)
    zygote = sup._engine.backend._zygote
    os.kill(zygote.pid, signal.SIGSTOP)
    try:
        result = sup.run("root")
    finally:
        os.kill(zygote.pid, signal.SIGCONT)
    assert result.answer == "the answer"
    with pytest.raises(brood.ChildCleanupError) as info:
        sup.close()
    assert info.value.answer == "the answer"


def test_startup_sweep_kills_processes_of_a_dead_supervisor(tmp_path):
    """A supervisor and its zygote die by SIGKILL; the grandchild its model code started is
    left, and so are the folder of its workers' scratch directories and the folder of its
    control socket. The next supervisor's start-up sweep finds the grandchild by its owner
    token and kills it, and removes the folders its owner record names."""
    import subprocess
    import sys
    import textwrap

    pidfile = tmp_path / "gc"
    ready = Signal(tmp_path, "ready")
    script = textwrap.dedent(f"""
        import brood, signal
        code = (
            "import subprocess, sys\\n"
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(10**6)'])\\n"
            "open({str(pidfile)!r}, 'w').write(str(p.pid))\\n"
            + {ready.code!r}
        )
        m = brood.ScriptedModel({{"root": ["```repl\\n" + code + "\\n```", "```repl\\n"
                                          + {Gate(tmp_path, "never").wait_code!r} + "\\n```"]}})
        sup = brood.Supervisor(m, limits=brood.Limits(fs_write=[{str(tmp_path)!r}]))
        sup.spawn("root")
        engine = sup._engine
        print(engine.backend._zygote.pid, engine.backend.scratch_root, engine.control.path,
              flush=True)
        signal.pause()
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    zygote, scratch_root, control = proc.stdout.readline().split()
    zygote_pid = int(zygote)
    ready.wait()
    grandchild = int(pidfile.read_text())
    os.kill(zygote_pid, signal.SIGKILL)
    proc.kill()
    proc.wait()
    proc.stdout.close()
    assert pid_alive(grandchild)  # orphaned: nobody is left to clean it up
    assert os.path.isdir(scratch_root) and os.path.exists(control)
    with brood.Supervisor(brood.ScriptedModel([]), limits=FAST):
        assert not pid_alive(grandchild)
        assert not os.path.exists(scratch_root)  # its workers' scratch folder went too
        assert not os.path.exists(os.path.dirname(control))  # and its socket and key


def test_the_sweep_removes_only_a_dead_supervisors_own_folders(tmp_path):
    """A record of a gone supervisor names its scratch and control folders: removed. A live
    one's, a folder not of brood's name (or of the other key's name), and a link of brood's
    name are left alone."""
    from brood.backends.owners import (
        CONTROL_PREFIX,
        SCRATCH_PREFIX,
        pid_namespace,
        record_folder,
        registry_dir,
        start_time,
        sweep_orphans,
    )

    registry = registry_dir()
    assert registry is not None

    def folder(name: str) -> str:
        path = tmp_path / name
        (path / "123").mkdir(parents=True)
        (path / "123" / "left").write_text("a run's file")
        return str(path)

    def record(mark: str, scratch: str, *, alive: bool, control: str | None = None) -> None:
        start = start_time(os.getpid()) if alive else "not-this-start"
        data = {"pid": os.getpid(), "start": start, "pidns": pid_namespace(), "scratch": scratch}
        (Path(registry) / mark).write_text(json.dumps(data))
        if control is not None:
            record_folder(mark, "control", control)

    dead = folder(SCRATCH_PREFIX + "dead")
    live = folder(SCRATCH_PREFIX + "live")
    other = folder("not-brood")
    target = folder("kept")
    link = str(tmp_path / (SCRATCH_PREFIX + "link"))
    os.symlink(target, link)
    dead_control = folder(CONTROL_PREFIX + "dead")
    live_control = folder(CONTROL_PREFIX + "live")
    wrong_key = folder(CONTROL_PREFIX + "as-scratch")
    record("a" * 32, dead, alive=False, control=dead_control)
    record("b" * 32, live, alive=True, control=live_control)
    record("c" * 32, other, alive=False, control=str(tmp_path / "not-brood"))
    record("d" * 32, link, alive=False)
    record("e" * 32, wrong_key, alive=False)
    sweep_orphans()
    assert not os.path.exists(dead) and not os.path.exists(dead_control)
    assert os.path.isdir(live) and os.path.isdir(live_control) and os.path.isdir(other)
    assert os.path.islink(link) and os.path.isdir(wrong_key)
    assert (Path(target) / "123" / "left").exists()
    assert sorted(os.listdir(registry)) == ["b" * 32]  # the dead ones' records went


# Model code that shuts its end of the channel for writing (the supervisor reads its end's
# close) and goes on living, with no step clock to end it.
HALF_CLOSE = """import os, socket, stat, time
channel = [f for f in range(64) if _is_socket(f)]
socket.socket(fileno=os.dup(channel[0])).shutdown(socket.SHUT_WR)
time.sleep(600)"""
IS_SOCKET = """import os, stat
def _is_socket(f):
    try:
        return stat.S_ISSOCK(os.fstat(f).st_mode)
    except OSError:
        return False"""


def test_a_worker_that_closes_its_channel_and_lives_on_ends_at_once_as_connection_lost():
    model = brood.ScriptedModel({"root": [repl(IS_SOCKET), repl(HALF_CLOSE)]})
    limits = fast(step_timeout=None)
    with brood.Supervisor(model, limits=limits) as sup:
        result = sup.run("root", timeout=120)
    assert result.state == "failed", result
    assert result.error.startswith("worker connection lost"), result


def test_a_session_holds_nothing_of_the_episodes_it_ended():
    """A supervisor that runs episode after episode (a Session, an OpenEnv server) does not
    keep the runs of ended episodes, nor their workers' connections (the journal keeps
    them), so its memory does not grow with every episode. (A run's connection is let go
    once its worker's end of it is read, a moment after the exit is confirmed.)"""
    import gc

    from brood.backends.base import WorkerConn
    from brood.supervisor.runs import Run

    def held() -> tuple[set[str], int]:
        gc.collect()
        objects = gc.get_objects()
        runs = {o.id for o in objects if isinstance(o, Run)}
        return runs, sum(isinstance(o, WorkerConn) for o in objects)

    def settled(ended: list[str]) -> tuple[set[str], int]:
        """What is held once no run of an ended episode is (bounded: a failure, not a pace)."""
        pause = threading.Event()
        for _ in range(250):
            runs, conns = held()
            if not runs & set(ended):
                return runs, conns
            pause.wait(0.02)
        raise AssertionError(f"runs of ended episodes held: {runs & set(ended)}")

    model = brood.ScriptedModel({"child": [repl("FINAL('c')")]})
    with brood.Session(model, limits=FAST) as env:
        ended: list[str] = []

        def episodes(n: int) -> None:
            for i in range(n):
                env.reset(f"episode {i}")
                obs = env.step("print(rlm_query('child task'))")
                assert obs.stdout == "c\n"
                ended.extend([env.run_id or "", obs.children[0]["id"]])
            env.reset("the last")

        episodes(3)
        runs, conns = settled(ended)
        assert runs == {env.run_id}
        episodes(6)
        runs, more_conns = settled(ended)
        assert runs == {env.run_id}
        assert more_conns < conns + 6  # the warm pool, the live root: not one per run (12)

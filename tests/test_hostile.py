"""Hostile and careless model code that must not hang, poison or kill the host: a step that
defeats its timeout, a step that kills its host at every replay, huge output, a killed
zygote. Each case ends with the supervisor still serving and nothing left running."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys

import psutil
import pytest

import brood
from brood.backends.owners import OWNER_ENV, sweep_orphans
from brood.journal import Journal
from tests.test_resume import repl, wait_gone
from tests.trust_util import coder, limits, still_serves, task
from tests.util import Gate, Signal

# A busy loop whose bare `except:` swallows StepTimeout, and one that disarms the step clock.
SWALLOWED = """while True:
    try:
        while True:
            pass
    except:
        pass
"""
DISARMED = """import signal
signal.setitimer(signal.ITIMER_REAL, 0)
while True:
    pass
"""


@pytest.fixture
def store(tmp_path) -> str:
    return f"sqlite:///{tmp_path}/j.db"


@pytest.mark.parametrize("code", [SWALLOWED, DISARMED], ids=["bare-except", "setitimer-0"])
def test_a_step_that_defeats_its_timeout_is_ended_from_outside(store, code):
    lim = limits(step_timeout=0.5, step_grace=0.5)
    with brood.Supervisor(coder, limits=lim, store=store) as sup:
        result = sup.run(task(code))  # a root with no timeout of its own
        assert result.state == "failed", result
        assert result.error.startswith("step timeout ignored: step 1"), result.error
        assert "Limits.step_grace" in result.error
        still_serves(sup, store, result.run_id)


def test_waits_on_children_do_not_count_on_the_supervisors_clock(store):
    """A step that waits on a child longer than its timeout is not ended: only compute
    counts, on both clocks."""
    lim = limits(step_timeout=0.3, step_grace=0.2)
    code = "import time\nh = rlm_spawn(task_of_child)\nprint(rlm_wait(h))\nFINAL('waited')"
    child = task("import time\ntime.sleep(1.5)\nFINAL('slept')")
    with brood.Supervisor(coder, limits=lim, store=store) as sup:
        result = sup.run(task(f"task_of_child = {child!r}\n" + code))
        assert (result.state, result.answer) == ("completed", "waited"), result


def test_session_step_timeout_bounds_a_step_even_when_disarmed(store):
    lim = limits(step_timeout=None, step_grace=0.3)
    with brood.Session(coder, limits=lim, store=store) as env:
        env.reset("drive")
        ok = env.step("print('fine')", timeout=5)
        assert ok.stdout.strip() == "fine" and not ok.done
        obs = env.step(DISARMED, timeout=0.3)
        assert obs.done, obs
        assert "step timeout ignored: step 2" in obs.error, obs.error
        env.reset("again")  # the session goes on with a new episode
        assert env.step("print(2 + 2)").stdout.strip() == "4"
        with pytest.raises(brood.InvalidArgument, match="timeout"):
            env.step("1", timeout=float("nan"))


def test_session_step_timeout_ends_the_step_with_step_timeout(store):
    with brood.Session(coder, limits=limits(step_timeout=None), store=store) as env:
        env.reset("drive")
        obs = env.step("while True:\n    pass", timeout=0.2)
        assert not obs.done and obs.error.startswith("StepTimeout"), obs
        assert json.loads(env.step("import json\nprint(json.dumps(7))").stdout) == 7


# ---- ownership: the sweep kills only what it can prove is a leftover ------------------------
def _dead_mark() -> str:
    """The owner mark of a supervisor that is gone: recorded by a process that then exits."""
    code = "from brood.backends.owners import register_owner; print(register_owner())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return done.stdout.strip()


def _in_other_pid_namespace(mark: str) -> tuple[subprocess.Popen[bytes], int] | None:
    """A process carrying `mark` in a new PID namespace (the `unshare` wrapper itself does
    not carry it); None where this test may not make one."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    flags = ["--pid", "--fork"] if os.getuid() == 0 else ["-Urp", "--fork"]
    inner = ["env", f"{OWNER_ENV}={mark}", "sh", "-c", "echo ready; exec sleep 600"]
    proc = subprocess.Popen(
        [unshare, *flags, *inner], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    assert proc.stdout is not None
    if proc.stdout.readline() != b"ready\n":  # unshare refused (no user namespaces here)
        proc.wait()
        proc.stdout.close()
        return None
    # `env` execs `sh`, which execs `sleep`: one process, whatever its name is by now.
    inside = [c.pid for c in psutil.Process(proc.pid).children()]
    if not inside:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        return None
    return proc, inside[0]


def test_the_sweep_leaves_other_users_and_other_namespaces_alone():
    mark = _dead_mark()
    env = dict(os.environ, **{OWNER_ENV: mark})
    sleeper = ["sleep", "600"]
    own = subprocess.Popen(sleeper, env=env, start_new_session=True)
    others: list[subprocess.Popen[bytes]] = []
    spared: dict[str, int] = {}
    try:
        if os.getuid() == 0:
            other_user = subprocess.Popen(sleeper, env=env, user=65534, start_new_session=True)
            others.append(other_user)
            spared["another user (uid 65534)"] = other_user.pid
        else:
            print("not root: no process of another user can be made; that case is not run")
        made = _in_other_pid_namespace(mark)
        if made is None:
            print("unshare cannot make a PID namespace here; that case is not run")
        else:
            others.append(made[0])
            spared["another PID namespace"] = made[1]
        killed = sweep_orphans()
        assert own.wait(30) == -signal.SIGKILL  # a provable leftover: swept
        assert own.pid in killed
        for what, pid in spared.items():
            assert pid not in killed, f"the sweep killed a process of {what}"
            assert psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie", what
    finally:
        for pid in spared.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for proc in [own, *others]:
            proc.kill()
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()


def test_a_mark_this_hosts_brood_did_not_make_is_never_swept():
    env = dict(os.environ, **{OWNER_ENV: "0" * 32})  # no record: some other tool's variable
    stale = subprocess.Popen(["sleep", "600"], env=env, start_new_session=True)
    try:
        assert stale.pid not in sweep_orphans()
        assert stale.poll() is None
    finally:
        stale.kill()
        stale.wait()


def test_model_code_finds_no_pid_in_its_owner_mark(store):
    code = "import os, json\nFINAL(json.dumps([os.environ['BROOD_OWNER'], os.getppid()]))"
    with brood.Supervisor(coder, limits=limits(), store=store) as sup:
        result = sup.run(task(code))
        mark, zygote = json.loads(result.answer)
        assert len(mark) == 32 and set(mark) <= set("0123456789abcdef"), mark
        assert str(os.getpid()) not in mark and str(zygote) not in mark


# ---- poison steps ---------------------------------------------------------------------------
POISON_HOST = """
import sys, brood
root_code, child_code, url, files, resume = sys.argv[1:6]
model = brood.ScriptedModel({"root": [root_code], "poison": [child_code]})
sup = brood.Supervisor(model, store=url, limits=brood.Limits(
    shutdown_grace=0.3, term_grace=0.3, fs_write=[files]))
handle = sup.resume(resume) if resume != "-" else sup.spawn("root task")
print(handle.id, flush=True)
import signal; signal.pause()
"""


def _host_dies_in_the_step(tmp_path, url: str, resume: str, in_step: Signal) -> str:
    """Run (or resume) the tree in another process, SIGKILL that process once the poison
    step runs, and return the root's id."""
    root = repl(
        "try:\n    r = rlm_query('poison child: kills its host')\n"
        "except Exception as e:\n    r = 'the child failed: ' + str(e)\nFINAL(r)"
    )
    child = repl(f"{in_step.code}\nopen({str(tmp_path / 'never')!r}).read()")
    args = [root, child, url, str(tmp_path), resume]
    proc = subprocess.Popen(
        [sys.executable, "-c", POISON_HOST, *args], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        root_id = proc.stdout.readline().strip()
        in_step.wait()
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    wait_gone(proc.pid)
    return root_id


def test_a_step_that_killed_its_host_twice_is_not_replayed_a_third_time(tmp_path):
    url = f"sqlite:///{tmp_path}/j.db"
    os.mkfifo(tmp_path / "never")
    in_step = Signal(tmp_path, "in-step")
    root_id = _host_dies_in_the_step(tmp_path, url, "-", in_step)
    assert _host_dies_in_the_step(tmp_path, url, root_id, in_step) == root_id  # resumed once
    with brood.Supervisor(coder, store=url, limits=limits()) as sup:  # replays only
        result = sup.resume(root_id).wait_result()
    assert result.state == "completed", result
    assert result.answer.startswith("the child failed"), result.answer
    with Journal(url) as journal:
        child = next(r for r in journal.tree(root_id)["children"])
        assert child["state"] == "failed"
        assert child["reason"].startswith("step 1 was under way each time its host process died")
        begun = journal.store.events(child["id"], "step_begun")
        assert [e["data"]["step"] for e in begun] == [1, 1]


# ---- the journal fails loudly ---------------------------------------------------------------
def _break_mid_step(tmp_path, url: str, brk) -> str:
    """Start a root whose step waits at a gate, break the journal with `brk()` while it
    waits, open the gate: the run must end at once with the StoreError, new work be refused,
    and close() stop everything and then raise the StoreError."""
    gate, in_step = Gate(tmp_path, "gate"), Signal(tmp_path, "in-step")
    code = f"{in_step.code}\n{gate.wait_code}\nprint('after the break')\nFINAL('done')"
    lim = limits(fs_write=(str(tmp_path),))
    sup = brood.Supervisor(coder, limits=lim, store=url)
    try:
        handle = sup.spawn(task(code))
        in_step.wait()
        brk()
        gate.open()
        result = handle.wait_result(timeout=30)  # a bound on a hang, not a pace
        assert result.state == "failed", result
        assert result.error.startswith("StoreError: "), result.error
        with pytest.raises(brood.StoreError):
            handle.wait()
        with pytest.raises(brood.StoreError, match="refuses new work"):
            sup.spawn("trivial task")
    finally:
        with pytest.raises(brood.StoreError):
            sup.close()
    return result.error


def test_a_journal_deleted_mid_run_ends_the_run_with_a_store_error(tmp_path):
    path = tmp_path / "j.db"
    error = _break_mid_step(tmp_path, f"sqlite:///{path}", lambda: path.unlink())
    assert "was deleted" in error, error


def test_a_journal_replaced_mid_run_ends_the_run_with_a_store_error(tmp_path):
    path = tmp_path / "j.db"

    def replace() -> None:
        shutil.copy(path, tmp_path / "copy.db")
        os.replace(tmp_path / "copy.db", path)

    error = _break_mid_step(tmp_path, f"sqlite:///{path}", replace)
    assert "replaced by another file" in error, error


def test_a_corrupted_journal_ends_the_run_with_a_store_error(tmp_path):
    path = tmp_path / "j.db"

    def corrupt() -> None:
        for name in (path, tmp_path / "j.db-wal", tmp_path / "j.db-shm"):
            size = os.path.getsize(name)
            with open(name, "r+b") as f:  # the same file, its bytes garbage
                f.write(os.urandom(size))

    _break_mid_step(tmp_path, f"sqlite:///{path}", corrupt)


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB filesystem (tmpfs), or a skip saying why none can be mounted here."""
    disk = tmp_path / "disk"
    disk.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small filesystem here: {done.stderr.strip()}")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=True)


def test_a_disk_filled_by_model_code_ends_the_run_with_a_store_error(tmp_path, small_disk):
    fill = (
        f"import os\nf = open({str(small_disk / 'fill')!r}, 'wb')\n"
        "try:\n    while True:\n        f.write(b'x' * 65536); f.flush()\n"
        "except OSError as e:\n    print('disk full:', e)\n"
        "print('x' * 100000)\nFINAL('filled')"
    )
    url = f"sqlite:///{small_disk}/j.db"
    lim = limits(fs_write=(str(small_disk),))
    sup = brood.Supervisor(coder, limits=lim, store=url)
    try:
        result = sup.run(task(fill))
        assert result.state == "failed", result
        assert result.error.startswith("StoreError: "), result.error
        assert "full" in result.error, result.error
    finally:
        with pytest.raises(brood.StoreError):
            sup.close()


# ---- output and messages are bounded where they are made -----------------------------------
PRINT_HOST = """
import json, resource, sys, brood
code = sys.argv[1]
model = brood.ScriptedModel({"print": [code]})
with brood.Supervisor(model, store=sys.argv[2], limits=brood.Limits(
        shutdown_grace=0.3, term_grace=0.3, worker_memory=None)) as sup:
    sup.run("print warm-up")  # the supervisor's own first-use costs, before the baseline
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = sup.run("print a gigabyte")
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps([result.state, result.answer, before * 1024, after * 1024]))
"""


def test_a_gigabyte_print_leaves_the_supervisors_memory_flat(tmp_path):
    code = repl("for _ in range(1024):\n    print('x' * (1 << 20))\nFINAL('printed')")
    url = f"sqlite:///{tmp_path}/j.db"
    done = subprocess.run(
        [sys.executable, "-c", PRINT_HOST, code, url],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    state, answer, before, after = json.loads(done.stdout.splitlines()[-1])
    assert (state, answer) == ("completed", "printed")
    grew = after - before
    print(f"supervisor peak RSS {before / 2**20:.0f} MiB -> {after / 2**20:.0f} MiB")
    assert grew < 64 * 2**20, f"the supervisor's peak memory grew {grew / 2**20:.0f} MiB"
    with Journal(url) as journal:
        (step,) = [
            s
            for r in journal.roots(2)
            if r["prompt"].startswith("print a")
            for s in journal.steps(r["id"])
        ]
    assert "characters of output dropped" in step["stdout"]
    assert len(step["stdout"]) < 2 * 4_000_000


def test_a_context_over_the_message_cap_fails_the_call_saying_so(store):
    code = (
        "try:\n    rlm_query('child', context='x' * (65 * 2**20))\n"
        "except Exception as e:\n    FINAL(f'{type(e).__name__}: {e}')"
    )
    with brood.Supervisor(coder, limits=limits(), store=store) as sup:
        result = sup.run(task(code))
        assert result.state == "completed", result
        assert result.answer.startswith("InvalidArgument: the request is"), result.answer
        assert "bytes, over the 67108864-byte bound of one message" in result.answer
        still_serves(sup, store, result.run_id)


def test_an_answer_over_the_message_cap_fails_the_run_saying_so(store):
    lim = limits(answer_limit=100_000_000)  # the answer cap would let it through
    with brood.Supervisor(coder, limits=lim, store=store) as sup:
        result = sup.run(task("FINAL('x' * (65 * 2**20))"))
        assert result.state == "failed", result
        assert "Final of 68,157,4" in result.error, result.error
        assert "over the 67,108,864-byte cap of one message" in result.error
        still_serves(sup, store, result.run_id)


# ---- a lost zygote is replaced --------------------------------------------------------------
KILL_ZYGOTE = "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nFINAL('killed it')"


def test_confined_model_code_cannot_signal_its_zygote(store):
    with brood.Supervisor(coder, limits=limits(), store=store) as sup:
        code = "import os\ntry:\n    os.kill(os.getppid(), 9)\n"
        code += "except OSError as e:\n    FINAL(repr(e))"
        result = sup.run(task(code))
        assert result.answer.startswith("PermissionError"), result


def test_a_zygote_killed_from_a_step_is_replaced(store, tmp_path):
    """Unconfined (trusted) model code can kill its zygote: a new one takes over."""
    gate, in_step = Gate(tmp_path, "gate"), Signal(tmp_path, "in-step")
    other = task(f"{in_step.code}\n{gate.wait_code}\nFINAL('the other tree')")
    killer = task(KILL_ZYGOTE)
    with brood.Supervisor(coder, limits=limits(confine=False), store=store) as sup:
        waiting = sup.spawn(other)
        in_step.wait()
        result = sup.run(killer)
        # Its worker talks to the supervisor directly: the run that killed the zygote ends.
        assert (result.state, result.answer) == ("completed", "killed it"), result
        gate.open()
        assert waiting.wait(timeout=60) == "the other tree"  # a bound on a hang, not a pace
        for _ in range(3):  # later trees are served by the new zygote
            still_serves(sup, store, result.run_id)
    with Journal(store) as journal:
        (event,) = journal.store.events(waiting.id, "zygote_lost")
    assert event["data"]["exit"] == "signal 9" and event["data"]["replaced"]


# ---- the memory of waiting parents is visible -----------------------------------------------
def test_ps_and_statistics_show_live_workers_and_their_memory(store, tmp_path):
    gate, in_child = Gate(tmp_path, "gate"), Signal(tmp_path, "in-child")
    child = task(f"{in_child.code}\n{gate.wait_code}\nFINAL('child')")
    parent = task(f"FINAL(rlm_query({child!r}))")
    with brood.Supervisor(coder, limits=limits(fs_write=(str(tmp_path),)), store=store) as sup:
        handle = sup.spawn(parent)
        in_child.wait()
        stats = sup.statistics()["workers"]
        assert stats["runs"] == 2 and stats["memory_bytes"] > 0, stats  # the parent waits
        done = subprocess.run(
            [sys.executable, "-m", "brood.cli.main", "ps", "--json", "--store", store],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        (row,) = json.loads(done.stdout)
        assert row["run_id"] == handle.id
        assert row["workers"] == 2 and row["memory_bytes"] > 2**20, row
        gate.open()
        assert handle.wait(timeout=60) == "child"


def test_a_zygote_that_cannot_be_replaced_fails_new_runs_saying_so(store, monkeypatch):
    from brood.backends.local import LocalBackend
    from brood.errors import BackendError

    with brood.Supervisor(coder, limits=limits(), store=store) as sup:
        assert sup.run("trivial task").answer == "alive"

        async def refuse(self) -> None:
            raise BackendError("no zygote today")

        monkeypatch.setattr(LocalBackend, "_start_zygote", refuse)
        zygote = sup._engine.backend._zygote
        os.kill(zygote.pid, signal.SIGKILL)
        zygote.wait()
        result = sup.run("trivial task")  # never a hang
        assert result.state == "failed", result
        assert "another could not start: no zygote today" in result.error, result.error


def test_a_worker_that_closes_its_connection_fails_its_run_at_once(store):
    # What a model that read brood's source could do: hang up, and keep the reader thread
    # from ending the process when the supervisor hangs up too.
    code = (
        "import gc, socket\nfrom brood.worker.link import Link\n"
        "link = next(o for o in gc.get_objects() if isinstance(o, Link))\n"
        "import os, threading\nos._exit = lambda status: threading.Event().wait()\n"
        "link.chan._w._sock.shutdown(socket.SHUT_WR)\n"
        "while True:\n    pass\n"
    )
    with brood.Supervisor(coder, limits=limits(step_timeout=None), store=store) as sup:
        result = sup.run(task(code), timeout=60)  # the root timeout only bounds a failure
        assert result.state == "failed", result
        assert result.error.startswith("worker connection lost"), result.error
        still_serves(sup, store, result.run_id)


def test_a_child_whose_journal_insert_fails_is_not_left_queued(store):
    from concurrent.futures import Future

    code = (
        "try:\n    rlm_spawn('child refused')\n"
        "except Exception as e:\n    FINAL(type(e).__name__ + ': ' + str(e))"
    )
    with brood.Supervisor(coder, limits=limits(), store=store) as sup:
        real = sup.store.insert_run

        def insert_run(rec, *args, **kw):
            if rec.prompt == "child refused":  # a write the journal refuses
                fut: Future = Future()
                fut.set_exception(brood.StoreError("journal write failed: refused"))
                return fut
            return real(rec, *args, **kw)

        sup.store.insert_run = insert_run
        result = sup.run(task(code))
        assert result.answer == "StoreError: journal write failed: refused", result
        assert sup.statistics()["runs"] == {"completed": 1}  # nothing queued, nothing counted
        still_serves(sup, store, result.run_id)

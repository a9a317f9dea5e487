"""Kernel confinement of workers: each case forks a child that confines itself and tries
something, reports the outcome through a pipe, and is reaped before the case ends."""

from __future__ import annotations

import ctypes
import errno
import gc
import json
import os
import resource
import signal
import socket
import struct
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

import brood
from brood.backends.confinement import policy_of
from brood.errors import ConfinementError
from brood.worker import disk
from brood.worker.confine import (
    CGROUP_HEADROOM,
    SCRATCH_WATCHED,
    Policy,
    Support,
    apply,
    cgroup_enter,
    cgroup_kill,
    cgroup_oom_kills,
    cgroup_parent,
    cgroup_remove,
    cgroup_remove_parent,
    default_read_paths,
    enter_private_network,
    gaps,
    probe,
    scratch_bound,
    seccomp_program,
)

SUPPORT = probe()
NOBODY = 65534
_PR_SET_DUMPABLE = 4
STDLIB_FILE = os.path.join(sysconfig.get_paths()["stdlib"], "os.py")
_PTRACE_SEIZE = 0x4206  # attaches without stopping the tracee, should the refusal fail
_CAP_SYS_RESOURCE = 24


def _has_capability(cap: int) -> bool:
    with open("/proc/self/status") as f:
        eff = next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))
    return bool(eff >> cap & 1)


class Outcome(msgspec.Struct):
    ok: bool
    value: Any = None
    error: str = ""  # exception class name
    errno: int | None = None
    message: str = ""


def _attempt(confine: Callable[[], object], action: Callable[[], Any]) -> Outcome:
    """Confine this (forked) process, then try `action`; what happened, as an Outcome."""
    try:
        confine()
        return Outcome(ok=True, value=action())
    except BaseException as exc:
        return Outcome(
            ok=False,
            error=type(exc).__name__,
            errno=getattr(exc, "errno", None),
            message=str(exc),
        )


def _report(fd: int, outcome: Outcome) -> None:
    data = msgspec.json.encode(outcome)
    while data:
        data = data[os.write(fd, data) :]


def run_child(
    policy: Policy | None,
    action: Callable[[], Any],
    *,
    support: Support = SUPPORT,
) -> tuple[Outcome | None, int]:
    """Fork; the child applies `policy` (if any) then runs `action`. Returns the child's
    outcome (None if it died before reporting) and its wait status, after reaping it."""
    # What earlier tests left in reference cycles is collected first: a TracerProvider
    # that was shut down runs its fork hook until then, on threads of its own in the
    # child, and `apply` rightly refuses a process that runs a second thread.
    gc.collect()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        code = 0
        try:
            os.close(r)
            _report(w, _attempt(lambda: apply(policy, support) if policy else None, action))
        except BaseException:
            code = 70
        finally:
            os._exit(code)
    os.close(w)
    chunks = []
    with os.fdopen(r, "rb") as f:
        while chunk := f.read():
            chunks.append(chunk)
    _, status = os.waitpid(pid, 0)
    data = b"".join(chunks)
    return (msgspec.json.decode(data, type=Outcome) if data else None), status


def outcome_of(policy: Policy | None, action: Callable[[], Any], **kw: Any) -> Outcome:
    outcome, status = run_child(policy, action, **kw)
    assert outcome is not None, f"child died before reporting (status {status})"
    assert os.waitstatus_to_exitcode(status) == 0
    return outcome


def assert_refused(outcome: Outcome, err: int = errno.EACCES) -> None:
    assert not outcome.ok, f"expected a refusal, got {outcome.value!r}"
    assert outcome.errno == err, outcome


def require(ok: bool, policy: Policy, *, private_network: bool = False) -> None:
    if not ok:
        why = gaps(policy, SUPPORT, private_network=private_network)
        pytest.skip("; ".join(why) or "this machine lacks the mechanism")


@pytest.fixture
def scratch(tmp_path: Path) -> Path:
    path = tmp_path / "scratch"
    path.mkdir()
    return path


@pytest.fixture
def listener() -> Iterator[tuple[str, int]]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)  # connects complete in the backlog; nobody needs to accept
    try:
        yield sock.getsockname()
    finally:
        sock.close()


def read(path: str | Path) -> int:
    with open(path, "rb") as f:
        return len(f.read(64))


def write(path: str | Path) -> int:
    Path(path).write_text("hi")
    return 2


def connect(addr: tuple[str, int]) -> str:
    with socket.create_connection(addr, timeout=5):
        return "connected"


# ---- files --------------------------------------------------------------------------------
def test_secrets_and_proc_are_refused(scratch: Path) -> None:
    policy = Policy(scratch=str(scratch))
    require(SUPPORT.landlock_abi >= 1, policy)
    assert_refused(outcome_of(policy, lambda: read("/etc/shadow")))
    assert_refused(outcome_of(policy, lambda: read("/proc/1/environ")))


def test_stdlib_is_readable_and_python_imports_work(scratch: Path) -> None:
    policy = Policy(scratch=str(scratch))
    require(SUPPORT.landlock_abi >= 1, policy)

    def action() -> int:
        import decimal  # a stdlib import after confinement, from disk

        return read(STDLIB_FILE) + int(decimal.Decimal("1"))

    assert outcome_of(policy, action).value == 65


def test_writes_go_to_scratch_only(scratch: Path, tmp_path: Path) -> None:
    policy = Policy(scratch=str(scratch))
    require(SUPPORT.landlock_abi >= 1, policy)
    assert outcome_of(policy, lambda: write(scratch / "a.txt")).ok
    assert (scratch / "a.txt").read_text() == "hi"
    assert_refused(outcome_of(policy, lambda: write(tmp_path / "outside.txt")))
    assert not (tmp_path / "outside.txt").exists()
    assert outcome_of(policy, lambda: write("/dev/null")).ok


def test_read_only_refuses_writes_in_scratch(scratch: Path) -> None:
    (scratch / "old.txt").write_text("old")
    policy = Policy(scratch=str(scratch), read_only=True)
    require(SUPPORT.landlock_abi >= 1, policy)
    assert_refused(outcome_of(policy, lambda: write(scratch / "a.txt")))
    assert_refused(outcome_of(policy, lambda: write(scratch / "old.txt")))
    assert outcome_of(policy, lambda: read(scratch / "old.txt")).value == 3


def test_fs_write_and_fs_read_widen(scratch: Path, tmp_path: Path) -> None:
    extra, data = tmp_path / "extra", tmp_path / "data.txt"
    extra.mkdir()
    data.write_text("data")
    policy = Policy(scratch=str(scratch), fs_write=[str(extra)], fs_read=[str(data), "/nope"])
    require(SUPPORT.landlock_abi >= 1, policy)
    assert outcome_of(policy, lambda: write(extra / "b.txt")).ok
    assert outcome_of(policy, lambda: read(data)).value == 4
    assert_refused(outcome_of(policy, lambda: write(data)))  # a file rule: read rights only


# ---- network, signals, ptrace ---------------------------------------------------------------
def test_tcp_connect_refused_without_network(scratch: Path, listener: tuple[str, int]) -> None:
    policy = Policy(scratch=str(scratch))
    require(SUPPORT.landlock_abi >= 4, policy, private_network=True)
    assert_refused(outcome_of(policy, lambda: connect(listener)))
    allowed = Policy(scratch=str(scratch), network=True)
    assert outcome_of(allowed, lambda: connect(listener)).value == "connected"


def test_signals_outside_the_worker_are_refused(scratch: Path) -> None:
    policy = Policy(scratch=str(scratch))
    require(SUPPORT.landlock_abi >= 6, policy)
    parent = os.getpid()
    assert_refused(outcome_of(policy, lambda: os.kill(parent, 0)), errno.EPERM)
    assert outcome_of(policy, lambda: os.kill(os.getpid(), 0)).ok  # itself: fine


def test_ptrace_of_the_parent_is_refused(scratch: Path) -> None:
    policy = Policy(scratch=str(scratch))
    require(SUPPORT.landlock_abi >= 1, policy)
    parent = os.getpid()

    def seize() -> int:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.ptrace.restype = ctypes.c_long
        rc = libc.ptrace(ctypes.c_long(_PTRACE_SEIZE), ctypes.c_long(parent), None, None)
        if rc < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        return int(rc)

    assert_refused(outcome_of(policy, seize), errno.EPERM)
    assert_refused(outcome_of(policy, lambda: read(f"/proc/{parent}/mem")))


# ---- capabilities and rlimits ---------------------------------------------------------------
def _raise_cpu_hard_limit() -> str:
    soft, hard = resource.getrlimit(resource.RLIMIT_CPU)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard + 1000))
    return "raised"


def _capabilities_left() -> list[int]:
    """[effective, permitted, inheritable, bounding-set count] of the calling process."""
    libc = ctypes.CDLL(None, use_errno=True)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this pid
    data = (ctypes.c_uint32 * 6)()
    assert libc.capget(header, data) == 0
    bounding = sum(libc.prctl(23, cap, 0, 0, 0) == 1 for cap in range(64))  # PR_CAPBSET_READ
    return [data[0] | data[3], data[1] | data[4], data[2] | data[5], bounding]


def test_every_capability_is_dropped(scratch: Path) -> None:
    policy = Policy(scratch=str(scratch), cpu_seconds=100)
    require(SUPPORT.drop_caps, policy)
    assert outcome_of(policy, _capabilities_left).value == [0, 0, 0, 0]
    outcome = outcome_of(policy, _raise_cpu_hard_limit)
    # CPython turns setrlimit's EPERM into ValueError("not allowed to raise maximum limit").
    assert not outcome.ok and "not allowed to raise" in outcome.message, outcome
    if _has_capability(_CAP_SYS_RESOURCE):  # the control: unconfined, root may raise it
        unconfined = Policy(scratch=str(scratch), cpu_seconds=100, confine=False)
        assert outcome_of(unconfined, _raise_cpu_hard_limit).value == "raised"


def test_file_size_limit(scratch: Path) -> None:
    policy = Policy(scratch=str(scratch), file_size=1 << 20)

    def big_write() -> int:
        fd = os.open(scratch / "big", os.O_WRONLY | os.O_CREAT, 0o600)
        chunk, written = b"x" * (1 << 20), 0
        try:
            while written < 4 << 20:  # SIGXFSZ is ignored by CPython: EFBIG instead
                written += os.write(fd, chunk)
        finally:
            os.close(fd)
        return written

    assert_refused(outcome_of(policy, big_write), errno.EFBIG)


def test_memory_limit(scratch: Path) -> None:
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    policy = Policy(scratch=str(scratch), memory=vm + (64 << 20))
    outcome = outcome_of(policy, lambda: len(bytearray(1 << 30)))
    assert outcome.error == "MemoryError", outcome


def test_cpu_limit_kills_a_busy_loop(scratch: Path) -> None:
    policy = Policy(scratch=str(scratch), cpu_seconds=1)

    def spin() -> None:
        while True:
            pass

    outcome, status = run_child(policy, spin)
    assert outcome is None
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) in (signal.SIGXCPU, signal.SIGKILL)


def test_confine_false_applies_only_rlimits(scratch: Path) -> None:
    policy = Policy(scratch=str(scratch), confine=False, open_files=64)
    assert gaps(policy, SUPPORT, private_network=True) == [
        "confinement is off (confine=False): no Landlock, no capability drop, no network "
        "or signal confinement; only the rlimits apply"
    ]

    def action() -> list[int]:
        return [read("/etc/shadow"), resource.getrlimit(resource.RLIMIT_NOFILE)[1]]

    if not os.access("/etc/shadow", os.R_OK):
        pytest.skip("/etc/shadow is not readable by this user even unconfined")
    assert outcome_of(policy, action).value == [read("/etc/shadow"), 64]


# ---- the contract around apply ---------------------------------------------------------------
def test_apply_refuses_a_threaded_process(scratch: Path) -> None:
    policy = Policy(scratch=str(scratch))

    def action() -> None:
        stop = threading.Event()
        thread = threading.Thread(target=stop.wait)
        thread.start()
        try:
            apply(policy, SUPPORT)
        finally:
            stop.set()
            thread.join()

    outcome = outcome_of(None, action)
    assert outcome.error == ConfinementError.__name__ and "threads" in outcome.message


def test_gaps_are_empty_for_the_default_policy_here(scratch: Path) -> None:
    policy = Policy(scratch=str(scratch))
    assert gaps(policy, SUPPORT, private_network=SUPPORT.netns) == []
    assert SUPPORT.landlock_abi >= 6 and SUPPORT.drop_caps and SUPPORT.netns, SUPPORT
    assert SUPPORT.seccomp and SUPPORT.no_new_privs and SUPPORT.disk == disk.TMPFS, SUPPORT
    assert gaps(policy_of(brood.Limits()), SUPPORT, private_network=SUPPORT.netns) == []
    lines = gaps(Policy(scratch=str(scratch), processes=10), SUPPORT, private_network=False)
    assert any(line.startswith("network: UDP") for line in lines)
    # A usable cgroup enforces the process limit, even for root.
    assert any(line.startswith("processes:") for line in lines) == (not SUPPORT.cgroup)


def test_policy_and_support_travel_in_msgpack(scratch: Path) -> None:
    policy = Policy(scratch=str(scratch), fs_read=["/data"], memory=1 << 30)
    wire = msgspec.msgpack.encode(policy)
    assert msgspec.msgpack.decode(wire, type=Policy) == policy
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(SUPPORT), type=Support) == SUPPORT
    assert probe() is SUPPORT  # cached


def test_default_read_paths() -> None:
    paths = default_read_paths()
    assert any(STDLIB_FILE.startswith(p + "/") for p in map(os.path.realpath, paths))
    for forbidden in ("/proc", "/tmp", "/etc/passwd", "/etc/shadow", "/", os.getcwd()):
        assert forbidden not in paths
    # A checkout and its venv may live anywhere, /tmp included; nothing else may.
    anywhere = {str(Path(brood.__file__).resolve().parent.parent)}
    anywhere |= {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    others = [p for p in paths if not any(p == a or p.startswith(a + "/") for a in anywhere)]
    assert not any(p.startswith(("/proc", "/tmp")) for p in others), paths


def test_private_network_leaves_only_a_down_loopback(listener: tuple[str, int]) -> None:
    require(SUPPORT.netns, Policy(scratch="/nonexistent"))

    def action() -> list[Any]:
        entered = enter_private_network()
        names = [name for _, name in socket.if_nameindex()]
        try:
            connect(listener)
            result = "connected"
        except OSError as exc:
            result = errno.errorcode.get(exc.errno or 0, str(exc))
        return [entered, names, result]

    entered, names, result = outcome_of(None, action).value
    assert entered is True and names == ["lo"]
    assert result in ("ENETUNREACH", "ECONNREFUSED", "EADDRNOTAVAIL"), result


def test_paths_that_do_not_exist_are_skipped(scratch: Path) -> None:
    policy = Policy(scratch=str(scratch), fs_read=["/etc/shadow/x", "/nope"], fs_write=["/nope2"])
    require(SUPPORT.landlock_abi >= 1, policy)
    assert outcome_of(policy, lambda: read(STDLIB_FILE)).value == 64


def test_doctor_reports_support_and_gaps() -> None:
    from typer.testing import CliRunner

    from brood.cli.main import app

    result = CliRunner().invoke(app, ["doctor", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["support"]["landlock_abi"] == SUPPORT.landlock_abi
    assert report["support"]["seccomp"] == SUPPORT.seccomp
    policy = policy_of(brood.Limits())
    assert report["gaps"] == gaps(policy, SUPPORT, private_network=SUPPORT.netns)
    assert report["scratch_disk"] == scratch_bound(policy, SUPPORT)
    text = CliRunner().invoke(app, ["doctor"])
    assert text.exit_code == 0 and "landlock" in text.output and "gaps" in text.output
    for row in ("no_new_privs", "seccomp filter", "user namespaces", "scratch disk"):
        assert row in text.output, text.output


# ---- cgroups ---------------------------------------------------------------------------------
def require_cgroup() -> None:
    if not SUPPORT.cgroup:
        pytest.skip(f"no usable cgroup here: {SUPPORT.cgroup_error}")


@pytest.fixture
def cgroup() -> Iterator[str]:
    require_cgroup()
    parent = cgroup_parent(SUPPORT)
    assert parent is not None and os.path.isdir(parent)
    try:
        yield parent
    finally:
        assert cgroup_remove_parent(parent, SUPPORT)
        assert not os.path.exists(parent)


def _alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _wait_dead(pids: list[int], timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := [p for p in pids if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.01)
    return left


def start_in_cgroup(parent: str, policy: Policy, action: Callable[[], Any]) -> tuple[int, Outcome]:
    """Fork; the child enters its cgroup below `parent`, applies `policy`, runs `action`,
    reports one line and then waits to be killed. Returns (child pid, outcome)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            os.close(r)

            def confine() -> None:
                cgroup_enter(parent, os.getpid(), policy, SUPPORT)
                apply(policy, SUPPORT)

            _report(w, _attempt(confine, action))
            os.write(w, b"\n")
            os.close(w)
            while True:
                signal.pause()
        finally:
            os._exit(70)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        line = f.readline()
    assert line, "the child died before reporting"
    return pid, msgspec.json.decode(line, type=Outcome)


def _pause_forever() -> None:  # pragma: no cover - runs in forked children
    while True:
        signal.pause()


def _fork_bomb() -> dict[str, Any]:  # pragma: no cover - runs in the confined child
    pids: list[int] = []
    while len(pids) < 10_000:
        try:
            pid = os.fork()
        except OSError as exc:
            return {"forks": len(pids), "errno": exc.errno, "pids": pids}
        if pid == 0:
            try:
                _pause_forever()
            finally:
                os._exit(0)
        pids.append(pid)
    return {"forks": len(pids), "errno": None, "pids": pids}


def _kill_and_reap(parent: str, pid: int, others: list[int]) -> None:
    cgroup_kill(parent, pid, SUPPORT)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert _wait_dead(others) == []
    deadline = time.monotonic() + 10
    while not cgroup_remove(parent, pid, SUPPORT):  # the last ones may still be reaped
        assert time.monotonic() < deadline, "the worker's cgroup stayed busy"
        time.sleep(0.01)


def test_fork_bomb_is_bounded_by_the_cgroup(scratch: Path, cgroup: str) -> None:
    policy = Policy(scratch=str(scratch), processes=20)
    pid, outcome = start_in_cgroup(cgroup, policy, _fork_bomb)
    assert outcome.ok, outcome
    bomb = outcome.value
    try:
        assert bomb["errno"] == errno.EAGAIN, bomb
        # pids.max counts tasks: the single-threaded child plus its forks.
        assert bomb["forks"] == 20 + CGROUP_HEADROOM - 1, bomb
        with open(os.path.join(cgroup, str(pid), "pids.max")) as f:
            assert int(f.read()) == 20 + CGROUP_HEADROOM
        assert sorted(_procs_of(cgroup, pid)) == sorted([pid, *bomb["pids"]])
    finally:
        _kill_and_reap(cgroup, pid, bomb["pids"])
    assert not os.path.exists(os.path.join(cgroup, str(pid)))


def _procs_of(parent: str, pid: int) -> list[int]:
    with open(os.path.join(parent, str(pid), "cgroup.procs")) as f:
        return [int(p) for p in f.read().split()]


def _setsid_grandchild() -> int:  # pragma: no cover - runs in the confined child
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()
            os.close(r)
            os.write(w, b"x")
            _pause_forever()
        finally:
            os._exit(0)
    os.close(w)
    os.read(r, 1)  # after its setsid
    return pid


def test_cgroup_kill_reaches_a_setsid_grandchild(scratch: Path, cgroup: str) -> None:
    pid, outcome = start_in_cgroup(cgroup, Policy(scratch=str(scratch)), _setsid_grandchild)
    assert outcome.ok, outcome
    grandchild = outcome.value
    try:
        assert _alive(grandchild) and os.getsid(grandchild) == grandchild
        assert os.getpgid(grandchild) != os.getpgid(pid)  # out of the child's group
        assert grandchild in _procs_of(cgroup, pid)
    finally:
        _kill_and_reap(cgroup, pid, [grandchild])


def test_cgroup_sets_the_memory_limit(scratch: Path, cgroup: str) -> None:
    if not SUPPORT.cgroup_memory_dir:
        pytest.skip(f"the memory controller is not used here: {SUPPORT.cgroup_error}")
    policy = Policy(scratch=str(scratch), memory=3 << 30)
    pid, outcome = start_in_cgroup(cgroup, policy, lambda: None)
    try:
        assert outcome.ok, outcome
        if SUPPORT.cgroup == "v2":
            knob = os.path.join(cgroup, str(pid), "memory.max")
        else:
            name = os.path.basename(cgroup)
            knob = os.path.join(SUPPORT.cgroup_memory_dir, name, str(pid), "memory.limit_in_bytes")
        with open(knob) as f:
            assert int(f.read()) == 3 << 30
        with open(os.path.join(os.path.dirname(knob), "cgroup.procs")) as f:
            assert pid in [int(p) for p in f.read().split()]
    finally:
        _kill_and_reap(cgroup, pid, [])


def test_a_process_killed_at_the_cgroup_memory_limit_is_counted(scratch: Path, cgroup: str) -> None:
    if not SUPPORT.cgroup_memory_dir:
        pytest.skip(f"the memory controller is not used here: {SUPPORT.cgroup_error}")
    policy = Policy(scratch=str(scratch), memory=64 << 20)
    assert cgroup_oom_kills(cgroup, 1, SUPPORT) == 0  # no such worker: nothing counted
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child: the cgroup's limit only (no RLIMIT_AS)
        try:
            cgroup_enter(cgroup, os.getpid(), policy, SUPPORT)
            chunks = [bytearray(16 << 20) for _ in range(32)]  # 512 MiB, touched
            os._exit(len(chunks) and 3)
        finally:
            os._exit(70)
    _, status = os.waitpid(pid, 0)
    try:
        assert os.waitstatus_to_exitcode(status) == -signal.SIGKILL
        assert cgroup_oom_kills(cgroup, pid, SUPPORT) >= 1
    finally:
        assert cgroup_remove(cgroup, pid, SUPPORT)  # reaped above: its cgroup is empty


def test_cgroup_enter_failure_raises(scratch: Path, cgroup: str) -> None:
    policy = Policy(scratch=str(scratch), processes=20)
    missing = os.path.join(cgroup, "no-such-parent")
    outcome = outcome_of(None, lambda: cgroup_enter(missing + "/x", os.getpid(), policy, SUPPORT))
    assert outcome.error == ConfinementError.__name__, outcome
    assert "cgroup" in outcome.message


def test_gaps_name_processes_only_without_a_cgroup(scratch: Path) -> None:
    policy = Policy(scratch=str(scratch), processes=10)
    without = msgspec.structs.replace(SUPPORT, cgroup="", cgroup_error="not mounted (test)")
    lines = [ln for ln in gaps(policy, without, private_network=True) if "processes" in ln]
    assert len(lines) == 1 and "not mounted (test)" in lines[0]
    require_cgroup()
    assert not any("processes" in ln for ln in gaps(policy, SUPPORT, private_network=True))


FORK_BOMB_CODE = """import os, signal
n = 0
try:
    while n < 10000:
        if os.fork() == 0:
            while True:
                signal.pause()
        n += 1
except OSError as exc:
    FINAL(f"forks={n} errno={exc.errno}")
FINAL(f"forks={n} unbounded")"""


def _descendants(root: int) -> list[int]:
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                kids = [int(p) for p in f.read().split()]
        except OSError:
            kids = []
        found += kids
        todo += kids
    return found


def test_fork_bomb_in_model_code_ends_and_leaves_nothing() -> None:
    require_cgroup()
    before = set(_descendants(os.getpid()))

    def chat_fn(messages: list[dict[str, Any]]) -> str:
        return f"```repl\n{FORK_BOMB_CODE}\n```"

    limits = brood.Limits(worker_processes=20, shutdown_grace=0.3, term_grace=0.3)
    with brood.Supervisor(chat_fn, limits=limits) as sup:
        zygote = sup._engine.backend._zygote.pid  # type: ignore[attr-defined]
        assert f"brood-{zygote}" in os.listdir(SUPPORT.cgroup_dir)
        result = sup.run("fork bomb")
    assert result.state == "completed", result
    forks = int(result.answer.split()[0].removeprefix("forks="))
    assert result.answer.endswith(f"errno={errno.EAGAIN}"), result.answer
    assert forks <= 20 + CGROUP_HEADROOM, result.answer
    assert _wait_dead([p for p in _descendants(os.getpid()) if p not in before]) == []
    # Its own brood-<zygote pid> is removed (another suite's may come and go meanwhile).
    mine = f"brood-{zygote}"
    left = [d for d in os.listdir(SUPPORT.cgroup_dir) if d == mine or d.startswith(mine + "-")]
    assert not left


def test_worker_cgroups_are_made_once_per_slot_and_reused() -> None:
    """Each worker joins a slot's cgroup, made once by the zygote: runs one after another
    reuse the same few, and each finds its slot as the first found it (the children the
    one before left in it killed and reaped first), so every run forks as far as its own
    limit lets it."""
    require_cgroup()
    runs = 6

    def chat_fn(messages: list[dict[str, Any]]) -> str:
        return f"```repl\n{FORK_BOMB_CODE}\n```"

    limits = brood.Limits(worker_processes=12, shutdown_grace=0.3, term_grace=0.3)
    with brood.Supervisor(chat_fn, limits=limits) as sup:
        zygote = sup._engine.backend._zygote.pid  # type: ignore[attr-defined]
        results = [sup.run(f"fork bomb {i}") for i in range(runs)]
        mine = os.path.join(SUPPORT.cgroup_dir, f"brood-{zygote}")
        slots = sorted(e.name for e in os.scandir(mine) if e.is_dir())
    forks = set()
    for result in results:
        assert result.state == "completed", result
        assert result.answer.endswith(f"errno={errno.EAGAIN}"), result.answer
        forks.add(int(result.answer.split()[0].removeprefix("forks=")))
    assert len(forks) == 1 and forks.pop() <= 12 + CGROUP_HEADROOM, results
    assert slots and all(name.startswith("slot-") for name in slots), slots
    # The warm pool's workers, the busy one and one being refilled: not one per run.
    assert len(slots) < runs, slots
    assert not os.path.exists(mine)


HOLD_ALL_CODE = """import os, signal
n, err = 0, None
try:
    while n < 1000:
        if os.fork() == 0:
            while True:
                signal.pause()
        n += 1
except OSError as exc:
    err = exc.errno
replies = llm_query_batched(["ping"] * 16)
FINAL(f"forks={n} errno={err} replies={sorted(set(replies))}")"""


def _hold_all(code: str, processes: int) -> tuple[brood.RunResult, str]:
    """A run whose step is `code` (its llm_query calls answered "pong") under
    worker_processes=`processes`: how it ended and the step's output; nothing left behind."""
    require_cgroup()

    def chat_fn(messages: list[dict[str, Any]]) -> str:
        if messages[-1]["content"] == "ping":
            return "pong"
        return f"```repl\n{code}\n```"

    limits = brood.Limits(worker_processes=processes, shutdown_grace=0.3, term_grace=0.3)
    before = set(_descendants(os.getpid()))
    with brood.Supervisor(chat_fn, limits=limits) as sup:
        result = sup.run("hold all you can")
        steps = sup.store.events(result.run_id, "step")
    assert _wait_dead([p for p in _descendants(os.getpid()) if p not in before]) == []
    return result, steps[0]["data"]["stdout"] if steps else ""


def test_model_code_holds_exactly_worker_processes_and_brood_threads_still_start() -> None:
    # Model code forks until refused, holding every child alive: it gets exactly
    # worker_processes (brood's own tasks are all running before it starts, and are the
    # whole headroom). At the cap a batch is still served: it needs no thread.
    result, _ = _hold_all(HOLD_ALL_CODE, 16)
    assert result.state == "completed", result
    assert result.answer == f"forks=16 errno={errno.EAGAIN} replies=['pong']", result.answer


def test_spawned_work_counts_among_worker_processes() -> None:
    # spawn() runs its work on a thread, which counts as model code's own: with every place
    # held by its forks, the spawn is refused, naming the limit; a plain call still goes.
    code = HOLD_ALL_CODE.replace(
        "replies = llm_query_batched",
        "try:\n    spawn(llm_query, 'ping')\nexcept RuntimeError as exc:\n"
        "    print('refused:', exc)\nreplies = llm_query_batched",
    )
    result, out = _hold_all(code, 4)
    assert result.answer == f"forks=4 errno={errno.EAGAIN} replies=['pong']", result.answer
    assert "refused: spawned work found no thread" in out and "worker_processes" in out, out


# ---- the seccomp filter's decisions, for each machine ------------------------------------------
# Checked with a small interpreter of the instructions the filter uses, so aarch64's program
# is checked on any machine. The numbers are written out here, apart from brood's table.
SYSCALLS = {
    "x86_64": dict(
        read=0,
        socket=41,
        socketpair=53,
        sendto=44,
        sendmsg=46,
        sendmmsg=307,
        io_uring_setup=425,
        prlimit64=302,
        setpriority=141,
        ioprio_set=251,
        sched_setparam=142,
        sched_setscheduler=144,
        sched_setaffinity=203,
        sched_setattr=314,
        unshare=272,
        setns=308,
        clone=56,
        clone3=435,
        execveat=322,
        memfd_create=319,
    ),
    "aarch64": dict(
        read=63,
        socket=198,
        socketpair=199,
        sendto=206,
        sendmsg=211,
        sendmmsg=269,
        io_uring_setup=425,
        prlimit64=261,
        setpriority=140,
        ioprio_set=30,
        sched_setparam=118,
        sched_setscheduler=119,
        sched_setaffinity=122,
        sched_setattr=274,
        unshare=97,
        setns=268,
        clone=220,
        clone3=435,
        execveat=281,
        memfd_create=279,
    ),
}
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
ALLOW, EPERM, EACCES, ENOSYS = "allow", "EPERM", "EACCES", "ENOSYS"
POINTER = 0x7FFF_1234_5678
THREAD_FLAGS = 0x3D0F00  # what glibc's pthread_create passes to clone


def run_filter(program: list[tuple[int, int, int, int]], arch: int, nr: int, *args: int) -> str:
    """What the filter answers to a call (classic BPF: load, and, jumps, return)."""
    data = struct.pack("<iIQ6Q", nr, arch, 0, *args, *[0] * (6 - len(args)))
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = program[pc]
        pc += 1
        if code == 0x20:
            acc = struct.unpack_from("<I", data, k)[0]
        elif code == 0x54:
            acc &= k
        elif code == 0x06:
            action, value = k & 0xFFFF0000, k & 0xFFFF
            if action == 0x7FFF0000:
                return ALLOW
            assert action == 0x00050000, hex(k)
            return errno.errorcode[value]
        else:
            taken = {0x15: acc == k, 0x25: acc > k, 0x35: acc >= k, 0x45: bool(acc & k)}[code]
            pc += jt if taken else jf


# (call, arguments, answer with the network off, answer with it on)
FILTER_CASES = [
    ("read", (0, POINTER, 10), ALLOW, ALLOW),
    ("prlimit64", (0, 0, POINTER, 0), ALLOW, ALLOW),  # setting its own limits
    ("prlimit64", (1234, 7, 0, POINTER), ALLOW, ALLOW),  # reading another's
    ("prlimit64", (1234, 0, POINTER, 0), EPERM, EPERM),
    ("prlimit64", (1234, 0, 1 << 32, 0), EPERM, EPERM),  # a pointer with only a high half
    ("prlimit64", (1 << 32, 0, POINTER, 0), ALLOW, ALLOW),  # the kernel reads pid 0
    ("setpriority", (0, 0, 19), ALLOW, ALLOW),
    ("setpriority", (1, 0, 19), ALLOW, ALLOW),  # its own process group
    ("setpriority", (0, 1234, 19), EPERM, EPERM),
    ("setpriority", (2, 0, 19), EPERM, EPERM),  # PRIO_USER: every process of the user
    ("ioprio_set", (1, 0, 3 << 13), ALLOW, ALLOW),
    ("ioprio_set", (1, 1234, 3 << 13), EPERM, EPERM),
    ("ioprio_set", (3, 0, 3 << 13), EPERM, EPERM),
    *[
        (call, (pid, POINTER), answer, answer)
        for call in ("sched_setparam", "sched_setscheduler", "sched_setaffinity", "sched_setattr")
        for pid, answer in ((0, ALLOW), (1234, EPERM))
    ],
    ("unshare", (0x10000000,), EPERM, EPERM),
    ("unshare", (0x400,), EPERM, EPERM),  # even CLONE_FILES alone: unshare is not needed
    ("setns", (3, 0), EPERM, EPERM),
    ("clone3", (POINTER, 88), ENOSYS, ENOSYS),
    ("clone", (17,), ALLOW, ALLOW),  # fork
    ("clone", (THREAD_FLAGS,), ALLOW, ALLOW),
    ("clone", (0x10000000 | 17,), EPERM, EPERM),
    ("clone", (0x20000 | 17,), EPERM, EPERM),
    ("execveat", (3, POINTER, POINTER, POINTER, 0), ALLOW, ALLOW),
    ("execveat", (3, POINTER, POINTER, POINTER, 0x1000), EPERM, EPERM),  # AT_EMPTY_PATH
    ("memfd_create", (POINTER, 0), EPERM, EPERM),
    ("memfd_create", (POINTER, 0x0008 | 0x1), ALLOW, ALLOW),  # NOEXEC_SEAL | CLOEXEC
    ("memfd_create", (POINTER, 0x0010), EPERM, EPERM),  # MFD_EXEC
    ("io_uring_setup", (8, POINTER), EPERM, EPERM),
    ("socket", (1, 1, 0), EACCES, EACCES),  # AF_UNIX
    ("socket", (2, 2, 0), ALLOW, ALLOW),  # AF_INET: Landlock and the netns govern it
    ("socket", (16, 3, 0), EACCES, ALLOW),  # AF_NETLINK
    ("socket", (40, 1, 0), EACCES, ALLOW),  # AF_VSOCK
    ("socketpair", (1, 1, 0, POINTER), ALLOW, ALLOW),
    ("socketpair", (1, 5, 0, POINTER), ALLOW, ALLOW),  # SOCK_SEQPACKET
    ("socketpair", (1, 2 | 0x80000, 0, POINTER), EACCES, EACCES),  # SOCK_DGRAM | CLOEXEC
    ("socketpair", (1, 2 | 0x800, 0, POINTER), EACCES, EACCES),  # SOCK_DGRAM | NONBLOCK
    ("sendto", (3, POINTER, 2, 0, 0, 0), ALLOW, ALLOW),  # send(): no address
    ("sendto", (3, POINTER, 2, 0, POINTER, 20), EPERM, ALLOW),
    ("sendmsg", (3, POINTER, 0), EPERM, ALLOW),
    ("sendmmsg", (3, POINTER, 2, 0), EPERM, ALLOW),
]


@pytest.mark.parametrize("machine", list(SYSCALLS))
@pytest.mark.parametrize("network", [False, True], ids=["network-off", "network-on"])
def test_the_filter_answers_each_call_as_designed(machine: str, network: bool) -> None:
    program = seccomp_program(network, machine)
    assert len(program) < 4096  # BPF_MAXINSNS
    numbers, arch = SYSCALLS[machine], AUDIT_ARCH[machine]
    for call, args, off, on in FILTER_CASES:
        got = run_filter(program, arch, numbers[call], *args)
        assert got == (on if network else off), (call, args, got)
    assert run_filter(program, 0x40000003, 1) == EACCES  # i386 through int 0x80: refused
    if machine == "x86_64":
        assert run_filter(program, arch, 0x40000000 | 0) == EACCES  # the x32 table


def test_gaps_without_seccomp_name_each_hole(scratch: Path) -> None:
    without = msgspec.structs.replace(SUPPORT, seccomp=False, seccomp_error="gone (test)")
    lines = gaps(Policy(scratch=str(scratch)), without, private_network=True)
    prefixes = [line.split(":", 1)[0] for line in lines if "gone (test)" in line]
    for prefix in ("unix sockets", "other processes", "namespaces", "memfd", "netlink and vsock"):
        assert prefix in prefixes, lines
    online = gaps(Policy(scratch=str(scratch), network=True), without, private_network=False)
    assert not any(line.startswith("netlink") for line in online)


def test_scratch_bound_and_its_gap(scratch: Path) -> None:
    policy = Policy(scratch=str(scratch), disk=1 << 20)
    with_tmpfs = msgspec.structs.replace(SUPPORT, disk=disk.TMPFS, disk_error="")
    no_tmpfs = msgspec.structs.replace(SUPPORT, disk="", disk_error="no mount here (test)")
    kept = msgspec.structs.replace(policy, keep_scratch=True)
    assert scratch_bound(policy, with_tmpfs) == disk.TMPFS
    assert scratch_bound(policy, no_tmpfs) == SCRATCH_WATCHED
    assert scratch_bound(kept, with_tmpfs) == SCRATCH_WATCHED
    assert scratch_bound(msgspec.structs.replace(policy, disk=None), with_tmpfs) == ""
    assert scratch_bound(msgspec.structs.replace(policy, confine=False), with_tmpfs) == ""

    def disk_lines(p: Policy, s: Support) -> list[str]:
        return [ln for ln in gaps(p, s, private_network=True) if ln.startswith("disk:")]

    assert disk_lines(policy, with_tmpfs) == []
    (line,) = disk_lines(policy, no_tmpfs)
    assert "no mount here (test)" in line and "Limits.worker_disk" in line
    (line,) = disk_lines(kept, with_tmpfs)
    assert "keep_scratch=True" in line


def test_scratch_is_a_tmpfs_of_its_own(scratch: Path) -> None:
    policy = Policy(scratch=str(scratch), disk=1 << 20)
    if scratch_bound(policy, SUPPORT) == SCRATCH_WATCHED:
        require(False, policy)

    def fill() -> list[Any]:
        os.chdir(scratch)  # as the zygote does after apply: onto the tmpfs
        fs = os.statvfs(".")
        got: list[Any] = [fs.f_blocks * fs.f_frsize, os.stat(".").st_dev != parent_dev]
        try:
            with open("fill", "wb") as f:
                f.write(b"x" * (2 << 20))
        except OSError as exc:
            return [*got, exc.errno]
        return [*got, None]

    parent_dev = os.stat(scratch.parent).st_dev
    assert outcome_of(policy, fill).value == [1 << 20, True, errno.ENOSPC]
    assert os.listdir(scratch) == []  # it was the worker's own tmpfs, gone with it
    with open("/proc/self/mountinfo") as f:
        assert str(scratch) not in f.read()


def test_scratch_tmpfs_for_a_user_without_privileges(tmp_path: Path) -> None:
    """A worker of a user without CAP_SYS_ADMIN mounts its tmpfs in a user namespace of its
    own, and apply then drops the capabilities that namespace gave it."""
    if os.geteuid() != 0:
        pytest.skip("making a process of another user needs root")
    where = tempfile.mkdtemp()  # beside the test's tmp_path, which that user cannot reach
    os.chown(where, NOBODY, NOBODY)
    base = msgspec.structs.replace(
        SUPPORT, landlock_abi=0, drop_caps=False, caps_held=False, cgroup="", uid=NOBODY
    )

    def as_nobody() -> dict[str, Any]:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
        # A process started by that user is dumpable; one that dropped from root is not,
        # and could then not write its own /proc/self/uid_map.
        ctypes.CDLL(None).prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)
        mechanism, why = disk.probe()
        if not mechanism:
            return {"skip": why}
        support = msgspec.structs.replace(base, disk=mechanism)
        apply(Policy(scratch=where, disk=1 << 20), support)
        path = os.path.join(where, "fill")
        try:
            with open(path, "wb") as f:
                f.write(b"x" * (2 << 20))
            err = None
        except OSError as exc:
            err = exc.errno
        return {
            "mechanism": mechanism,
            "errno": err,
            "owner": os.stat(path).st_uid,
            "caps": _capabilities_left(),
        }

    try:
        got = outcome_of(None, as_nobody).value
    finally:
        os.rmdir(where)
    if "skip" in got:
        pytest.skip(f"no user namespace with a mount for uid {NOBODY} here: {got['skip']}")
    assert got == {
        "mechanism": disk.TMPFS_USERNS,
        "errno": errno.ENOSPC,
        "owner": NOBODY,
        "caps": [0, 0, 0, 0],
    }

"""What Landlock does not scope, through the real REPL (DESIGN.md section 14): model code in a
confined worker tries to reach the supervisor and other trees' workers with prlimit,
setpriority and the scheduler calls, to make namespaces, to run a program from a memfd, to
send datagrams to a path-bound socket and to open netlink sockets, and to fill the disk.
Each case asserts it was refused or contained, that the supervisor still serves a run and
the journal still lists the runs, and (a fixture) that the supervisor's own limits,
priority and scheduling are what they were.

The supervisor is this test process; its pid goes to model code in the task text (the
worker's parent is the zygote). Cases that need the seccomp filter skip, naming brood's own
gap line, on a machine without it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import platform
import resource
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import brood
from brood.backends.scratch import Measure, over_limit, scratch_bytes
from tests.trust_util import (
    NO_FINAL,
    coder,
    limits,
    outcome,
    refused,
    require,
    still_serves,
    task,
)
from tests.util import Gate, Signal

SUPERVISOR = os.getpid()
# System call numbers for the calls model code makes through ctypes (the table in
# brood.worker.confine is brood's; these check it independently).
NUMBERS = {
    "x86_64": {"clone": 56, "clone3": 435, "ioprio_set": 251, "ioprio_get": 252},
    "aarch64": {"clone": 220, "clone3": 435, "ioprio_set": 30, "ioprio_get": 31},
}.get(platform.machine(), {})
CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x20000, 0x10000000, 0x20000000, 0x40000000
SIGCHLD = 17
IOPRIO_WHO_PROCESS, IOPRIO_WHO_USER = 1, 3
IOPRIO_IDLE = 3 << 13  # IOPRIO_CLASS_IDLE, level 0
NOBODY_UID = 54_321  # a uid with no process: a refused PRIO_USER call then harms no one
MFD_NOEXEC_SEAL = 0x0008
MIB = 2**20


@pytest.fixture
def store(tmp_path) -> str:
    return f"sqlite:///{tmp_path}/j.db"


def sup_of(store: str, lim: brood.Limits | None = None, **kw: Any) -> brood.Supervisor:
    return brood.Supervisor(coder, limits=lim or limits(), store=store, **kw)


def _ioprio(pid: int) -> int:
    if not NUMBERS:
        return -1
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return int(libc.syscall(NUMBERS["ioprio_get"], IOPRIO_WHO_PROCESS, pid))


RLIMITS = ("RLIMIT_CPU", "RLIMIT_NOFILE", "RLIMIT_FSIZE", "RLIMIT_AS", "RLIMIT_NPROC")


def state_of(pid: int) -> dict[str, Any]:
    """What a prlimit, setpriority, ioprio_set or sched_set* call could change of `pid`."""
    return {
        "rlimits": {name: resource.prlimit(pid, getattr(resource, name)) for name in RLIMITS},
        "nice": os.getpriority(os.PRIO_PROCESS, pid),
        "affinity": os.sched_getaffinity(pid),
        "scheduler": os.sched_getscheduler(pid),
        "ioprio": _ioprio(pid),
    }


def restore(pid: int, state: dict[str, Any]) -> None:
    """Put back what an attack that got through changed, so that one failing case does not
    leave its mark on the next (zygotes inherit this process's limits)."""
    for name, value in state["rlimits"].items():
        with contextlib.suppress(OSError, ValueError):
            resource.prlimit(pid, getattr(resource, name), value)
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, pid, state["nice"])
    with contextlib.suppress(OSError):
        os.sched_setaffinity(pid, state["affinity"])
    with contextlib.suppress(OSError):
        os.sched_setscheduler(pid, state["scheduler"], os.sched_param(0))


@pytest.fixture(autouse=True)
def supervisor_untouched() -> Iterator[None]:
    """Every case ends with the supervisor's limits, priority and scheduling unchanged."""
    before = state_of(SUPERVISOR)
    yield
    after = state_of(SUPERVISOR)
    if after != before:
        restore(SUPERVISOR, before)
    assert after == before


def blocked_sibling(
    sup: brood.Supervisor, tmp_path: Path, after: str = ""
) -> tuple[Any, Gate, int]:
    """Another tree in `sup`, whose code announces itself, waits on a gate, then runs
    `after` and answers 'sibling done'; its handle, the gate and its worker's pid."""
    started, go = Signal(tmp_path, "sibling-started"), Gate(tmp_path, "sibling-go")
    handle = sup.spawn(task(f"{started.code}\n{go.wait_code}\n{after}\nFINAL('sibling done')"))
    started.wait()
    return handle, go, sup._engine.core.runs[handle.id].rec.pid


# ---- other processes: rlimits ----------------------------------------------------------------
SIBLING_USES_LIMITS = (
    "open('s.txt', 'w').write('x' * 4096)\nheld = [open('s.txt') for _ in range(16)]"
)


def test_prlimit_of_the_supervisor_zygote_and_a_sibling_is_refused(store, tmp_path):
    with sup_of(store, limits(fs_write=[str(tmp_path)])) as sup:
        require(sup.limits, "other processes")
        sibling, go, sib = blocked_sibling(sup, tmp_path, SIBLING_USES_LIMITS)
        zygote = sup._engine.backend._zygote.pid
        sibling_before, zygote_before = state_of(sib), state_of(zygote)
        nofile = resource.getrlimit(resource.RLIMIT_NOFILE)
        # On the supervisor, values that would do no harm should the refusal fail (it does
        # not look at them): RLIMIT_CPU=1 would kill this very test runner. On the zygote
        # and the sibling's worker, the attack itself.
        harmless = {
            "CPU": (10**9, resource.RLIM_INFINITY),
            "NOFILE": (nofile[0] - 1, nofile[1]),
            "FSIZE": (2**62, resource.RLIM_INFINITY),
        }
        attack = {"CPU": (1, 1), "NOFILE": (4, 4), "FSIZE": (0, 0)}
        body = "import resource\n"
        for who, pid, values in (
            ("sup", SUPERVISOR, harmless),
            ("zygote", zygote, attack),
            ("sibling", sib, attack),
        ):
            for name, value in values.items():
                body += (
                    f"tr('{who}_{name}', lambda: resource.prlimit({pid}, "
                    f"resource.RLIMIT_{name}, {value!r}))\n"
                )
        body += (
            f"tr('read_sup', lambda: resource.prlimit({SUPERVISOR}, resource.RLIMIT_NOFILE))\n"
            "tr('read_own', lambda: resource.getrlimit(resource.RLIMIT_NOFILE))\n"
            "tr('lower_own', lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (512, 1024)))\n"
            "tr('prlimit_own', lambda: resource.prlimit(0, resource.RLIMIT_CPU, (3600, 3600)))\n"
            "tr('after_own', lambda: resource.getrlimit(resource.RLIMIT_NOFILE))"
        )
        result, got = outcome(sup, body)
        for who in ("sup", "zygote", "sibling"):
            for name in attack:
                refused(got[f"{who}_{name}"])
        assert got["read_sup"] == ["ok", repr(nofile)]  # reading another's limits: allowed
        assert got["read_own"] == ["ok", "(1024, 1024)"]  # Limits.worker_open_files
        assert got["lower_own"][0] == got["prlimit_own"][0] == "ok", got
        assert got["after_own"] == ["ok", "(512, 1024)"]
        assert state_of(sib) == sibling_before and state_of(zygote) == zygote_before
        go.open()
        assert sibling.wait(timeout=60) == "sibling done"  # it can still write and open files
        assert sup._engine.backend._zygote.pid == zygote
        still_serves(sup, store, result.run_id, sibling.id)


# ---- other processes: priority and scheduling ------------------------------------------------
def test_priority_and_scheduling_of_others_are_refused(store, tmp_path):
    with sup_of(store, limits(fs_write=[str(tmp_path)])) as sup:
        require(sup.limits, "other processes")
        sibling, go, sib = blocked_sibling(sup, tmp_path)
        sibling_before = state_of(sib)
        cpu = min(os.sched_getaffinity(0))
        body = f"""import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def ioprio_set(which, who):
    rc = libc.syscall({NUMBERS.get("ioprio_set", -1)}, which, who, {IOPRIO_IDLE})
    if rc < 0:
        raise OSError(ctypes.get_errno(), 'ioprio_set')
    return rc
for who, pid in (('sup', {SUPERVISOR}), ('sibling', {sib})):
    tr(who + '_nice', lambda: os.setpriority(os.PRIO_PROCESS, pid, 19))
    tr(who + '_affinity', lambda: os.sched_setaffinity(pid, {{{cpu}}}))
    tr(who + '_scheduler', lambda: os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0)))
    tr(who + '_param', lambda: os.sched_setparam(pid, os.sched_param(0)))
    tr(who + '_ioprio', lambda: ioprio_set({IOPRIO_WHO_PROCESS}, pid))
tr('user_nice', lambda: os.setpriority(os.PRIO_USER, {NOBODY_UID}, 19))
tr('user_ioprio', lambda: ioprio_set({IOPRIO_WHO_USER}, {NOBODY_UID}))
tr('own_nice', lambda: os.setpriority(os.PRIO_PROCESS, 0, 5))
tr('own_nice_call', lambda: os.nice(1))
tr('own_group_nice', lambda: os.setpriority(os.PRIO_PGRP, 0, 7))
tr('own_affinity', lambda: os.sched_setaffinity(0, {{{cpu}}}))
tr('own_ioprio', lambda: ioprio_set({IOPRIO_WHO_PROCESS}, 0))
R['own'] = [os.getpriority(os.PRIO_PROCESS, 0), sorted(os.sched_getaffinity(0))]"""
        result, got = outcome(sup, body)
        for who in ("sup", "sibling"):
            for what in ("nice", "affinity", "scheduler", "param", "ioprio"):
                if what == "ioprio" and not NUMBERS:
                    continue
                refused(got[f"{who}_{what}"])
        refused(got["user_nice"])  # PRIO_USER reaches every process of a user
        if NUMBERS:
            refused(got["user_ioprio"])
            assert got["own_ioprio"][0] == "ok", got
        for own in ("own_nice", "own_nice_call", "own_group_nice", "own_affinity"):
            assert got[own][0] == "ok", got
        assert got["own"] == [7, [cpu]]  # the last call set its whole process group to 7
        assert state_of(sib) == sibling_before
        go.open()
        assert sibling.wait(timeout=60) == "sibling done"
        still_serves(sup, store, result.run_id, sibling.id)


# ---- namespaces ------------------------------------------------------------------------------
NAMESPACES = f"""import ctypes, shutil, subprocess, threading
libc = ctypes.CDLL(None, use_errno=True)
# A raw clone that succeeded would return 0 in a child running this very code: PyDLL keeps
# the GIL across the call, so that child could leave at once.
raw = ctypes.PyDLL(None, use_errno=True)
raw.syscall.restype = ctypes.c_long
def rc_errno(rc):
    return [rc, ctypes.get_errno() if rc < 0 else 0]
def clone(nr, *args):
    rc = raw.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])
    if rc == 0:
        os._exit(0)
    if rc > 0:
        os.waitpid(rc, 0)
    return rc_errno(rc)
for name, flag in (('user', {CLONE_NEWUSER}), ('mount', {CLONE_NEWNS}), ('net', {CLONE_NEWNET}),
                   ('pid', {CLONE_NEWPID})):
    R['unshare_' + name] = rc_errno(libc.unshare(flag))
    R['clone_' + name] = clone({NUMBERS.get("clone", -1)}, flag | {SIGCHLD}, 0, 0, 0, 0)
args = (ctypes.c_uint64 * 11)({CLONE_NEWUSER}, 0, 0, 0, {SIGCHLD})  # struct clone_args
R['clone3'] = clone({NUMBERS.get("clone3", -1)}, ctypes.addressof(args), ctypes.sizeof(args))
pidfd = os.pidfd_open({SUPERVISOR})
R['setns'] = rc_errno(libc.setns(pidfd, {CLONE_NEWNET}))
if shutil.which('unshare'):
    p = subprocess.run(['unshare', '-U', 'true'], capture_output=True, text=True)
    R['unshare_cmd'] = [p.returncode, p.stderr]
pid = os.fork()
if pid == 0:
    os._exit(7)
R['fork'] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
box = []
t = threading.Thread(target=lambda: box.append(1))
t.start()
t.join()
R['thread'] = box
R['subprocess'] = subprocess.run(['echo', 'hi'], capture_output=True, text=True).stdout"""


def test_namespaces_are_refused(store):
    with sup_of(store) as sup:
        require(sup.limits, "namespaces")
        if not NUMBERS:
            pytest.skip(f"no system call numbers for {platform.machine()!r} in this test")
        result, got = outcome(sup, NAMESPACES)
        for name in ("user", "mount", "net", "pid"):
            assert got[f"unshare_{name}"] == [-1, errno.EPERM], got
            assert got[f"clone_{name}"] == [-1, errno.EPERM], got
        # clone3's flags are out of the filter's sight: glibc falls back to clone on ENOSYS.
        assert got["clone3"] == [-1, errno.ENOSYS], got
        assert got["setns"] == [-1, errno.EPERM], got
        if "unshare_cmd" in got:
            code, err = got["unshare_cmd"]
            assert code != 0 and "Operation not permitted" in err, got
        assert got["fork"] == 7 and got["thread"] == [1] and got["subprocess"] == "hi\n"
        still_serves(sup, store, result.run_id)


# ---- memfd exec ------------------------------------------------------------------------------
MEMFD = f"""import stat
TRUE = open('/bin/true', 'rb').read()
def in_child(fn):
    # 0 if /bin/true ran; 100 + errno if the exec was refused
    pid = os.fork()
    if pid == 0:
        try:
            fn()
        except OSError as e:
            os._exit(100 + (e.errno or 0))
        os._exit(99)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
def memfd(flags):
    fd = os.memfd_create('payload', flags)
    os.write(fd, TRUE)
    return fd
tr('plain', lambda: memfd(0))
tr('mfd_exec', lambda: memfd(0x0010))
try:
    fd = memfd({MFD_NOEXEC_SEAL})
except OSError as e:  # a kernel before 6.3 does not know the flag: no memfd at all
    R['sealed'] = ['refused', e.errno]
else:
    R['sealed'] = ['made', oct(stat.S_IMODE(os.fstat(fd).st_mode))]
    tr('chmod', lambda: os.fchmod(fd, 0o755))
    R['exec_proc'] = in_child(lambda: os.execv(f'/proc/self/fd/{{fd}}', ['true']))
    R['exec_fd'] = in_child(lambda: os.execve(fd, ['true'], {{}}))
open('true.copy', 'wb').write(TRUE)
os.chmod('true.copy', 0o755)
R['exec_scratch'] = in_child(lambda: os.execv(os.path.abspath('true.copy'), ['true']))"""


def test_memfd_exec_is_refused(store):
    with sup_of(store) as sup:
        require(sup.limits, "memfd")
        result, got = outcome(sup, MEMFD)
        refused(got["plain"])  # an executable memfd: refused whatever the sysctl says
        refused(got["mfd_exec"])
        if got["sealed"][0] == "made":  # no exec bit, and sealed so
            assert got["sealed"] == ["made", "0o666"], got
            refused(got["chmod"])
            assert got["exec_proc"] == 100 + errno.EACCES, got  # through /proc/self/fd
            assert got["exec_fd"] == 100 + errno.EPERM, got  # execveat(AT_EMPTY_PATH)
        else:
            assert got["sealed"] == ["refused", errno.EINVAL], got
        # A program written to scratch runs: on a path Landlock sees, confined as the worker.
        assert got["exec_scratch"] == 0, got
        still_serves(sup, store, result.run_id)


# ---- datagrams to path-bound sockets, netlink ------------------------------------------------
DATAGRAMS = """import socket
def pair(kind):
    a, b = socket.socketpair(socket.AF_UNIX, kind)
    return 'made'
tr('dgram_pair', lambda: pair(socket.SOCK_DGRAM))
tr('dgram_pair_cloexec', lambda: pair(socket.SOCK_DGRAM | socket.SOCK_CLOEXEC))
tr('dgram_pair_nonblock', lambda: pair(socket.SOCK_DGRAM | socket.SOCK_NONBLOCK))
tr('dgram_socket', lambda: socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM))
a, b = socket.socketpair()
s1, s2 = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
tr('stream_sendto', lambda: a.sendto(b'escape', {path!r}))
tr('stream_sendmsg', lambda: a.sendmsg([b'escape'], [], 0, {path!r}))
tr('seqpacket_sendto', lambda: s1.sendto(b'escape', {path!r}))
tr('send', lambda: a.send(b'ok'))
tr('recv', lambda: b.recv(10))"""


@pytest.mark.parametrize("network", [False, True], ids=["network-off", "network-on"])
def test_datagrams_to_a_path_bound_socket_are_refused(store, tmp_path, network):
    path = str(tmp_path / "outside.sock")  # outside every Landlock rule, like journald's
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listener:
        listener.bind(path)
        listener.setblocking(False)
        with sup_of(store, limits(network=network)) as sup:
            require(sup.limits, "unix sockets")
            result, got = outcome(sup, DATAGRAMS.format(path=path))
            for name in ("dgram_pair", "dgram_pair_cloexec", "dgram_pair_nonblock", "dgram_socket"):
                refused(got[name])
            if network:  # a connected stream names no other socket (EISCONN)
                refused(got["stream_sendto"], "OSError")
                refused(got["stream_sendmsg"], "OSError")
                assert got["seqpacket_sendto"][0] == "ok", got  # to its peer: address ignored
            else:
                refused(got["stream_sendto"])
                refused(got["stream_sendmsg"])
                refused(got["seqpacket_sendto"])
            assert got["send"] == ["ok", "2"] and got["recv"] == ["ok", "b'ok'"]
            with pytest.raises(BlockingIOError):
                listener.recv(100)  # nothing arrived
            still_serves(sup, store, result.run_id)


NETLINK = """import socket
tr('netlink', lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0))
tr('vsock', lambda: socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM))
tr('udp', lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).close())"""


@pytest.mark.parametrize("network", [False, True], ids=["network-off", "network-on"])
def test_netlink_and_vsock_only_with_the_network(store, network):
    with sup_of(store, limits(network=network)) as sup:
        require(sup.limits, "netlink and vsock")
        result, got = outcome(sup, NETLINK)
        if network:
            assert got["netlink"][0] == "ok", got
        else:
            refused(got["netlink"])
            refused(got["vsock"])
        assert got["udp"] == ["ok", "None"]
        still_serves(sup, store, result.run_id)


# ---- everyday Python under the filter --------------------------------------------------------
EVERYDAY = """import asyncio, ctypes, multiprocessing, subprocess, threading
R['asyncio'] = asyncio.run(asyncio.sleep(0, result='ran'))  # a socketpair self-pipe
ctx = multiprocessing.get_context('fork')
a, b = ctx.Pipe()
p = ctx.Process(target=lambda: b.send('from a child'))
p.start()
R['multiprocessing'] = [a.recv(), p.join(), p.exitcode]
out = []
threads = [threading.Thread(target=out.append, args=(i,)) for i in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
R['threads'] = sorted(out)
R['subprocess'] = subprocess.run(['sh', '-c', 'echo $((6 * 7))'], capture_output=True,
                                 text=True).stdout
callback = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int)(lambda x: x + 1)
R['ctypes_callback'] = callback(41)
import resource
R['getrlimit'] = resource.getrlimit(resource.RLIMIT_CPU)"""


def test_everyday_python_still_works(store):
    with sup_of(store) as sup:
        result, got = outcome(sup, EVERYDAY)
        assert got["asyncio"] == "ran"
        assert got["multiprocessing"] == ["from a child", None, 0]
        assert got["threads"] == [0, 1, 2, 3]
        assert got["subprocess"] == "42\n"
        assert got["ctypes_callback"] == 42
        assert got["getrlimit"] == [resource.RLIM_INFINITY] * 2
        still_serves(sup, store, result.run_id)


# ---- disk ------------------------------------------------------------------------------------
FILL = """n = 0
try:
    with open('fill.bin', 'wb') as f:
        while n < 64 * 2**20:
            f.write(b'x' * 2**20)
            n += 2**20
finally:
    print('written', n)"""
HEALTHY_WRITE = "open('data.bin', 'wb').write(b'y' * 4 * 2**20)"
HEALTHY = f"import os\n{HEALTHY_WRITE}\nFINAL(str(os.path.getsize('data.bin')))"


def test_a_full_scratch_tmpfs_fails_only_its_own_writes(store, tmp_path):
    lim = limits(worker_disk=8 * MIB, fs_write=[str(tmp_path)])
    require(lim, "disk")
    shown: list[str] = []

    def recording(messages: list[dict[str, Any]]) -> str:
        shown.append(messages[-1]["content"])
        return coder(messages)

    with brood.Supervisor(recording, limits=lim, store=store) as sup:
        healthy, go, _ = blocked_sibling(sup, tmp_path, HEALTHY_WRITE)
        result = sup.run(task(FILL))
        assert (result.state, result.answer) == ("completed", NO_FINAL), result
        after_step = shown[-1]  # what the model was shown of the step that filled scratch
        assert "No space left on device" in after_step, after_step
        assert f"Limits.worker_disk={8 * MIB}" in after_step, after_step
        written = int(after_step.split("written ")[1].split()[0])
        assert 4 * MIB <= written <= 8 * MIB, written
        go.open()  # the other tree's own scratch has all its room
        assert healthy.wait(timeout=60) == "sibling done"
        lone = sup.run(task(HEALTHY), model=coder)
        assert lone.answer == str(4 * MIB)
        still_serves(sup, store, result.run_id, healthy.id, lone.run_id)


def test_a_watched_scratch_past_worker_disk_fails_its_run(store, tmp_path):
    # keep_scratch=True keeps scratch on disk for the user to read: the supervisor watches
    # its size instead of a tmpfs bounding it (as on a machine that cannot mount one).
    never = Gate(tmp_path, "never")  # the attacker waits here until the watch stops it
    lim = limits(worker_disk=8 * MIB, fs_write=[str(tmp_path)])
    sup = sup_of(store, lim, keep_scratch=True)
    root = sup._engine.backend.scratch_root
    try:
        with sup:
            healthy, go, _ = blocked_sibling(sup, tmp_path, HEALTHY_WRITE)
            fill = "open('fill.bin', 'wb').write(b'x' * 16 * 2**20)\n" + never.wait_code
            result = sup.spawn(task(fill)).wait_result(timeout=60)  # a hang guard only
            assert result.state == "failed", result
            assert f"Limits.worker_disk={8 * MIB}" in result.error, result.error
            go.open()
            assert healthy.wait(timeout=60) == "sibling done"
            still_serves(sup, store, result.run_id, healthy.id)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_scratch_bytes_counts_what_is_on_disk(tmp_path):
    (tmp_path / "a").write_bytes(b"x" * MIB)
    os.link(tmp_path / "a", tmp_path / "a-again")  # one file, two names
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / "b").write_bytes(b"y" * MIB)
    with open(tmp_path / "sparse", "wb") as f:
        f.truncate(1 << 40)  # a terabyte that takes no block
    hidden.chmod(0)  # model code may hide a directory from its owner
    size = scratch_bytes(str(tmp_path))
    assert 2 * MIB <= size < 2 * MIB + 64 * 1024, size
    assert scratch_bytes(str(tmp_path / "missing")) == 0
    assert over_limit(Measure(size), size) is None
    past = over_limit(Measure(size), size - 1)
    assert past is not None and f"holds {size} bytes, past Limits.worker_disk={size - 1}" in past
    unread = over_limit(Measure(0, "PermissionError: no"), size)
    assert unread is not None and "could not be measured (PermissionError: no)" in unread

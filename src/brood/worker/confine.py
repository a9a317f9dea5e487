"""Kernel confinement of a worker: rlimits, Landlock, capability drop, a seccomp filter
(for what Landlock does not scope), private network, a bounded scratch (`brood.worker.disk`)
and a cgroup per worker (pids and memory limits, and a kill that reaches every process).

Invariant: `apply` (and `cgroup_enter`, where a cgroup is usable) either enforces every
mechanism `probe()` said this machine has, or raises `ConfinementError`; what the machine
lacks is named by `gaps()`, never dropped silently. Worker side: imports only the standard
library, msgspec and `brood.errors`.

Landlock, `PR_SET_NO_NEW_PRIVS` and the capability sets are per thread (threads started
later inherit them), so `apply` runs in a freshly forked worker before any thread starts.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import platform
import re
import resource
import signal
import site
import stat
import sys
import sysconfig
import threading
import time
from collections.abc import Iterable
from typing import NamedTuple

import msgspec

from brood.errors import ConfinementError
from brood.worker import disk
from brood.worker.trial import in_child

__all__ = [
    "BATCH_THREADS",
    "CGROUP_HEADROOM",
    "SCRATCH_WATCHED",
    "Policy",
    "Support",
    "apply",
    "cgroup_empty",
    "cgroup_enter",
    "cgroup_join",
    "cgroup_kill",
    "cgroup_make",
    "cgroup_oom_kills",
    "cgroup_parent",
    "cgroup_remove",
    "cgroup_remove_parent",
    "default_read_paths",
    "enter_private_network",
    "gaps",
    "held_fds",
    "pids_capped",
    "prepare",
    "probe",
    "scratch_bound",
    "seccomp_program",
    "set_child_subreaper",
]

# ---- kernel constants (include/uapi/linux/landlock.h, prctl.h, capability.h, sched.h) -----
# Landlock's syscall numbers come from the unified table: the same on x86_64 and aarch64.
_LANDLOCK_SYSCALLS = {
    "x86_64": (444, 445, 446),
    "aarch64": (444, 445, 446),
    "arm64": (444, 445, 446),
}
_LANDLOCK_CREATE_RULESET_VERSION = 1 << 0
_LANDLOCK_RULE_PATH_BENEATH = 1

_FS_EXECUTE = 1 << 0
_FS_WRITE_FILE = 1 << 1
_FS_READ_FILE = 1 << 2
_FS_READ_DIR = 1 << 3
_FS_REFER = 1 << 13  # ABI 2
_FS_TRUNCATE = 1 << 14  # ABI 3
_FS_IOCTL_DEV = 1 << 15  # ABI 5
_FS_ABI1 = (1 << 13) - 1  # EXECUTE … MAKE_SYM: the thirteen rights of ABI 1
# Rights a rule on a non-directory may carry; the kernel refuses a rule with any other.
_FS_FILE_RIGHTS = _FS_EXECUTE | _FS_WRITE_FILE | _FS_READ_FILE | _FS_TRUNCATE | _FS_IOCTL_DEV
_FS_READ = _FS_READ_FILE | _FS_READ_DIR | _FS_EXECUTE

_NET_BIND_TCP = 1 << 0  # ABI 4
_NET_CONNECT_TCP = 1 << 1
_SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0  # ABI 6
_SCOPE_SIGNAL = 1 << 1

_PR_CAPBSET_DROP = 24
_PR_SET_SECUREBITS = 28
_PR_SET_NO_NEW_PRIVS = 38
_PR_GET_NO_NEW_PRIVS = 39
_PR_SET_CHILD_SUBREAPER = 36
_PR_CAP_AMBIENT = 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4
# NOROOT, NO_SETUID_FIXUP, KEEP_CAPS and NO_CAP_AMBIENT_RAISE, each with its lock bit:
# a root worker that execs gets no capabilities back, and cannot undo that.
_SECUREBITS_LOCKED_DOWN = 0b1110_1111
_CAP_SETPCAP = 8
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
_CLONE_NEWNET = 0x40000000

_DEV_READ = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")
_SYSTEM_READ = (
    "/usr",
    "/lib",
    "/lib64",
    "/bin",
    "/sbin",
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/localtime",
    "/etc/nsswitch.conf",
    "/usr/share/zoneinfo",
)
# Read only when the policy allows network: name resolution and TLS roots.
_NETWORK_READ = (
    "/etc/resolv.conf",
    "/etc/hosts",
    "/etc/host.conf",
    "/etc/gai.conf",
    "/etc/services",
    "/etc/protocols",
    "/etc/ssl",
    "/etc/pki",
    "/etc/ca-certificates",
)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.prctl.restype = ctypes.c_int
_libc.prctl.argtypes = [ctypes.c_int, *[ctypes.c_ulong] * 4]
_libc.unshare.restype = ctypes.c_int
_libc.unshare.argtypes = [ctypes.c_int]


class _RulesetAttr(ctypes.Structure):
    _fields_ = (
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),  # ABI 4
        ("scoped", ctypes.c_uint64),  # ABI 6
    )


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1  # __attribute__((packed)) in the uapi header: 12 bytes
    _fields_ = (("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32))


class _CapHeader(ctypes.Structure):
    _fields_ = (("version", ctypes.c_uint32), ("pid", ctypes.c_int))


class _CapData(ctypes.Structure):
    _fields_ = (
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    )


_CapDataPair = _CapData * 2  # version 3 carries 64 capability bits as two 32-bit halves


class Policy(msgspec.Struct, frozen=True, kw_only=True):
    """What one worker may do. Travels in a msgpack frame, so plain fields only.

    Paths are allowed beneath (a directory and all it holds); paths that do not exist are
    skipped. `read_only` turns scratch and `fs_write` into read-only paths.

    `processes` bounds what model code may start. Where a cgroup is usable
    (`Support.cgroup`), the worker's cgroup gets pids.max = processes + CGROUP_HEADROOM:
    pids.max counts tasks, so threads as well as processes, and the headroom is exactly
    brood's own tasks in the worker (its main thread and the link reader, both started
    before model code runs: `pids_capped`); model code then runs exactly `processes`
    processes or threads of its own at once, and everything it starts, in any session or
    process group, counts: the threads its `spawn()`ed work runs on too. RLIMIT_NPROC is set too;
    it counts every process of the user and does not apply to root. `memory` is RLIMIT_AS
    per process and, where the cgroup's memory controller is usable, also the memory limit
    of the worker's whole cgroup.

    `disk` bounds the bytes in the worker's scratch directory: a tmpfs of that size where
    `Support.disk` names a way to mount one (`brood.worker.disk`), unless `keep_scratch`
    (the user reads scratch after the run, so it stays on disk and the supervisor watches
    its size; `scratch_bound` says which holds).
    """

    confine: bool = True
    scratch: str
    fs_read: list[str] = []
    fs_write: list[str] = []
    network: bool = False
    read_only: bool = False
    memory: int | None = None  # bytes -> RLIMIT_AS, and the cgroup's memory limit
    cpu_seconds: int | None = None  # -> RLIMIT_CPU: SIGXCPU at the value, SIGKILL a second later
    processes: int | None = None  # -> pids.max (+ CGROUP_HEADROOM) and RLIMIT_NPROC
    file_size: int | None = None  # bytes -> RLIMIT_FSIZE
    open_files: int | None = None  # -> RLIMIT_NOFILE
    disk: int | None = None  # bytes -> the size of the scratch tmpfs (or of the watch)
    keep_scratch: bool = False  # scratch outlives the run: no tmpfs, a watched size


class Support(msgspec.Struct, frozen=True):
    """What this machine can enforce, from `probe()`. The `*_error` fields say why not."""

    landlock_abi: int  # 0 when unavailable
    drop_caps: bool  # we hold CAP_SETPCAP: bounding set, securebits and capset can all drop
    netns: bool  # unshare(CLONE_NEWNET) is permitted here
    caps_held: bool = False  # the process holds any capability (root, or file caps)
    uid: int = -1
    landlock_error: str = ""
    netns_error: str = ""
    # "v2", "v1" or "" (then `cgroup_error` says why): the cgroup mechanism for workers.
    cgroup: str = ""
    cgroup_dir: str = ""  # our own cgroup in the pids hierarchy: brood-<zygote pid> goes here
    # Where the memory limit goes: v1, our own memory cgroup; v2, cgroup_dir; "" when the
    # memory controller is not usable (`cgroup_error` then says why, and RLIMIT_AS remains).
    cgroup_memory_dir: str = ""
    cgroup_error: str = ""
    # The seccomp filter installs and refuses what it should (then user namespaces are
    # refused as well); `seccomp_error` says why not.
    seccomp: bool = False
    seccomp_error: str = ""
    no_new_privs: bool = False  # PR_SET_NO_NEW_PRIVS exists (Linux 3.5)
    # How a worker can bound its scratch: disk.TMPFS, disk.TMPFS_USERNS, or "" (then
    # `disk_error` says why, and the supervisor watches scratch sizes instead).
    disk: str = ""
    disk_error: str = ""


# ---- probing ------------------------------------------------------------------------------
def _errno_text(err: int) -> str:
    return f"{errno.errorcode.get(err, str(err))}: {os.strerror(err)}"


def _landlock_numbers() -> tuple[int, int, int] | None:
    return _LANDLOCK_SYSCALLS.get(platform.machine())


def _probe_landlock() -> tuple[int, str]:
    numbers = _landlock_numbers()
    if numbers is None:
        return 0, f"no Landlock syscall numbers for architecture {platform.machine()!r}"
    abi = _libc.syscall(
        ctypes.c_long(numbers[0]), None, ctypes.c_size_t(0), ctypes.c_uint32(1)
    )  # LANDLOCK_CREATE_RULESET_VERSION
    if abi >= 1:
        return int(abi), ""
    err = ctypes.get_errno()
    if err == errno.ENOSYS:
        return 0, "the kernel has no Landlock (ENOSYS; needs Linux 5.13+ built with it)"
    if err == errno.EOPNOTSUPP:
        return 0, "Landlock is built in but disabled (add landlock to the lsm= boot parameter)"
    return 0, f"landlock_create_ruleset failed ({_errno_text(err)})"


def _status_caps() -> tuple[int, int]:
    """(effective, permitted) capability masks of this process."""
    eff = prm = 0
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    eff = int(line.split()[1], 16)
                elif line.startswith("CapPrm:"):
                    prm = int(line.split()[1], 16)
    except OSError:
        pass
    return eff, prm


def _probe_netns() -> tuple[bool, str]:
    # In a short-lived child: unsharing in the caller would take its network away. The
    # child only makes one syscall and leaves with _exit, so forking a threaded caller is safe.
    try:
        pid = os.fork()
    except OSError as exc:
        return False, f"could not fork to probe ({exc})"
    if pid == 0:  # pragma: no cover - child
        code = 0 if _libc.unshare(_CLONE_NEWNET) == 0 else (ctypes.get_errno() or 1)
        os._exit(min(code, 255))
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code == 0:
        return True, ""
    if code == errno.EPERM:
        why = "not root" if os.geteuid() != 0 else "CAP_SYS_ADMIN is missing"
        return False, f"unshare(CLONE_NEWNET) is not permitted ({why})"
    if code == errno.EINVAL:
        return False, "the kernel has no network namespaces (CONFIG_NET_NS)"
    if code < 0:
        return False, f"the probe child died of signal {-code}"
    return False, f"unshare(CLONE_NEWNET) failed ({_errno_text(code)})"


@functools.cache
def probe() -> Support:
    """What this machine can enforce. Cached per process; cheap; never raises.

    Forks short-lived children to try `unshare(CLONE_NEWNET)`, the seccomp filter and a
    scratch tmpfs (`brood.worker.disk`), and one that moves itself into a test cgroup
    (created under our own and removed again; on cgroup v2 this enables the pids and memory
    controllers for our cgroup's children, which is what brood needs).
    Call it in the zygote before forking workers so they inherit the cached answer.
    """
    try:
        abi, landlock_error = _probe_landlock()
    except Exception as exc:  # never raise: report instead
        abi, landlock_error = 0, f"probe failed ({exc!r})"
    eff, prm = _status_caps()
    try:
        netns, netns_error = _probe_netns()
    except Exception as exc:
        netns, netns_error = False, f"probe failed ({exc!r})"
    try:
        seccomp, seccomp_error = _probe_seccomp()
    except Exception as exc:
        seccomp, seccomp_error = False, f"probe failed ({exc!r})"
    try:
        bound, disk_error = disk.probe()
    except Exception as exc:
        bound, disk_error = "", f"probe failed ({exc!r})"
    base = Support(
        landlock_abi=abi,
        drop_caps=bool(eff >> _CAP_SETPCAP & 1),
        netns=netns,
        caps_held=bool(eff or prm),
        uid=os.geteuid(),
        landlock_error=landlock_error,
        netns_error=netns_error,
        seccomp=seccomp,
        seccomp_error=seccomp_error,
        no_new_privs=_libc.prctl(_PR_GET_NO_NEW_PRIVS, 0, 0, 0, 0) >= 0,
        disk=bound,
        disk_error=disk_error,
    )
    try:
        return _probe_cgroup(base)
    except Exception as exc:
        return msgspec.structs.replace(base, cgroup_error=f"probe failed ({exc!r})")


# ---- what the policy asks for that is not enforced ----------------------------------------
def gaps(policy: Policy, support: Support, *, private_network: bool) -> list[str]:
    """One human line per thing `policy` asks for that will NOT be enforced here, naming it
    and why. Empty when everything is enforced. `private_network` says whether the zygote
    entered a private network namespace (`enter_private_network()` returned True)."""
    if not policy.confine:
        return [
            "confinement is off (confine=False): no Landlock, no capability drop, no network "
            "or signal confinement; only the rlimits apply"
        ]
    out: list[str] = []
    abi = support.landlock_abi
    if abi == 0:
        out.append(
            f"files: not confined ({support.landlock_error or 'no Landlock'}); the worker can "
            "read and write whatever its user can"
            + (", and read_only is guidance only" if policy.read_only else "")
        )
    else:
        if abi < 3:
            out.append(f"files: truncate(2) is not restricted (Landlock ABI {abi} < 3)")
        if abi < 5:
            out.append(f"files: ioctl on device files is not restricted (Landlock ABI {abi} < 5)")
    if abi < 6:
        why = f"Landlock ABI {abi} < 6" if abi else "no Landlock"
        out.append(
            f"signals: the worker may signal other processes of its user ({why})"
            + (", and ptrace them where the kernel's ptrace policy allows" if not abi else "")
            + ("" if private_network else "; abstract unix sockets outside it are reachable")
        )
    if not policy.network and not private_network:
        netwhy = support.netns_error or "no private network namespace was entered"
        if abi >= 4:
            out.append(
                f"network: UDP and other non-TCP sockets are not confined ({netwhy}); "
                "TCP is refused by Landlock"
            )
        else:
            why = f"Landlock ABI {abi} < 4" if abi else "no Landlock"
            out.append(f"network: not confined ({netwhy}; {why})")
    if policy.network and private_network:
        out.append(
            "network: asked for, but the zygote is in a private network namespace, so the "
            "worker has only a down loopback"
        )
    if support.caps_held and not support.drop_caps:
        out.append(
            "capabilities: the bounding set is kept (no CAP_SETPCAP); effective, permitted and "
            "inheritable sets are cleared"
        )
    if policy.processes is not None and not support.cgroup:
        nocg = f"no cgroup is used ({support.cgroup_error or 'none is usable'})"
        if support.uid == 0:
            out.append(
                f"processes: RLIMIT_NPROC does not apply to root (uid 0) and {nocg}, "
                "so the number of processes is not limited"
            )
        else:
            out.append(
                f"processes: RLIMIT_NPROC counts all processes of the user (uid {support.uid}), "
                f"not this worker's; {nocg}"
            )
    if not support.no_new_privs:
        out.append(
            "no_new_privs: the kernel has no PR_SET_NO_NEW_PRIVS (Linux < 3.5): a setuid "
            "program model code runs gains its privileges"
        )
    if not support.seccomp:
        why = support.seccomp_error or "no seccomp filter"
        out += [
            "unix sockets: connecting, or sending a datagram, to a socket bound to a path is "
            f"not refused (Landlock does not govern it; {why})",
            "other processes: prlimit, setpriority, ioprio_set and sched_set* may change any "
            f"process of the worker's user, the supervisor included ({why})",
            "namespaces: model code may make user, mount, network and pid namespaces where "
            f"the kernel lets its user ({why})",
            f"memfd: a program written to a memfd may be executed ({why})",
        ]
        if not policy.network:
            out.append(f"netlink and vsock: sockets are not refused without the network ({why})")
    if scratch_bound(policy, support) == SCRATCH_WATCHED:
        why = (
            "keep_scratch=True keeps scratch on disk to be read after the run"
            if policy.keep_scratch
            else f"scratch cannot be a tmpfs of its own here ({support.disk_error})"
        )
        out.append(
            f"disk: {why}; the supervisor watches each run's scratch and fails a run past "
            "Limits.worker_disk, but a run can write more between two looks, and scratch "
            "shares the temporary directory's filesystem (a default journal's too)"
        )
    return out


SCRATCH_WATCHED = "watched"


def scratch_bound(policy: Policy, support: Support) -> str:
    """How `policy.disk` holds for a worker here: `disk.TMPFS` or `disk.TMPFS_USERNS` (the
    worker mounts a tmpfs of that size on its scratch), SCRATCH_WATCHED (the supervisor
    watches the size), or "" (nothing to hold: no bound asked, or confinement is off)."""
    if not policy.confine or policy.disk is None:
        return ""
    if policy.keep_scratch or not support.disk:
        return SCRATCH_WATCHED
    return support.disk


# ---- paths --------------------------------------------------------------------------------
def _brood_root() -> str:
    import brood.errors  # the package's own location: works for editable and wheel installs

    return os.path.dirname(os.path.dirname(os.path.abspath(brood.errors.__file__)))


def _is_beneath(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _minimal(paths: Iterable[str]) -> list[str]:
    """Existing real paths, deduplicated, without those beneath another (fewer rules)."""
    real: set[str] = set()
    for p in paths:
        if p and os.path.exists(p):
            real.add(os.path.realpath(p))
    kept: list[str] = []
    for p in sorted(real, key=lambda s: (s.count("/"), s)):
        if not any(_is_beneath(p, k) for k in kept):
            kept.append(p)
    return sorted(kept)


@functools.cache
def _default_read_paths() -> tuple[str, ...]:
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    prefixes.discard("/")  # a prefix of / would open the whole tree; take its parts instead
    prefixes.discard("")
    python: list[str] = sorted(prefixes)
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        with_key = sysconfig.get_paths().get(key)
        if with_key:
            python.append(with_key)
    try:
        python.extend(site.getsitepackages())
    except AttributeError:  # some old virtualenvs lack it
        pass
    real_prefixes = [os.path.realpath(p) for p in prefixes]
    for entry in sys.path:
        if entry and any(_is_beneath(os.path.realpath(entry), p) for p in real_prefixes):
            python.append(entry)
    python.append(_brood_root())
    return tuple(_minimal([*python, *_SYSTEM_READ, *_DEV_READ]))


def default_read_paths() -> list[str]:
    """What every confined worker may read (and execute): the Python installation, the
    directory holding the `brood` package, system libraries and a few files under /etc and
    /dev. Not /proc, /tmp, the home directory or the current directory. Existing paths only,
    resolved; computed once per process."""
    return list(_default_read_paths())


# ---- applying -----------------------------------------------------------------------------
def _fail(what: str, err: int, hint: str = "") -> ConfinementError:
    msg = f"confinement: {what} failed ({_errno_text(err)})"
    return ConfinementError(msg + (f"; {hint}" if hint else ""))


def _set_rlimit(name: str, which: int, soft: int, hard: int | None = None) -> None:
    hard = soft if hard is None else hard
    _, cur_hard = resource.getrlimit(which)
    if cur_hard != resource.RLIM_INFINITY:  # never try to raise: only root could
        hard = min(hard, cur_hard)
        soft = min(soft, hard)
    try:
        resource.setrlimit(which, (soft, hard))
    except (OSError, ValueError) as exc:
        raise ConfinementError(
            f"confinement: setting {name} to soft={soft} hard={hard} failed ({exc}); "
            "lower the limit in Limits"
        ) from exc


def _apply_rlimits(policy: Policy) -> None:
    if policy.memory is not None:
        _set_rlimit("RLIMIT_AS (memory)", resource.RLIMIT_AS, policy.memory)
    if policy.cpu_seconds is not None:
        # soft then hard: SIGXCPU first, SIGKILL a second of CPU later if it is caught
        n = policy.cpu_seconds
        _set_rlimit("RLIMIT_CPU (cpu_seconds)", resource.RLIMIT_CPU, n, n + 1)
    if policy.processes is not None:
        _set_rlimit("RLIMIT_NPROC (processes)", resource.RLIMIT_NPROC, policy.processes)
    if policy.file_size is not None:
        _set_rlimit("RLIMIT_FSIZE (file_size)", resource.RLIMIT_FSIZE, policy.file_size)
    if policy.open_files is not None:
        _set_rlimit("RLIMIT_NOFILE (open_files)", resource.RLIMIT_NOFILE, policy.open_files)


def set_child_subreaper() -> None:
    """Make this process a child subreaper: what its descendants orphan is reparented to it,
    not to init. Through the libc handle loaded once at import (in the zygote, before any
    fork): a worker that loaded its own (ctypes.CDLL) would spend a third of a millisecond
    and ~90 copy-on-write faults on it. A no-op where prctl refuses."""
    _libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _prctl(what: str, option: int, arg2: int = 0, arg3: int = 0) -> int:
    ctypes.set_errno(0)
    rc: int = _libc.prctl(option, arg2, arg3, 0, 0)
    if rc < 0:
        raise _fail(what, ctypes.get_errno())
    return rc


def _thread_count() -> int:
    try:
        # procfs counts a process's threads in the link count of its task directory (2 +
        # one per thread): one stat, where listing them costs a fresh worker ten times more.
        links = os.stat("/proc/self/task").st_nlink
        return links - 2 if links > 2 else len(os.listdir("/proc/self/task"))
    except OSError:  # no /proc: Python's own threads are what we can see
        return threading.active_count()


def _handled_fs(abi: int) -> int:
    rights = _FS_ABI1
    if abi >= 2:
        rights |= _FS_REFER
    if abi >= 3:
        rights |= _FS_TRUNCATE
    if abi >= 5:
        rights |= _FS_IOCTL_DEV
    return rights


# The Landlock rules for `default_read_paths()`, made once by `prepare` in the zygote (at
# the Landlock ABI in `_held_abi`), each holding an O_PATH descriptor of its path: a worker
# inherits them and only adds them to its ruleset, instead of opening, inspecting and
# describing each path again. `apply` closes them once its ruleset is in force, before any
# model code runs.
_held_rules: list[tuple[str, _PathBeneathAttr]] = []
_held_abi = 0


def _hold_read_rules(abi: int) -> None:
    global _held_abi
    read = _FS_READ & _handled_fs(abi)
    for path in default_read_paths():
        try:
            pfd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue  # the worker tries it again, and names the path if it fails there too
        access = read if stat.S_ISDIR(os.fstat(pfd).st_mode) else read & _FS_FILE_RIGHTS
        _held_rules.append((path, _PathBeneathAttr(allowed_access=access, parent_fd=pfd)))
    _held_abi = abi


def held_fds() -> list[int]:
    """The descriptors `prepare` holds for the Landlock rules of every worker: a worker
    forked from this process keeps them until `apply` has used and closed them."""
    return [rule.parent_fd for _, rule in _held_rules]


def _release_held_rules() -> None:
    while _held_rules:
        os.close(_held_rules.pop()[1].parent_fd)


def _landlock_rules(policy: Policy, handled: int, held: bool) -> list[tuple[str, int]]:
    """The rules of `policy` as (path, access); with `held`, not those of `_held_rules`."""
    read = _FS_READ & handled
    write = handled  # every right the running ABI knows
    rules: list[tuple[str, int]] = [] if held else [(p, read) for p in default_read_paths()]
    if policy.network:
        rules += [(p, read) for p in _NETWORK_READ]
    rules += [(p, read) for p in policy.fs_read]
    writable = [policy.scratch, *policy.fs_write]
    rules += [(p, read if policy.read_only else write) for p in writable]
    rules.append(("/dev/null", read | _FS_WRITE_FILE))  # writing to /dev/null is harmless
    return rules


def _add_landlock_rule(add_rule: int, ruleset: int, rule: _PathBeneathAttr, path: str) -> None:
    """Add one path-beneath rule to the ruleset being built."""
    rc = _libc.syscall(
        ctypes.c_long(add_rule),
        ctypes.c_int(ruleset),
        ctypes.c_int(_LANDLOCK_RULE_PATH_BENEATH),
        ctypes.byref(rule),
        ctypes.c_uint32(0),
    )
    if rc < 0:
        raise _fail(f"landlock_add_rule for {path!r}", ctypes.get_errno())


def _apply_landlock(policy: Policy, abi: int) -> None:
    numbers = _landlock_numbers()
    if numbers is None:
        raise ConfinementError(
            f"confinement: Landlock ABI {abi} reported but no syscall numbers for "
            f"{platform.machine()!r}"
        )
    create, add_rule, restrict = numbers
    handled = _handled_fs(abi)
    attr = _RulesetAttr(handled_access_fs=handled)
    size = 8
    if abi >= 4:
        size = 16
        if not policy.network:  # handled with no rule: every TCP bind and connect is refused
            attr.handled_access_net = _NET_BIND_TCP | _NET_CONNECT_TCP
    if abi >= 6:
        size = 24
        attr.scoped = _SCOPE_SIGNAL | _SCOPE_ABSTRACT_UNIX_SOCKET
    fd = _libc.syscall(
        ctypes.c_long(create), ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0)
    )
    if fd < 0:
        raise _fail(f"landlock_create_ruleset (ABI {abi})", ctypes.get_errno())
    held = _held_abi == abi
    try:
        for path, held_rule in _held_rules if held else ():
            _add_landlock_rule(add_rule, fd, held_rule, path)
        for path, access in _landlock_rules(policy, handled, held):
            try:
                pfd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except (FileNotFoundError, NotADirectoryError):
                continue  # paths that do not exist are skipped
            except OSError as exc:
                raise ConfinementError(
                    f"confinement: cannot open {path!r} for a Landlock rule ({exc}); fix or "
                    "drop the path in Limits(fs_read=, fs_write=)"
                ) from exc
            try:
                if not stat.S_ISDIR(os.fstat(pfd).st_mode):
                    access &= _FS_FILE_RIGHTS
                rule = _PathBeneathAttr(allowed_access=access, parent_fd=pfd)
                _add_landlock_rule(add_rule, fd, rule, path)
            finally:
                os.close(pfd)
        rc = _libc.syscall(ctypes.c_long(restrict), ctypes.c_int(fd), ctypes.c_uint32(0))
        if rc < 0:
            raise _fail("landlock_restrict_self", ctypes.get_errno())
    finally:
        os.close(fd)
        _release_held_rules()


_bounding_dropped = False  # this process emptied its bounding set and locked securebits


def _drop_bounding_set() -> None:
    # Every capability in the bounding set, until the kernel says the number is unknown.
    for cap in range(64):
        ctypes.set_errno(0)
        if _libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) < 0:
            err = ctypes.get_errno()
            if err == errno.EINVAL and cap > _CAP_SETPCAP:
                break
            raise _fail(f"PR_CAPBSET_DROP of capability {cap}", err)
    _prctl("PR_SET_SECUREBITS", _PR_SET_SECUREBITS, _SECUREBITS_LOCKED_DOWN)


def _drop_caps(full: bool) -> None:
    if full:
        _drop_bounding_set()
    ctypes.set_errno(0)
    if _libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) < 0:
        err = ctypes.get_errno()
        if err != errno.EINVAL:  # EINVAL: a kernel before ambient capabilities (4.3)
            raise _fail("PR_CAP_AMBIENT_CLEAR_ALL", err)
    header = _CapHeader(version=_LINUX_CAPABILITY_VERSION_3, pid=0)
    data = _CapDataPair()
    if _libc.capset(ctypes.byref(header), ctypes.byref(data)) < 0:
        raise _fail("capset to no capabilities", ctypes.get_errno())
    check = _CapDataPair()
    if _libc.capget(ctypes.byref(header), ctypes.byref(check)) < 0:
        raise _fail("capget", ctypes.get_errno())
    if any(d.effective or d.permitted or d.inheritable for d in check):
        raise ConfinementError("confinement: capabilities remain after capset to none")


def apply(policy: Policy, support: Support) -> None:
    """Confine the calling process to `policy`, using what `support` says exists.

    Call in a freshly forked worker BEFORE it starts any thread: Landlock, no_new_privs and
    capabilities apply to the calling thread (threads started later inherit them). Order:
    rlimits; PR_SET_NO_NEW_PRIVS; Landlock (files, TCP unless `policy.network`, and at ABI 6
    signal and abstract-socket scoping); the capability drop; the seccomp filter (see
    `seccomp_program`); PR_SET_CHILD_SUBREAPER. Before all that, where `scratch_bound` says
    so, it mounts the scratch tmpfs (`brood.worker.disk`): change into `policy.scratch`
    after `apply`, not before. Raises `ConfinementError` when a mechanism `support` reports
    fails to apply, or when the process already runs more than one thread. With
    `policy.confine` False, sets only the rlimits and the subreaper flag.
    """
    if policy.confine and (n := _thread_count()) != 1:
        raise ConfinementError(
            f"confinement: the process runs {n} threads; Landlock and the capability drop "
            "bind only the calling thread, so apply() must run before any thread starts"
        )
    # First the scratch tmpfs: the Landlock rules below must name it, not the directory
    # beneath it.
    bound = scratch_bound(policy, support)
    mounts = policy.disk is not None and bound in (disk.TMPFS, disk.TMPFS_USERNS)
    # Emptied before the fork (`prepare`): a process inherits its bounding set and
    # securebits, and can never widen them again, except in a user namespace of its own.
    bounding_dropped = _bounding_dropped
    if mounts and disk.bound_scratch(policy.scratch, policy.disk or 0, bound):
        # The new user namespace gave this process every capability within it, and a full
        # bounding set.
        support = msgspec.structs.replace(support, drop_caps=True, caps_held=True)
        bounding_dropped = False
    _apply_rlimits(policy)
    if policy.confine:
        if support.no_new_privs:
            _prctl("PR_SET_NO_NEW_PRIVS", _PR_SET_NO_NEW_PRIVS, 1)
        if support.landlock_abi > 0:
            _apply_landlock(policy, support.landlock_abi)
        if support.drop_caps or support.caps_held:
            _drop_caps(full=support.drop_caps and not bounding_dropped)
        if support.seccomp:  # after no_new_privs, which a filter needs without CAP_SYS_ADMIN
            _install_filter(_compiled_filter(policy.network))
    # Lifecycle, not security: orphans of model code reparent to the worker, not past it.
    _prctl("PR_SET_CHILD_SUBREAPER", _PR_SET_CHILD_SUBREAPER, 1)


# ---- seccomp: what Landlock does not scope --------------------------------------------------
# One filter, installed once per worker (`apply`), inherited by every thread and process the
# worker starts, and never removable. Landlock scopes files, TCP, signals and ptrace; the
# calls below act on things Landlock does not see, and the kernel lets them reach any
# process or socket of the worker's user, which is the supervisor's user:
#
# - Unix sockets. Landlock (up to ABI 7) does not govern connect() or sendto() to a socket
#   bound to a path, so socket(AF_UNIX) is refused: model code cannot reach a container
#   engine's socket, the journal daemon's or another tree's. socketpair(AF_UNIX,
#   SOCK_STREAM), which asyncio's self-pipe uses, stays; a SOCK_DGRAM pair is refused, since
#   sendto() on a datagram socket names any path-bound socket. With the network off, also
#   sendto() with an address, sendmsg() and sendmmsg() (whose address sits in a struct the
#   filter cannot read; the worker's own channel uses send()), and netlink and vsock
#   sockets. io_uring could make sockets past all this: refused.
# - Other processes. prlimit64, setpriority, ioprio_set and sched_set* only ask that the
#   target has the caller's user: model code could set RLIMIT_CPU=1 on the supervisor. Each
#   may change the caller itself only (pid, or `who`, 0); reading limits (prlimit64 with no
#   new limit, as resource.getrlimit does) stays allowed for any pid.
# - Namespaces. unshare, setns and clone with a CLONE_NEW* flag are refused: a new user
#   namespace gives back every capability inside it, and with them mount, network and pid
#   namespaces of its own. clone3 passes its flags in a struct the filter cannot read, so it
#   answers ENOSYS, and glibc falls back to clone (threads, fork, posix_spawn all do).
# - memfd exec. A memfd lives on an internal mount Landlock does not check, so
#   execve("/proc/self/fd/N") runs whatever was written to one (tried on Linux 6.18 with
#   Landlock ABI 7), and a filter cannot read execve's path. So memfd_create is allowed only
#   with MFD_NOEXEC_SEAL (Linux 6.3+: no exec bits, sealed so; older kernels refuse the flag,
#   so no memfd at all there), and execveat with AT_EMPTY_PATH (fexecve) is refused. Neither
#   CPython nor glibc makes a memfd of its own, and ctypes callbacks use anonymous memory.
#   Scratch keeps its EXECUTE right: a program model code writes there runs, on a path
#   Landlock sees and confined as the worker is.
# Refusals are EPERM (EACCES for socket families, as before): PermissionError in Python.


class _Numbers(NamedTuple):
    """The system call numbers the filter looks at, for one machine."""

    arch: int  # AUDIT_ARCH_*: a call made through another ABI has other numbers
    x32: int  # x86_64's x32 bit (calls with it use the x32 table), or 0
    socket: int
    socketpair: int
    sendto: int
    sendmsg: int
    sendmmsg: int
    io_uring_setup: int
    prlimit64: int
    setpriority: int
    ioprio_set: int
    sched_setparam: int
    sched_setscheduler: int
    sched_setaffinity: int
    sched_setattr: int
    unshare: int
    setns: int
    clone: int
    clone3: int
    execveat: int
    memfd_create: int


# x86_64: arch/x86/entry/syscalls/syscall_64.tbl; aarch64: include/uapi/asm-generic/unistd.h.
_SECCOMP = {
    "x86_64": _Numbers(
        arch=0xC000003E,
        x32=0x40000000,
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
    "aarch64": _Numbers(
        arch=0xC00000B7,
        x32=0,
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
_SECCOMP["arm64"] = _SECCOMP["aarch64"]
_AF_UNIX, _AF_NETLINK, _AF_VSOCK = 1, 16, 40
_SOCK_DGRAM, _SOCK_TYPE_MASK = 2, 0xF  # SOCK_CLOEXEC and SOCK_NONBLOCK sit above the mask
_PRIO_PGRP = 1  # setpriority's `which`: 0 a process, 1 a process group, 2 a user
_IOPRIO_WHO_PGRP = 2  # ioprio_set's `which`: 1 a process, 2 a process group, 3 a user
# CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID and NEWNET. CLONE_NEWTIME (0x80) is
# no clone() flag: clone's low byte is the exit signal.
_CLONE_NEW_ANY = 0x7E020000
_CLONE_NEWUSER = 0x10000000
_AT_EMPTY_PATH = 0x1000
_MFD_NOEXEC_SEAL, _MFD_EXEC = 0x0008, 0x0010
_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2
_RET_ALLOW, _RET_ERRNO = 0x7FFF0000, 0x00050000
# Classic BPF: load a 32-bit word of struct seccomp_data into the accumulator, AND it with a
# constant, compare it (jump if equal, greater, greater or equal, any bit set), return.
_LD_W_ABS, _ALU_AND_K, _RET_K = 0x20, 0x54, 0x06
_JEQ_K, _JGT_K, _JGE_K, _JSET_K = 0x15, 0x25, 0x35, 0x45
_BPF_MAX_JUMP = 255  # a conditional jump's offsets are one byte each
# struct seccomp_data: nr at 0, arch at 4, six 64-bit arguments from 16. Both machines are
# little-endian: an argument's low half is at 16 + 8 * i, its high half 4 bytes later. An int
# argument (a pid, a flag word) is its low half: the kernel ignores the high one.
_NR, _ARCH = 0, 4


def _low(i: int) -> int:
    return 16 + 8 * i


def _high(i: int) -> int:
    return 16 + 8 * i + 4


_Target = str | None  # a label to jump to, or None: the next instruction


class _Program:
    """A classic BPF program being written, with named jump targets (forward only, as BPF
    requires), resolved by `assemble`."""

    def __init__(self) -> None:
        self.code: list[tuple[int, _Target, _Target, int]] = []
        self.labels: dict[str, int] = {}

    def label(self, name: str) -> None:
        self.labels[name] = len(self.code)

    def load(self, offset: int) -> None:
        self.code.append((_LD_W_ABS, None, None, offset))

    def mask(self, bits: int) -> None:
        self.code.append((_ALU_AND_K, None, None, bits))

    def jump(self, op: int, k: int, yes: _Target = None, no: _Target = None) -> None:
        self.code.append((op, yes, no, k))

    def ret(self, action: int) -> None:
        self.code.append((_RET_K, None, None, action))

    def if_null(self, arg: int, yes: str, no: str) -> None:
        """Jump to `yes` if pointer argument `arg` is NULL (both halves zero), else `no`."""
        self.load(_low(arg))
        self.jump(_JEQ_K, 0, no=no)
        self.load(_high(arg))
        self.jump(_JEQ_K, 0, yes=yes, no=no)

    def assemble(self) -> list[tuple[int, int, int, int]]:
        return [
            (op, self._offset(at, yes), self._offset(at, no), k)
            for at, (op, yes, no, k) in enumerate(self.code)
        ]

    def _offset(self, at: int, target: _Target) -> int:
        if target is None:
            return 0
        offset = self.labels[target] - at - 1
        if not 0 <= offset <= _BPF_MAX_JUMP:
            raise ValueError(f"seccomp: a jump from {at} to {target!r} spans {offset}")
        return offset


def seccomp_program(network: bool, machine: str | None = None) -> list[tuple[int, int, int, int]]:
    """The worker's filter as (code, jt, jf, k) instructions. With `network` False it also
    refuses addressed sends and netlink and vsock sockets. Raises KeyError for a machine
    brood has no system call numbers for."""
    n = _SECCOMP[machine or platform.machine()]
    p = _Program()
    p.load(_ARCH)
    p.jump(_JEQ_K, n.arch, no="other_abi")
    p.load(_NR)
    if n.x32:
        p.jump(_JGE_K, n.x32, yes="other_abi")
    # Which call is it: refused outright, answered ENOSYS, or its arguments looked at below.
    refused = [n.io_uring_setup, n.unshare, n.setns]
    checked = {
        "socket": [n.socket],
        "socketpair": [n.socketpair],
        "own_limits": [n.prlimit64],
        "own_priority": [n.setpriority],
        "own_io_priority": [n.ioprio_set],
        "own_scheduling": [
            n.sched_setparam,
            n.sched_setscheduler,
            n.sched_setaffinity,
            n.sched_setattr,
        ],
        "clone": [n.clone],
        "execveat": [n.execveat],
        "memfd_create": [n.memfd_create],
    }
    if not network:
        refused += [n.sendmsg, n.sendmmsg]
        checked["sendto"] = [n.sendto]
    for nr in refused:
        p.jump(_JEQ_K, nr, yes="eperm")
    p.jump(_JEQ_K, n.clone3, yes="enosys")
    for name, numbers in checked.items():
        for nr in numbers:
            p.jump(_JEQ_K, nr, yes=name)
    p.ret(_RET_ALLOW)

    p.label("socket")  # socket(family, type, protocol)
    p.load(_low(0))
    p.jump(_JEQ_K, _AF_UNIX, yes="eacces")
    if not network:
        p.jump(_JEQ_K, _AF_NETLINK, yes="eacces")
        p.jump(_JEQ_K, _AF_VSOCK, yes="eacces")
    p.ret(_RET_ALLOW)

    p.label("socketpair")  # socketpair(family, type, protocol, sv)
    p.load(_low(0))
    p.jump(_JEQ_K, _AF_UNIX, no="allow")
    p.load(_low(1))
    p.mask(_SOCK_TYPE_MASK)
    p.jump(_JEQ_K, _SOCK_DGRAM, yes="eacces", no="allow")

    if not network:
        p.label("sendto")  # sendto(fd, buf, len, flags, dest_addr, addrlen)
        p.if_null(4, yes="allow", no="eperm")

    p.label("own_limits")  # prlimit64(pid, resource, new_limit, old_limit)
    p.load(_low(0))
    p.jump(_JEQ_K, 0, yes="allow")  # pid 0: the caller itself, read or set
    p.if_null(2, yes="allow", no="eperm")  # another process: read only

    p.label("own_priority")  # setpriority(which, who, prio)
    p.load(_low(0))
    p.jump(_JGT_K, _PRIO_PGRP, yes="eperm")  # PRIO_USER: every process of the user
    p.load(_low(1))
    p.jump(_JEQ_K, 0, yes="allow", no="eperm")  # who 0: the caller or its process group

    p.label("own_io_priority")  # ioprio_set(which, who, ioprio)
    p.load(_low(0))
    p.jump(_JGT_K, _IOPRIO_WHO_PGRP, yes="eperm")  # IOPRIO_WHO_USER: the whole user
    p.load(_low(1))
    p.jump(_JEQ_K, 0, yes="allow", no="eperm")

    p.label("own_scheduling")  # sched_set*(pid, ...)
    p.load(_low(0))
    p.jump(_JEQ_K, 0, yes="allow", no="eperm")

    p.label("clone")  # clone(flags, stack, ...): flags are the first argument on both
    p.load(_low(0))
    p.jump(_JSET_K, _CLONE_NEW_ANY, yes="eperm", no="allow")

    p.label("execveat")  # execveat(dirfd, path, argv, envp, flags)
    p.load(_low(4))
    p.jump(_JSET_K, _AT_EMPTY_PATH, yes="eperm", no="allow")

    p.label("memfd_create")  # memfd_create(name, flags)
    p.load(_low(1))
    p.jump(_JSET_K, _MFD_EXEC, yes="eperm")
    p.jump(_JSET_K, _MFD_NOEXEC_SEAL, yes="allow", no="eperm")

    p.label("allow")
    p.ret(_RET_ALLOW)
    p.label("eperm")
    p.ret(_RET_ERRNO | errno.EPERM)
    p.label("eacces")
    p.ret(_RET_ERRNO | errno.EACCES)
    p.label("enosys")
    p.ret(_RET_ERRNO | errno.ENOSYS)
    p.label("other_abi")  # int 0x80 or x32 on x86_64: other numbers, so refuse them all
    p.ret(_RET_ERRNO | errno.EACCES)
    return p.assemble()


class _SockFilter(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_uint16),
        ("jt", ctypes.c_uint8),
        ("jf", ctypes.c_uint8),
        ("k", ctypes.c_uint32),
    ]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def _numbers_known(machine: str | None = None) -> bool:
    """Whether brood knows the system call numbers of this machine (x86_64, aarch64)."""
    return (machine or platform.machine()) in _SECCOMP


@functools.cache
def _compiled_filter(network: bool) -> _SockFprog:
    """The filter as the kernel takes it. Cached: `prepare` builds it in the zygote, so a
    worker only installs it; building it there cost each worker about a millisecond (and
    copy-on-write pages) at every fork."""
    program = seccomp_program(network)
    filters = (_SockFilter * len(program))(*[_SockFilter(*ins) for ins in program])
    return _SockFprog(len(program), filters)  # holds `filters` alive (ctypes' _objects)


def _install_filter(fprog: _SockFprog) -> None:
    ctypes.set_errno(0)
    if _libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.addressof(fprog), 0, 0) < 0:
        raise _fail("installing the seccomp filter", ctypes.get_errno())


def prepare(policy: Policy, support: Support) -> None:
    """Do once, in the zygote before it forks, what every worker's `apply` needs: compute
    the Landlock read paths, their rules (holding a descriptor of each path: `held_fds`,
    which the zygote leaves open in a worker until `apply` has used them) and the compiled
    seccomp filter (workers then share them copy-on-write instead of each building its
    own), and, where `support.drop_caps`, empty
    this process's capability bounding set and lock its securebits, which every worker
    forked from it inherits (and `apply` then leaves as they are: dropping them again cost
    each worker ~45 system calls, each replacing its credentials). The zygote keeps its
    effective capabilities and never executes a program, so it loses nothing it uses.
    Should the drop fail here, every worker makes it itself."""
    global _bounding_dropped
    if policy.confine:
        default_read_paths()
        if support.landlock_abi > 0 and _landlock_numbers() is not None and not _held_rules:
            _hold_read_rules(support.landlock_abi)
        if support.seccomp:
            _compiled_filter(policy.network)
        if support.drop_caps and not _bounding_dropped:
            try:
                _drop_bounding_set()
            except ConfinementError:
                return
            _bounding_dropped = True


_PROBE_NOT_REFUSED = 200  # the probe child's exit code when the filter let unshare through


def _probe_seccomp() -> tuple[bool, str]:
    """Install the filter in a short-lived child, as `apply` does (after no_new_privs), and
    check that it refuses unshare(CLONE_NEWUSER). The program is built here, so the child
    only makes system calls and leaves with _exit (safe in a threaded caller)."""
    if not _numbers_known():
        return False, f"brood has no system call numbers for {platform.machine()!r}"
    program = _compiled_filter(network=False)
    try:
        pid = os.fork()
    except OSError as exc:
        return False, f"could not fork to probe ({exc})"
    if pid == 0:  # pragma: no cover - child
        code = 0
        try:
            _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)  # failing here shows at install
            _install_filter(program)
            code = _PROBE_NOT_REFUSED
            if _libc.unshare(_CLONE_NEWUSER) < 0 and ctypes.get_errno() == errno.EPERM:
                code = 0
        except ConfinementError:
            code = min(ctypes.get_errno() or 1, 255)
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code == 0:
        return True, ""
    if code == _PROBE_NOT_REFUSED:
        return False, "the filter was installed but did not refuse unshare(CLONE_NEWUSER)"
    if code == errno.EINVAL:
        return False, "the kernel has no seccomp filters (CONFIG_SECCOMP_FILTER)"
    if code == errno.EACCES:
        return False, "installing a filter needs no_new_privs or CAP_SYS_ADMIN"
    if code < 0:
        return False, f"the probe child died of signal {-code}"
    return False, f"installing a filter failed ({_errno_text(code)})"


def enter_private_network() -> bool:
    """Move the calling process into a new network namespace: its later children see only a
    loopback interface that is down. Call once in the zygote, single-threaded, before it
    forks workers, when the network is off. Returns True if done, False if not permitted
    (`gaps()` then names what stays open); never raises."""
    return bool(_libc.unshare(_CLONE_NEWNET) == 0)


# ---- cgroups ------------------------------------------------------------------------------
# Layout: the zygote makes <our own cgroup>/brood-<zygote pid> once (in the pids hierarchy,
# and on v1 also in the memory hierarchy), each worker makes and enters <that>/<its pid>
# before `apply` (Landlock then keeps it from writing to /sys/fs/cgroup), and the zygote
# kills and removes a worker's cgroup once its exit is confirmed.

BATCH_THREADS = 16
"""Threads a worker runs the work model code `spawn()`s on, started as work comes. They run
at model code's request, so they count among its `Policy.processes` (llm_query_batched
needs none: its calls are all in flight from the calling thread)."""

CGROUP_HEADROOM = 2
"""Tasks added to `Policy.processes` in pids.max: brood's own tasks in a worker, exactly (its
main thread and the link reader), both running before model code starts (`pids_capped`), so
model code gets exactly `Policy.processes` tasks of its own. Starting 16 call threads in
every worker beforehand, as brood once did, cost each worker about 2.5 ms of CPU."""

_pids_capped = False  # this process is in a worker cgroup whose pids.max caps model code

_CGROUP_KILL_ROUNDS = 200
_PIDFD_BATCH = 256


def _unescape(field: str) -> str:
    """A /proc/self/mountinfo field: spaces and the like are written as octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _cgroup_mounts() -> tuple[dict[str, tuple[str, str]], tuple[str, str] | None]:
    """({v1 controller: (mount root, mount point)}, (root, point) of the cgroup2 mount)."""
    v1: dict[str, tuple[str, str]] = {}
    v2: tuple[str, str] | None = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, sep, right = line.partition(" - ")
            fields, rest = left.split(), right.split()
            if not sep or len(fields) < 5 or not rest:
                continue
            where = (_unescape(fields[3]), _unescape(fields[4]))
            if rest[0] == "cgroup2" and v2 is None:
                v2 = where
            elif rest[0] == "cgroup" and len(rest) >= 3:
                for opt in rest[2].split(","):
                    v1.setdefault(opt, where)
    return v1, v2


def _own_cgroups() -> tuple[dict[str, str], str | None]:
    """({v1 controller: our cgroup path}, our cgroup v2 path), from /proc/self/cgroup."""
    v1: dict[str, str] = {}
    v2: str | None = None
    with open("/proc/self/cgroup") as f:
        for line in f:
            hierarchy, _, rest = line.rstrip("\n").partition(":")
            controllers, _, path = rest.partition(":")
            if hierarchy == "0" and not controllers:
                v2 = path
            else:
                for name in controllers.split(","):
                    v1[name] = path
    return v1, v2


def _cgroup_dir(mount: tuple[str, str], path: str) -> str | None:
    root, point = mount
    if root != "/":
        if path != root and not path.startswith(root.rstrip("/") + "/"):
            return None  # our cgroup is not visible through this mount
        path = path[len(root) :]
    return os.path.normpath(os.path.join(point, path.lstrip("/")))


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _mkdir(leaf: str) -> None:
    try:
        os.mkdir(leaf, 0o755)
    except FileExistsError:  # left by an earlier worker with this pid: reused
        pass


def _read(path: str) -> bytes:
    """The whole of a small kernel file, read raw: the zygote reads cgroup files at every
    reap, where a text-mode file object costs more than the read."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        data = b""
        while chunk := os.read(fd, 65536):
            data += chunk
        return data
    finally:
        os.close(fd)


def _procs(leaf: str) -> list[int]:
    return [int(p) for p in _read(os.path.join(leaf, "cgroup.procs")).split()]


def _memory_leaf_parent(parent: str, support: Support) -> str | None:
    """The v1 memory hierarchy's counterpart of `parent` (None on v2 or without memory)."""
    if support.cgroup != "v1" or not support.cgroup_memory_dir:
        return None
    return os.path.join(support.cgroup_memory_dir, os.path.basename(parent))


def _controllers(support: Support) -> list[str]:
    return ["pids", "memory"] if support.cgroup_memory_dir else ["pids"]


def _delegate(directory: str, controllers: list[str]) -> None:
    """Enable `controllers` for the children of a v2 cgroup (cgroup.subtree_control)."""
    with open(os.path.join(directory, "cgroup.subtree_control")) as f:
        enabled = f.read().split()
    missing = [c for c in controllers if c not in enabled]
    if missing:
        knob = os.path.join(directory, "cgroup.subtree_control")
        _write(knob, " ".join("+" + c for c in missing))


def _make_parent(support: Support, name: str) -> str:
    parent = os.path.join(support.cgroup_dir, name)
    made: list[str] = []
    try:
        if support.cgroup == "v2":
            _delegate(support.cgroup_dir, _controllers(support))
        for directory in (parent, _memory_leaf_parent(parent, support)):
            if directory is not None:
                os.mkdir(directory, 0o755)
                made.append(directory)
        if support.cgroup == "v2":
            # brood-<pid> holds no process itself, so its children may have controllers.
            _delegate(parent, _controllers(support))
    except OSError:
        for directory in reversed(made):
            try:
                os.rmdir(directory)
            except OSError:
                pass
        raise
    return parent


def _why(what: str, exc: OSError, support: Support) -> str:
    text = f"{what} failed ({_errno_text(exc.errno or 0)})"
    if support.cgroup == "v2" and exc.errno == errno.EBUSY and "subtree_control" in what:
        text += (
            "; cgroup v2 allows no controllers below a cgroup that holds processes, and "
            f"{support.cgroup_dir} holds brood's: start brood in a cgroup of its own below a "
            "delegated one"
        )
    elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        text += "; the cgroup is not writable by this user (not delegated)"
    return text


_STALE = re.compile(r"brood-(?:probe-)?(\d+)(?:-[0-9a-f]+)?")


def _sweep_stale(support: Support) -> None:
    """Remove what zygotes that died without shutting down (SIGKILL) left: empty cgroups
    named after a pid that no longer exists. A busy one stays (rmdir refuses it)."""
    for base in (support.cgroup_dir, support.cgroup_memory_dir if support.cgroup == "v1" else ""):
        try:
            entries = list(os.scandir(base)) if base else []
        except OSError:
            continue
        for entry in entries:
            match = _STALE.fullmatch(entry.name)
            if not match or not entry.is_dir(follow_symlinks=False):
                continue
            owner = int(match.group(1))
            if owner == os.getpid() or os.path.exists(f"/proc/{owner}"):
                continue
            try:
                leaves = [e.path for e in os.scandir(entry.path) if e.is_dir()]
            except OSError:
                continue
            for leaf in leaves:
                _rmdir(leaf)
            _rmdir(entry.path)


def cgroup_parent(support: Support | None = None) -> str | None:
    """Create this process's (the zygote's) cgroup for its workers: `brood-<pid>` under our
    own cgroup in the pids hierarchy (and, on v1, in the memory hierarchy too). Returns its
    path (the pids one), or None when `support.cgroup` is empty. Raises `ConfinementError`
    if the machine supports cgroups but this fails. Call once, before forking workers."""
    support = probe() if support is None else support
    if not support.cgroup:
        return None
    _sweep_stale(support)
    name = f"brood-{os.getpid()}"
    for _ in range(3):
        try:
            return _make_parent(support, name)
        except FileExistsError:  # the same pid in another pid namespace, or a crashed zygote
            name = f"brood-{os.getpid()}-{os.urandom(4).hex()}"
        except OSError as exc:
            what = f"creating the cgroup {os.path.join(support.cgroup_dir, name)}"
            raise ConfinementError(f"confinement: {_why(what, exc, support)}") from exc
    raise ConfinementError(f"confinement: cgroup names under {support.cgroup_dir} are taken")


def _leaves(parent: str, name: int | str, support: Support) -> tuple[str, str | None]:
    """Worker cgroup `name`'s directory under `parent` (pids; on v2 memory too) and, where
    the memory controller is usable, its memory directory (the same one on v2)."""
    leaf = os.path.join(parent, str(name))
    mem_parent = _memory_leaf_parent(parent, support)
    mem_leaf: str | None = leaf if support.cgroup == "v2" else None
    if mem_parent is not None:
        mem_leaf = os.path.join(mem_parent, str(name))
    if not support.cgroup_memory_dir:
        mem_leaf = None
    return leaf, mem_leaf


def cgroup_make(
    parent: str, name: int | str, policy: Policy, support: Support | None = None
) -> None:
    """Create worker cgroup `<parent>/<name>` and set its limits (pids.max =
    `policy.processes` + CGROUP_HEADROOM; the memory limit = `policy.memory` where the
    memory controller is usable). The zygote makes one per slot and reuses it for worker
    after worker (`cgroup_join`): making a cgroup costs the kernel far more than joining
    one. Raises `ConfinementError` naming the step that failed."""
    support = probe() if support is None else support
    leaf, mem_leaf = _leaves(parent, name, support)
    step = f"creating the cgroup {leaf}"
    try:
        _mkdir(leaf)
        if policy.processes is not None:
            step = f"setting pids.max of {leaf} to {policy.processes} + {CGROUP_HEADROOM}"
            _write(os.path.join(leaf, "pids.max"), str(policy.processes + CGROUP_HEADROOM))
        if mem_leaf is not None:
            if mem_leaf != leaf:
                step = f"creating the cgroup {mem_leaf}"
                _mkdir(mem_leaf)
            if policy.memory is not None:
                knob = "memory.max" if support.cgroup == "v2" else "memory.limit_in_bytes"
                step = f"setting {knob} of {mem_leaf} to {policy.memory}"
                _write(os.path.join(mem_leaf, knob), str(policy.memory))
    except OSError as exc:
        raise ConfinementError(f"confinement: cgroup: {_why(step, exc, support)}") from exc


def cgroup_join(
    parent: str, name: int | str, pid: int, policy: Policy, support: Support | None = None
) -> None:
    """Move process `pid` into worker cgroup `<parent>/<name>` (`cgroup_make`). Called by
    the worker itself, single-threaded, before `apply` (whose Landlock closes
    /sys/fs/cgroup). Raises `ConfinementError` naming the step that failed."""
    global _pids_capped
    support = probe() if support is None else support
    leaf, mem_leaf = _leaves(parent, name, support)
    step = ""
    try:
        if mem_leaf is not None and mem_leaf != leaf:
            step = f"moving process {pid} into {mem_leaf}"
            _write(os.path.join(mem_leaf, "cgroup.procs"), str(pid))
        step = f"moving process {pid} into {leaf}"
        _write(os.path.join(leaf, "cgroup.procs"), str(pid))
    except OSError as exc:
        raise ConfinementError(f"confinement: cgroup: {_why(step, exc, support)}") from exc
    if pid == os.getpid() and policy.processes is not None:
        _pids_capped = True


def cgroup_enter(parent: str, pid: int, policy: Policy, support: Support | None = None) -> None:
    """`cgroup_make` then `cgroup_join` of a cgroup of its own, `<parent>/<pid>`, for
    process `pid`."""
    cgroup_make(parent, pid, policy, support)
    cgroup_join(parent, pid, pid, policy, support)


def cgroup_empty(parent: str, name: int | str) -> bool:
    """Whether no process is left in worker cgroup `<parent>/<name>` (one that is gone
    counts as empty): a slot's cgroup is handed to the next worker only then."""
    try:
        return not _procs(os.path.join(parent, str(name)))
    except FileNotFoundError:
        return True


_M_ARENA_MAX = -8  # mallopt's parameter (malloc.h)
MALLOC_ARENAS = 2
"""Arenas glibc's malloc keeps in a worker that starts its call threads at once: the main
thread's and one its threads share."""


def share_thread_arenas() -> None:
    """Let the worker's threads share one malloc arena (glibc's M_ARENA_MAX): each arena
    reserves 64 MiB of address space, which RLIMIT_AS (`Policy.memory`) counts, so 16
    spawned jobs at once would take up to 1 GiB of model code's. Call before any thread
    starts; a no-op where libc has no mallopt."""
    mallopt = getattr(_libc, "mallopt", None)
    if mallopt is not None:
        mallopt(_M_ARENA_MAX, MALLOC_ARENAS)


def pids_capped() -> bool:
    """Whether this process entered a worker cgroup whose pids.max caps what model code may
    start (`cgroup_enter`). Then pids.max = `Policy.processes` + CGROUP_HEADROOM, and the
    worker must start all of brood's own threads before model code runs: a thread started
    later would take one of model code's places, or find none left."""
    return _pids_capped


def cgroup_oom_kills(parent: str, pid: int | str, support: Support | None = None) -> int:
    """How many processes the kernel killed in worker cgroup `pid` (a pid or a slot's name)
    for passing its memory limit, since the cgroup was made (0 when unknown): read at the
    worker's reap, so its end can name the limit."""
    support = probe() if support is None else support
    if not support.cgroup_memory_dir:
        return 0
    if support.cgroup == "v2":
        path = os.path.join(parent, str(pid), "memory.events")
    else:
        mem_parent = _memory_leaf_parent(parent, support)
        if mem_parent is None:
            return 0
        path = os.path.join(mem_parent, str(pid), "memory.oom_control")
    try:
        for line in _read(path).splitlines():
            key, _, value = line.partition(b" ")
            if key == b"oom_kill":
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _kill_listed(leaf: str, pids: list[int]) -> None:
    """SIGKILL those of `pids` that are still in `leaf`: each is pinned with a pidfd first,
    and signalled only if a later read of cgroup.procs still lists it (no reused pid)."""
    for start in range(0, len(pids), _PIDFD_BATCH):
        fds: dict[int, int] = {}
        try:
            for pid in pids[start : start + _PIDFD_BATCH]:
                try:
                    fds[pid] = os.pidfd_open(pid)
                except ProcessLookupError:
                    continue
                except OSError:
                    fds[pid] = -1  # no pidfd here (Linux < 5.3): plain kill below
            try:
                members = set(_procs(leaf))
            except FileNotFoundError:
                return
            for pid, fd in fds.items():
                if pid not in members:
                    continue
                try:
                    if fd >= 0:
                        signal.pidfd_send_signal(fd, signal.SIGKILL)
                    else:
                        os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        finally:
            for fd in fds.values():
                if fd >= 0:
                    os.close(fd)


def cgroup_kill(parent: str, pid: int | str, support: Support | None = None) -> None:
    """SIGKILL every process in the cgroup of worker `pid`, whatever its session or process
    group: cgroup.kill on v2 where the kernel has it (5.14+); otherwise rounds of reading
    cgroup.procs and killing what is new until a round finds nothing new (a killed process
    cannot fork). Does not wait for them to be reaped; never raises for a missing cgroup."""
    support = probe() if support is None else support
    leaf = os.path.join(parent, str(pid))
    if support.cgroup == "v2":
        try:
            _write(os.path.join(leaf, "cgroup.kill"), "1")
            return
        except FileNotFoundError:
            if not os.path.isdir(leaf):
                return
        except OSError:
            pass  # fall back to the rounds below
    killed: set[int] = set()
    for _ in range(_CGROUP_KILL_ROUNDS):
        try:
            fresh = [p for p in _procs(leaf) if p not in killed]
        except FileNotFoundError:
            return
        if not fresh:
            return
        _kill_listed(leaf, fresh)
        killed.update(fresh)


def _rmdir(directory: str) -> bool:
    try:
        os.rmdir(directory)
    except FileNotFoundError:
        pass
    except OSError:  # EBUSY: processes (or a child cgroup) remain
        return False
    return True


def cgroup_remove(parent: str, pid: int | str, support: Support | None = None) -> bool:
    """Remove worker `pid`'s cgroup. False while it still holds a process (not reaped yet):
    try again later. True when it is gone (or never existed)."""
    support = probe() if support is None else support
    ok = _rmdir(os.path.join(parent, str(pid)))
    mem_parent = _memory_leaf_parent(parent, support)
    if mem_parent is not None:
        ok = _rmdir(os.path.join(mem_parent, str(pid))) and ok
    return ok


def cgroup_remove_parent(parent: str, support: Support | None = None) -> bool:
    """Remove the zygote's cgroup, and any empty worker cgroup still in it. False if some
    are still busy."""
    support = probe() if support is None else support
    ok = True
    for directory in (parent, _memory_leaf_parent(parent, support)):
        if directory is None:
            continue
        try:
            entries = [e.path for e in os.scandir(directory) if e.is_dir(follow_symlinks=False)]
        except FileNotFoundError:
            continue
        except OSError:
            entries = []
        for entry in entries:
            ok = _rmdir(entry) and ok
        ok = _rmdir(directory) and ok
    return ok


def _try_cgroup(support: Support) -> str:
    """Make a parent and a worker cgroup as the zygote and a worker would, move a child in,
    and remove both. "" if it all works, else why not."""
    name = f"brood-probe-{os.getpid()}-{os.urandom(3).hex()}"
    try:
        parent = _make_parent(support, name)
    except OSError as exc:
        return _why(f"creating a cgroup under {support.cgroup_dir}", exc, support)
    pid = -1
    try:
        memory = 1 << 30 if support.cgroup_memory_dir else None
        policy = Policy(scratch="", processes=1, memory=memory)
        pid, why = in_child(lambda: cgroup_enter(parent, os.getpid(), policy, support))
        return why.removeprefix("confinement: cgroup: ")
    finally:
        if pid > 0:
            for _ in range(100):  # a reaped task can linger in its cgroup for a moment
                if cgroup_remove(parent, pid, support):
                    break
                time.sleep(0.001)
        cgroup_remove_parent(parent, support)


def _probe_cgroup(base: Support) -> Support:
    mounts, unified = _cgroup_mounts()
    own, own_unified = _own_cgroups()
    candidates: list[tuple[str, str, str]] = []  # (version, pids dir, memory dir)
    reasons: list[str] = []
    if unified is not None and own_unified is not None:
        path = _cgroup_dir(unified, own_unified)
        if path is None:
            reasons.append("v2: our cgroup is outside the mounted cgroup2 hierarchy")
        else:
            try:
                with open(os.path.join(path, "cgroup.controllers")) as f:
                    available = f.read().split()
            except OSError as exc:
                available = []
                reasons.append(f"v2: reading {path}/cgroup.controllers failed ({exc})")
            if "pids" in available:
                candidates.append(("v2", path, path if "memory" in available else ""))
            elif not reasons:
                reasons.append(f"v2: the pids controller is not available in {path}")
    if "pids" in mounts and "pids" in own:
        path = _cgroup_dir(mounts["pids"], own["pids"])
        memory = None
        if "memory" in mounts and "memory" in own:
            memory = _cgroup_dir(mounts["memory"], own["memory"])
        if path is None:
            reasons.append("v1: our cgroup is outside the mounted pids hierarchy")
        else:
            candidates.append(("v1", path, memory or ""))
    else:
        reasons.append("v1: no pids hierarchy is mounted")
    for version, path, memory in candidates:
        support = msgspec.structs.replace(
            base, cgroup=version, cgroup_dir=path, cgroup_memory_dir=memory
        )
        why = _try_cgroup(support)
        if not why:
            return support
        if memory:  # perhaps only the memory controller is refused
            without = msgspec.structs.replace(support, cgroup_memory_dir="")
            if not _try_cgroup(without):
                return msgspec.structs.replace(
                    without, cgroup_error=f"memory controller not used: {why}"
                )
        reasons.append(f"{version}: {why}")
    return msgspec.structs.replace(base, cgroup_error="; ".join(reasons))

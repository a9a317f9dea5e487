"""Kernel confinement of a worker: rlimits, Landlock, capability drop, private network.

Invariant: `apply` either enforces every mechanism `probe()` said this machine has, or
raises `ConfinementError`; what the machine lacks is named by `gaps()`, never dropped
silently. Worker side: imports only the standard library, msgspec and `brood.errors`.

Landlock, `PR_SET_NO_NEW_PRIVS` and the capability sets are per thread (threads started
later inherit them), so `apply` runs in a freshly forked worker before any thread starts.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import platform
import resource
import site
import stat
import sys
import sysconfig
import threading
from collections.abc import Iterable

import msgspec

from brood.errors import ConfinementError

__all__ = [
    "CGROUP_HEADROOM",
    "Policy",
    "Support",
    "apply",
    "cgroup_enter",
    "cgroup_kill",
    "cgroup_parent",
    "cgroup_remove",
    "cgroup_remove_parent",
    "default_read_paths",
    "enter_private_network",
    "gaps",
    "probe",
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
    pids.max counts tasks, so threads as well as processes, and the headroom covers brood's
    own tasks in the worker (its main thread, the link reader and up to 16 batch-call
    threads); model code can then run `processes` processes or threads of its own, and
    everything it starts, in any session or process group, counts. RLIMIT_NPROC is set too;
    it counts every process of the user and does not apply to root. `memory` is RLIMIT_AS
    per process and, where the cgroup's memory controller is usable, also the memory limit
    of the worker's whole cgroup.
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

    Forks one short-lived child to try `unshare(CLONE_NEWNET)`, and one that moves itself
    into a test cgroup (created under our own and removed again; on cgroup v2 this enables
    the pids and memory controllers for our cgroup's children, which is what brood needs). Call it in the zygote
    before forking workers so they inherit the cached answer.
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
    base = Support(
        landlock_abi=abi,
        drop_caps=bool(eff >> _CAP_SETPCAP & 1),
        netns=netns,
        caps_held=bool(eff or prm),
        uid=os.geteuid(),
        landlock_error=landlock_error,
        netns_error=netns_error,
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
    if policy.processes is not None:
        if support.uid == 0:
            out.append(
                "processes: RLIMIT_NPROC does not apply to root (uid 0) and no cgroup is used, "
                "so the number of processes is not limited"
            )
        else:
            out.append(
                f"processes: RLIMIT_NPROC counts all processes of the user (uid {support.uid}), "
                "not this worker's; no cgroup is used"
            )
    return out


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


def _prctl(what: str, option: int, arg2: int = 0, arg3: int = 0) -> int:
    ctypes.set_errno(0)
    rc: int = _libc.prctl(option, arg2, arg3, 0, 0)
    if rc < 0:
        raise _fail(what, ctypes.get_errno())
    return rc


def _thread_count() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
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


def _landlock_rules(policy: Policy, handled: int) -> list[tuple[str, int]]:
    read = _FS_READ & handled
    write = handled  # every right the running ABI knows
    rules: list[tuple[str, int]] = [(p, read) for p in default_read_paths()]
    if policy.network:
        rules += [(p, read) for p in _NETWORK_READ]
    rules += [(p, read) for p in policy.fs_read]
    writable = [policy.scratch, *policy.fs_write]
    rules += [(p, read if policy.read_only else write) for p in writable]
    rules.append(("/dev/null", read | _FS_WRITE_FILE))  # writing to /dev/null is harmless
    return rules


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
    try:
        for path, access in _landlock_rules(policy, handled):
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
                rc = _libc.syscall(
                    ctypes.c_long(add_rule),
                    ctypes.c_int(fd),
                    ctypes.c_int(_LANDLOCK_RULE_PATH_BENEATH),
                    ctypes.byref(rule),
                    ctypes.c_uint32(0),
                )
                if rc < 0:
                    raise _fail(f"landlock_add_rule for {path!r}", ctypes.get_errno())
            finally:
                os.close(pfd)
        rc = _libc.syscall(ctypes.c_long(restrict), ctypes.c_int(fd), ctypes.c_uint32(0))
        if rc < 0:
            raise _fail("landlock_restrict_self", ctypes.get_errno())
    finally:
        os.close(fd)


def _drop_caps(full: bool) -> None:
    if full:
        # Every capability in the bounding set, until the kernel says the number is unknown.
        for cap in range(64):
            ctypes.set_errno(0)
            if _libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) < 0:
                err = ctypes.get_errno()
                if err == errno.EINVAL and cap > _CAP_SETPCAP:
                    break
                raise _fail(f"PR_CAPBSET_DROP of capability {cap}", err)
        _prctl("PR_SET_SECUREBITS", _PR_SET_SECUREBITS, _SECUREBITS_LOCKED_DOWN)
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
    signal and abstract-socket scoping); the capability drop; PR_SET_CHILD_SUBREAPER.
    Raises `ConfinementError` when a mechanism `support` reports fails to apply, or when the
    process already runs more than one thread. With `policy.confine` False, sets only the
    rlimits and the subreaper flag.
    """
    if policy.confine and (n := _thread_count()) != 1:
        raise ConfinementError(
            f"confinement: the process runs {n} threads; Landlock and the capability drop "
            "bind only the calling thread, so apply() must run before any thread starts"
        )
    _apply_rlimits(policy)
    if policy.confine:
        _prctl("PR_SET_NO_NEW_PRIVS", _PR_SET_NO_NEW_PRIVS, 1)
        if support.landlock_abi > 0:
            _apply_landlock(policy, support.landlock_abi)
        if support.drop_caps or support.caps_held:
            _drop_caps(full=support.drop_caps)
    # Lifecycle, not security: orphans of model code reparent to the worker, not past it.
    _prctl("PR_SET_CHILD_SUBREAPER", _PR_SET_CHILD_SUBREAPER, 1)


def enter_private_network() -> bool:
    """Move the calling process into a new network namespace: its later children see only a
    loopback interface that is down. Call once in the zygote, single-threaded, before it
    forks workers, when the network is off. Returns True if done, False if not permitted
    (`gaps()` then names what stays open); never raises."""
    return bool(_libc.unshare(_CLONE_NEWNET) == 0)

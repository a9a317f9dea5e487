"""Scratch on a bounded space of its own (`Limits.worker_disk`, DESIGN.md section 14).

Each confined worker mounts a tmpfs of `size=worker_disk` on its scratch directory before it
confines itself. A write past it fails with ENOSPC in that worker only: its scratch is no
longer the filesystem that other trees' scratch, the default (temporary) journal and the
rest of the machine write to, so one run cannot fill it for them.

Where the mount lives: in a mount namespace of the worker's own, made just before. It
vanishes with the worker's last process, so nothing is left to unmount, even when the
supervisor and the zygote are killed; and no other process sees it, not even the
supervisor. That is why `keep_scratch=True` does not use it: the user reads a kept scratch
directory after the run, from outside, so it stays on the scratch root's filesystem and the
supervisor watches its size instead (`brood.backends.scratch`). The directory the supervisor
made stays beneath the mount, empty, and is removed at the run's end as before.

What it costs: a tmpfs keeps its files in memory (swappable), charged to the worker's
cgroup, so they count toward `Limits.worker_memory` where brood has a memory cgroup (not
toward RLIMIT_AS); and making the namespace and the mount adds about 0.3 ms to a worker's
start and exit.

Who may mount: root (CAP_SYS_ADMIN) directly; any other user in a user namespace of its own,
where the kernel allows one (the worker maps its own uid and gid into it, so files keep
their owner, and `confine.apply` then drops the capabilities the namespace gave it).

Worker side: imports only the standard library and `brood.errors`.
"""

from __future__ import annotations

import ctypes
import errno
import os

from brood.errors import ConfinementError
from brood.worker.trial import in_child

__all__ = ["TMPFS", "TMPFS_USERNS", "bound_scratch", "probe"]

TMPFS = "tmpfs"  # mounted by a worker that holds CAP_SYS_ADMIN
TMPFS_USERNS = "tmpfs in a user namespace"  # mounted in a user namespace the worker made

# One inode per 4 KiB of worker_disk: a file with any data takes at least one 4 KiB page,
# so the bytes bound how many such files fit; the inode limit bounds the empty files (whose
# inodes are kernel memory the byte size does not count) by the same measure.
INODE_BYTES = 4096
_MIN_INODES = 1024  # enough for a small scratch to hold directories and empty files

_CLONE_NEWNS = 0x00020000
_CLONE_NEWUSER = 0x10000000
_MS_NOSUID, _MS_NODEV = 0x2, 0x4
_MS_REC, _MS_PRIVATE = 0x4000, 0x40000
_CAP_SYS_ADMIN = 21

_libc = ctypes.CDLL(None, use_errno=True)
_libc.unshare.restype = ctypes.c_int
_libc.unshare.argtypes = [ctypes.c_int]
_libc.mount.restype = ctypes.c_int
_libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]


def _errno_text(err: int) -> str:
    return f"{errno.errorcode.get(err, str(err))}: {os.strerror(err)}"


def _may_mount() -> bool:
    """Whether this process holds CAP_SYS_ADMIN (root, or a capability given to it)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_SYS_ADMIN & 1)
    except OSError:
        pass
    return False


def _call(what: str, rc: int) -> None:
    if rc < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what} failed ({_errno_text(err)})")


def _write(path: str, text: str) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)
    except OSError as exc:
        err = exc.errno or 0
        raise OSError(err, f"writing {text!r} to {path} failed ({_errno_text(err)})") from exc


def _own_namespace(mechanism: str) -> None:
    """Move the calling process into a mount namespace of its own (and, for TMPFS_USERNS,
    a user namespace that maps its uid and gid to themselves)."""
    if mechanism == TMPFS_USERNS:
        uid, gid = os.getuid(), os.getgid()
        _call("unshare(CLONE_NEWUSER | CLONE_NEWNS)", _libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNS))
        _write("/proc/self/setgroups", "deny")  # the kernel's condition for a gid_map
        _write("/proc/self/uid_map", f"{uid} {uid} 1")
        _write("/proc/self/gid_map", f"{gid} {gid} 1")
    else:
        _call("unshare(CLONE_NEWNS)", _libc.unshare(_CLONE_NEWNS))
    # A mount namespace starts as a copy whose mounts may share propagation with the ones
    # they were copied from (systemd makes / shared): made private, the tmpfs below cannot
    # appear in the supervisor's namespace.
    _call("making mounts private", _libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None))


def _mount_tmpfs(path: str, size: int) -> None:
    inodes = max(_MIN_INODES, size // INODE_BYTES)
    # nosuid and nodev: nothing there may raise privileges or open a device. Not noexec:
    # model code may build and run a program in its scratch (it stays confined).
    options = f"size={size},nr_inodes={inodes},mode=0700".encode()
    flags = _MS_NOSUID | _MS_NODEV
    rc = _libc.mount(b"brood-scratch", path.encode(), b"tmpfs", flags, options)
    _call(f"mounting a tmpfs of {size} bytes on {path}", rc)


def bound_scratch(scratch: str, size: int, mechanism: str) -> bool:
    """Mount a tmpfs of `size` bytes on the existing directory `scratch`, in a new mount
    namespace of the calling process, by `mechanism` (TMPFS or TMPFS_USERNS, from `probe`).
    Call in the worker, single-threaded, after it entered its cgroup and before it changes
    into `scratch` and confines itself. Returns True when the process is now in a user
    namespace of its own, whose full capability set the caller must drop. Raises
    `ConfinementError` naming the step that failed."""
    try:
        _own_namespace(mechanism)
        _mount_tmpfs(scratch, size)
    except OSError as exc:
        raise ConfinementError(
            f"confinement: scratch disk ({mechanism}): {exc.strerror}; `brood doctor` shows "
            "how scratch is bounded here, and Limits(worker_disk=None) leaves it unbounded"
        ) from exc
    return mechanism == TMPFS_USERNS


def probe() -> tuple[str, str]:
    """(mechanism, "") when a worker here can put its scratch on a tmpfs of its own, else
    ("", why not). Tries it in a short-lived child, on a fresh directory under the temporary
    directory (in the child's own namespace, so nothing is mounted here). Never raises."""
    # Imported here, not at the top: a zygote that imports no tempfile (nor with it shutil
    # and three compression libraries) maps fewer files into every worker it forks.
    import tempfile

    mechanism = TMPFS if _may_mount() else TMPFS_USERNS
    try:
        where = tempfile.mkdtemp(prefix="brood-disk-probe-")
    except OSError as exc:
        return "", f"could not make a directory to probe ({exc})"

    def scratch_of_its_own() -> None:
        bound_scratch(where, 1 << 20, mechanism)
        with open(os.path.join(where, "probe"), "wb") as f:
            f.write(b"x")

    try:
        _, why = in_child(scratch_of_its_own)
    finally:
        try:
            os.rmdir(where)
        except OSError:
            pass  # the probe child wrote beside its mount: leave it, it is tiny
    if why:
        return "", why.removeprefix("confinement: ")
    return mechanism, ""

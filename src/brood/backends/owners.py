"""Which processes are brood's own, and the sweep of what a dead supervisor left behind.

Every process a supervisor starts (its zygote, workers, what model code forks) carries
BROOD_OWNER=MARK in its environment. The mark is random: it names no process, so model code
that reads it learns nothing it could signal. The supervisor records its mark in this
user's registry folder (`registry_dir()`, mode 0700) with its own pid, start time and PID
namespace, and removes the record when it closes. The record also names the supervisor's
scratch and control folders, which a sweep removes once the supervisor is gone.

The registry is `$TMPDIR/brood-owners-UID`, shared by every brood process of the user, unless
BROOD_OWNERS_DIR names another folder (an absolute path; made 0700 when missing, refused when
it is not this user's alone). Supervisors see and sweep only the leftovers recorded in their
own registry: a test suite gives each test its own, so two suites running at once (or a
user's own brood beside them) never sweep each other's processes.

The sweep kills a process only when it can prove the process is a leftover of this host's
brood: the process belongs to the sweeping user and lives in the sweeper's PID namespace, its
mark is in the registry, and the supervisor the record names is gone (no process of that pid
started at the recorded time, in the same namespace). A process of another user, one in
another PID namespace, or one whose mark the registry does not hold is never touched.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import stat
import tempfile
from typing import Any

from brood.errors import InvalidArgument

OWNER_ENV = "BROOD_OWNER"
REGISTRY_ENV = "BROOD_OWNERS_DIR"
MARK_CHARS = frozenset("0123456789abcdef")
MARK_LEN = 32
SCRATCH_PREFIX = "brood-scratch-"  # a supervisor's folder of its workers' scratch directories
CONTROL_PREFIX = "brood-ctl-"  # a supervisor's folder of its control socket and its key
# The folders an owner record may name, by key, each with the prefix of brood's own name.
FOLDERS = {"scratch": SCRATCH_PREFIX, "control": CONTROL_PREFIX}


def registry_dir() -> str | None:
    """This user's folder of owner records (BROOD_OWNERS_DIR, else `$TMPDIR/brood-owners-UID`),
    made private on first use. The default folder is None when a folder of that name exists
    but is not this user's alone (then nothing is ever swept); a folder BROOD_OWNERS_DIR names
    that cannot be this user's alone is refused with InvalidArgument."""
    given = os.environ.get(REGISTRY_ENV)
    if given and not os.path.isabs(given):
        raise InvalidArgument(
            f"{REGISTRY_ENV}={given!r} is not an absolute path; "
            f"set it to one (e.g. {os.path.join(tempfile.gettempdir(), 'my-brood-owners')}), "
            "or unset it for the user's own folder"
        )
    path = given or os.path.join(tempfile.gettempdir(), f"brood-owners-{os.getuid()}")
    with contextlib.suppress(FileExistsError, FileNotFoundError):
        os.mkdir(path, 0o700)
    if _private(path):
        return path
    if given:
        raise InvalidArgument(
            f"{REGISTRY_ENV}={given!r} is not a folder of this user's alone (mode 0700, owned "
            f"by uid {os.getuid()}, its parent folder existing); make it one "
            f"(mkdir -p -m 700 {given}), or unset {REGISTRY_ENV} for the user's own folder"
        )
    return None


def _private(path: str) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077


def proc_stat(pid: int | str) -> list[str]:
    """The fields of /proc/PID/stat after the command name (state first, then ppid,
    pgrp, ...); [] when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def start_time(pid: int | str) -> str:
    """The process's start time (clock ticks since boot): with its pid, it names one process
    even after the pid is reused."""
    fields = proc_stat(pid)
    return fields[19] if len(fields) > 19 else "?"


def pid_namespace(pid: int | str = "self") -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def register_owner(scratch: str | None = None) -> str:
    """A new mark for the processes of one supervisor, recorded in the registry with the
    folder its workers' scratch directories are made in (removed by a later sweep if the
    supervisor dies without removing it)."""
    mark = secrets.token_hex(MARK_LEN // 2)
    folder = registry_dir()
    if folder is not None:
        me = os.getpid()
        record = {"pid": me, "start": start_time(me), "pidns": pid_namespace(), "scratch": scratch}
        fd = os.open(os.path.join(folder, mark), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
    return mark


def record_folder(mark: str, key: str, path: str) -> None:
    """Add a folder to `mark`'s record (`key` one of FOLDERS), for a later sweep to remove
    if the supervisor dies without removing it. The record is replaced whole, never half
    written."""
    folder = registry_dir()
    record = owner_record(mark)
    if folder is None or record is None:
        return
    record[key] = path
    fd, temp = tempfile.mkstemp(dir=folder, prefix=".new-")
    with os.fdopen(fd, "w") as f:
        json.dump(record, f)
    os.replace(temp, os.path.join(folder, mark))


def unregister_owner(mark: str) -> None:
    try:
        folder = registry_dir()
    except InvalidArgument:  # it was this user's alone when the record was made; now it is not
        return
    if folder is not None and _is_mark(mark):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(folder, mark))


def _is_mark(mark: str) -> bool:
    return len(mark) == MARK_LEN and set(mark) <= MARK_CHARS


def owner_record(mark: str) -> dict[str, Any] | None:
    """The registry's record of `mark` (read from another process's environment, so
    anything); None when this host's brood did not make it."""
    folder = registry_dir()
    if folder is None or not _is_mark(mark):
        return None
    try:
        with open(os.path.join(folder, mark)) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("pid"), int) else None


def supervisor_gone(record: dict[str, Any]) -> bool:
    """Whether the supervisor a record names is provably gone: it lived in this PID
    namespace (else its pid means nothing here) and no process of its pid started when it
    did."""
    if record.get("pidns") != pid_namespace():
        return False
    return start_time(record["pid"]) != record.get("start")


def processes_owned() -> dict[int, str]:
    """{pid: mark} of this user's processes in this PID namespace that carry BROOD_OWNER."""
    found: dict[int, str] = {}
    prefix = (OWNER_ENV + "=").encode()
    uid, ns = os.getuid(), pid_namespace()
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid != uid or pid_namespace(entry) != ns:
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        for item in env.split(b"\0"):
            if item.startswith(prefix):
                found[int(entry)] = item[len(prefix) :].decode(errors="replace")
                break
    return found


def processes_of(supervisor_pid: int) -> list[int]:
    """Processes started by the supervisors of process `supervisor_pid` (tests use it)."""
    return sorted(
        pid
        for pid, mark in processes_owned().items()
        if (record := owner_record(mark)) is not None and record["pid"] == supervisor_pid
    )


def sweep_orphans(mark: str | None = None) -> list[int]:
    """Kill the leftovers of supervisors that are gone (or, given `mark`, every process that
    one supervisor started); returns their pids. Records of gone supervisors with nothing
    left are removed."""
    killed = []
    left: set[str] = set()
    for pid, found in processes_owned().items():
        if pid == os.getpid():
            continue
        if mark is not None:
            if found != mark:
                continue
        else:
            record = owner_record(found)
            if record is None or not supervisor_gone(record):
                continue
            left.add(found)
        for kill in (os.killpg, os.kill):
            with contextlib.suppress(OSError):
                kill(pid, signal.SIGKILL)
        killed.append(pid)
    if mark is None:
        _forget_gone(left)
    return killed


def _forget_gone(still_running: set[str]) -> None:
    """Remove the scratch and control folders of gone supervisors (every process of theirs
    was killed above), and the records of those that had no process left to sweep (those
    that had one are removed by the next sweep, once it is surely dead)."""
    folder = registry_dir()
    if folder is None:
        return
    for name in os.listdir(folder):
        record = owner_record(name)
        if record is None or not supervisor_gone(record):
            continue
        for key, prefix in FOLDERS.items():
            _remove_folder(record.get(key), prefix)
        if name not in still_running:
            unregister_owner(name)


def _remove_folder(path: object, prefix: str) -> None:
    """A dead supervisor's folder, as its record names it: removed only when it is a folder
    of brood's name (`prefix`) that this user owns, not a link."""
    if not isinstance(path, str) or not os.path.isabs(path):
        return
    if not os.path.basename(path).startswith(prefix):
        return
    try:
        st = os.lstat(path)
    except OSError:
        return  # already gone
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():
        shutil.rmtree(path, ignore_errors=True)


def owner_token() -> str:
    """`PID:START:NONCE`: a supervisor's id in the journal. It names this process even
    after its pid is reused, and one supervisor among several in the same process."""
    return f"{os.getpid()}:{start_time(os.getpid())}:{secrets.token_hex(4)}"


def owner_alive(token: str) -> bool:
    """Whether the process a journal's supervisor id names is still that same process."""
    pid, _, rest = token.partition(":")
    start = rest.partition(":")[0]
    try:
        return start_time(int(pid)) == start
    except ValueError:
        return False

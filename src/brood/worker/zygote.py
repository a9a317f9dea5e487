"""The zygote: a pre-imported process that forks workers on request and reaps them.

Started once per supervisor with `python -m brood.worker.zygote FD SCRATCH_ROOT SYS_PATH
POLICY SUPPORT`, in the clean environment workers get. It imports the worker code, freezes
the heap (so forked workers share it copy-on-write) and then only forks, reaps and reports.

Each worker gets its own socketpair; the supervisor's end travels back with `Forked` over
the control socket (SCM_RIGHTS), so no path exists that another process could connect to.
A worker confines itself (`confine.apply`) as soon as it is forked, in the warm pool, before
it starts any thread and long before a run is handed to it, in its own scratch directory
`SCRATCH_ROOT/PID` (where the machine allows, a tmpfs of `Limits.worker_disk`
that `apply` mounts there in the worker's own mount namespace: `brood.worker.disk`).

The zygote is a child subreaper, and so is every worker: what model code starts stays in
the worker's tree, even after setsid and a double fork; when the worker dies, those
processes are reparented here, and any child of the zygote that is not a worker is killed
at once (its worker is gone). Where cgroups are used, each worker joins the cgroup of a
slot: made once, with its limits, and handed to worker after worker once the one before
it is confirmed gone and the cgroup is empty (a cgroup made and removed per worker cost
the kernel more than joining one). A worker's exit is confirmed (GroupGone) once no
process of its group and no such stray is left. If the supervisor goes away (its end of
the control socket closes), the zygote kills everything it has and exits.
"""

from __future__ import annotations

import _random
import _signal
import ctypes
import gc
import itertools
import os
import random
import select
import signal
import socket
import struct
import sys
import traceback

import msgspec

from brood.errors import ConfinementError
from brood.protocol import HEADER, Exited, Fork, Forked, GroupGone, Msg, Quit, decode, encode
from brood.worker import confine

# Plain ints for `_signal.signal` in a fresh worker: `signal.signal` converts its result to
# an enum, and that machinery costs a forked worker ~30 copy-on-write page faults.
_SIGCHLD, _SIG_DFL = int(signal.SIGCHLD), int(signal.SIG_DFL)

# Workers are forked by libc's fork() itself rather than os.fork(), which also runs the
# interpreter's at-fork hooks (os.register_at_fork: threading, logging and random register
# theirs). Those hooks repair what other threads held at the fork; the zygote has no other
# thread and holds no lock when it forks, so they have nothing to repair, and running them
# cost every worker about 0.5 ms of CPU. PyDLL keeps the GIL held across the call, as
# os.fork does. The one hook whose effect a worker needs,
# random's reseed, is done in the child (`_reseed`).
_libc_fork = ctypes.PyDLL(None, use_errno=True).fork
_libc_fork.restype = ctypes.c_int
_libc_fork.argtypes = []
# The generator behind the random module's functions: reseeded in each worker from the
# kernel's entropy, as os.fork's hook would (so no two workers share a sequence), through
# its C method, which costs a fresh worker half the CPU of `random.seed()`.
_RANDOM = getattr(random.seed, "__self__", None)


def _fork_without_hooks() -> int:
    pid: int = _libc_fork()
    if pid < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return pid


def _reseed() -> None:
    if isinstance(_RANDOM, _random.Random):
        _random.Random.seed(_RANDOM, None)
        _RANDOM.gauss_next = None  # type: ignore[attr-defined]  # as random.seed() does


def _single_threaded() -> bool:
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return False


def _set_subreaper() -> None:
    # Not Linux: prctl refuses, orphans go to init, exit is still confirmed per process group.
    confine.set_child_subreaper()


def _group_empty(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def children() -> list[int]:
    """This (single-threaded) process's children."""
    me = os.getpid()
    try:  # raw reads, no text-mode file object: this runs at every reap, after every fork
        fd = os.open(f"/proc/{me}/task/{me}/children", os.O_RDONLY | os.O_CLOEXEC)
        try:
            data = b""
            while chunk := os.read(fd, 65536):
                data += chunk
        finally:
            os.close(fd)
        return [int(p) for p in data.split()]
    except OSError:
        pass
    found = []  # a kernel without CONFIG_PROC_CHILDREN: scan every process's parent
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == me:
                        found.append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return found


def _only_own_fds(sock: int) -> None:
    """Leave the worker only its standard streams (on /dev/null: model code must not write
    to the user's terminal), its own socket, and the descriptors of its Landlock rules,
    which `confine.apply` closes once it has used them. Landlock checks opens, not
    descriptors already held, so nothing else the zygote had open may cross into a
    worker."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    low = 3
    for keep in sorted({sock, *confine.held_fds()}):
        os.closerange(low, keep)
        low = keep + 1
    os.closerange(low, os.sysconf("SC_OPEN_MAX"))


class Zygote:
    def __init__(
        self,
        ctrl: socket.socket,
        scratch_root: str,
        policy: confine.Policy,
        support: confine.Support,
    ) -> None:
        self.ctrl = ctrl
        self.scratch_root = scratch_root
        self.policy = policy
        self.support = support
        self.groups: set[int] = set()  # worker pids (= their process group ids) not yet gone
        self.reaped: set[int] = set()
        self.strays: set[int] = set()  # killed, not yet reaped: no exit is confirmed meanwhile
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        # brood-<our pid>: the workers' cgroups are below it, one per slot.
        self.cgroup: str | None = None
        self.cgroup_error = ""  # the parent could not be made: every worker reports it
        self.slots = itertools.count()  # names of slots: slot-0, slot-1, ...
        self.slot_of: dict[int, str] = {}  # worker pid -> its slot, until it is gone
        self.free_slots: list[str] = []  # made, empty, to be handed to the next worker
        self.released: set[str] = set()  # of gone workers, until their cgroup is empty
        # The hooks of os.fork are skipped only where they have nothing to repair.
        self.fork = _fork_without_hooks if _single_threaded() else os.fork
        # OOM kills counted in a slot's cgroup before its current worker joined it.
        self.oom_before: dict[str, int] = {}
        if policy.confine:
            try:
                self.cgroup = confine.cgroup_parent(self.support)
            except ConfinementError as exc:
                self.cgroup_error = str(exc)

    def send(self, msg: Msg, fd: int | None = None) -> None:
        if fd is None:
            self.ctrl.sendall(encode(msg))
        else:
            rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", fd))]
            self.ctrl.sendmsg([encode(msg)], rights)  # socket.send_fds, without its layer

    def recv(self) -> Msg | None:
        data = self.ctrl.recv(65536)
        return decode(data[HEADER.size :]) if data else None

    def take_slot(self) -> tuple[str | None, str]:
        """A free slot's cgroup for the next worker (made now if none is free), or None;
        and the error that worker is to report when its slot could not be made."""
        if self.cgroup is None:
            return None, self.cgroup_error
        if self.free_slots:
            return self.free_slots.pop(), ""
        slot = f"slot-{next(self.slots)}"
        try:
            confine.cgroup_make(self.cgroup, slot, self.policy, self.support)
        except ConfinementError as exc:
            confine.cgroup_remove(self.cgroup, slot, self.support)
            return None, str(exc)
        self.oom_before[slot] = 0
        return slot, ""

    def fork_worker(self) -> int:
        slot, slot_error = self.take_slot()
        mine, theirs = socket.socketpair()
        pid = self.fork()
        if pid == 0:
            try:
                signal.set_wakeup_fd(-1)
                if self.fork is _fork_without_hooks:
                    _reseed()
                _signal.signal(_SIGCHLD, _SIG_DFL)
                os.setsid()  # own session and process group: cleanup signals the whole group
                self.ctrl.close()
                mine.close()
                os.close(self.wake_r)
                os.close(self.wake_w)
                self.become_worker(theirs, slot, slot_error)
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(1)
        theirs.close()
        self.groups.add(pid)
        if slot is not None:
            self.slot_of[pid] = slot
        try:
            self.send(Forked(pid), mine.fileno())
        finally:
            mine.close()
        return pid

    def become_worker(self, sock: socket.socket, slot: str | None, slot_error: str) -> None:
        from brood.worker.main import report_unusable, serve

        scratch = os.path.join(self.scratch_root, str(os.getpid()))
        # `apply` makes the worker a child subreaper (what model code starts stays below
        # it, even orphaned); a worker whose confinement fails runs no model code.
        try:
            if slot_error:
                raise ConfinementError(slot_error)
            if self.cgroup is not None and slot is not None:
                # Before apply: Landlock then closes /sys/fs/cgroup.
                confine.cgroup_join(self.cgroup, slot, os.getpid(), self.policy, self.support)
            os.mkdir(scratch, 0o700)
            os.environ["HOME"] = os.environ["TMPDIR"] = scratch
            _only_own_fds(sock.fileno())
            # Before any thread exists: Landlock binds only the calling thread and the
            # threads it starts afterwards.
            confine.apply(msgspec.structs.replace(self.policy, scratch=scratch), self.support)
            os.chdir(scratch)  # after apply, which may mount the scratch tmpfs on it
        except Exception as exc:
            report_unusable(sock, f"confinement failed: {exc}")
            return
        serve(sock)

    def reap(self) -> None:
        exited = []
        reaped_any = False
        while True:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            reaped_any = True
            if pid in self.groups and pid not in self.reaped:
                exited.append((pid, status, usage))
            else:
                self.strays.discard(pid)
        # A stray is born only when a child of ours dies (its orphans become ours): the
        # children are listed then, once for all the deaths of this pass.
        if reaped_any:
            self.kill_strays()
        for pid, status, usage in exited:
            empty = _group_empty(pid) and not self.strays
            slot = self.slot_of.get(pid)
            # Read before its slot can go to the next worker, whose count starts there.
            kills = self.oom_kills(slot)
            oom = kills - self.oom_before.get(slot, 0) if slot is not None else 0
            if empty:
                self.groups.discard(pid)
                self.release_cgroup(pid, kills)
            else:
                self.reaped.add(pid)
            cpu = usage.ru_utime + usage.ru_stime
            self.send(Exited(pid, os.waitstatus_to_exitcode(status), empty, cpu, oom))
        for pgid in [g for g in self.groups if g in self.reaped]:
            if _group_empty(pgid) and not self.strays:
                self.groups.discard(pgid)
                self.reaped.discard(pgid)
                self.send(GroupGone(pgid))
                self.release_cgroup(pgid)
        self.remove_cgroups()

    def oom_kills(self, slot: str | None) -> int:
        """The OOM kills counted in `slot`'s cgroup since it was made (0 without one)."""
        if self.cgroup is None or slot is None:
            return 0
        return confine.cgroup_oom_kills(self.cgroup, slot, self.support)

    def release_cgroup(self, pid: int, kills: int | None = None) -> None:
        """Worker `pid` is confirmed gone: its slot is free again once its cgroup is empty,
        now or at a later reap; anything still in it (a process that left its session and
        process group) is killed first. `kills`: its slot's OOM kills, read just now."""
        slot = self.slot_of.pop(pid, None)
        if slot is None or self.cgroup is None:
            return
        if confine.cgroup_empty(self.cgroup, slot):
            self._free(slot, kills)
            return
        try:
            confine.cgroup_kill(self.cgroup, slot, self.support)
        except OSError:
            pass
        self.released.add(slot)

    def remove_cgroups(self) -> None:
        """Free the slots of gone workers whose cgroup is empty; one that still holds a
        process (killed, not yet reaped) waits for the next reap."""
        if self.cgroup is None:
            return
        for slot in list(self.released):
            if confine.cgroup_empty(self.cgroup, slot):
                self.released.discard(slot)
                self._free(slot)

    def _free(self, slot: str, kills: int | None = None) -> None:
        """Hand `slot` (its cgroup empty) to the next worker, whose OOM kills are counted
        from here: `kills` when they were read as the worker before was confirmed gone
        (nothing has run in the slot since), else read now."""
        self.oom_before[slot] = self.oom_kills(slot) if kills is None else kills
        self.free_slots.append(slot)

    def kill_strays(self, everything: bool = False) -> None:
        """Kill every child that is not a live worker and left its worker's process group
        (setsid): a process model code started, reparented here because its worker (and so
        its run) is gone. One still in its worker's group is left to the escalation, which
        signals the group (SIGTERM first); `everything` kills those too. It is our child,
        so its pid cannot be reused before we reap it."""
        for pid in children():
            stray = pid not in self.groups or pid in self.reaped
            if stray and not everything:
                try:
                    stray = os.getpgid(pid) not in self.groups
                except OSError:
                    stray = False  # already gone
            if stray and pid not in self.strays:
                self.strays.add(pid)
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass

    def shutdown(self) -> None:
        for pid in list(self.slot_of):  # everything in a worker's cgroup, whatever its group
            self.release_cgroup(pid)
        for pgid in list(self.groups):
            # The pid too: a worker forked a moment ago may not have called setsid() yet,
            # and then has no process group of its own to signal.
            for kill in (os.killpg, os.kill):
                try:
                    kill(pgid, signal.SIGKILL)
                except OSError:
                    pass
        self.groups.clear()
        while True:
            self.kill_strays(everything=True)  # workers' orphans land here as they die
            try:
                os.waitpid(-1, 0)
            except ChildProcessError:
                break
            except InterruptedError:
                continue
        if self.cgroup is not None:
            try:  # every slot's cgroup with it: each is empty now (all was reaped above)
                confine.cgroup_remove_parent(self.cgroup, self.support)
            except OSError:
                pass

    def serve(self) -> None:
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        # epoll itself rather than a selectors.DefaultSelector: what the zygote runs between
        # two forks it copies page by page after each (a page a live worker still shares is
        # copied at the zygote's first write to it), and the selector's Python layer was
        # part of that.
        poll = select.epoll()
        try:
            poll.register(self.ctrl.fileno(), select.EPOLLIN)
            poll.register(self.wake_r, select.EPOLLIN)
            self._loop(poll)
        except OSError:
            pass  # the supervisor is gone (broken pipe): shut down below
        finally:
            poll.close()
            self.shutdown()

    def _loop(self, poll: select.epoll) -> None:
        while True:
            for fd, _ in poll.poll():
                if fd == self.wake_r:
                    try:
                        os.read(self.wake_r, 4096)
                    except BlockingIOError:
                        pass
                    self.reap()
                    continue
                msg = self.recv()
                if msg is None or isinstance(msg, Quit):
                    return
                if isinstance(msg, Fork):
                    for _ in range(msg.count):
                        self.fork_worker()
                self.reap()


def main() -> None:
    fd, scratch_root = int(sys.argv[1]), sys.argv[2]
    # The supervisor's import path: a context pickled by reference to an importable module
    # unpickles the same way in the worker (where confinement lets it read that module).
    sys.path[:] = [p for p in sys.argv[3].split(os.pathsep) if p] + [
        p for p in sys.path if p not in sys.argv[3].split(os.pathsep)
    ]
    policy = msgspec.json.decode(sys.argv[4], type=confine.Policy)
    # What this machine enforces, as the supervisor probed it (same host, user and cgroup):
    # probing again would cost every supervisor's start a few forks.
    support = msgspec.json.decode(sys.argv[5], type=confine.Support)
    if policy.confine and not policy.network:
        confine.enter_private_network()  # every worker forked from here inherits it
    import brood.worker.main  # noqa: F401  - pre-import what every worker runs
    from brood.worker.prompt import cached_system_prompt
    from brood.worker.repl import prebuild_builtins
    from brood.worker.verbs import prebind

    for can_spawn in (True, False):
        cached_system_prompt(can_spawn)

    _set_subreaper()
    ctrl = socket.socket(fileno=fd)
    ctrl.setblocking(True)
    zygote = Zygote(ctrl, scratch_root, policy, support)
    confine.prepare(policy, support)  # computed once here, not again in every worker
    gc.collect()
    # Last, so that what each worker's run takes from them lies together on a few pages.
    prebind()
    prebuild_builtins()
    gc.freeze()  # forked workers then share this heap instead of copying it on first GC
    zygote.serve()


if __name__ == "__main__":
    main()

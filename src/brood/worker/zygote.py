"""The zygote: a pre-imported process that forks workers on request and reaps them.

Started once per supervisor with `python -m brood.worker.zygote FD SOCKET_PATH`. It imports
the worker code, freezes the heap (so forked workers share it copy-on-write) and then only
forks, reaps and reports. It is a child subreaper, so grandchildren that model code started
are reparented to it when their worker dies and are reaped here too; a worker's exit is
confirmed (GroupGone) once no process of its process group is left. If the supervisor goes
away (its end of the control socket closes), the zygote kills every worker group and exits.
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import os
import selectors
import signal
import socket
import sys

from brood.protocol import Exited, Fork, Forked, GroupGone, Quit, SyncChannel

PR_SET_CHILD_SUBREAPER = 36


def _set_subreaper() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: orphans go to init, exit is still confirmed per process group


def _group_empty(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


class Zygote:
    def __init__(self, ctrl: socket.socket, sock_path: str) -> None:
        self.ctrl = ctrl
        self.chan = SyncChannel.over_socket(ctrl, buffered=False)
        self.sock_path = sock_path
        self.groups: set[int] = set()  # worker pids (= their process group ids) not yet gone
        self.reaped: set[int] = set()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)

    def fork_worker(self) -> int:
        pid = os.fork()
        if pid == 0:
            try:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.setsid()  # own session and process group: cleanup signals the whole group
                self.ctrl.close()
                os.close(self.wake_r)
                os.close(self.wake_w)
                from brood.worker.main import serve

                serve(self.sock_path)
            finally:
                os._exit(1)
        self.groups.add(pid)
        return pid

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if pid in self.groups and pid not in self.reaped:
                empty = _group_empty(pid)
                if empty:
                    self.groups.discard(pid)
                else:
                    self.reaped.add(pid)
                self.chan.send(Exited(pid, os.waitstatus_to_exitcode(status), empty))
        for pgid in [g for g in self.groups if g in self.reaped]:
            if _group_empty(pgid):
                self.groups.discard(pgid)
                self.reaped.discard(pgid)
                self.chan.send(GroupGone(pgid))

    def shutdown(self) -> None:
        for pgid in list(self.groups):
            # The pid too: a worker forked a moment ago may not have called setsid() yet,
            # and then has no process group of its own to signal.
            for kill in (os.killpg, os.kill):
                try:
                    kill(pgid, signal.SIGKILL)
                except OSError:
                    pass
        while True:
            try:
                os.waitpid(-1, 0)
            except ChildProcessError:
                break
            except InterruptedError:
                continue

    def serve(self) -> None:
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        sel = selectors.DefaultSelector()
        sel.register(self.ctrl, selectors.EVENT_READ, "ctrl")
        sel.register(self.wake_r, selectors.EVENT_READ, "child")
        try:
            self._loop(sel)
        except OSError:
            pass  # the supervisor is gone (broken pipe): shut down below
        finally:
            self.shutdown()

    def _loop(self, sel: selectors.BaseSelector) -> None:
        while True:
            for key, _ in sel.select():
                if key.data == "child":
                    try:
                        os.read(self.wake_r, 4096)
                    except BlockingIOError:
                        pass
                    self.reap()
                    continue
                msg = self.chan.recv()
                if msg is None or isinstance(msg, Quit):
                    return
                if isinstance(msg, Fork):
                    for _ in range(msg.count):
                        self.chan.send(Forked(self.fork_worker()))
                self.reap()


def main() -> None:
    fd, sock_path = int(sys.argv[1]), sys.argv[2]
    # The supervisor's import path: a chat_fn pickled by reference to an importable module
    # (a test file, the user's package) must import the same way in the worker.
    sys.path[:] = [p for p in sys.argv[3].split(os.pathsep) if p] + [
        p for p in sys.path if p not in sys.argv[3].split(os.pathsep)
    ]
    for name in sys.argv[4:]:
        try:
            importlib.import_module(name)  # e.g. openai, so workers do not import it each
        except ImportError:
            pass
    import brood.worker.main  # noqa: F401  - pre-import what every worker runs
    from brood.worker.prompt import cached_system_prompt

    for can_spawn in (True, False):
        cached_system_prompt(can_spawn)

    _set_subreaper()
    ctrl = socket.socket(fileno=fd)
    ctrl.setblocking(True)
    gc.collect()
    gc.freeze()  # forked workers then share this heap instead of copying it on first GC
    Zygote(ctrl, sock_path).serve()


if __name__ == "__main__":
    main()

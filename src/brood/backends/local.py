"""The local backend: one worker process per run, forked from a warm zygote.

The supervisor starts one zygote (`python -m brood.worker.zygote`), in the clean
environment workers get, which forks workers into their own sessions. Each worker talks to
the supervisor over its own socketpair, whose supervisor end the zygote passes back with
`Forked` (SCM_RIGHTS over a SOCK_SEQPACKET control socket): there is no path another
process could connect to. Workers wait in a small warm pool, so starting a run is one
message. Every process brood starts carries BROOD_OWNER in its environment, which lets a
later supervisor find and kill what a dead one left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile

import msgspec

from brood.backends.base import WorkerConn, WorkerSettings
from brood.errors import BackendError
from brood.protocol import (
    HEADER,
    Exited,
    Failed,
    Fork,
    Forked,
    GroupGone,
    Msg,
    ProtocolError,
    Quit,
    decode,
    encode,
    read_frame,
)
from brood.worker import confine

WARM_WORKERS = 2  # ready workers kept forked; each idles at about 1 MiB of its own memory
ZYGOTE_START_TIMEOUT_S = 60.0  # a cold import on a loaded machine can take seconds
OWNER_ENV = "BROOD_OWNER"


def owner_token() -> str:
    """`PID:STARTTIME:NONCE`: names this process even after its pid is reused, and one
    supervisor among several in the same process."""
    return f"{os.getpid()}:{_start_time(os.getpid())}:{secrets.token_hex(4)}"


def _start_time(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return "?"


def owner_alive(token: str) -> bool:
    """Whether the process an owner token names is still that same process."""
    pid, _, rest = token.partition(":")
    start = rest.partition(":")[0]
    try:
        return _start_time(int(pid)) == start
    except ValueError:
        return False


def processes_owned() -> dict[int, str]:
    """{pid: owner token} of every process that carries BROOD_OWNER."""
    found: dict[int, str] = {}
    prefix = (OWNER_ENV + "=").encode()
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        for item in env.split(b"\0"):
            if item.startswith(prefix):
                found[int(entry)] = item[len(prefix) :].decode(errors="replace")
                break
    return found


def sweep_orphans(owner: str | None = None) -> list[int]:
    """Kill processes left by supervisors that died (or, given `owner`, every process that
    supervisor started); returns their pids."""
    killed = []
    for pid, token in processes_owned().items():
        if pid == os.getpid() or (token != owner if owner else owner_alive(token)):
            continue
        for kill in (os.killpg, os.kill):
            with contextlib.suppress(OSError):
                kill(pid, signal.SIGKILL)
        killed.append(pid)
    return killed


def pids_in_group(pgid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid:
                pids.append(int(entry))
        except (OSError, IndexError, ValueError):
            continue
    return pids


class LocalBackend:
    def __init__(self, owner: str, settings: WorkerSettings) -> None:
        self.owner = owner
        self.settings = settings
        # Workers' scratch directories live here, one per worker (its pid), each reachable
        # by that worker alone (Landlock); removed when their run ends.
        self.scratch_root = tempfile.mkdtemp(prefix="brood-scratch-")
        self._zygote: subprocess.Popen[bytes] | None = None
        self._ctrl: socket.socket | None = None
        self._idle: asyncio.Queue[WorkerConn] = asyncio.Queue()
        self.conns: dict[int, WorkerConn] = {}
        self._early_exit: dict[int, int] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._ready = asyncio.Event()
        self._closed = False
        self.escaped: list[int] = []
        self._all: set[WorkerConn] = set()  # every connection, to close them all at the end

    async def start(self) -> None:
        sweep_orphans()
        sup_end, zyg_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = dict(self.settings.env, **{OWNER_ENV: self.owner})
        try:
            # Popen returns once the zygote is exec'd; it does not wait for it.
            self._zygote = subprocess.Popen(  # noqa: ASYNC220
                [
                    sys.executable,
                    "-m",
                    "brood.worker.zygote",
                    str(zyg_end.fileno()),
                    self.scratch_root,
                    os.pathsep.join(sys.path),
                    msgspec.json.encode(self.settings.policy).decode(),
                    msgspec.json.encode(confine.probe()).decode(),
                ],
                pass_fds=[zyg_end.fileno()],
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=self.scratch_root,
                start_new_session=True,
            )
        except OSError as exc:
            raise BackendError(f"could not start the worker zygote: {exc}") from exc
        finally:
            zyg_end.close()
        sup_end.setblocking(False)
        self._ctrl = sup_end
        asyncio.get_running_loop().add_reader(sup_end, self._on_ctrl)
        self._fork(WARM_WORKERS)
        try:
            await asyncio.wait_for(self._ready.wait(), ZYGOTE_START_TIMEOUT_S)
        except TimeoutError as exc:
            raise BackendError(
                f"the worker zygote did not fork a worker within {ZYGOTE_START_TIMEOUT_S:g} s"
            ) from exc

    def _track(self, coro: object) -> None:
        task = asyncio.ensure_future(coro)  # type: ignore[call-overload]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _fork(self, count: int) -> None:
        if self._ctrl is None or self._closed:
            return
        try:
            self._ctrl.send(encode(Fork(count)))
        except BlockingIOError:
            loop = asyncio.get_running_loop()
            self._track(loop.sock_sendall(self._ctrl, encode(Fork(count))))
        except OSError:
            pass  # the zygote is gone; _on_ctrl has seen it and failed what it could

    def _on_ctrl(self) -> None:
        """The zygote's messages, one packet each; a Forked carries the worker's socket."""
        assert self._ctrl is not None
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(self._ctrl, 65536, 4)
            except BlockingIOError:
                return
            except OSError:
                data, fds = b"", []
            if not data:
                self._zygote_gone()
                return
            msg = decode(data[HEADER.size :])
            if isinstance(msg, Forked) and fds:
                self._add_worker(msg.pid, fds[0])
                fds = fds[1:]
            for fd in fds:
                os.close(fd)
            if isinstance(msg, Exited):
                conn = self.conns.pop(msg.pid, None) if msg.group_empty else self.conns.get(msg.pid)
                if conn is None:
                    self._early_exit[msg.pid] = msg.status
                else:
                    conn.cpu, conn.oom_kills = msg.cpu, msg.oom_kills
                    if msg.group_empty:
                        conn.gone.set()
                    conn.mark_exited(msg.status)
            elif isinstance(msg, GroupGone):
                conn = self.conns.pop(msg.pid, None)
                if conn is not None:
                    conn.gone.set()

    def _zygote_gone(self) -> None:
        assert self._ctrl is not None
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().remove_reader(self._ctrl)
        # Nothing can be confirmed any more for workers not yet reaped.
        for conn in self.conns.values():
            conn.mark_exited(-signal.SIGKILL)

    def _add_worker(self, pid: int, fd: int) -> None:
        conn = WorkerConn(pid, None, os.path.join(self.scratch_root, str(pid)))
        self.conns[pid] = conn
        self._all.add(conn)
        if pid in self._early_exit:
            conn.mark_exited(self._early_exit.pop(pid))
        self._ready.set()
        self._track(self._serve(conn, socket.socket(fileno=fd)))

    async def _serve(self, conn: WorkerConn, sock: socket.socket) -> None:
        """Read one worker's frames. A frame that is not one a worker may send, or is too
        big, ends that worker's run with the reason; the supervisor goes on."""
        reader, conn.writer = await asyncio.open_unix_connection(sock=sock)
        await self._idle.put(conn)
        try:
            while (msg := await read_frame(reader, worker=True)) is not None:
                conn.deliver(msg)
        except ProtocolError as exc:
            conn.deliver(_violation(exc))
        finally:
            conn.closed.set()
            conn.writer.close()

    async def acquire(self) -> WorkerConn:
        if self._closed:
            raise BackendError("the local backend is closed")
        self._fork(1)  # keep the warm pool full: one fork for each worker handed out
        while True:
            conn = await self._idle.get()
            if not conn.exited.done() and not conn.closed.is_set():
                return conn

    def release_unused(self, conn: WorkerConn) -> None:
        self._idle.put_nowait(conn)

    def signal_group(self, conn: WorkerConn, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(conn.pid, sig)

    def group_pids(self, conn: WorkerConn) -> list[int]:
        return pids_in_group(conn.pid)

    def discard_scratch(self, conn: WorkerConn) -> None:
        if conn.scratch and not self.settings.keep_scratch:
            shutil.rmtree(conn.scratch, ignore_errors=True)

    def idle_pids(self) -> list[int]:
        return [c.pid for c in self.conns.values() if c.handler is None]

    async def close(self) -> None:
        """Stop the zygote (which kills every worker group it still tracks) and wait for it."""
        if self._closed:
            return
        self._closed = True
        if self._ctrl is not None:
            with contextlib.suppress(Exception):
                await asyncio.get_running_loop().sock_sendall(self._ctrl, encode(Quit()))
        if self._zygote is not None:
            zygote = self._zygote
            try:
                await asyncio.wait_for(asyncio.to_thread(zygote.wait), 10.0)
            except TimeoutError:
                zygote.kill()
                await asyncio.to_thread(zygote.wait)
        if self._ctrl is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._ctrl)
            self._ctrl.close()
        for conn in list(self._all):
            if conn.writer is not None:
                conn.writer.close()
        # The last net: a process that left its worker's process group (setsid) is not
        # covered by group signals, but it still carries this supervisor's owner token.
        self.escaped = sweep_orphans(self.owner)
        for task in list(self._tasks):
            task.cancel()
        if self.settings.keep_scratch:  # keep what runs used; drop what no run got
            for conn in self._all:
                if conn.handler is None:
                    shutil.rmtree(conn.scratch, ignore_errors=True)
        else:
            shutil.rmtree(self.scratch_root, ignore_errors=True)


def _violation(exc: ProtocolError) -> Msg:
    return Failed(
        reason=f"protocol violation: the worker sent a frame it may not send ({exc})",
        error=str(exc),
    )

"""The local backend: one worker process per run, forked from a warm zygote.

The supervisor starts one zygote (`python -m brood.worker.zygote`), in the clean
environment workers get, which forks workers into their own sessions. Each worker talks to
the supervisor over its own socketpair, whose supervisor end the zygote passes back with
`Forked` (SCM_RIGHTS over a SOCK_SEQPACKET control socket): there is no path another
process could connect to. Workers wait in a small warm pool, so starting a run is one
message. Every process brood starts carries an owner mark in its environment, which lets a
later supervisor find and kill what a dead one left behind (brood.backends.owners).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable

import msgspec

from brood.backends.base import STATUS_UNKNOWN, WorkerConn, WorkerSettings
from brood.backends.owners import (
    OWNER_ENV,
    SCRATCH_PREFIX,
    proc_stat,
    register_owner,
    sweep_orphans,
    unregister_owner,
)
from brood.backends.scratch import SCRATCH_WATCH_S, Remover, over_limit, scratch_sizes
from brood.errors import BackendError
from brood.protocol import (
    HEADER,
    MAX_WORKER_FRAME,
    Exited,
    Failed,
    Fork,
    Forked,
    GroupGone,
    Msg,
    ProtocolError,
    Quit,
    decode,
    decode_worker,
    encode,
)
from brood.worker import confine

WARM_WORKERS = 2  # ready workers kept forked; each idles at about 1 MiB of its own memory
# A worker handed out while another is still warm is replaced this much later, so that the
# refill fork (a few ms of CPU) does not compete with the start it follows: a spawn's path
# to its child's first model request is then the journal and the messages, not a fork.
# With no worker left warm, the refill is asked for at once.
REFILL_DELAY_S = 0.005
ORPHAN_POLL_S = 0.05  # how often the workers of a lost zygote are looked at until gone
# A worker whose connection closed has this long to be seen exited (it closes its end in
# the kernel a moment before it is a zombie); one still alive then has lost its connection.
CONNECTION_GRACE_S = 0.05
# What one read of a worker's connection takes at most (asyncio's own default): read into one
# buffer of the backend's, shared by every connection, so a read allocates nothing.
READ_BUFFER = 256 * 1024
ZYGOTE_START_TIMEOUT_S = 60.0  # a cold import on a loaded machine can take seconds


def pids_in_group(pgid: int, *, live: bool = False) -> list[int]:
    """The processes of group `pgid`; with `live`, not those that have exited and wait to be
    reaped (zombies)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = proc_stat(entry)
        if len(fields) > 2 and fields[2] == str(pgid) and not (live and fields[0] in "ZX"):
            pids.append(int(entry))
    return pids


def own_memory(pid: int) -> int:
    """Bytes of memory process `pid` holds alone (Private_Clean + Private_Dirty); 0 once
    it is gone."""
    total = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith(("Private_Clean:", "Private_Dirty:")):
                    total += int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return 0
    return total


def _exited(pid: int) -> bool:
    """Whether process `pid` has ended (gone, or a zombie not reaped yet)."""
    fields = proc_stat(pid)
    return not fields or fields[0] in "ZX"


class LocalBackend:
    def __init__(self, settings: WorkerSettings) -> None:
        self.owner = ""  # this backend's owner mark, from start()
        self.settings = settings
        self._reads = memoryview(bytearray(READ_BUFFER))  # every worker's frames arrive here
        # Workers' scratch directories live here, one per worker (its pid), each reachable
        # by that worker alone (Landlock); removed when their run ends.
        self.scratch_root = tempfile.mkdtemp(prefix=SCRATCH_PREFIX)
        self._zygote: subprocess.Popen[bytes] | None = None
        self._ctrl: socket.socket | None = None
        # Ready workers; None once no worker can come any more (`self.failed` says why).
        self._idle: asyncio.Queue[WorkerConn | None] = asyncio.Queue()
        self.failed: str | None = None
        self.conns: dict[int, WorkerConn] = {}
        self._early_exit: dict[int, int] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._ready = asyncio.Event()
        self._closed = False
        self.escaped: list[int] = []
        self._all: set[WorkerConn] = set()  # every connection, to close them all at the end
        self.on_lost: Callable[[int, int], None] | None = None
        self._orphans: set[WorkerConn] = set()  # workers of a lost zygote, not yet gone
        self._replacing = False  # a lost zygote's successor is starting
        self._owed = 0  # forks asked for meanwhile, made once it is up
        self._remover = Remover()  # ended workers' scratch directories, off the loop

    async def start(self) -> None:
        sweep_orphans()
        kept = self.settings.keep_scratch  # the user keeps it: no sweep removes it either
        self.owner = register_owner(None if kept else self.scratch_root)
        await self._start_zygote()
        policy = self.settings.policy
        if policy.disk is not None and (
            confine.scratch_bound(policy, confine.probe()) == confine.SCRATCH_WATCHED
        ):
            self._track(self._watch_scratch(policy.disk))

    async def _watch_scratch(self, limit: int) -> None:
        """Where no tmpfs bounds scratch (brood.backends.scratch), look at every busy
        worker's scratch each SCRATCH_WATCH_S, and fail the run of one past `limit`
        (Limits.worker_disk) as a worker's own failure would: the supervisor then stops it."""
        failed: set[WorkerConn] = set()
        while not self._closed:
            await asyncio.sleep(SCRATCH_WATCH_S)
            busy = [
                c
                for c in self.conns.values()
                if c.handler is not None and not c.exited.done() and c not in failed
            ]
            failed &= set(self.conns.values())  # forget the workers that are gone
            if not busy:
                continue
            measures = await asyncio.to_thread(scratch_sizes, [c.scratch for c in busy])
            for conn, measure in zip(busy, measures, strict=True):
                reason = over_limit(measure, limit)
                if reason is not None and not conn.exited.done():
                    failed.add(conn)
                    conn.deliver(Failed(reason=reason, error=""))

    async def _start_zygote(self) -> None:
        if self._closed:
            raise BackendError("the local backend is closed")
        self._ready.clear()
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
        if self._replacing:
            self._owed += count
            return
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
        if self._closed or not self._ready.is_set():
            # close() stopped it (every worker went with it), or it died before it could
            # fork (starting another would fail the same way: start() reports it).
            for conn in self.conns.values():
                conn.mark_exited(-signal.SIGKILL)
            return
        # Lost (killed from outside, or by model code): its workers go on without it, and
        # a new zygote serves what comes next.
        self._orphans.update(self.conns.values())
        self.conns.clear()
        for conn in self._orphans:
            if conn.handler is None:  # warm, with no run: no run may get it now
                conn.mark_exited(STATUS_UNKNOWN)
                self.signal_group(conn, signal.SIGKILL)
        self._replacing = True
        self._track(self._replace_zygote())

    async def _replace_zygote(self) -> None:
        old = self._zygote
        assert old is not None and self._ctrl is not None
        status = await asyncio.to_thread(old.wait)
        self._ctrl.close()
        if self.on_lost is not None:
            self.on_lost(old.pid, status)
        self._track(self._watch_orphans())
        self._replacing = False
        try:
            await self._start_zygote()
        except BackendError as exc:
            self.failed = f"the worker zygote was lost and another could not start: {exc}"
            self._idle.put_nowait(None)  # wakes every start waiting for a worker
            return
        owed, self._owed = self._owed, 0
        self._fork(owed)

    async def _watch_orphans(self) -> None:
        """No process reaps the workers of a lost zygote for brood, so they are looked at
        until each has exited and no process of its group is left (a rare path: polling)."""
        while self._orphans:
            for conn in list(self._orphans):
                if not conn.exited.done() and _exited(conn.pid):
                    conn.mark_exited(STATUS_UNKNOWN)
                if conn.exited.done() and not pids_in_group(conn.pid, live=True):
                    conn.gone.set()
                    self._orphans.discard(conn)
            await asyncio.sleep(ORPHAN_POLL_S)

    def _add_worker(self, pid: int, fd: int) -> None:
        conn = WorkerConn(pid, None, os.path.join(self.scratch_root, str(pid)))
        self.conns[pid] = conn
        self._all.add(conn)
        if pid in self._early_exit:
            conn.mark_exited(self._early_exit.pop(pid))
        self._ready.set()
        # Its frames are read (`WorkerFrames`) from now on; it is offered to runs at once.
        frames = WorkerFrames(self, conn, self._reads)
        WorkerSocket(asyncio.get_running_loop(), socket.socket(fileno=fd), frames)
        self._idle.put_nowait(conn)

    def closed(self, conn: WorkerConn) -> None:
        """Worker `conn`'s connection ended (or broke the protocol): no frame comes any more."""
        conn.closed.set()
        if conn.handler is not None and not conn.exited.done():
            # A worker that exits closes its end first: its exit is reported, with how it
            # died. One still alive without its connection (it closed it, or shut it for
            # writing) can do nothing more: its run ends at once. Our end stays open until
            # then, so that the worker does not exit of it and hide what it did.
            asyncio.get_running_loop().call_later(CONNECTION_GRACE_S, self._lost, conn)
        else:
            if conn.writer is not None:
                conn.writer.close()
            self._done_with(conn)

    def _lost(self, conn: WorkerConn) -> None:
        # A worker that died (a zombie not reaped yet: a slow core dump, a busy zygote) is
        # not a lost connection: its exit report says how it died.
        if not conn.exited.done() and not _exited(conn.pid):
            conn.deliver(
                Failed(
                    reason="worker connection lost: the worker closed its connection to the "
                    "supervisor but did not exit; its process group was stopped",
                    error="",
                )
            )
        if conn.writer is not None:
            conn.writer.close()
        self._done_with(conn)

    def _done_with(self, conn: WorkerConn) -> None:
        """Forget a run's connection once closed: a supervisor that runs run after run
        (a server) would otherwise hold every connection, and through its callbacks every
        run, it ever had. A warm worker's stays, so close() can drop its scratch."""
        if conn.handler is not None:
            self._all.discard(conn)

    async def acquire(self) -> WorkerConn:
        if self._closed:
            raise BackendError("the local backend is closed")
        # Keep the warm pool full: one fork for each worker handed out.
        if self._idle.qsize() > 0:
            asyncio.get_running_loop().call_later(REFILL_DELAY_S, self._fork, 1)
        else:
            self._fork(1)
        while True:
            conn = await self._idle.get()
            if conn is None:
                self._idle.put_nowait(None)  # for the next one waiting
                raise BackendError(self.failed or "the local backend is closed")
            if not conn.exited.done() and not conn.closed.is_set():
                return conn

    def release_unused(self, conn: WorkerConn) -> None:
        self._idle.put_nowait(conn)

    def signal_group(self, conn: WorkerConn, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(conn.pid, sig)

    def group_pids(self, conn: WorkerConn) -> list[int]:
        return pids_in_group(conn.pid)

    def discard_scratch(self, conn: WorkerConn) -> asyncio.Future[None]:
        if conn.scratch and not self.settings.keep_scratch:
            return self._remover.remove(conn.scratch)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done

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
        for conn in self._orphans:  # a lost zygote's workers: nothing else stops them now
            self.signal_group(conn, signal.SIGKILL)
        self.escaped = sweep_orphans(self.owner) if self.owner else []
        if self.owner and not self.escaped:
            unregister_owner(self.owner)
        for task in list(self._tasks):
            task.cancel()
        self._remover.close()
        if self.settings.keep_scratch:  # keep what runs used; drop what no run got
            for conn in self._all:
                if conn.handler is None:
                    shutil.rmtree(conn.scratch, ignore_errors=True)
        else:
            shutil.rmtree(self.scratch_root, ignore_errors=True)


class WorkerSocket(asyncio.Transport):
    """The supervisor's end of one worker's socket, read and written from the loop's own
    selector: the part of asyncio's socket transport a worker's connection uses (reads
    into its protocol's buffer, writes that queue what the socket does not take, end of
    stream, close), made in a call instead of `loop.create_connection`'s coroutine, its
    waiter and four callbacks (about 70 us of the loop for every child on this machine).

    Like asyncio's transport, it tells its protocol of the end of the stream
    (`eof_received`; a protocol that returns True keeps it open for writing) and of the
    connection's loss (`connection_lost`, once, on a close or an error)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        protocol: asyncio.BufferedProtocol,
    ) -> None:
        super().__init__()
        self._loop, self._sock, self._protocol = loop, sock, protocol
        self._fd = sock.fileno()
        self._out = bytearray()  # what the socket has not taken yet
        self._reading = self._closing = self._lost = False
        sock.setblocking(False)
        protocol.connection_made(self)
        loop.add_reader(self._fd, self._read_ready)
        self._reading = True

    def _read_ready(self) -> None:
        try:
            n = self._sock.recv_into(self._protocol.get_buffer(-1))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._abort(exc)
            return
        if n:
            self._protocol.buffer_updated(n)
            return
        self.pause_reading()
        if not self._protocol.eof_received():
            self.close()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._closing:
            return
        if not self._out:
            try:
                sent = self._sock.send(data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as exc:
                self._abort(exc)
                return
            if sent == len(data):
                return
            data = memoryview(data)[sent:]
            self._loop.add_writer(self._fd, self._write_ready)
        self._out += data

    def _write_ready(self) -> None:
        try:
            sent = self._sock.send(self._out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._abort(exc)
            return
        del self._out[:sent]
        if not self._out:
            self._loop.remove_writer(self._fd)
            if self._closing:
                self._end(None)

    def is_closing(self) -> bool:
        return self._closing

    def pause_reading(self) -> None:
        if self._reading:
            self._reading = False
            self._loop.remove_reader(self._fd)

    def close(self) -> None:
        """Stop reading; close once what is queued is sent."""
        if self._closing:
            return
        self._closing = True
        self.pause_reading()
        if not self._out:
            self._loop.call_soon(self._end, None)

    def _abort(self, exc: Exception | None) -> None:
        self._closing = True
        self.pause_reading()
        if self._out:
            self._out.clear()
            self._loop.remove_writer(self._fd)
        self._loop.call_soon(self._end, exc)

    def _end(self, exc: Exception | None) -> None:
        if self._lost:
            return
        self._lost = True
        try:
            self._protocol.connection_lost(exc)
        finally:
            self._sock.close()


class WorkerFrames(asyncio.BufferedProtocol):
    """The supervisor's end of one worker's connection: frames are cut from what arrives and
    handed to the worker's run as they come, in the loop's own callback (no reading task
    woken per frame). A frame that is not one a worker may send, or is too big, ends that
    worker's run with the reason; the supervisor goes on. A frame's size is checked as soon
    as its header is in, so a too-big body is never buffered.

    Bytes are read into the backend's one read buffer (`shared`), which every connection
    uses in turn (the loop reads one at a time), so a read allocates nothing; only a frame
    that arrives in parts gets a buffer of its own (`part`), of exactly its size."""

    def __init__(self, backend: LocalBackend, conn: WorkerConn, shared: memoryview) -> None:
        self.backend, self.conn = backend, conn
        self.shared = shared
        self.part: bytearray | None = None  # a frame begun (its header, then all of it)
        self.have = 0  # bytes of `part` read so far
        self.ended = False
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.conn.writer = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.part is not None:  # the rest of the frame begun, and no more
            return memoryview(self.part)[self.have :]
        return self.shared

    def buffer_updated(self, nbytes: int) -> None:
        if self.ended:
            return
        part = self.part
        if part is None:
            self._frames(self.shared[:nbytes])
            return
        self.have += nbytes
        if self.have < len(part):
            return
        if len(part) == HEADER.size:  # its header is in: a buffer for the whole frame
            self._begin(part)
            return
        self.part = None
        self._decoded(memoryview(part)[HEADER.size :])

    def _frames(self, data: memoryview) -> None:
        """Hand on each whole frame of `data`; keep the one it ends inside of."""
        pos, end = 0, len(data)
        while end - pos >= HEADER.size:
            (size,) = HEADER.unpack_from(data, pos)
            if size > MAX_WORKER_FRAME:
                self._too_big(size)
                return
            stop = pos + HEADER.size + size
            if stop > end:
                break
            if not self._decoded(data[pos + HEADER.size : stop]):
                return
            pos = stop
        if pos < end:
            self._begin(data[pos:end])

    def _begin(self, head: memoryview | bytearray) -> None:
        """Keep the start of a frame (`head`) until the rest of it comes."""
        if len(head) < HEADER.size:
            part = bytearray(HEADER.size)
        else:
            (size,) = HEADER.unpack_from(head)
            if size > MAX_WORKER_FRAME:
                self._too_big(size)
                return
            if size == 0:  # whole already, and empty: not a frame a worker may send
                self.part = None
                self._decoded(memoryview(b""))
                return
            part = bytearray(HEADER.size + size)
        part[: len(head)] = head
        self.part, self.have = part, len(head)

    def _too_big(self, size: int) -> None:
        self._refuse(
            ProtocolError(f"frame of {size} bytes exceeds the {MAX_WORKER_FRAME}-byte bound")
        )

    def _decoded(self, body: memoryview) -> bool:
        """Hand one frame's message on; False (the worker refused) if it is not one."""
        try:
            msg = decode_worker(body)
        except ProtocolError as exc:
            self._refuse(exc)
            return False
        self.conn.deliver(msg)
        return True

    def _refuse(self, exc: ProtocolError) -> None:
        self.ended = True
        self.part = None
        assert self.transport is not None
        self.transport.pause_reading()
        self.conn.deliver(_violation(exc))
        self.backend.closed(self.conn)

    def eof_received(self) -> bool:
        if not self.ended:
            self.ended = True
            self.backend.closed(self.conn)
        return True  # our end stays open for writing: `closed` decides when it closes

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.ended:
            self.ended = True
            self.backend.closed(self.conn)


def _violation(exc: ProtocolError) -> Msg:
    return Failed(
        reason=f"protocol violation: the worker sent a frame it may not send ({exc})",
        error=str(exc),
    )

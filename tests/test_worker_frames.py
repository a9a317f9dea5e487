"""The supervisor's end of one worker's connection. The frame cutter (`WorkerFrames`):
whatever way the bytes arrive (whole frames, several at once, a byte at a time), each frame
is handed on once and whole; a frame over the bound is refused from its header, before its
body comes. The socket under it (`WorkerSocket`), on a real socket pair: what the worker
cannot take yet is queued and sent whole and in order, the end of the worker's stream is
told and leaves the socket open for writing, and a close or a broken pipe is told once."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest

from brood.backends.base import WorkerConn
from brood.backends.local import READ_BUFFER, WorkerFrames, WorkerSocket
from brood.protocol import HEADER, MAX_WORKER_FRAME, Failed, Msg, Remember, encode


class _Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.paused = False

    def pause_reading(self) -> None:
        self.paused = True


class _Backend:
    def __init__(self) -> None:
        self.closed_conns: list[WorkerConn] = []

    def closed(self, conn: WorkerConn) -> None:
        self.closed_conns.append(conn)


def _cut(stream: bytes, reads: list[int]) -> tuple[list[Msg], _Backend, _Transport]:
    """Feed `stream` to a WorkerFrames the way the loop does: each read takes at most the
    next size of `reads` (the last repeats) and what the buffer it is given holds."""

    async def feed() -> tuple[list[Msg], _Backend, _Transport]:
        got: list[Msg] = []
        backend = _Backend()
        conn = WorkerConn(1, None)
        conn.attach(got.append)
        shared = memoryview(bytearray(READ_BUFFER))
        frames = WorkerFrames(backend, conn, shared)  # type: ignore[arg-type]
        transport = _Transport()
        frames.connection_made(transport)
        pos, i = 0, 0
        while pos < len(stream) and not frames.ended:
            buf = frames.get_buffer(-1)
            assert len(buf) > 0, "an empty buffer stops the transport"
            n = min(reads[min(i, len(reads) - 1)], len(buf), len(stream) - pos)
            buf[:n] = stream[pos : pos + n]
            frames.buffer_updated(n)
            shared[:] = b"\xff" * len(shared)  # the next read overwrites the shared buffer
            pos, i = pos + n, i + 1
        return got, backend, transport

    return asyncio.run(feed())


MESSAGES: list[Any] = [
    Remember(value=b"first" * 10),
    Remember(value=bytes(range(256)) * 40),  # over 10 KB: arrives in several reads
    Remember(value=b""),
    Remember(value=b"last"),
]
STREAM = b"".join(encode(m) for m in MESSAGES)


@pytest.mark.parametrize(
    "reads",
    [[len(STREAM)], [1], [3], [HEADER.size], [7, 5000, 2], [100, 1]],
    ids=["all-at-once", "byte-by-byte", "three", "header-sized", "mixed", "uneven"],
)
def test_each_frame_is_handed_on_once_and_whole(reads: list[int]) -> None:
    got, backend, _ = _cut(STREAM, reads)
    # Decoded values are the frames' own: the shared buffer was overwritten after each read.
    assert got == MESSAGES
    assert backend.closed_conns == []


def test_a_frame_over_the_bound_is_refused_from_its_header() -> None:
    head = HEADER.pack(MAX_WORKER_FRAME + 1)
    got, backend, transport = _cut(encode(MESSAGES[0]) + head + b"x" * 10, [len(head) + 30])
    assert got[0] == MESSAGES[0]
    assert isinstance(got[1], Failed) and "exceeds" in got[1].reason
    assert transport.paused and len(backend.closed_conns) == 1


@pytest.mark.parametrize("reads", [[1], [HEADER.size], [100]])
def test_an_empty_frame_is_a_violation_however_it_arrives(reads: list[int]) -> None:
    got, backend, _ = _cut(HEADER.pack(0) + encode(MESSAGES[0]), reads)
    assert len(got) == 1 and isinstance(got[0], Failed)
    assert "protocol violation" in got[0].reason
    assert len(backend.closed_conns) == 1


class _Recorder(asyncio.BufferedProtocol):
    def __init__(self) -> None:
        self.buf = bytearray(65536)
        self.got = bytearray()
        self.eof = 0
        self.lost: list[Exception | None] = []
        self.eof_told, self.lost_told = asyncio.Event(), asyncio.Event()

    def get_buffer(self, sizehint: int) -> memoryview:
        return memoryview(self.buf)

    def buffer_updated(self, nbytes: int) -> None:
        self.got += self.buf[:nbytes]

    def eof_received(self) -> bool:
        self.eof += 1
        self.eof_told.set()
        return True  # as WorkerFrames: the supervisor decides when its end closes

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost.append(exc)
        self.lost_told.set()


async def _read_all(sock: socket.socket) -> bytes:
    loop, got = asyncio.get_running_loop(), bytearray()
    while chunk := await loop.sock_recv(sock, 1 << 16):
        got += chunk
    return bytes(got)


def test_a_worker_socket_queues_what_the_worker_cannot_take_yet_and_sends_it_whole() -> None:
    async def go() -> tuple[bytes, bytes, _Recorder]:
        ours, theirs = socket.socketpair()
        theirs.setblocking(False)
        proto = _Recorder()
        ws = WorkerSocket(asyncio.get_running_loop(), ours, proto)
        sent = b"".join(bytes([i]) * 1_000_000 for i in range(3))  # far over a socket buffer
        for i in range(3):
            ws.write(bytes([i]) * 1_000_000)
        ws.close()  # sent first, then closed
        assert ws.is_closing()
        ws.write(b"after the close")  # dropped, as asyncio's transports drop it
        got = await _read_all(theirs)
        theirs.close()
        return got, sent, proto

    got, sent, proto = asyncio.run(go())
    assert got == sent
    assert proto.lost == [None]


def test_a_worker_socket_tells_the_end_of_the_stream_and_then_a_broken_pipe() -> None:
    async def go() -> tuple[_Recorder, bytes]:
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair()
        theirs.setblocking(False)
        proto = _Recorder()
        ws = WorkerSocket(loop, ours, proto)
        await loop.sock_sendall(theirs, b"last words")
        theirs.shutdown(socket.SHUT_WR)
        await proto.eof_told.wait()
        ws.write(b"still open for writing")
        heard = await loop.sock_recv(theirs, 100)
        theirs.close()
        ws.write(b"to a closed peer")  # the pipe breaks
        await proto.lost_told.wait()
        ws.write(b"after the loss")  # dropped
        return proto, heard

    proto, heard = asyncio.run(go())
    assert bytes(proto.got) == b"last words" and proto.eof == 1
    assert heard == b"still open for writing"
    assert len(proto.lost) == 1 and isinstance(proto.lost[0], OSError)

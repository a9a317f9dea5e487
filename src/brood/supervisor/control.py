"""The control socket: how another process (`brood cancel`, `brood send`) reaches the
supervisor that owns a tree. Its path is journaled with the supervisor's row.

A client proves it may act by sending, first, the secret kept in `ctl.key` beside the
socket (mode 0600 in a 0700 directory): the supervisor's user can read it, workers cannot
(their confinement keeps them out of that directory, and they never get the secret). A
connection that does not start with the secret is closed unanswered.
"""

from __future__ import annotations

import asyncio
import hmac
import os
import secrets
import shutil
import socket
import tempfile
from typing import Any

from brood.backends.owners import CONTROL_PREFIX, record_folder
from brood.errors import BroodError, InvalidArgument
from brood.lifecycle import RunState
from brood.protocol import (
    CtlAnswer,
    CtlAuth,
    CtlCancel,
    CtlFlow,
    CtlSend,
    Msg,
    ProtocolError,
    Reply,
    SyncChannel,
    encode,
    error_info,
    read_frame,
    rebuild_error,
)
from brood.supervisor.core import Core


class ControlServer:
    def __init__(self, core: Core) -> None:
        self.core = core
        self._dir: str | None = None
        self.path = ""
        self._secret = secrets.token_hex(32)
        self._server: asyncio.AbstractServer | None = None

    async def start(self, owner: str | None) -> None:
        """Make the socket's folder and listen; `owner` (the backend's owner mark) records
        the folder so that a later supervisor's sweep removes it if this one is killed."""
        self._dir = tempfile.mkdtemp(prefix=CONTROL_PREFIX)  # mode 0700
        if owner:
            record_folder(owner, "control", self._dir)
        self.path = os.path.join(self._dir, "ctl.sock")
        fd = os.open(key_path(self.path), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self._secret)
        self._server = await asyncio.start_unix_server(self._serve, path=self.path)
        os.chmod(self.path, 0o600)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            first = await read_frame(reader)
            if not isinstance(first, CtlAuth) or not hmac.compare_digest(
                first.secret.encode(), self._secret.encode()
            ):
                return
            while (msg := await read_frame(reader)) is not None:
                req_id = getattr(msg, "req_id", 0)
                try:
                    reply = Reply(req_id, value=await self._handle(msg))
                except Exception as exc:
                    reply = Reply(req_id, error=error_info(exc))
                writer.write(encode(reply))
                await writer.drain()
        except ProtocolError:
            pass  # not a brood client: drop it
        finally:
            writer.close()

    async def _handle(self, msg: Msg) -> Any:
        if isinstance(msg, CtlAnswer):
            return await self.core.asks.answer(msg.ask_id, msg.value, msg.by)
        if isinstance(msg, CtlFlow):
            flow = self.core.flows.flow_executor(msg.run_id)
            if flow is None:
                raise BroodError(f"run {msg.run_id} is not a flow this supervisor runs")
            if msg.op == "stop":
                return await flow.stop()
            if msg.op == "resume":
                await flow.resume()
                return flow.status_value
            if msg.op == "status":
                return flow.status()
            raise InvalidArgument(f"flow op must be stop, resume or status, not {msg.op!r}")
        if not isinstance(msg, CtlCancel | CtlSend):
            raise InvalidArgument(
                f"the control socket takes CtlCancel, CtlSend or CtlFlow, not {type(msg).__name__}"
            )
        run = self.core.runs.get(msg.run_id)
        if run is None:
            raise BroodError(f"run {msg.run_id} is not owned by this supervisor")
        if isinstance(msg, CtlCancel):
            return (await self.core.finish(run, RunState.CANCELLED, msg.reason)).value
        await self.core.send_message(run, msg.message)
        return None

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


def key_path(socket_path: str) -> str:
    return os.path.join(os.path.dirname(socket_path), "ctl.key")


def control_request(
    path: str, msg: CtlCancel | CtlSend | CtlFlow | CtlAnswer, timeout: float | None = None
) -> Any:
    """Send one request to a supervisor's control socket and return its reply's value."""
    try:
        with open(key_path(path)) as f:
            secret = f.read()
    except OSError as exc:
        raise BroodError(
            f"cannot read the control key of the supervisor at {path}: {exc}; only the user "
            "who runs that supervisor can control it"
        ) from exc
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
        chan = SyncChannel.over_socket(sock)
        try:
            chan.send(CtlAuth(secret))
            chan.send(msg)
            reply = chan.recv()
        finally:
            chan.close()
    finally:
        sock.close()
    if not isinstance(reply, Reply):
        raise BroodError(f"the supervisor at {path} closed the connection without replying")
    if reply.error is not None:
        raise rebuild_error(reply.error)
    return reply.value

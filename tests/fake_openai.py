"""A real HTTP server that speaks OpenAI's chat completions API from a script.

It listens on 127.0.0.1 on a free port and answers `POST /v1/chat/completions` the way an
OpenAI-compatible server does, so the real `openai` client (in real worker processes) can
talk to it. Replies come from a script: either a `{key: [reply, ...]}` mapping, where a
request takes the next reply of the longest key found in its first user message, or a
function of the request's JSON body. A reply is text or a `Reply` (token counts, an error
status, a delay before answering). Every request is recorded with what was sent back.

    with FakeOpenAI({"task": ["```repl\\nFINAL('x')\\n```"]}) as server:
        brood.Supervisor(model=f"openai:m@{server.base_url}")
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["Exchange", "FakeOpenAI", "Reply"]

COMPLETIONS_PATH = "/v1/chat/completions"
# 400 because the openai client does not retry it: a script miss shows up once, at once.
NO_REPLY_STATUS = 400


@dataclass(frozen=True)
class Reply:
    """One scripted answer.

    `status` other than 200 sends an OpenAI-style error body carrying `error` (or `raw`). `delay` is
    how long the server waits before answering; closing the server cuts it short (the
    request is then dropped unanswered), so a slow reply never holds up a test's teardown.
    """

    content: str = ""
    prompt_tokens: int = 10
    completion_tokens: int = 5
    status: int = 200
    error: str = "scripted error"
    delay: float = 0.0
    finish_reason: str = "stop"
    headers: tuple[tuple[str, str], ...] = ()  # extra response headers, e.g. Retry-After
    raw: bytes | None = None  # a body of these bytes (with `status`), not a chat completion
    content_type: str = "application/json"  # of a `raw` body (an HTML error page: text/html)


@dataclass
class Exchange:
    """A request the server received and what it sent back (`usage` None for an error)."""

    path: str
    headers: dict[str, str]
    body: Any
    status: int | None = None
    usage: dict[str, int] | None = None
    reply: str | None = None

    @property
    def first_user_message(self) -> str:
        return first_user_message(self.body)


Script = Mapping[str, Sequence[str | Reply]] | Callable[[dict[str, Any]], str | Reply]


def first_user_message(body: Any) -> str:
    messages = body.get("messages") if isinstance(body, dict) else None
    for m in messages or ():
        if isinstance(m, dict) and m.get("role") == "user":
            return str(m.get("content", ""))
    return ""


class FakeOpenAI:
    """The server; a context manager that starts it on enter and stops it on exit.

    `base_url` is `http://127.0.0.1:PORT/v1`; `requests` lists every `Exchange` in arrival
    order. `close()` stops accepting, cuts pending delays short, joins every handler thread
    and closes the listening socket.
    """

    def __init__(self, script: Script) -> None:
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._requests: list[Exchange] = []
        if callable(script):
            self._answer: Callable[[dict[str, Any]], str | Reply] = script
        else:
            queues = {str(k): list(v) for k, v in script.items()}
            self._answer = lambda body: self._next_scripted(queues, body)
        self._httpd: _Server | None = None
        self._thread: threading.Thread | None = None

    # ---- lifecycle ---------------------------------------------------------------------
    def start(self) -> FakeOpenAI:
        httpd = _Server(("127.0.0.1", 0), _Handler)
        httpd.fake = self
        self._httpd = httpd
        self._thread = threading.Thread(
            target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="fake-openai"
        )
        self._thread.start()
        return self

    def close(self) -> None:
        self._closing.set()
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        httpd.shutdown()
        assert self._thread is not None
        self._thread.join()
        httpd.server_close()  # joins the handler threads (daemon_threads is off)

    def __enter__(self) -> FakeOpenAI:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- what tests read ---------------------------------------------------------------
    @property
    def port(self) -> int:
        assert self._httpd is not None, "the server is not running"
        return int(self._httpd.server_address[1])

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def requests(self) -> list[Exchange]:
        with self._lock:
            return list(self._requests)

    def reported_usage(self) -> dict[str, int]:
        """Token counts summed over every successful reply, as an OpenAI client sees them."""
        total = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        for ex in self.requests:
            for k in total:
                total[k] += (ex.usage or {}).get(k, 0)
        return total

    # ---- answering ---------------------------------------------------------------------
    def _next_scripted(self, queues: dict[str, list[str | Reply]], body: dict[str, Any]) -> Reply:
        task = first_user_message(body)
        keys = [k for k in queues if k in task]
        if not keys:
            return Reply(
                status=NO_REPLY_STATUS,
                error=f"fake_openai: no script key found in the first user message {task[:80]!r}",
            )
        key = max(keys, key=len)
        with self._lock:
            reply = queues[key].pop(0) if queues[key] else None
        if reply is None:
            return Reply(
                status=NO_REPLY_STATUS, error=f"fake_openai: the replies for {key!r} ran out"
            )
        return reply if isinstance(reply, Reply) else Reply(reply)

    def _record(self, ex: Exchange) -> None:
        with self._lock:
            self._requests.append(ex)

    def _wait(self, delay: float) -> bool:
        """Wait `delay` seconds; False if the server closed meanwhile."""
        return not self._closing.wait(delay) if delay > 0 else not self._closing.is_set()


class _Server(ThreadingHTTPServer):
    daemon_threads = False  # server_close() then joins every handler thread
    block_on_close = True
    fake: FakeOpenAI

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that gave up (timed out) closes its socket; that is not a server failure.
        pass


class _Handler(BaseHTTPRequestHandler):
    # HTTP/1.0: one request per connection, so no handler thread idles on a keep-alive
    # connection and closing the server never waits on a client.
    protocol_version = "HTTP/1.0"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._send(HTTPStatus.NOT_FOUND, _error_body("fake_openai serves POST " + COMPLETIONS_PATH))

    def do_POST(self) -> None:
        fake = self.server.fake
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length)
        try:
            body = json.loads(raw)
        except ValueError:
            body = raw.decode("utf-8", "replace")
        ex = Exchange(self.path, {k.lower(): v for k, v in self.headers.items()}, body)
        fake._record(ex)
        if self.path != COMPLETIONS_PATH or not isinstance(body, dict):
            ex.status = HTTPStatus.NOT_FOUND
            self._send(ex.status, _error_body(f"fake_openai serves POST {COMPLETIONS_PATH}"))
            return
        answer = fake._answer(body)
        reply = answer if isinstance(answer, Reply) else Reply(answer)
        if not fake._wait(reply.delay):
            return  # closed while waiting: drop the request unanswered
        ex.status = reply.status
        if reply.raw is not None:
            self._send(reply.status, reply.raw, reply.headers, reply.content_type)
            return
        if reply.status != 200:
            self._send(reply.status, _error_body(reply.error), reply.headers)
            return
        usage = {
            "prompt_tokens": reply.prompt_tokens,
            "completion_tokens": reply.completion_tokens,
            "total_tokens": reply.prompt_tokens + reply.completion_tokens,
        }
        ex.usage, ex.reply = usage, reply.content
        self._send(
            200,
            {
                "id": f"chatcmpl-fake-{id(ex):x}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body.get("model"),
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": reply.content},
                        "finish_reason": reply.finish_reason,
                        "logprobs": None,
                    }
                ],
                "usage": usage,
            },
        )

    def _send(
        self,
        status: int,
        payload: dict[str, Any] | bytes,
        headers: tuple[tuple[str, str], ...] = (),
        content_type: str = "application/json",
    ) -> None:
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        try:
            self.send_response(status)
            for name, value in headers:
                self.send_header(name, value)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up before the answer


def _error_body(message: str) -> dict[str, Any]:
    return {
        "error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}
    }

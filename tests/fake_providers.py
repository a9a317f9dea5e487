"""Real HTTP servers that speak Anthropic's Messages API and Gemini's generateContent from
a script, so the real `anthropic` and `google-genai` SDKs can talk to them.

Each listens on 127.0.0.1 on a free port. A script is what `tests/fake_openai.py` takes: a
`{key: [reply, ...]}` mapping (a request takes the next reply of the longest key found in
its first user message) or a function of the request's JSON body; a reply is text or a
`Reply` (token counts, an error status with headers, a delay). Every request is recorded.

    with FakeAnthropic({"task": ["```repl\\nFINAL('x')\\n```"]}) as server:
        brood.Supervisor(model=f"anthropic:claude-test@{server.base_url}")
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from fake_openai import Reply

__all__ = ["FakeAnthropic", "FakeGemini", "Received", "Reply"]

Script = Mapping[str, Sequence[str | Reply]] | Callable[[dict[str, Any]], str | Reply]
# 400: neither SDK's client (nor brood) retries it, so a script miss shows up once, at once.
NO_REPLY_STATUS = 400


@dataclass
class Received:
    """A request the server received, and the status it answered."""

    path: str
    headers: dict[str, str]
    body: Any
    status: int | None = None


class _FakeProvider:
    """The server; a context manager that starts it on enter and stops it on exit.
    Subclasses say which path they serve and how their bodies look."""

    path: re.Pattern[str]

    def __init__(self, script: Script) -> None:
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._received: list[Received] = []
        if callable(script):
            self._answer: Callable[[dict[str, Any]], str | Reply] = script
        else:
            queues = {str(k): list(v) for k, v in script.items()}
            self._answer = lambda body: self._next_scripted(queues, body)
        self._httpd: _Server | None = None
        self._thread: threading.Thread | None = None

    # ---- what a provider's API looks like ----------------------------------------------
    def first_user_message(self, body: dict[str, Any]) -> str:
        raise NotImplementedError

    def answer_body(self, body: dict[str, Any], reply: Reply) -> dict[str, Any]:
        raise NotImplementedError

    def error_body(self, status: int, message: str) -> dict[str, Any]:
        raise NotImplementedError

    # ---- lifecycle ---------------------------------------------------------------------
    def start(self) -> _FakeProvider:
        httpd = _Server(("127.0.0.1", 0), _Handler)
        httpd.fake = self
        self._httpd = httpd
        self._thread = threading.Thread(
            target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="fake-provider"
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

    def __enter__(self) -> Any:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def base_url(self) -> str:
        assert self._httpd is not None, "the server is not running"
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    @property
    def requests(self) -> list[Received]:
        with self._lock:
            return list(self._received)

    # ---- answering ---------------------------------------------------------------------
    def _next_scripted(self, queues: dict[str, list[str | Reply]], body: dict[str, Any]) -> Reply:
        task = self.first_user_message(body)
        keys = [k for k in queues if k in task]
        if not keys:
            return Reply(status=NO_REPLY_STATUS, error=f"fake: no script key in {task[:80]!r}")
        key = max(keys, key=len)
        with self._lock:
            reply = queues[key].pop(0) if queues[key] else None
        if reply is None:
            return Reply(status=NO_REPLY_STATUS, error=f"fake: the replies for {key!r} ran out")
        return reply if isinstance(reply, Reply) else Reply(reply)

    def _record(self, received: Received) -> None:
        with self._lock:
            self._received.append(received)

    def _wait(self, delay: float) -> bool:
        """Wait `delay` seconds; False if the server closed meanwhile."""
        return not self._closing.wait(delay) if delay > 0 else not self._closing.is_set()


class FakeAnthropic(_FakeProvider):
    """`POST /v1/messages`; `base_url` is what `anthropic.Anthropic(base_url=)` takes."""

    path = re.compile(r"^/v1/messages$")

    def first_user_message(self, body: dict[str, Any]) -> str:
        for m in body.get("messages") or ():
            if isinstance(m, dict) and m.get("role") == "user":
                return str(m.get("content", ""))
        return ""

    def answer_body(self, body: dict[str, Any], reply: Reply) -> dict[str, Any]:
        return {
            "id": "msg_fake",
            "type": "message",
            "role": "assistant",
            "model": body.get("model"),
            "content": [{"type": "text", "text": reply.content}],
            "stop_reason": "end_turn",
            "stop_sequence": None,
            "usage": {
                "input_tokens": reply.prompt_tokens,
                "output_tokens": reply.completion_tokens,
            },
        }

    def error_body(self, status: int, message: str) -> dict[str, Any]:
        kind = {429: "rate_limit_error", 529: "overloaded_error"}.get(status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": message}}


class FakeGemini(_FakeProvider):
    """`POST /VERSION/models/MODEL:generateContent` (`v1beta`, `v1`: the SDK's choice);
    `base_url` is what the client's
    `http_options.base_url` takes. A reply's `completion_tokens` are its candidates'
    tokens; `thought_tokens`, set on the server, are added to every answer as thinking."""

    path = re.compile(r"^/v1\w*/models/[^/:]+:generateContent$")
    thought_tokens = 0

    def first_user_message(self, body: dict[str, Any]) -> str:
        for c in body.get("contents") or ():
            if isinstance(c, dict) and c.get("role") == "user":
                return "".join(str(p.get("text", "")) for p in c.get("parts") or ())
        return ""

    def answer_body(self, body: dict[str, Any], reply: Reply) -> dict[str, Any]:
        usage = {
            "promptTokenCount": reply.prompt_tokens,
            "candidatesTokenCount": reply.completion_tokens,
            "totalTokenCount": reply.prompt_tokens + reply.completion_tokens + self.thought_tokens,
        }
        if self.thought_tokens:
            usage["thoughtsTokenCount"] = self.thought_tokens
        return {
            "candidates": [
                {
                    "content": {"role": "model", "parts": [{"text": reply.content}]},
                    "finishReason": "STOP",
                    "index": 0,
                }
            ],
            "usageMetadata": usage,
            "modelVersion": "fake",
        }

    def error_body(self, status: int, message: str) -> dict[str, Any]:
        kind = {429: "RESOURCE_EXHAUSTED", 503: "UNAVAILABLE"}.get(status, "INVALID_ARGUMENT")
        return {"error": {"code": status, "message": message, "status": kind}}


class _Server(ThreadingHTTPServer):
    daemon_threads = False  # server_close() then joins every handler thread
    block_on_close = True
    fake: _FakeProvider

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that gave up (timed out) closed its socket: not a server failure


class _Handler(BaseHTTPRequestHandler):
    # HTTP/1.0: one request per connection, so closing the server never waits on a client.
    protocol_version = "HTTP/1.0"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        fake = self.server.fake
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            body = json.loads(raw)
        except ValueError:
            body = raw.decode("utf-8", "replace")
        path = self.path.partition("?")[0]
        received = Received(path, {k.lower(): v for k, v in self.headers.items()}, body)
        fake._record(received)
        if not fake.path.match(path) or not isinstance(body, dict):
            received.status = 404
            self._send(404, fake.error_body(404, f"fake: no route {path}"))
            return
        answer = fake._answer(body)
        reply = answer if isinstance(answer, Reply) else Reply(answer)
        if not fake._wait(reply.delay):
            return  # closed while waiting: dropped unanswered
        received.status = reply.status
        if reply.raw is not None:
            self._send(reply.status, reply.raw, reply.headers, reply.content_type)
        elif reply.status != 200:
            self._send(reply.status, fake.error_body(reply.status, reply.error), reply.headers)
        else:
            self._send(200, fake.answer_body(body, reply))

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

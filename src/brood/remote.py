"""`RemoteSession`: a `brood.Session` that lives in a `brood serve` on another machine,
driven over its `/v1/sessions` API with the same calls and `Observation`s.

A front end of the server's API (the standard library's HTTP client, imported when a
session is opened): the episode's workers, confinement and journal are the server's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from brood.errors import BroodError, InvalidArgument
from brood.session import Observation

__all__ = ["RemoteSession"]

# How long a call waits for the server's answer: a step answers once its code ends, which
# the step's own timeout bounds on the server (Limits.step_timeout, 120 s by default).
CALL_TIMEOUT_S = 3600.0


class RemoteSession:
    """An environment on a `brood serve` at `url` (e.g. `http://host:8000`): opened here
    (`POST /v1/sessions`), then `reset(prompt, context)`, `step(code)`,
    `record_reward(reward, info)` and `close()` as on `brood.Session`. `token` is the
    server's (`brood serve --token`); `limits` tightens the server's for this session's
    episodes (`{"max_depth": 2, "step_timeout": 30}`: only tighter values are taken);
    `model` must be the server's model when given.

    Refusals raise: InvalidArgument for a bad argument (400/422, naming the field),
    BroodError for the rest (401 token, 404 unknown session, 409 no episode or a closed
    session, 429 the server's bound of sessions, 503), each with the server's message and
    fix. `close()` returns once the server confirmed every worker's exit; a session not
    closed is closed by the server after it has been idle for its timeout."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        limits: Mapping[str, float | None] | None = None,
        model: str | None = None,
        timeout: float = CALL_TIMEOUT_S,
    ) -> None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise InvalidArgument(
                f"url must be the server's http(s) address, like 'http://127.0.0.1:8000', "
                f"got {url!r}"
            )
        self.url = url.rstrip("/")
        self._token = token
        self._timeout = timeout
        self._closed = False
        self.run_id: str | None = None
        body: dict[str, Any] = {}
        if limits is not None:
            body["limits"] = dict(limits)
        if model is not None:
            body["model"] = model
        self.session_id: str = str(self._call("POST", "/v1/sessions", body)["session_id"])

    def __repr__(self) -> str:
        return f"<RemoteSession {self.session_id} at {self.url}>"

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        import urllib.error
        import urllib.request

        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method)
        request.add_header("Accept", "application/json")
        if data is not None:
            request.add_header("Content-Type", "application/json")
        if self._token is not None:
            request.add_header("Authorization", f"Bearer {self._token}")
        try:
            with urllib.request.urlopen(request, timeout=self._timeout) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as exc:
            raise _refusal(method, path, exc.code, exc.read()) from None
        except (urllib.error.URLError, OSError) as exc:
            raise BroodError(
                f"brood serve at {self.url} could not be reached ({method} {path}): {exc}; "
                "check the address and that the server runs"
            ) from exc

    def _path(self, tail: str = "") -> str:
        if self._closed:
            raise BroodError(f"session {self.session_id} is closed; open a new RemoteSession")
        return f"/v1/sessions/{self.session_id}{tail}"

    def _observed(self, answer: dict[str, Any]) -> Observation:
        self.run_id = answer.get("run_id")
        return Observation(
            stdout=answer["stdout"],
            stderr=answer["stderr"],
            error=answer["error"],
            done=answer["done"],
            answer=answer["answer"],
            children=answer["children"],
        )

    def reset(self, prompt: str, context: Any = None) -> Observation:
        """End the current episode (its tree ends, exit confirmed) and start a new one whose
        root waits for `step`. `context` must be JSON."""
        return self._observed(
            self._call("POST", self._path("/reset"), {"prompt": prompt, "context": context})
        )

    def step(self, code: str, *, timeout: float | None = None) -> Observation:
        """Run `code` in the root's REPL on the server; blocks until it ends. `done` and
        `answer` are set once it calls FINAL (the root's children are then cancelled)."""
        body: dict[str, Any] = {"code": code}
        if timeout is not None:
            body["timeout"] = timeout
        return self._observed(self._call("POST", self._path("/step"), body))

    def record_reward(self, reward: float, info: Mapping[str, Any] | None = None) -> None:
        """Journal the episode's reward (a rubric's score), carried by the training exports."""
        body: dict[str, Any] = {"reward": reward}
        if info is not None:
            body["info"] = dict(info)
        self._call("POST", self._path("/reward"), body)

    def status(self) -> dict[str, Any]:
        """The server's view: run_id, episode, state, busy, done, answer, children, idle."""
        answer: dict[str, Any] = self._call("GET", self._path())
        return answer

    def close(self) -> None:
        """End the episode and close the session on the server, every exit confirmed.
        Closing twice does nothing."""
        if self._closed:
            return
        try:
            self._call("DELETE", self._path())
        except BroodError as exc:
            if " is closed" not in str(exc):  # closed already (idle, or the server closed)
                raise
        self._closed = True

    def __enter__(self) -> RemoteSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _refusal(method: str, path: str, status: int, raw: bytes) -> BroodError:
    """The server's refusal as brood's error, in the server's words."""
    try:
        error = json.loads(raw)["error"]
        message = str(error["message"])
        fix = error.get("fix")
        field = error.get("field")
    except (ValueError, KeyError, TypeError):
        message, fix, field = raw.decode("utf-8", "replace")[:500] or "no message", None, None
    text = f"{method} {path} was refused ({status}): {message}" + (f"; {fix}" if fix else "")
    if status in (400, 413, 422):
        return InvalidArgument(text if field is None else f"{field}: {text}")
    return BroodError(text)

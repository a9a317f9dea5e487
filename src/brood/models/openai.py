"""An OpenAI-compatible chat model (OpenAI, vLLM, SGLang, Ollama, llama.cpp, …)."""

from __future__ import annotations

import asyncio
import email.utils
import os
import time
from collections.abc import Callable
from typing import Any

from brood.errors import InvalidArgument, ModelError, RateLimited
from brood.limits import is_duration
from brood.models.base import Completion, Messages, Model, check_text, rate_gated

DEFAULT_TIMEOUT_S = 120.0  # one try; a server that hangs costs minutes, not an hour
DEFAULT_TRIES = 3  # the first try and two retries
BACKOFF_FIRST_S = 0.5  # first wait before a retry, doubled each time
BACKOFF_MAX_S = 30.0  # no single wait is longer, whatever the server asks
RETRY_STATUSES = frozenset({408, 409, 429}) | frozenset(range(500, 600))
BODY_SHOWN = 200  # bytes of a reply's body an error quotes when the reply is not readable


class NotACompletion(ValueError):
    """A reply that is not a chat completion (HTML, plain text, JSON of another shape); the
    message says what came back. Retried like a 5xx: a proxy's error page is often brief."""


class OpenAIModel(Model):
    """Chat completions through the `openai` client.

    The base URL and key come from the arguments or from OPENAI_BASE_URL / OPENAI_API_KEY.
    The client is built on first use, in the supervisor's model gateway, and its one
    connection pool serves every run (workers never hold it or the key). A 429, a 5xx, a
    timeout or a dropped connection is retried up to `max_retries` times, waiting what the
    server's Retry-After asks (capped at BACKOFF_MAX_S) or else 0.5 s doubling; when the
    retries run out, the call fails with a ModelError naming the last error, a RateLimited
    (with the server's Retry-After) if that was a 429. In a supervisor's gateway a 429 is
    RateLimited at once: the gateway's gate then waits once for every call to the endpoint.
    `sleep` is how it waits (tests pass a fake clock).
    """

    provider = "openai"

    def __init__(
        self,
        model: str,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        max_retries: int = DEFAULT_TRIES - 1,
        sleep: Callable[[float], object] = time.sleep,
        **create_kwargs: Any,
    ) -> None:
        if not isinstance(model, str) or not model.strip():
            raise InvalidArgument("OpenAIModel(model=...) needs a model name, e.g. 'gpt-4.1-mini'")
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
            raise InvalidArgument(
                f"OpenAIModel(max_retries=...) must be an int >= 0, got {max_retries!r}"
            )
        if not is_duration(timeout):
            raise InvalidArgument(
                f"OpenAIModel(timeout=...) must be seconds > 0, got {timeout!r}; it bounds "
                "one try of a call"
            )
        self.name = model
        self.base_url = base_url
        self.api_key = api_key
        self.timeout = timeout
        self.max_retries = max_retries
        self.sleep = sleep
        self.create_kwargs = create_kwargs
        self._client: Any = None
        self._async_client: Any = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_client"] = state["_async_client"] = None  # clients do not travel
        return state

    def _client_args(self) -> dict[str, Any]:
        return {
            "base_url": self.base_url or os.environ.get("OPENAI_BASE_URL"),
            "api_key": self.api_key or os.environ.get("OPENAI_API_KEY") or "not-needed",
            "timeout": self.timeout,
            "max_retries": 0,  # brood retries itself, so the waits are its own and testable
        }

    def _get_client(self) -> Any:
        if self._client is None:
            import openai

            self._client = openai.OpenAI(**self._client_args())
        return self._client

    def _failure(self, exc: Exception, attempt: int, name: str | None) -> float:
        """How long to wait before the next try; raises ModelError (RateLimited for a 429)
        when none is left."""
        import openai

        wait = retry_wait(exc, attempt)
        limited = isinstance(exc, openai.APIStatusError) and exc.status_code == 429
        if wait is None or attempt == self.max_retries or (limited and rate_gated.get()):
            where = self.base_url or os.environ.get("OPENAI_BASE_URL") or "the default OpenAI URL"
            tries = f" after {attempt + 1} tries" if attempt else ""
            cause = f" ({exc.__cause__})" if exc.__cause__ else ""
            count = f" ({attempt + 1} tries)" if attempt else ""
            if isinstance(exc, NotACompletion):
                failure = f"the reply is not a chat completion{count}: {exc}"
            elif isinstance(exc, openai.APIStatusError) and not _reads_as_json(exc.response):
                # an error page of a proxy or a server, not an API error: say what it was
                failure = f"an error reply{count}: {what_came_back(exc.response)}"
            else:
                failure = f"{type(exc).__name__}{tries}: {exc}{cause}"
            message = f"model {name!r} at {where}: {failure}"
            if limited:
                asked = _retry_after(exc.response.headers)  # type: ignore[attr-defined]
                raise RateLimited(message, retry_after=asked) from exc
            raise ModelError(message) from exc
        return wait

    def complete(self, messages: Messages, model: str | None = None) -> Completion:
        import openai

        name = model or self.name
        for attempt in range(self.max_retries + 1):
            try:
                raw = self._get_client().chat.completions.with_raw_response.create(
                    model=name, messages=messages, **self.create_kwargs
                )
                resp = _parsed(raw)
                break
            except (openai.OpenAIError, ValueError) as exc:  # ValueError: an unreadable reply
                self.sleep(self._failure(exc, attempt, name))
        return self._completion(resp, name)

    async def acomplete(self, messages: Messages, model: str | None = None) -> Completion:
        """`complete` on the supervisor's loop, through one async client: many calls in
        flight cost no threads, and a call whose run ends is cancelled, not left running."""
        import openai

        if self._async_client is None:
            self._async_client = openai.AsyncOpenAI(**self._client_args())
        name = model or self.name
        for attempt in range(self.max_retries + 1):
            try:
                raw = await self._async_client.chat.completions.with_raw_response.create(
                    model=name, messages=messages, **self.create_kwargs
                )
                resp = _parsed(raw)
                break
            except (openai.OpenAIError, ValueError) as exc:  # ValueError: an unreadable reply
                wait = self._failure(exc, attempt, name)
                if self.sleep is time.sleep:
                    await asyncio.sleep(wait)
                else:  # a clock the caller gave (tests): its sleep may block
                    await asyncio.to_thread(self.sleep, wait)
        return self._completion(resp, name)

    async def aclose(self) -> None:
        """Close the async client's connections (the gateway does, as it closes)."""
        client, self._async_client = self._async_client, None
        if client is not None:
            await client.close()

    def _completion(self, resp: Any, name: str | None) -> Completion:
        if not resp.choices:
            raise ModelError(f"model {name!r} returned no choices")
        text = check_text(resp.choices[0].message.content, f"model {name!r}")
        usage = resp.usage
        return Completion(
            text,
            input_tokens=getattr(usage, "prompt_tokens", 0) or 0,
            output_tokens=getattr(usage, "completion_tokens", 0) or 0,
        )


def _parsed(raw: Any) -> Any:
    """The chat completion of a raw reply (the openai client's `with_raw_response`), or
    NotACompletion saying what came back: the client turns an HTML page into a str, JSON of
    another shape into an object without choices, and a body that is no JSON at all into a
    JSONDecodeError that has lost the reply."""
    try:
        resp = raw.parse()
    except ValueError:
        resp = None
    choices = getattr(resp, "choices", None)
    if not isinstance(choices, list) or any(
        getattr(c, "message", None) is None for c in choices[:1]
    ):
        raise NotACompletion(what_came_back(raw.http_response))
    return resp


def _reads_as_json(response: Any) -> bool:
    try:
        return isinstance(response.json(), dict)
    except ValueError:
        return False


def what_came_back(response: Any) -> str:
    """`HTTP 502, text/html, 1,234 bytes: '<html>...'`: a reply's status, content type and
    the first BODY_SHOWN bytes of its body, escaped (repr) so that a terminal shows its
    control characters and escape sequences rather than obeying them."""
    body = bytes(response.content)
    kind = response.headers.get("content-type") or "no content type"
    if not body:
        return f"HTTP {response.status_code}, {kind}, an empty body"
    head = body[:BODY_SHOWN].decode("utf-8", "backslashreplace")
    first = f", the first {BODY_SHOWN}" if len(body) > BODY_SHOWN else ""
    return f"HTTP {response.status_code}, {kind}, {len(body):,} bytes{first}: {head!r}"


def from_spec(rest: str) -> OpenAIModel:
    """The model an `openai:` spec names: `MODEL[@BASE_URL][?timeout=S&tries=N]`."""
    from urllib.parse import parse_qsl

    target, _, query = rest.partition("?")
    name, _, url = target.partition("@")
    if not name.strip():
        raise InvalidArgument(f"model spec 'openai:{rest}' names no model; write openai:MODEL")
    options: dict[str, Any] = {}
    try:
        pairs = parse_qsl(query, strict_parsing=True) if query else []
    except ValueError:
        raise InvalidArgument(
            f"model spec 'openai:{rest}': cannot read the options {query!r}; "
            "write ?timeout=SECONDS (> 0) and/or &tries=N (>= 1)"
        ) from None
    for key, value in pairs:
        try:
            if key == "timeout":
                options["timeout"] = float(value)
            elif key == "tries":
                tries = int(value)
                if tries < 1:
                    raise ValueError
                options["max_retries"] = tries - 1
            else:
                raise KeyError(key)
        except (KeyError, ValueError):
            raise InvalidArgument(
                f"model spec 'openai:{rest}': option {key}={value!r} is not one brood takes; "
                "write ?timeout=SECONDS (> 0) and/or &tries=N (>= 1)"
            ) from None
    return OpenAIModel(name.strip(), base_url=url or None, **options)


def retry_wait(exc: Exception, attempt: int) -> float | None:
    """Seconds to wait before retrying after `exc`, or None if it is not worth retrying."""
    import openai

    if isinstance(exc, openai.APIStatusError):
        if exc.status_code not in RETRY_STATUSES:
            return None
        asked = _retry_after(exc.response.headers)
        if asked is not None:
            return min(max(asked, 0.0), BACKOFF_MAX_S)
    elif not isinstance(exc, openai.APIConnectionError | ValueError):
        return None  # APIConnectionError includes timeouts; ValueError is an unreadable body
    return float(min(BACKOFF_FIRST_S * 2**attempt, BACKOFF_MAX_S))


def _retry_after(headers: Any) -> float | None:
    ms = headers.get("retry-after-ms")
    if ms:
        try:
            return float(ms) / 1000
        except ValueError:
            pass
    value = headers.get("retry-after")
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        pass
    try:
        return email.utils.parsedate_to_datetime(value).timestamp() - time.time()
    except (TypeError, ValueError):
        return None  # unreadable: fall back to brood's own backoff

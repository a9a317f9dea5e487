"""What brood's models of hosted APIs share, whichever SDK makes the call (openai,
anthropic, google-genai): one try's timeout, retries that wait what the server's Retry-After
asks, a 429 that becomes RateLimited for the gateway's rate-limit gate, errors said the same
way, and the options of a spec (`PROVIDER:MODEL[@URL][?timeout=S&tries=N]`).

A provider's model subclasses `RemoteModel` and says only what differs: how its client is
built, how one request is sent and read, and what its SDK's exceptions mean (`Failure`).
"""

from __future__ import annotations

import asyncio
import email.utils
import importlib
import json
import os
import sys
import time
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any, ClassVar, NamedTuple

from brood.errors import InvalidArgument, ModelError, RateLimited, install_hint
from brood.limits import is_duration
from brood.models.base import Completion, Messages, Model, rate_gated

DEFAULT_TIMEOUT_S = 120.0  # one try; a server that hangs costs minutes, not an hour
DEFAULT_TRIES = 3  # the first try and two retries
BACKOFF_FIRST_S = 0.5  # first wait before a retry, doubled each time
BACKOFF_MAX_S = 30.0  # no single wait is longer, whatever the server asks
# 408 timeout, 409 conflict, 429 rate limit, every 5xx (Anthropic's 529 "overloaded" too).
RETRY_STATUSES = frozenset({408, 409, 429}) | frozenset(range(500, 600))
RATE_LIMITED = 429


class Failure(NamedTuple):
    """What a provider's exception says about the try that raised it."""

    retry: bool  # another try may succeed: a status of RETRY_STATUSES, a timeout, a drop
    status: int | None = None  # the HTTP status, when the server answered
    asked: float | None = None  # the seconds the server asked to wait (Retry-After)


class RemoteModel(Model):
    """A model behind an HTTP API, called through its provider's SDK.

    The client is built on first use, in the supervisor's model gateway, and its one
    connection pool serves every run (workers never hold it or the key); the SDK's own
    retries are off, so the waits are brood's and testable. A 408/409/429/5xx answer, a
    timeout or a dropped connection is retried up to `max_retries` times, waiting what the
    server's Retry-After asks (capped at BACKOFF_MAX_S) or else 0.5 s doubling; when the
    retries run out, the call fails with a ModelError naming the last error, a RateLimited
    (with the server's Retry-After) if that was a 429. In a supervisor's gateway a 429 is
    RateLimited at once: the gateway's gate then waits once for every call to the endpoint.
    `sleep` is how it waits (tests pass a fake clock).
    """

    base_url_env: ClassVar[str]  # the variable the SDK reads its base URL from
    default_where: ClassVar[str]  # said in errors when neither names a URL
    name: str  # the model's name at the provider, sent with every call
    example: ClassVar[str] = "MODEL"  # a model name, for the errors that ask for one

    def __init__(
        self,
        model: str,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        max_retries: int = DEFAULT_TRIES - 1,
        sleep: Callable[[float], object] = time.sleep,
    ) -> None:
        cls = type(self).__name__
        if not isinstance(model, str) or not model.strip():
            raise InvalidArgument(f"{cls}(model=...) needs a model name, e.g. {self.example!r}")
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
            raise InvalidArgument(
                f"{cls}(max_retries=...) must be an int >= 0, got {max_retries!r}"
            )
        if not is_duration(timeout):
            raise InvalidArgument(
                f"{cls}(timeout=...) must be seconds > 0, got {timeout!r}; it bounds one try "
                "of a call"
            )
        self.name = model
        self.base_url = base_url
        self.api_key = api_key
        self.timeout = timeout
        self.max_retries = max_retries
        self.sleep = sleep
        self._client: Any = None
        self._async_client: Any = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_client"] = state["_async_client"] = None  # clients do not travel
        return state

    # ---- what a provider says ------------------------------------------------------------
    def _new_client(self) -> Any:
        """A client of the provider's SDK with no retries of its own and `timeout`."""
        raise NotImplementedError

    def _new_async_client(self) -> Any:
        raise NotImplementedError

    def _send(self, client: Any, name: str, messages: Messages) -> Any:
        """One try: the provider's reply, or the SDK's exception."""
        raise NotImplementedError

    async def _asend(self, client: Any, name: str, messages: Messages) -> Any:
        raise NotImplementedError

    def _failure(self, exc: Exception) -> Failure | None:
        """What `exc`, raised by a try, means; None for an exception that is not the
        provider's (it is raised as it is)."""
        raise NotImplementedError

    def _completion(self, reply: Any, name: str) -> Completion:
        raise NotImplementedError

    async def _close_async(self, client: Any) -> None:
        await client.close()

    def _said(self, exc: Exception, failure: Failure, tries: int) -> str:
        """How the last error of a call that failed is told."""
        return said(exc, tries)

    # ---- the calls -----------------------------------------------------------------------
    def where(self) -> str:
        """The URL the calls go to, as errors say it."""
        return self.base_url or os.environ.get(self.base_url_env) or self.default_where

    def _get_client(self) -> Any:
        if self._client is None:
            self._client = self._new_client()
        return self._client

    def complete(self, messages: Messages, model: str | None = None) -> Completion:
        name = model or self.name
        for attempt in range(self.max_retries + 1):
            try:
                reply = self._send(self._get_client(), name, messages)
                break
            except Exception as exc:
                failure = self._failure(exc)
                if failure is None:
                    raise
                self.sleep(self._wait_or_give_up(exc, failure, attempt, name))
        return self._completion(reply, name)

    async def acomplete(self, messages: Messages, model: str | None = None) -> Completion:
        """`complete` on the supervisor's loop, through one async client: many calls in
        flight cost no threads, and a call whose run ends is cancelled, not left running."""
        if self._async_client is None:
            self._async_client = self._new_async_client()
        name = model or self.name
        for attempt in range(self.max_retries + 1):
            try:
                reply = await self._asend(self._async_client, name, messages)
                break
            except Exception as exc:
                failure = self._failure(exc)
                if failure is None:
                    raise
                wait = self._wait_or_give_up(exc, failure, attempt, name)
                if self.sleep is time.sleep:
                    await asyncio.sleep(wait)
                else:  # a clock the caller gave (tests): its sleep may block
                    await asyncio.to_thread(self.sleep, wait)
        return self._completion(reply, name)

    async def aclose(self) -> None:
        """Close the async client's connections (the gateway does, as it closes)."""
        client, self._async_client = self._async_client, None
        if client is not None:
            await self._close_async(client)

    def _wait_or_give_up(self, exc: Exception, failure: Failure, attempt: int, name: str) -> float:
        """How long to wait before the next try; raises ModelError (RateLimited for a 429)
        when none is left."""
        wait = retry_wait(failure, attempt)
        limited = failure.status == RATE_LIMITED
        if wait is None or attempt == self.max_retries or (limited and rate_gated.get()):
            message = f"model {name!r} at {self.where()}: {self._said(exc, failure, attempt + 1)}"
            if limited:
                raise RateLimited(message, retry_after=failure.asked) from exc
            raise ModelError(message) from exc
        return wait


def retry_wait(failure: Failure, attempt: int) -> float | None:
    """Seconds to wait before retrying after `failure`, or None if it is not worth it."""
    if not failure.retry:
        return None
    if failure.asked is not None:
        return min(max(failure.asked, 0.0), BACKOFF_MAX_S)
    return float(min(BACKOFF_FIRST_S * 2**attempt, BACKOFF_MAX_S))


def said(exc: BaseException, tries: int) -> str:
    """`APITimeoutError after 3 tries: Request timed out. (cause)`: an SDK's exception, as
    the last error of a call."""
    after = f" after {tries} tries" if tries > 1 else ""
    cause = f" ({exc.__cause__})" if exc.__cause__ else ""
    return f"{type(exc).__name__}{after}: {exc}{cause}"


def status_failure(status: int, headers: Mapping[str, str] | None) -> Failure:
    """The Failure of an HTTP error answer."""
    asked = retry_after(headers) if headers is not None else None
    return Failure(status in RETRY_STATUSES, status, asked)


def retry_after(headers: Any) -> float | None:
    """The seconds a reply's `retry-after-ms` or `Retry-After` (seconds or a date) asks."""
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


def transient(exc: BaseException) -> bool:
    """A timeout, a dropped connection or a reply that is no JSON, from whichever HTTP
    library an SDK uses (httpx, httpx2, aiohttp): worth another try. Looked up among the
    modules already imported, so none is imported for it."""
    if isinstance(exc, TimeoutError | ConnectionError | json.JSONDecodeError):
        return True
    for module, name in (("httpx", "TransportError"), ("httpx2", "TransportError")):
        found = sys.modules.get(module)
        if found is not None and isinstance(exc, getattr(found, name, ())):
            return True
    aiohttp = sys.modules.get("aiohttp")
    return aiohttp is not None and isinstance(exc, getattr(aiohttp, "ClientError", ()))


def split_system(messages: Messages) -> tuple[str | None, Messages]:
    """The system prompt (every system message, joined) and the other messages, for the
    providers that take the system prompt apart from the conversation."""
    system = [str(m.get("content", "")) for m in messages if m.get("role") == "system"]
    rest = [m for m in messages if m.get("role") != "system"]
    return ("\n\n".join(system) if system else None), rest


def import_sdk(module: str, extra: str, who: str) -> ModuleType:
    """The SDK `who` needs, or InvalidArgument saying which extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise InvalidArgument(
            f"{who} needs the {module.partition('.')[0]!r} package: {install_hint(extra)}"
        ) from None


def parse_spec(
    provider: str, rest: str, counts: tuple[str, ...] = ()
) -> tuple[str, str | None, dict[str, Any]]:
    """The model name, the URL and the options of a spec `PROVIDER:REST`, where REST is
    `MODEL[@URL][?timeout=S&tries=N]`; `counts` names the provider's own integer options
    (> 0), passed to its model as they are (`max_tokens`)."""
    from urllib.parse import parse_qsl

    target, _, query = rest.partition("?")
    name, _, url = target.partition("@")
    if not name.strip():
        raise InvalidArgument(
            f"model spec '{provider}:{rest}' names no model; write {provider}:MODEL"
        )
    usage = "write ?timeout=SECONDS (> 0) and/or &tries=N (>= 1)" + "".join(
        f" and/or &{c}=N (>= 1)" for c in counts
    )
    options: dict[str, Any] = {}
    try:
        pairs = parse_qsl(query, strict_parsing=True) if query else []
    except ValueError:
        raise InvalidArgument(
            f"model spec '{provider}:{rest}': cannot read the options {query!r}; {usage}"
        ) from None
    for key, value in pairs:
        try:
            if key == "timeout":
                options["timeout"] = float(value)
            elif key in ("tries", *counts):
                count = int(value)
                if count < 1:
                    raise ValueError
                if key == "tries":
                    options["max_retries"] = count - 1
                else:
                    options[key] = count
            else:
                raise KeyError(key)
        except (KeyError, ValueError):
            raise InvalidArgument(
                f"model spec '{provider}:{rest}': option {key}={value!r} is not one brood "
                f"takes; {usage}"
            ) from None
    return name.strip(), url or None, options

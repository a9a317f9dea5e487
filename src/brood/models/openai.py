"""An OpenAI-compatible chat model (OpenAI, vLLM, SGLang, Ollama, llama.cpp, …)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from brood.errors import ModelError
from brood.models.base import Completion, Messages, check_text
from brood.models.remote import (
    DEFAULT_TIMEOUT_S,
    DEFAULT_TRIES,
    Failure,
    RemoteModel,
    parse_spec,
    said,
    status_failure,
)

BODY_SHOWN = 200  # bytes of a reply's body an error quotes when the reply is not readable


class NotACompletion(ValueError):
    """A reply that is not a chat completion (HTML, plain text, JSON of another shape); the
    message says what came back. Retried like a 5xx: a proxy's error page is often brief."""


class OpenAIModel(RemoteModel):
    """Chat completions through the `openai` client.

    The base URL and key come from the arguments or from OPENAI_BASE_URL / OPENAI_API_KEY.
    Retries, Retry-After, the 429 that the gateway's gate waits for, and the timeout of one
    try are every hosted model's (`RemoteModel`). `create_kwargs` (e.g. `temperature=0`)
    go to every `create` call.
    """

    provider = "openai"
    base_url_env = "OPENAI_BASE_URL"
    default_where = "the default OpenAI URL"
    example = "gpt-4.1-mini"

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
        super().__init__(
            model,
            base_url=base_url,
            api_key=api_key,
            timeout=timeout,
            max_retries=max_retries,
            sleep=sleep,
        )
        self.create_kwargs = create_kwargs

    def _client_args(self) -> dict[str, Any]:
        return {
            "base_url": self.base_url or os.environ.get("OPENAI_BASE_URL"),
            "api_key": self.api_key or os.environ.get("OPENAI_API_KEY") or "not-needed",
            "timeout": self.timeout,
            "max_retries": 0,  # brood retries itself, so the waits are its own and testable
        }

    def _new_client(self) -> Any:
        import openai

        return openai.OpenAI(**self._client_args())

    def _new_async_client(self) -> Any:
        import openai

        return openai.AsyncOpenAI(**self._client_args())

    def _send(self, client: Any, name: str, messages: Messages) -> Any:
        raw = client.chat.completions.with_raw_response.create(
            model=name, messages=messages, **self.create_kwargs
        )
        return _parsed(raw)

    async def _asend(self, client: Any, name: str, messages: Messages) -> Any:
        raw = await client.chat.completions.with_raw_response.create(
            model=name, messages=messages, **self.create_kwargs
        )
        return _parsed(raw)

    def _failure(self, exc: Exception) -> Failure | None:
        import openai

        if isinstance(exc, openai.APIStatusError):
            return status_failure(exc.status_code, exc.response.headers)
        if isinstance(exc, openai.APIConnectionError | ValueError):
            return Failure(True)  # APIConnectionError includes timeouts; ValueError: no reply
        if isinstance(exc, openai.OpenAIError):
            return Failure(False)
        return None

    def _said(self, exc: Exception, failure: Failure, tries: int) -> str:
        import openai

        count = f" ({tries} tries)" if tries > 1 else ""
        if isinstance(exc, NotACompletion):
            return f"the reply is not a chat completion{count}: {exc}"
        if isinstance(exc, openai.APIStatusError) and not _reads_as_json(exc.response):
            # an error page of a proxy or a server, not an API error: say what it was
            return f"an error reply{count}: {what_came_back(exc.response)}"
        return said(exc, tries)

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
    name, url, options = parse_spec("openai", rest)
    return OpenAIModel(name, base_url=url, **options)

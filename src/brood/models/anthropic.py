"""Claude models through the official `anthropic` SDK (the optional extra
the `[anthropic]` extra): `anthropic:MODEL[@URL]`."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from brood.errors import InvalidArgument, ModelError
from brood.models.base import Completion, Messages
from brood.models.remote import (
    DEFAULT_TIMEOUT_S,
    DEFAULT_TRIES,
    Failure,
    RemoteModel,
    import_sdk,
    parse_spec,
    split_system,
    status_failure,
    transient,
)

# The Messages API requires a reply's cap. Every Claude model takes 4,096 (Claude 3
# Haiku's own cap), and a REPL turn of code is far shorter; `max_tokens=` raises it.
DEFAULT_MAX_TOKENS = 4_096
EXTRA = "anthropic"
KEY_ENV = "ANTHROPIC_API_KEY"


class AnthropicModel(RemoteModel):
    """Messages through the `anthropic` client: the system prompt is its `system`
    parameter, the conversation its user and assistant messages, and the usage its
    `usage.input_tokens` / `output_tokens`.

    The key comes from `api_key` or what the SDK finds itself (ANTHROPIC_API_KEY,
    ANTHROPIC_AUTH_TOKEN, a profile); the base URL from `base_url` or ANTHROPIC_BASE_URL.
    Retries, Retry-After, the 429 that the gateway's gate waits for and the timeout of one
    try are every hosted model's (`RemoteModel`); the 529 "overloaded" answer is retried
    like any 5xx. `create_kwargs` (e.g. `temperature=0`) go to every `create` call.
    """

    provider = "anthropic"
    base_url_env = "ANTHROPIC_BASE_URL"
    default_where = "the default Anthropic URL"
    example = "claude-sonnet-4-5"

    def __init__(
        self,
        model: str,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        max_tokens: int = DEFAULT_MAX_TOKENS,
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
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise InvalidArgument(
                f"AnthropicModel(max_tokens=...) must be an int >= 1, got {max_tokens!r}; it "
                "caps one reply"
            )
        import_sdk("anthropic", EXTRA, f"model 'anthropic:{model}'")
        self.max_tokens = max_tokens
        self.create_kwargs = create_kwargs

    def _client_args(self) -> dict[str, Any]:
        args: dict[str, Any] = {"timeout": self.timeout, "max_retries": 0}
        if self.base_url:
            args["base_url"] = self.base_url
        if self.api_key:
            args["api_key"] = self.api_key
        return args

    def _keyed(self, client: Any) -> Any:
        if client.api_key is None and client.auth_token is None and client.credentials is None:
            raise ModelError(
                f"model 'anthropic:{self.name}' has no API key: set {KEY_ENV} (or pass "
                "AnthropicModel(api_key=...))"
            )
        return client

    def _new_client(self) -> Any:
        import anthropic

        return self._keyed(anthropic.Anthropic(**self._client_args()))

    def _new_async_client(self) -> Any:
        import anthropic

        return self._keyed(anthropic.AsyncAnthropic(**self._client_args()))

    def check_key(self) -> None:
        """ModelError unless the SDK finds a key (or another credential) for this model."""
        self._get_client()

    def _request(self, name: str, messages: Messages) -> dict[str, Any]:
        system, rest = split_system(messages)
        chat = [
            {
                "role": "assistant" if m.get("role") == "assistant" else "user",
                "content": m["content"],
            }
            for m in rest
        ]
        request: dict[str, Any] = {
            "model": name,
            "max_tokens": self.max_tokens,
            "messages": chat,
            **self.create_kwargs,
        }
        if system is not None:
            request["system"] = system
        return request

    def _send(self, client: Any, name: str, messages: Messages) -> Any:
        return client.messages.create(**self._request(name, messages))

    async def _asend(self, client: Any, name: str, messages: Messages) -> Any:
        return await client.messages.create(**self._request(name, messages))

    def _failure(self, exc: Exception) -> Failure | None:
        import anthropic

        if isinstance(exc, anthropic.APIStatusError):
            return status_failure(exc.status_code, exc.response.headers)
        if isinstance(exc, anthropic.APIConnectionError) or transient(exc):
            return Failure(True)  # APIConnectionError includes timeouts
        if isinstance(exc, anthropic.AnthropicError):
            return Failure(False)
        return None

    def _completion(self, reply: Any, name: str) -> Completion:
        texts = [b.text for b in reply.content or () if getattr(b, "type", None) == "text"]
        if not texts:
            raise ModelError(
                f"model 'anthropic:{name}' returned no text (stop reason "
                f"{getattr(reply, 'stop_reason', None)!r})"
            )
        usage = reply.usage
        return Completion(
            "".join(texts),
            input_tokens=getattr(usage, "input_tokens", 0) or 0,
            output_tokens=getattr(usage, "output_tokens", 0) or 0,
        )


def from_spec(rest: str) -> AnthropicModel:
    """The model an `anthropic:` spec names: `MODEL[@BASE_URL][?timeout=S&tries=N&max_tokens=N]`;
    InvalidArgument if the SDK is missing or finds no key."""
    name, url, options = parse_spec("anthropic", rest, counts=("max_tokens",))
    model = AnthropicModel(name, base_url=url, **options)
    try:
        model.check_key()
    except ModelError as exc:
        raise InvalidArgument(str(exc)) from None
    return model

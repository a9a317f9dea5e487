"""Gemini models through the official `google-genai` SDK (the optional extra
the `[gemini]` extra): `gemini:MODEL[@URL]`, the Gemini Developer API."""

from __future__ import annotations

import os
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

EXTRA = "gemini"
KEY_ENVS = ("GEMINI_API_KEY", "GOOGLE_API_KEY")  # the SDK prefers GOOGLE_API_KEY if both
RETRY_INFO = "type.googleapis.com/google.rpc.RetryInfo"


class GeminiModel(RemoteModel):
    """`generate_content` through the `google-genai` client: the system prompt is the
    config's `system_instruction`, the conversation its `user` and `model` turns, and the
    usage its `usage_metadata` (output tokens include the thinking tokens, which are billed
    as output).

    The key comes from `api_key`, GEMINI_API_KEY or GOOGLE_API_KEY; the base URL from
    `base_url` or GOOGLE_GEMINI_BASE_URL. Retries, Retry-After (or the RetryInfo of a 429's
    details), the 429 that the gateway's gate waits for and the timeout of one try are
    every hosted model's (`RemoteModel`). `config` (e.g. `temperature=0`,
    `max_output_tokens=2048`) goes into every call's GenerateContentConfig.
    """

    provider = "gemini"
    base_url_env = "GOOGLE_GEMINI_BASE_URL"
    default_where = "the default Gemini URL"
    example = "gemini-2.5-flash"

    def __init__(
        self,
        model: str,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        max_retries: int = DEFAULT_TRIES - 1,
        sleep: Callable[[float], object] = time.sleep,
        **config: Any,
    ) -> None:
        super().__init__(
            model,
            base_url=base_url,
            api_key=api_key,
            timeout=timeout,
            max_retries=max_retries,
            sleep=sleep,
        )
        import_sdk("google.genai", EXTRA, f"model 'gemini:{model}'")
        self.config = config

    def _key(self) -> str:
        key = self.api_key or next((k for e in KEY_ENVS if (k := os.environ.get(e))), None)
        if not key:
            raise ModelError(
                f"model 'gemini:{self.name}' has no API key: set {' or '.join(KEY_ENVS)} (or "
                "pass GeminiModel(api_key=...))"
            )
        return key

    def _new_client(self) -> Any:
        from google import genai
        from google.genai import types

        options = types.HttpOptions(
            base_url=self.base_url or None,
            # the SDK's timeout is in milliseconds; its own retries stay off (None)
            timeout=max(1, round(self.timeout * 1000)),
            retry_options=None,
        )
        return genai.Client(api_key=self._key(), vertexai=False, http_options=options)

    def _new_async_client(self) -> Any:
        return self._new_client().aio

    async def _close_async(self, client: Any) -> None:
        await client.aclose()

    def check_key(self) -> None:
        """ModelError unless a key is given or set in the environment."""
        self._key()

    def _request(self, name: str, messages: Messages) -> dict[str, Any]:
        system, rest = split_system(messages)
        contents = [
            {
                "role": "model" if m.get("role") == "assistant" else "user",
                "parts": [{"text": str(m.get("content", ""))}],
            }
            for m in rest
        ]
        config = dict(self.config)
        if system is not None:
            config["system_instruction"] = system
        return {"model": name, "contents": contents, "config": config}

    def _send(self, client: Any, name: str, messages: Messages) -> Any:
        return client.models.generate_content(**self._request(name, messages))

    async def _asend(self, client: Any, name: str, messages: Messages) -> Any:
        return await client.models.generate_content(**self._request(name, messages))

    def _failure(self, exc: Exception) -> Failure | None:
        from google.genai import errors

        if isinstance(exc, errors.APIError):
            failure = status_failure(exc.code, getattr(exc.response, "headers", None))
            if failure.asked is None:  # Google's APIs say it in the error's details
                failure = failure._replace(asked=_retry_delay(exc.details))
            return failure
        if transient(exc):
            return Failure(True)
        return None

    def _completion(self, reply: Any, name: str) -> Completion:
        text = reply.text
        if not isinstance(text, str):
            candidates = reply.candidates or []
            why = candidates[0].finish_reason if candidates else reply.prompt_feedback
            raise ModelError(f"model 'gemini:{name}' returned no text ({why})")
        usage = reply.usage_metadata
        output = (getattr(usage, "candidates_token_count", 0) or 0) + (
            getattr(usage, "thoughts_token_count", 0) or 0
        )
        return Completion(
            text,
            input_tokens=getattr(usage, "prompt_token_count", 0) or 0,
            output_tokens=output,
        )


def _retry_delay(details: Any) -> float | None:
    """The `retryDelay` ("30s") of the RetryInfo in an error body's details, if any."""
    error = details.get("error", details) if isinstance(details, dict) else None
    found = error.get("details") if isinstance(error, dict) else None
    for item in found if isinstance(found, list) else ():
        if isinstance(item, dict) and item.get("@type") == RETRY_INFO:
            delay = str(item.get("retryDelay", ""))
            try:
                return float(delay.removesuffix("s"))
            except ValueError:
                return None
    return None


def from_spec(rest: str) -> GeminiModel:
    """The model a `gemini:` spec names: `MODEL[@BASE_URL][?timeout=S&tries=N]`;
    InvalidArgument if the SDK is missing or no key is set."""
    name, url, options = parse_spec("gemini", rest)
    model = GeminiModel(name, base_url=url, **options)
    try:
        model.check_key()
    except ModelError as exc:
        raise InvalidArgument(str(exc)) from None
    return model

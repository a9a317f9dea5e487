"""An OpenAI-compatible chat model (OpenAI, vLLM, SGLang, Ollama, llama.cpp, …)."""

from __future__ import annotations

import os
from typing import Any

from brood.errors import ModelError
from brood.models.base import Completion, Messages, Model, check_text

DEFAULT_TIMEOUT_S = 600.0  # a long generation on a slow local server still fits


class OpenAIModel(Model):
    """Chat completions through the `openai` client.

    The base URL and key come from the arguments or from OPENAI_BASE_URL / OPENAI_API_KEY.
    The client is built lazily, inside the worker that uses it.
    """

    def __init__(
        self,
        model: str,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        max_retries: int = 2,
        **create_kwargs: Any,
    ) -> None:
        self.name = model
        self.base_url = base_url
        self.api_key = api_key
        self.timeout = timeout
        self.max_retries = max_retries
        self.create_kwargs = create_kwargs
        self._client: Any = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_client"] = None  # each worker builds its own client
        return state

    def _get_client(self) -> Any:
        if self._client is None:
            import openai

            self._client = openai.OpenAI(
                base_url=self.base_url or os.environ.get("OPENAI_BASE_URL"),
                api_key=self.api_key or os.environ.get("OPENAI_API_KEY") or "not-needed",
                timeout=self.timeout,
                max_retries=self.max_retries,
            )
        return self._client

    def complete(self, messages: Messages, model: str | None = None) -> Completion:
        import openai

        try:
            resp = self._get_client().chat.completions.create(
                model=model or self.name, messages=messages, **self.create_kwargs
            )
        except openai.OpenAIError as exc:
            raise ModelError(f"model {model or self.name!r}: {type(exc).__name__}: {exc}") from exc
        if not resp.choices:
            raise ModelError(f"model {model or self.name!r} returned no choices")
        text = check_text(resp.choices[0].message.content, f"model {model or self.name!r}")
        usage = resp.usage
        return Completion(
            text,
            input_tokens=getattr(usage, "prompt_tokens", 0) or 0,
            output_tokens=getattr(usage, "completion_tokens", 0) or 0,
        )

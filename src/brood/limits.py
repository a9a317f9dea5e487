"""Limits on a tree of runs and the admission checks that enforce them."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from brood.errors import InvalidArgument, LimitExceeded

__all__ = ["Limits"]

OPTIONAL = frozenset({"child_timeout", "step_timeout", "token_budget", "cost_budget"})
INTEGER = frozenset(
    {
        "max_depth",
        "max_children",
        "max_children_per_run",
        "max_concurrency",
        "max_iterations",
        "output_limit",
        "token_budget",
    }
)
POSITIVE = frozenset({"child_timeout", "step_timeout"})  # 0 s would mean "already expired"
FLOORS = {
    "max_depth": 1,
    "max_concurrency": 1,
    "max_iterations": 1,
    "output_limit": 100,
}  # below 100 characters no output would be readable


@dataclass(frozen=True, kw_only=True)
class Limits:
    """Bounds on a whole tree of runs (DESIGN.md section 5).

    max_depth: run levels including the root; a run at depth d starts child runs only if
        d + 1 < max_depth, otherwise `rlm_query` answers with a plain model call.
    max_children: child runs in the whole tree. max_children_per_run: per parent.
    max_concurrency: runs computing at once (a run blocked waiting on children does not
        hold a slot, so a waiting parent never starves its children).
    child_timeout: wall-clock seconds per child run; expiry ends it `timed_out`.
    max_iterations: model turns per run. step_timeout: one REPL step's own compute seconds
        (time spent waiting on children is not counted).
    token_budget / cost_budget: whole tree; a breach cancels the tree with reason `budget`.
    shutdown_grace / term_grace: seconds of the cleanup escalation (cooperative stop, then
        SIGTERM, then SIGKILL); tests shrink them.
    output_limit: characters of one step's output shown to the model.
    """

    max_depth: int = 3
    max_children: int = 256
    max_children_per_run: int = 64
    max_concurrency: int = 8
    child_timeout: float | None = 600.0
    max_iterations: int = 20
    step_timeout: float | None = 120.0
    token_budget: int | None = None
    cost_budget: float | None = None
    shutdown_grace: float = 1.0
    term_grace: float = 2.0
    output_limit: int = 20_000

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.name in OPTIONAL:
                continue
            whole = f.name in INTEGER
            kind = "a whole number" if whole else "a number"
            if (
                isinstance(value, bool)
                or not isinstance(value, int if whole else int | float)
                or not math.isfinite(value)
            ):
                none = " or None (no limit)" if f.name in OPTIONAL else ""
                raise InvalidArgument(
                    f"Limits.{f.name} must be {kind}{none}, got {type(value).__name__} {value!r}"
                )
            if f.name in POSITIVE and value <= 0:
                raise InvalidArgument(
                    f"Limits.{f.name} must be > 0, got {value!r}"
                    + ("; use None for no limit" if f.name in OPTIONAL else "")
                )
            floor = FLOORS.get(f.name, 0)
            if value < floor:
                raise InvalidArgument(f"Limits.{f.name} must be >= {floor}, got {value!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def can_start_child(self, depth: int) -> bool:
        """Whether a run at `depth` may start child runs (else rlm_query is a plain call)."""
        return depth + 1 < self.max_depth

    def admit_children(self, *, tree_total: int, run_total: int, count: int) -> None:
        """Refuse `count` new children when a child-count limit would break."""
        if tree_total + count > self.max_children:
            raise LimitExceeded(
                "max_children",
                tree_total + count,
                self.max_children,
                hint=f"the tree has {tree_total} children already; "
                "raise Limits(max_children=...) or start fewer children",
            )
        if run_total + count > self.max_children_per_run:
            raise LimitExceeded(
                "max_children_per_run",
                run_total + count,
                self.max_children_per_run,
                hint=f"this run has {run_total} children already; "
                "raise Limits(max_children_per_run=...) or start fewer children",
            )

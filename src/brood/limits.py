"""Limits on a tree of runs and the admission checks that enforce them."""

from __future__ import annotations

import builtins
import difflib
import math
import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from brood.errors import InvalidArgument, LimitExceeded

__all__ = ["PI_RLM_BLOCKED_BUILTINS", "Limits"]

OPTIONAL = frozenset(
    {
        "child_timeout",
        "step_timeout",
        "stall_timeout",
        "token_budget",
        "cost_budget",
        "worker_memory",
        "worker_cpu_seconds",
        "worker_processes",
        "worker_file_size",
        "worker_open_files",
        "worker_disk",
        "models",
        "compact_at",
        "hibernate_after",
        "max_workers",
    }
)
INTEGER = frozenset(
    {
        "max_depth",
        "max_children",
        "max_children_per_run",
        "max_concurrency",
        "max_iterations",
        "output_limit",
        "answer_limit",
        "max_prompt_chars",
        "max_chunks",
        "token_budget",
        "worker_memory",
        "worker_cpu_seconds",
        "worker_processes",
        "worker_file_size",
        "worker_open_files",
        "worker_disk",
        "journal_bytes_per_run",
        "max_asks_per_run",
        "compact_at",
        "max_workers",
    }
)
# 0 s would mean "already expired"
POSITIVE = frozenset({"child_timeout", "step_timeout", "stall_timeout", "compact_at"})
FLOORS = {
    "max_depth": 1,
    "max_concurrency": 1,
    "max_iterations": 1,
    "output_limit": 100,  # below 100 characters no output would be readable
    "answer_limit": 100,
    "max_prompt_chars": 2_000,  # a chunk needs 1,000 characters beside its prompt
    "max_chunks": 1,
    "worker_memory": 64 * 2**20,  # a Python worker does not start in less
    "worker_cpu_seconds": 1,
    "worker_processes": 1,
    "worker_file_size": 1,
    "worker_open_files": 16,  # the worker's own sockets, pipes and the standard streams
    "worker_disk": 2**20,  # a scratch directory smaller than this holds no real file
    "journal_bytes_per_run": 2**20,  # a run's first turns and steps need room
    "max_workers": 1,
}
WORKER_SHARE = 32 * 2**20  # bytes of available memory per live worker, max_workers' default
MOST_WORKERS = 4_096  # the default max_workers is never more than this


def default_max_workers() -> int:
    """Live workers one supervisor allows by default (Limits.max_workers=None): the host's
    available memory / WORKER_SHARE, at most MOST_WORKERS, at least 1; MOST_WORKERS where
    the available memory cannot be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            info = dict(line.split(":", 1) for line in f if ":" in line)
        available = int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError, IndexError):
        return MOST_WORKERS
    return max(1, min(MOST_WORKERS, available // WORKER_SHARE))


FLAGS = frozenset({"confine", "network", "read_only"})
PATHS = frozenset({"fs_read", "fs_write"})
POOL_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
# pi-rlm's guard set: calls a model is told not to make (model guidance, not security).
PI_RLM_BLOCKED_BUILTINS = ("eval", "exec", "compile", "globals", "locals")
BUILTIN_PRESETS = {"pi-rlm": PI_RLM_BLOCKED_BUILTINS}


def is_duration(value: object) -> bool:
    """Whether `value` is a number of seconds a timeout can be: finite and > 0 (not a bool)."""
    return (
        not isinstance(value, bool)
        and isinstance(value, int | float)
        and math.isfinite(value)
        and value > 0
    )


def check_timeout(timeout: object) -> None:
    """Refuse a wait's or a run's `timeout` that is neither None (no limit) nor a duration."""
    if timeout is not None and not is_duration(timeout):
        raise InvalidArgument(
            f"timeout must be a number of seconds > 0, or None for no limit; got {timeout!r}"
        )


@dataclass(frozen=True, kw_only=True)
class Limits:
    """Bounds on a whole tree of runs (DESIGN.md section 5).

    max_depth: run levels including the root; a run at depth d starts child runs only if
        d + 1 < max_depth, otherwise `rlm_query` answers with a plain model call.
    max_children: child runs in the whole tree. max_children_per_run: per parent.
    max_concurrency: runs computing at once (a run blocked waiting on children does not
        hold a slot, so a waiting parent never starves its children).
    child_timeout: wall-clock seconds per child run; expiry ends it `timed_out`.
    stall_timeout: seconds a step's wait on a model call, a child or a task may hear
        nothing from below (no reply, state change or heartbeat) before it raises
        StallTimeout in the step; the work keeps running. The alarm is the waiter's: work
        started with `spawn` never raises it itself, however slow (its `rlm_await` does).
        None: no alarm.
    max_iterations: model turns per run. step_timeout: one REPL step's own compute seconds
        (time spent waiting on children is not counted). step_grace: seconds past
        step_timeout after which the supervisor's own clock of the step ends a step that
        did not end itself (its code swallowed or disarmed the timeout): the run fails
        with reason `step timeout ignored`.
    token_budget / cost_budget: whole tree; a breach cancels the tree with reason `budget`.
    shutdown_grace / term_grace: seconds of the cleanup escalation (cooperative stop, then
        SIGTERM, then SIGKILL); tests shrink them.
    output_limit: characters of one step's output shown to the model (the journal keeps up
        to 50 times as much; beyond that output is dropped with a note).
    answer_limit: characters of a FINAL answer; a longer one fails the run saying so.
    max_prompt_chars: characters of one plain model call's prompt (llm_query and the like);
        a longer one is refused before it costs a call, pointing at llm_query_chunked.
    max_chunks: model calls one llm_query_chunked / map_files / llm_map_reduce may make.

    Confinement of model code (DESIGN.md section 14), on by default:
    confine: False runs model code with everything the user has (trusted code only).
    fs_read / fs_write: paths model code may also read / read and write (besides the
        Python installation, read-only, and the run's scratch directory, read-write).
    network: True lets model code open network connections.
    read_only: no file writes at all, the scratch directory included.
    blocked_builtins: builtins that raise an explanatory PermissionError when called, or
        "pi-rlm" for pi-rlm's set (eval, exec, compile, globals, locals). Guidance for
        models, not a security boundary.
    worker_memory (bytes of address space), worker_cpu_seconds, worker_processes,
    worker_file_size (bytes), worker_open_files: per-worker resource limits (None: none).
    worker_processes: the processes (and threads: the kernel counts tasks) model code may
        hold at once, exactly. Where a pids cgroup is usable, its pids.max is this plus
        brood's own tasks in the worker, counted exactly (the main thread and the link
        reader, both running before model code starts); the threads `spawn()`ed work runs
        on count among model code's; past it `fork` and `Thread.start` fail (EAGAIN). Without
        a cgroup it is RLIMIT_NPROC, which counts every process of the user (and does not
        bind root); `brood doctor` says which holds.

    worker_disk: bytes of the files a worker's scratch directory may hold (None: only
        the disk's own size); past it a write fails with ENOSPC, or the run fails naming
        the limit where only a watch of its size is possible (`brood doctor` says which).

    pools: named capacity pools, name -> how many runs may hold it at once (>= 1). A run
        started with `pool=NAME` holds one place from its start to its end; a start at
        capacity waits, queued, without holding a concurrency slot (DESIGN.md section 9).

    What the supervisor enforces on what a worker sends, whatever its code does:
    models: the model names model code may pass (`llm_query(..., model=)`,
        `rlm_query(..., model=)`); None: the supervisor's model and the models the user gave
        its roots. A name holding a URL is never taken from model code.
    journal_bytes_per_run: bytes one run may add to the journal (steps, model calls,
        messages, remembered values); past it the run fails naming the limit.
    max_asks_per_run: asks to a person one run may open.

    compact_at: the size past which a run's history is compacted (None: never). Before a
        model turn, the history is measured by the prompt tokens the model reported for
        the run's last turn or, when it reports none, by the characters of that turn's
        messages and its reply (the system prompt's included). Past `compact_at`, one
        model call (kind "compact", journaled, counted in budgets, replayed on resume)
        summarizes the turns so far, and the run goes on from its system prompt, its
        task, that summary and its newest output. REPL variables persist, and the model
        is told so. Set it well above the system prompt and the task (brood's system
        prompt is about 10,000 characters), or most turns compact.

    Density (DESIGN.md section 17):
    hibernate_after: seconds a run may wait (on children, an ask, a flow, a pool, a slow
        model call) before it gives up its worker; it is rebuilt by replaying its journal
        when the wait is satisfied, its state `running` throughout. 0: at once; None:
        never (not even to make room under max_workers). A run whose replay could diverge
        (threads or files of its code, spawned work in flight, a wait with a timeout, a
        Session's or a conversation's root) stays live, and its journal says why.
    max_workers: live workers in this supervisor (warm-pool workers do not count); past it
        starts queue in order and the longest-waiting runs hibernate first to make room.
        None: the host's available memory / 32 MiB at the supervisor's start, at most
        4,096 (`effective_max_workers`; `brood doctor` shows it).
    """

    max_depth: int = 3
    max_children: int = 256
    max_children_per_run: int = 64
    max_concurrency: int = 8
    child_timeout: float | None = 600.0
    max_iterations: int = 20
    step_timeout: float | None = 120.0
    stall_timeout: float | None = 300.0
    token_budget: int | None = None
    cost_budget: float | None = None
    shutdown_grace: float = 1.0
    term_grace: float = 2.0
    step_grace: float = 5.0
    output_limit: int = 20_000
    answer_limit: int = 1_000_000
    max_prompt_chars: int = 400_000
    max_chunks: int = 1_000
    confine: bool = True
    fs_read: tuple[str, ...] = ()
    fs_write: tuple[str, ...] = ()
    network: bool = False
    read_only: bool = False
    blocked_builtins: tuple[str, ...] = ()
    worker_memory: int | None = 4 * 2**30
    worker_cpu_seconds: int | None = None
    worker_processes: int | None = 256
    worker_file_size: int | None = 2**30
    worker_open_files: int | None = 1024
    worker_disk: int | None = 2**30
    pools: dict[str, int] = field(default_factory=dict)
    models: tuple[str, ...] | None = None
    journal_bytes_per_run: int = 64 * 2**20
    max_asks_per_run: int = 100
    compact_at: int | None = None
    hibernate_after: float | None = 30.0
    max_workers: int | None = None

    def __post_init__(self) -> None:
        self._check_others()
        object.__setattr__(self, "pools", _checked_pools(self.pools))
        object.__setattr__(self, "models", _checked_models(self.models))
        for f in fields(self):
            if f.name in FLAGS | PATHS or f.name in ("blocked_builtins", "pools", "models"):
                continue
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

    def _check_others(self) -> None:
        for name in FLAGS:
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise InvalidArgument(
                    f"Limits.{name} must be True or False, got {type(value).__name__} {value!r}"
                )
        for name in PATHS:
            value = getattr(self, name)
            if isinstance(value, str | os.PathLike):
                value = (value,)
            if not isinstance(value, list | tuple) or not all(
                isinstance(p, str | os.PathLike) for p in value
            ):
                raise InvalidArgument(
                    f"Limits.{name} must be a list of paths, got {value!r}; "
                    f"e.g. Limits({name}=['/data'])"
                )
            paths = tuple(os.path.abspath(os.fspath(p)) for p in value)
            object.__setattr__(self, name, paths)
        names = self.blocked_builtins
        if isinstance(names, str):
            if names not in BUILTIN_PRESETS:
                raise InvalidArgument(
                    f"Limits.blocked_builtins preset {names!r} is unknown; use "
                    f"{', '.join(map(repr, BUILTIN_PRESETS))} or a list of builtin names"
                )
            names = BUILTIN_PRESETS[names]
        if not isinstance(names, list | tuple) or not all(
            isinstance(b, str) and b.isidentifier() for b in names
        ):
            raise InvalidArgument(
                f"Limits.blocked_builtins must be a list of builtin names or 'pi-rlm', "
                f"got {names!r}"
            )
        for name in names:
            _check_builtin(name)
        object.__setattr__(self, "blocked_builtins", tuple(names))

    def to_dict(self) -> dict[str, Any]:
        """Every field by name, as plain values."""
        return asdict(self)

    def check_pool(self, pool: object, where: str = "pool") -> str | None:
        """`pool` if it names one of the pools (or is None); else InvalidArgument listing
        them."""
        if pool is None or (isinstance(pool, str) and pool in self.pools):
            return pool
        known = ", ".join(sorted(self.pools)) or "none are configured"
        raise InvalidArgument(
            f"{where}={pool!r} is not a pool (pools: {known}); name one of them, or declare "
            f"it with Limits(pools={{{pool!r}: CAPACITY}})"
        )

    def effective_max_workers(self) -> int:
        """max_workers, or its default on this host (`default_max_workers`) when None."""
        return self.max_workers if self.max_workers is not None else default_max_workers()

    def can_start_child(self, depth: int) -> bool:
        """Whether a run at `depth` may start child runs (else rlm_query is a plain call)."""
        return may_start_children(depth, self.max_depth)

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


def may_start_children(depth: int, max_depth: int) -> bool:
    """The depth rule, in one place for both sides: `max_depth` counts run levels with the
    root's, so a run at `depth` starts children only if they would be within it."""
    return depth + 1 < max_depth


def _check_builtin(name: str) -> None:
    """A name Limits.blocked_builtins may turn off: one of Python's builtins. A typo would
    otherwise block nothing, silently."""
    if name in vars(builtins):
        return
    close = difflib.get_close_matches(name, [n for n in vars(builtins) if n[0] != "_"], n=1)
    hint = f"did you mean {close[0]!r}?" if close else "name one that dir(builtins) lists"
    raise InvalidArgument(
        f"Limits.blocked_builtins: {name!r} is not a Python builtin, so blocking it would "
        f"block nothing; {hint} (or use the preset 'pi-rlm')"
    )


def _checked_models(models: object) -> tuple[str, ...] | None:
    if models is None:
        return None
    if isinstance(models, str) or not isinstance(models, list | tuple | set | frozenset):
        raise InvalidArgument(
            f"Limits.models must be a list of model names, got {type(models).__name__} "
            f"{models!r}; e.g. Limits(models=['gpt-4.1-mini', 'gpt-4.1'])"
        )
    for name in models:
        if not isinstance(name, str) or not name.strip():
            raise InvalidArgument(
                f"Limits.models: {name!r} is not a model name; list names as str, e.g. "
                "Limits(models=['gpt-4.1-mini'])"
            )
    return tuple(dict.fromkeys(models))


def _checked_pools(pools: object) -> dict[str, int]:
    if not isinstance(pools, Mapping):
        raise InvalidArgument(
            f"Limits.pools must be a mapping of pool name to capacity, got "
            f"{type(pools).__name__} {pools!r}; e.g. Limits(pools={{'deploy': 1, 'gpu': 4}})"
        )
    checked: dict[str, int] = {}
    for name, capacity in pools.items():
        if not isinstance(name, str) or not POOL_NAME.fullmatch(name):
            raise InvalidArgument(
                f"Limits.pools: {name!r} is not a pool name; use up to 64 letters, digits, "
                "'_', '.' and '-'"
            )
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise InvalidArgument(
                f"Limits.pools[{name!r}] must be a whole number >= 1 (how many runs hold the "
                f"pool at once), got {capacity!r}"
            )
        checked[name] = capacity
    return checked

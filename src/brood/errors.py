"""The error tree. Every brood error derives from `BroodError`.

Each message says what happened, the values involved, and what to do about it.
These classes are importable on both sides of the process boundary: a worker re-raises
the supervisor's refusals as the same classes inside the REPL.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "AskCancelled",
    "BackendError",
    "BroodError",
    "ChildCleanupError",
    "ChildFailed",
    "ChildNotReady",
    "ConfinementError",
    "ConversationClosed",
    "IllegalTransition",
    "InvalidArgument",
    "InvalidSpec",
    "LimitExceeded",
    "ModelError",
    "NodeLost",
    "OutputError",
    "ProtocolError",
    "RateLimited",
    "RayMissing",
    "ReplayDiverged",
    "StaleHandle",
    "StallTimeout",
    "StoreError",
    "SupervisorClosed",
    "ToolError",
    "UnknownRun",
]


def install_hint(extra: str) -> str:
    """How to install brood's optional extra `extra`: brood is installed from its clone
    (or from git), not from a package index."""
    return f"install brood's [{extra}] extra (in brood's clone: pip install -e '.[{extra}]')"


class BroodError(Exception):
    """Base class of every error brood raises on purpose."""


class InvalidArgument(BroodError, ValueError):
    """An argument has the wrong type or value; the message names it and the fix."""


class LimitExceeded(BroodError):
    """A request was refused at admission because it would break a limit.

    `kind` names the limit (`"max_children"`, `"max_children_per_run"`, …), `value` is what
    the request would have reached, `limit` the configured bound.
    """

    def __init__(self, kind: str, value: float, limit: float, hint: str = "") -> None:
        self.kind = kind
        self.value = value
        self.limit = limit
        self.hint = hint
        msg = f"limit {kind} exceeded: this request would reach {value}, the limit is {limit}"
        msg += f"; {hint}" if hint else f"; raise Limits({kind}=...) or do with fewer"
        super().__init__(msg)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.kind, self.value, self.limit, self.hint))


class ChildFailed(BroodError):
    """A child run ended without an answer (failed, cancelled or timed out).

    `status` is its final state and `reason` why. For batched calls, `failed` lists the
    failed indices and `answers` holds every answer, `None` where a child failed.
    """

    def __init__(
        self,
        message: str,
        *,
        run_id: str | None = None,
        status: str | None = None,
        reason: str | None = None,
        failed: list[int] | None = None,
        answers: list[str | None] | None = None,
    ) -> None:
        super().__init__(message)
        self.run_id = run_id
        self.status = status
        self.reason = reason
        self.failed = failed or []
        self.answers = answers or []


class StallTimeout(BroodError):
    """A wait of a step (on a model call, a child or a task) heard nothing from below for
    `Limits.stall_timeout` seconds: no reply, no state change, no heartbeat. The work keeps
    running; `waited_on` names it, and it can be awaited again (or cancelled)."""

    def __init__(self, message: str, *, waited_on: str | None = None) -> None:
        super().__init__(message)
        self.waited_on = waited_on

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), str(self), vars(self)))


class AskCancelled(BroodError):
    """An ask to a person ended without an answer: withdrawn (rlm_cancel), its deadline
    passed with no default, or its run ended. `ask` is the ask's id; the message says why."""

    def __init__(self, message: str, *, ask: str | None = None) -> None:
        super().__init__(message)
        self.ask = ask

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), str(self), vars(self)))


class ChildNotReady(BroodError):
    """`rlm_result` was called on a child that has not ended yet."""


class StaleHandle(BroodError):
    """A handle was used after the session or supervisor that made it was reset or closed."""


class ChildCleanupError(BroodError):
    """Exit of some worker processes could not be confirmed.

    `pids` lists the processes that may still be alive, `answer` keeps the final answer of
    the run being cleaned up (if it had one). The worker group is quarantined (killed again
    until it is gone) and the supervisor goes on serving other trees.
    """

    def __init__(self, message: str, *, pids: list[int], answer: str | None = None) -> None:
        super().__init__(message)
        self.pids = pids
        self.answer = answer

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), str(self), vars(self)))


class InvalidSpec(BroodError, ValueError):
    """A flow spec or model spec is invalid; the message lists every problem with its path."""


class OutputError(BroodError, ValueError):
    """A state's answer does not hold one of its declared outputs in the declared form
    (a json output that does not parse as JSON); the message names the output and says how
    the answer should carry it."""


class IllegalTransition(BroodError):
    """A move that the transition table does not allow."""


class ProtocolError(BroodError):
    """A frame could not be decoded; the peer is broken or not a brood process."""


class ReplayDiverged(BroodError):
    """Resuming a tree, a replayed step asked for a call the journal does not hold (another
    prompt, another order, a child under a new key). The message names the run, the step,
    and the expected and actual call."""


class SupervisorClosed(BroodError):
    """The supervisor is closed (or refused reuse after a cleanup failure)."""


class ConversationClosed(BroodError):
    """A turn was sent to a conversation that has ended (closed, failed, timed out or
    cancelled); the message says how it ended and how to start another."""


class ModelError(BroodError):
    """A model call failed or returned something that is not text."""


class ToolError(BroodError):
    """A tool (a function the user gave the supervisor, or an MCP server's tool) failed:
    it raised, timed out, returned what is not JSON, or its server is gone. `tool` names
    it; the message says what happened and what to do."""

    def __init__(self, message: str, *, tool: str = "") -> None:
        super().__init__(message)
        self.tool = tool


class RateLimited(ModelError):
    """A model endpoint refused a call for its rate limit (HTTP 429). A `Model` or a
    `chat_fn` raises it, with `retry_after` the seconds the server asked to wait (or None);
    the gateway then holds every call to that endpoint until then, and tries again."""

    def __init__(self, message: str = "rate limited", *, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


# How the worker words the reason of a run that failed on a rate-limited model call. Text
# for people only: whether a run failed on a rate limit is the supervisor's own decision
# (`FailureKind.RATE_LIMITED`, from what its gateway answered), never read from this.
RATE_LIMITED_REASON = "model error: rate limited: "


class StoreError(BroodError):
    """The journal could not be opened, read or written."""


class UnknownRun(StoreError, LookupError):
    """The journal holds no run with this id (`run_id`); the journal itself is fine."""

    def __init__(self, message: str, *, run_id: str | None = None) -> None:
        super().__init__(message)
        self.run_id = run_id

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), str(self), vars(self)))


class NodeLost(BroodError):
    """A cluster's node running a child placed there (placement="spread") was lost (its
    agent died). The child's subtree is resumed from the journal on the parent's node."""


class BackendError(BroodError):
    """A backend could not start, signal or reap a worker."""


class RayMissing(BroodError, ImportError):
    """Ray is not installed; `brood.Cluster` needs the optional extra `[ray]`."""


class ConfinementError(BroodError):
    """A confinement mechanism this machine supports (Landlock, the capability drop, an
    rlimit, the private network) failed to apply to a worker; the worker must not run
    model code. The message names the mechanism, the values and the errno."""


def _rebuild(cls: type[BroodError], message: str, fields: dict[str, Any]) -> BroodError:
    exc = cls.__new__(cls)
    Exception.__init__(exc, message)
    vars(exc).update(fields)
    return exc

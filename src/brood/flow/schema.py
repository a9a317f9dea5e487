"""The flow spec schema: the pydantic models a YAML/JSON spec validates against, the name
rule, and the bounds and defaults of a flow.

The models check one field at a time (unknown keys are errors, values are strict); the
checks that span fields (ids, references, guards, cycles) are in `brood.flow.check`.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Final, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from brood.flow.guards import Op

__all__ = [
    "FOREACH_MAX",
    "MAX_TRANSITIONS",
    "FlowSpec",
    "Foreach",
    "Guard",
    "Input",
    "Node",
    "Output",
    "RunSettings",
    "State",
    "SubAgent",
    "Transition",
]

MAX_TRANSITIONS: Final = 10_000  # the hard cap on fired transitions, so a runaway loop ends
TRANSITIONS_PER_STATE: Final = 10  # max_transitions defaults to 10 x the number of states
MAX_PARALLEL: Final = 64  # instances of one flow running at once, at most
DEFAULT_PARALLEL: Final = 8
MAX_STATES: Final = 1024
FOREACH_MAX: Final = 64  # Limits.max_children_per_run's default: one instance per child run

NAME_PATTERN = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")
NAME_RULE = "use letters, digits, '_' and '-', starting with a letter or '_'"

ValueType = Literal["text", "json"]
FailurePolicy = Literal["fail_fast", "continue", "escalate"]
Lifecycle = Literal["task", "resident"]


def _check_name(value: str) -> str:
    if not NAME_PATTERN.fullmatch(value):
        raise ValueError(f"{value!r} is not a valid name; {NAME_RULE}")
    return value


Name = Annotated[str, AfterValidator(_check_name)]


class SpecModel(BaseModel):
    """The base of every part of a spec: no unknown fields, no coercion, frozen."""

    # strict: YAML's "3" is a string, not a number; allow_inf_nan: a budget of .inf or NaN
    # is a mistake, not "no limit".
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)


class _AgentFields(SpecModel):
    """Model settings a sub-agent run may set; None means the supervisor's default."""

    model: str | None = Field(default=None, min_length=1)
    temperature: float | None = Field(default=None, ge=0)
    max_tokens: int | None = Field(default=None, ge=1)
    max_iterations: int | None = Field(default=None, ge=1)


class SubAgent(_AgentFields):
    """A named sub-agent under `subagents`: a prompt template plus optional model settings.
    States use it with `subagent: NAME`; its placeholders must be inputs of every such state."""

    prompt: str
    description: str | None = None


class Input(SpecModel):
    """A state input. `from: STATE.OUTPUT` reads another state's output; without `from` it is
    a flow input given when the flow starts. `type` defaults to the source output's type
    (`text` for a flow input). A required input (the default) holds the state until the
    value exists; an optional one is `null` when it does not."""

    name: Name
    type: ValueType | None = None
    from_: str | None = Field(default=None, alias="from")
    optional: bool = False


class Output(SpecModel):
    """A declared output: `name` and `type` (`text`: the answer, `json`: parsed JSON)."""

    name: Name
    type: ValueType = "text"


class Foreach(SpecModel):
    """Run one instance of the state per element of the json input `over` (a list), at
    most `max` of them; in the prompt, `{over}` is the current element."""

    over: Name
    max: int = Field(default=FOREACH_MAX, ge=1)


def _shorthand(items: Any) -> Any:
    """`[a, {name: b, ...}]` -> `[{name: a}, {name: b, ...}]`; anything else is left to the
    schema to refuse."""
    if isinstance(items, list):
        return [{"name": item} if isinstance(item, str) else item for item in items]
    return items


class _Step(_AgentFields):
    """What states and nodes share."""

    id: Name
    description: str | None = None
    prompt: str | None = None
    subagent: str | None = None
    inputs: list[Input] = []
    outputs: list[Output] = []
    # A child that fails is started again, up to `retries` times. An answer that cannot
    # give a declared output (a binding failure) is never retried: it would fail the same.
    retries: int = Field(default=0, ge=0)
    budget: float | None = Field(default=None, gt=0)
    # When an entry fails for good: fail_fast ends the flow, escalate pauses it (resume
    # runs the entry again), continue goes on: unguarded transitions from the failed state
    # fire, so a dependent that reads none of its outputs runs and one that reads a
    # required output fails at binding; the flow ends failed, naming the failed states.
    failure_policy: FailurePolicy | None = None
    foreach: Foreach | None = None
    lifecycle: Lifecycle = "task"
    # A capacity pool of the supervisor's Limits.pools each instance holds while it runs
    # (checked against the pools when the flow starts).
    pool: str | None = Field(default=None, min_length=1, max_length=64)

    @field_validator("inputs", "outputs", mode="before")
    @classmethod
    def _names_are_shorthand(cls, items: Any) -> Any:
        return _shorthand(items)


class State(_Step):
    """A state of the state form. `entry: true` states start when the flow starts; others
    start when a transition enters them; `max_entries` bounds how often one runs."""

    entry: bool = False
    max_entries: int = Field(default=1, ge=1)


class Node(_Step):
    """A node of the DAG form: runs once, after every node in `depends_on` settled, with
    their outputs as inputs."""

    depends_on: list[Name] = []


class Guard(SpecModel):
    """A transition's condition on the source state's output `output`, optionally at `path`
    inside it (`a.b[0].c`), compared JSON-strictly (see `brood.flow.guards`)."""

    output: Name
    path: str | None = None
    op: Op
    value: Any = None


class Transition(SpecModel):
    """`from` -> `to`, fired when `from` settles and `when` (if any) passes."""

    from_: Name = Field(alias="from")
    to: Name
    when: Guard | None = None


class RunSettings(SpecModel):
    """Whole-flow settings, with the factory executor's defaults and bounds: `max_parallel`
    state instances at once (1..64, default 8), `budget` wall-clock seconds for the flow,
    the default `failure_policy` of its states (`escalate`), and `max_transitions` fired in
    all (default 10 x the number of states, at most 10,000)."""

    max_parallel: int = Field(default=DEFAULT_PARALLEL, ge=1, le=MAX_PARALLEL)
    budget: float | None = Field(default=None, gt=0)
    failure_policy: FailurePolicy = "escalate"
    max_transitions: int | None = Field(default=None, ge=1, le=MAX_TRANSITIONS)


class FlowSpec(SpecModel):
    """A whole flow spec: `states` + `transitions` (the state form) or `nodes` (the DAG
    form), `subagents` by name, and `run` settings. Build it with `load_spec`, which also
    runs the checks that span fields; `FlowSpec.model_validate` alone checks only the
    schema."""

    name: str | None = None
    description: str | None = None
    run: RunSettings = RunSettings()
    subagents: dict[str, SubAgent] = {}
    states: list[State] | None = None
    transitions: list[Transition] = []
    nodes: list[Node] | None = None

"""The compiled machine: plain frozen dataclasses, the same for both spec forms, that the
executor runs. `brood.flow.compile` builds them from a valid spec."""

from __future__ import annotations

from dataclasses import dataclass, field

from brood.flow.guards import Condition
from brood.flow.schema import FailurePolicy, Lifecycle, ValueType

__all__ = [
    "AgentSettings",
    "FlowParam",
    "Machine",
    "MachineForeach",
    "MachineInput",
    "MachineOutput",
    "MachineState",
    "MachineTransition",
    "RunConfig",
]


@dataclass(frozen=True, kw_only=True)
class AgentSettings:
    """Model settings of a state's runs; None means the supervisor's default."""

    model: str | None = None
    temperature: float | None = None
    max_tokens: int | None = None
    max_iterations: int | None = None


@dataclass(frozen=True, kw_only=True)
class MachineInput:
    """An input with its type resolved. `source`/`output` name where its value comes from;
    both None for a flow input (given when the flow starts)."""

    name: str
    type: ValueType
    source: str | None
    output: str | None
    optional: bool


@dataclass(frozen=True, kw_only=True)
class MachineOutput:
    name: str
    type: ValueType


@dataclass(frozen=True, kw_only=True)
class MachineForeach:
    over: str
    max: int


@dataclass(frozen=True, kw_only=True)
class MachineState:
    """One state, with everything resolved: the prompt template (its own or its subagent's),
    the merged model settings, input types, and the failure policy (its own or the run's)."""

    id: str
    entry: bool
    prompt: str
    subagent: str | None
    settings: AgentSettings
    inputs: tuple[MachineInput, ...]
    outputs: tuple[MachineOutput, ...]
    retries: int
    budget: float | None
    failure_policy: FailurePolicy
    foreach: MachineForeach | None
    max_entries: int
    lifecycle: Lifecycle
    pool: str | None = None

    def output_type(self, name: str) -> ValueType:
        return next(o.type for o in self.outputs if o.name == name)


@dataclass(frozen=True, kw_only=True)
class MachineTransition:
    """Fired when `source` settles and `guard` (None: always) passes on its outputs."""

    source: str
    target: str
    guard: Condition | None = None


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """The run settings of a compiled flow (see `RunSettings`)."""

    max_parallel: int
    budget: float | None
    failure_policy: FailurePolicy
    max_transitions: int


@dataclass(frozen=True, kw_only=True)
class FlowParam:
    """A flow input: a value given by name when the flow starts. `optional` only if every
    state that reads it declares it optional."""

    name: str
    type: ValueType
    optional: bool


@dataclass(frozen=True, kw_only=True)
class Machine:
    """The executable form of a flow, the same for both spec forms.

    `states` maps id -> state in declaration order; `transitions` are in spec order (for the
    DAG form: node order, then each node's `depends_on` order); `entry` lists the states
    the flow starts in; `params` the flow inputs by name. Treat it as immutable.
    """

    name: str | None
    run: RunConfig
    states: dict[str, MachineState]
    transitions: tuple[MachineTransition, ...]
    entry: tuple[str, ...]
    params: dict[str, FlowParam] = field(default_factory=dict)

    def transitions_from(self, state_id: str) -> tuple[MachineTransition, ...]:
        """The transitions that `state_id` settling may fire, in spec order."""
        return tuple(t for t in self.transitions if t.source == state_id)

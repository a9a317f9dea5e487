"""Flows: state-machine workflows of sub-agents (DESIGN.md section 8).

`load_spec` reads and validates a spec, `compile_spec` turns it into the `Machine` the
executor runs, `evaluate` decides transition guards, `render_prompt` and `read_output`
carry values into and out of a state's run. This package imports only `brood.errors` (and
pydantic and PyYAML); it starts nothing.
"""

from brood.flow.guards import Condition, evaluate, json_equal, parse_path
from brood.flow.render import fenced_blocks, read_output, render_input, render_prompt
from brood.flow.spec import (
    FOREACH_MAX,
    MAX_TRANSITIONS,
    AgentSettings,
    FlowParam,
    FlowSpec,
    Foreach,
    Guard,
    Input,
    Machine,
    MachineForeach,
    MachineInput,
    MachineOutput,
    MachineState,
    MachineTransition,
    Node,
    Output,
    OutputError,
    Placeholder,
    RunConfig,
    RunSettings,
    State,
    SubAgent,
    Transition,
    check_spec,
    compile_spec,
    load_spec,
    parse_template,
)

__all__ = [
    "FOREACH_MAX",
    "MAX_TRANSITIONS",
    "AgentSettings",
    "Condition",
    "FlowParam",
    "FlowSpec",
    "Foreach",
    "Guard",
    "Input",
    "Machine",
    "MachineForeach",
    "MachineInput",
    "MachineOutput",
    "MachineState",
    "MachineTransition",
    "Node",
    "Output",
    "OutputError",
    "Placeholder",
    "RunConfig",
    "RunSettings",
    "State",
    "SubAgent",
    "Transition",
    "check_spec",
    "compile_spec",
    "evaluate",
    "fenced_blocks",
    "json_equal",
    "load_spec",
    "parse_path",
    "parse_template",
    "read_output",
    "render_input",
    "render_prompt",
]

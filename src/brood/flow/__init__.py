"""Flows: state-machine workflows of sub-agents (DESIGN.md section 8).

`load_spec` reads and validates a spec, `compile_spec` turns it into the `Machine` the
executor runs, `evaluate` decides transition guards, `render_prompt` and `read_output`
carry values into and out of a state's run. This package imports only `brood.errors` (and
pydantic and PyYAML); it starts nothing.

A flow is a state machine of sub-agents (DESIGN.md section 8). It is written in one of two
forms that compile to the same `Machine`:

- the state form: `states` (each with an `entry` flag) and `transitions` between them,
  optionally guarded (`when {output, path, op, value}`);
- the DAG form: `nodes` with `depends_on`. The nodes without dependencies are the entries,
  every dependency becomes an unconditional transition into the node, and every output of
  a dependency becomes a required input of the node, so a node starts only once all of its
  dependencies have produced their outputs.

`load_spec` reads a spec (a path, YAML/JSON text or a dict), checks the schema with
pydantic (unknown keys are errors) and then everything that spans fields (ids, references,
cycles, guards, templates). It reports every problem at once (up to 100), each as
`path: message`, in one `InvalidSpec`, and returns a `FlowSpec` only if there is none.
`load_spec_text` does the same for text alone, never taken for a path, and by default tells
each problem in the schema's own words (no value or unknown key from the text): how the
supervisor reads a spec model code sent. Both refuse a spec over 1 MiB or nested more than
64 levels deep before anything recurses into it. `compile_spec` turns a valid `FlowSpec`
into the plain-dataclass `Machine` the executor runs.

Decisions a spec author relies on:

- `budget` (run and state) is wall-clock seconds, a plain positive number.
- An input without `from` is a flow input: a value given when the flow is started, by name.
  Its type defaults to `text`; an input with `from` defaults to its source output's type.
- `outputs` items are a name (a text output) or `{name, type}`.
- A state runs at most `max_entries` times (default 1); a loop needs `max_entries` > 1 on
  the states it re-enters.
- A prompt's `{name}` placeholders must name the state's inputs; `{{` and `}}` are literal
  braces (so a JSON example in a prompt is written `{{"ok": true}}`).
- A state's model settings (`model`, `temperature`, `max_tokens`, `max_iterations`)
  override the settings of the subagent it names.
- YAML is read with YAML 1.2 booleans (only `true`/`false`; `yes`, `no`, `on`, `off` stay
  strings), no implicit timestamps (a date stays a string), and duplicate keys are errors.

Where each part lives:

- `brood.flow.schema`: the pydantic models (`FlowSpec`, `State`, `Node`, ...), the name
  rule, and the bounds and defaults of a flow (`FOREACH_MAX`, `MAX_TRANSITIONS`, ...);
- `brood.flow.template`: prompt templates (`parse_template`, `Placeholder`);
- `brood.flow.load`: reading a source (paths, JSON, the YAML loader, bounds of size and
  nesting), `load_spec` and `load_spec_text`;
- `brood.flow.check`: schema problems told with their paths, the checks that span fields,
  and `check_spec`;
- `brood.flow.compile`: `compile_spec`, from a valid spec to a `Machine`;
- `brood.flow.machine`: the compiled `Machine` and its parts;
- `brood.flow.guards`: transition guards (`evaluate`);
- `brood.flow.render`: prompts rendered from inputs, outputs read from answers
  (`OutputError` when an answer does not carry one);
- `brood.flow.host`: `FlowHost`, what the executor needs of the supervisor's core, and
  `FlowRun`, what it reads of a run;
- `brood.flow.executor`: the executor, on the supervisor's loop (not imported here);
- `brood.flow.service`: `FlowService`, the flows of one supervisor: started from the API
  or by a run's code, steered by a worker's requests, rebuilt on a resume (not imported
  here; the supervisor's engine builds it on a flow's first use).
"""

from brood.flow.check import check_spec
from brood.flow.compile import compile_spec
from brood.flow.guards import Condition, evaluate, json_equal, parse_path
from brood.flow.load import load_spec, load_spec_text
from brood.flow.machine import (
    AgentSettings,
    FlowParam,
    Machine,
    MachineForeach,
    MachineInput,
    MachineOutput,
    MachineState,
    MachineTransition,
    RunConfig,
)
from brood.flow.render import OutputError, fenced_blocks, read_output, render_input, render_prompt
from brood.flow.schema import (
    FOREACH_MAX,
    MAX_TRANSITIONS,
    FlowSpec,
    Foreach,
    Guard,
    Input,
    Node,
    Output,
    RunSettings,
    State,
    SubAgent,
    Transition,
)
from brood.flow.template import Placeholder, parse_template

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
    "load_spec_text",
    "parse_path",
    "parse_template",
    "read_output",
    "render_input",
    "render_prompt",
]

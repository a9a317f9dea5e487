"""Every problem of a flow spec at once, each as `path: message`: pydantic's schema errors
told the way a spec author wrote the spec, the checks that span fields (ids, references,
templates, guards, reachability, cycles), and the `InvalidSpec` that lists them in the
order of the spec.

A state that fails the schema is checked from what passes of it (`_view_from_raw`), so it
causes no follow-on problems.
"""

from __future__ import annotations

import difflib
import json
import math
import re
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Final, Literal

from pydantic import BaseModel, ValidationError

from brood.errors import InvalidSpec
from brood.flow.guards import NUMERIC_OPS, parse_path
from brood.flow.schema import (
    _NAME,
    _NAME_RULE,
    MAX_STATES,
    FlowSpec,
    Input,
    Node,
    State,
    SubAgent,
    Transition,
    ValueType,
    _Spec,
)
from brood.flow.template import parse_template, placeholders

__all__ = ["check_spec"]

TOP: Final = "(top level)"  # the path shown for problems of the spec as a whole


# ---- the report ----------------------------------------------------------------------------


_SECTIONS: Final = ("name", "description", "run", "subagents", "states", "nodes", "transitions")
_PLACE = re.compile(r"([A-Za-z_]+)(?:\[(\d+)\])?")


def _place(problem: str) -> tuple[int, int]:
    """Where a problem sits in a spec, to list problems in the order of the spec."""
    m = _PLACE.match(problem)
    if problem.startswith(TOP) or not m or m.group(1) not in _SECTIONS:
        return (-1, -1)
    return (_SECTIONS.index(m.group(1)), int(m.group(2) or -1))


def _raise(label: str, problems: list[str]) -> None:
    problems = sorted(dict.fromkeys(problems), key=_place)
    if problems:
        count = f"{len(problems)} problem" + ("s" if len(problems) != 1 else "")
        lines = "".join(f"\n  {p}" for p in problems)
        raise InvalidSpec(f"invalid flow spec {label}: {count}{lines}")


def check_spec(spec: FlowSpec) -> list[str]:
    """Every problem of a schema-valid spec that spans fields, as `path: message` lines
    (empty when the spec is valid)."""
    return _Checker(_view_from_spec(spec)).run()


# ---- schema problems -----------------------------------------------------------------------


def _format_path(loc: Iterable[Any]) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif _NAME.fullmatch(str(part)):
            path += f".{part}" if path else str(part)
        else:
            path += f"[{json.dumps(str(part))}]"
    return path or TOP


def _describe(value: Any) -> str:
    """`string 'x'`, `float nan`, `null`, `list [1, 2]`: a value with its JSON-ish kind."""
    if value is None:
        return "null"
    kinds = {bool: "boolean", int: "integer", float: "number", str: "string"}
    kind = next((k for t, k in kinds.items() if type(value) is t), type(value).__name__)
    if isinstance(value, dict):
        kind = "mapping"
    shown = json.dumps(value) if isinstance(value, bool) else repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return f"{kind} {shown}"


def _unwrap(annotation: Any) -> Any:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _unwrap(args[0]) if len(args) == 1 else annotation
    if origin is Annotated:
        return _unwrap(typing.get_args(annotation)[0])
    return annotation


def _model_at(loc: Iterable[Any]) -> type[BaseModel] | None:
    """The schema model that validates the value at `loc` (for naming its allowed keys)."""
    current: Any = FlowSpec
    for part in loc:
        current = _unwrap(current)
        if isinstance(current, type) and issubclass(current, BaseModel):
            fields = {f.alias or name: f for name, f in current.model_fields.items()}
            if part not in fields:
                return None
            current = fields[part].annotation
            continue
        origin = typing.get_origin(current)
        args = typing.get_args(current)
        if origin is list and args and isinstance(part, int):
            current = args[0]
        elif origin is dict and len(args) == 2:
            current = args[1]
        else:
            return None
    current = _unwrap(current)
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


_KEY_HINTS: Final[dict[tuple[str, str], str]] = {
    ("State", "depends_on"): "depends_on belongs to the DAG form (nodes); "
    "in the state form, transitions lead from one state to the next",
    ("Node", "entry"): "in the DAG form the nodes without depends_on are the entries",
    ("Node", "max_entries"): "a node runs once; use the state form to re-enter a state",
    ("FlowSpec", "edges"): "edges are transitions (the state form) or depends_on (the DAG form)",
    ("Transition", "guard"): "a transition's condition is written under when",
    ("Transition", "if"): "a transition's condition is written under when",
    ("Transition", "condition"): "a transition's condition is written under when",
}


def _unknown_key(loc: tuple[Any, ...]) -> str:
    key = str(loc[-1])
    model = _model_at(loc[:-1])
    if model is None:
        return "unknown key"
    allowed = sorted(f.alias or name for name, f in model.model_fields.items())
    hint = _KEY_HINTS.get((model.__name__, key))
    if hint is None:
        close = difflib.get_close_matches(key, allowed, n=1)
        hint = f"did you mean {close[0]!r}?" if close else ""
    listed = f"(allowed: {', '.join(allowed)})"
    return f"unknown key; {hint} {listed}" if hint else f"unknown key {listed}"


def _bound(value: Any) -> Any:
    """0.0 -> 0: a bound as the spec author would write it."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _schema_problems(exc: ValidationError) -> list[str]:
    problems = []
    for error in exc.errors():
        loc = tuple(error["loc"])
        kind = error["type"]
        value = error.get("input")
        ctx = error.get("ctx") or {}
        got = _describe(value)
        if kind == "missing":
            message = "required, but missing"
        elif kind == "extra_forbidden":
            message = _unknown_key(loc)
        elif kind == "literal_error":
            message = f"must be {ctx.get('expected')}, got {got}"
        elif kind in ("int_type", "int_parsing", "int_from_float"):
            message = f"must be a whole number, got {got}"
        elif kind in ("float_type", "float_parsing"):
            message = f"must be a number, got {got}"
        elif kind == "finite_number":
            message = f"must be a finite number, got {got}"
        elif kind in ("bool_type", "bool_parsing"):
            message = f"must be true or false, got {got}"
        elif kind == "string_type":
            message = f"must be a string, got {got}"
        elif kind == "list_type":
            message = f"must be a list, got {got}"
        elif kind in ("dict_type", "model_type", "model_attributes_type"):
            message = f"must be a mapping, got {got}"
            if len(loc) >= 2 and loc[-2] in ("inputs", "outputs"):
                message = f"must be a name or a mapping with name, got {got}"
        elif kind == "greater_than_equal":
            message = f"must be >= {_bound(ctx.get('ge'))}, got {got}"
        elif kind == "greater_than":
            message = f"must be > {_bound(ctx.get('gt'))}, got {got}"
        elif kind == "string_too_short":
            message = "must not be empty"
        elif kind == "value_error":
            message = str(error["msg"]).removeprefix("Value error, ")
        else:
            message = str(error["msg"])
        problems.append(f"{_format_path(loc)}: {message}")
    return problems


# ---- checks that span fields ---------------------------------------------------------------


@dataclass
class _Item:
    """A state or node as the checks see it. `step` is None when it failed the schema (its
    problems are reported already); `id` and `entry` come from the raw data then."""

    path: str
    id: str | None
    step: State | Node | None
    entry: bool
    broken: frozenset[str] = frozenset()  # keys that failed the schema, left out of `step`
    inputs: list[tuple[str, Input]] = field(default_factory=list)  # (path, input), resolved


@dataclass
class _Edge:
    path: str
    transition: Transition | None
    source: str | None
    target: str | None


@dataclass
class _View:
    form: Literal["states", "nodes"]
    items: list[_Item] | None  # None: the states/nodes list itself is broken
    edges: list[_Edge]
    subagents: dict[str, SubAgent | None]
    has_states: bool
    has_nodes: bool
    has_transitions: bool


def _view_from_spec(spec: FlowSpec) -> _View:
    form: Literal["states", "nodes"] = "nodes" if spec.nodes is not None else "states"
    steps: list[State | Node] = [*(spec.nodes or [])] if form == "nodes" else [*(spec.states or [])]
    items = [
        _Item(
            f"{form}[{i}]",
            step.id,
            step,
            step.entry if isinstance(step, State) else not step.depends_on,
        )
        for i, step in enumerate(steps)
    ]
    edges = [_Edge(f"transitions[{i}]", t, t.from_, t.to) for i, t in enumerate(spec.transitions)]
    return _View(
        form=form,
        items=items,
        edges=edges,
        subagents=dict(spec.subagents),
        has_states=spec.states is not None,
        has_nodes=spec.nodes is not None,
        has_transitions="transitions" in spec.model_fields_set,
    )


def _validated(model: type[_Spec], raw: Any) -> tuple[Any, frozenset[str]]:
    """`raw` validated as `model`, leaving out the keys that fail the schema (their problems
    are reported by the whole-spec validation), so the rest can still be checked; with the
    left-out keys. (None, ...) when even the rest does not pass (a required key is bad)."""
    try:
        return model.model_validate(raw), frozenset()
    except ValidationError as exc:
        broken = frozenset(str(e["loc"][0]) for e in exc.errors() if e["loc"])
        if not isinstance(raw, Mapping) or not broken:
            return None, broken
        try:
            kept = {key: value for key, value in raw.items() if key not in broken}
            return model.model_validate(kept), broken
        except ValidationError:
            return None, broken


def _view_from_raw(data: Mapping[str, Any]) -> _View:
    """A view of a spec that failed the schema: the parts that pass it, and the raw ids of
    those that do not, so that references to them are not reported as unknown."""
    has_nodes = "nodes" in data and data["nodes"] is not None
    form: Literal["states", "nodes"] = "nodes" if has_nodes else "states"
    raw_steps = data.get(form)
    items: list[_Item] | None = None
    if isinstance(raw_steps, list):
        items = []
        for i, raw in enumerate(raw_steps):
            step, broken = _validated(Node if form == "nodes" else State, raw)
            raw_id = raw.get("id") if isinstance(raw, Mapping) else None
            entry = isinstance(raw, Mapping) and (
                raw.get("entry") is True if form == "states" else not raw.get("depends_on")
            )
            items.append(
                _Item(
                    f"{form}[{i}]",
                    raw_id if isinstance(raw_id, str) and _NAME.fullmatch(raw_id) else None,
                    step,
                    entry,
                    broken,
                )
            )
    edges: list[_Edge] = []
    raw_edges = data.get("transitions")
    if isinstance(raw_edges, list):
        for i, raw in enumerate(raw_edges):
            fields = raw if isinstance(raw, Mapping) else {}
            source, target = fields.get("from"), fields.get("to")
            edges.append(
                _Edge(
                    f"transitions[{i}]",
                    _validated(Transition, raw)[0],
                    source if isinstance(source, str) else None,
                    target if isinstance(target, str) else None,
                )
            )
    subagents: dict[str, SubAgent | None] = {}
    raw_subagents = data.get("subagents")
    if isinstance(raw_subagents, Mapping):
        for name, raw in raw_subagents.items():
            subagents[str(name)] = _validated(SubAgent, raw)[0]
    return _View(
        form=form,
        items=items,
        edges=edges,
        subagents=subagents,
        has_states="states" in data and data["states"] is not None,
        has_nodes=has_nodes,
        has_transitions="transitions" in data,
    )


def _names(names: Iterable[str]) -> str:
    return ", ".join(names) or "none"


def _json_problems(value: Any, path: str) -> list[str]:
    """Problems that keep `value` from being finite JSON, each with its path."""
    if value is None or isinstance(value, bool | str | int):
        return []
    if isinstance(value, float):
        if math.isfinite(value):
            return []
        return [f"{path}: {value} is not JSON (only finite numbers are); give a finite number"]
    if isinstance(value, list):
        return [p for i, item in enumerate(value) for p in _json_problems(item, f"{path}[{i}]")]
    if isinstance(value, dict):
        problems = []
        for key, item in value.items():
            if not isinstance(key, str):
                problems.append(
                    f"{path}: the key {key!r} is a {type(key).__name__}; JSON keys are strings"
                )
                continue
            step = f".{key}" if _NAME.fullmatch(key) else f"[{json.dumps(key)}]"
            problems.extend(_json_problems(item, path + step))
        return problems
    if isinstance(value, tuple | set | frozenset):
        return [f"{path}: a {type(value).__name__} is not JSON; use a list"]
    return [
        f"{path}: a {type(value).__name__} is not JSON; use null, true/false, a number, "
        "a string, a list or a mapping"
    ]


class _Checker:
    """Runs every cross-field check over a view, collecting problems instead of stopping at
    the first; `_Compiler` (brood.flow.compile) then builds the machine from the same
    resolved view."""

    def __init__(self, view: _View) -> None:
        self.view = view
        self.problems: list[str] = []
        self.noun = "node" if view.form == "nodes" else "state"
        self.by_id: dict[str, _Item] = {}
        self.params: dict[str, tuple[ValueType, bool, str]] = {}  # name -> (type, optional, path)

    def run(self) -> list[str]:
        view = self.view
        self._check_form()
        for name, sub in view.subagents.items():
            path = _format_path(["subagents", name])
            if not _NAME.fullmatch(name):
                self.problems.append(f"{path}: {name!r} is not a valid name; {_NAME_RULE}")
            if sub is not None:
                self.problems.extend(f"{path}.prompt: {p}" for p in parse_template(sub.prompt)[1])
        if view.items is None:
            return self.problems
        self._check_ids()
        for item in view.items:
            if item.step is not None:
                self._check_step(item, item.step)
        if view.form == "nodes":
            self._check_dependency_cycles()
        else:
            for edge in view.edges:
                if edge.transition is not None:
                    self._check_transition(edge, edge.transition)
            self._check_entries()
            self._check_input_cycles()
        return self.problems

    # -- the form and the ids

    def _check_form(self) -> None:
        view = self.view
        if view.has_states and view.has_nodes:
            self.problems.append(
                f"{TOP}: has both states and nodes; write states (with transitions) for the "
                "state form or nodes (with depends_on) for the DAG form, not both"
            )
        elif not view.has_states and not view.has_nodes:
            self.problems.append(
                f"{TOP}: a flow needs states (the state form) or nodes (the DAG form)"
            )
        if view.has_nodes and view.has_transitions:
            self.problems.append(
                "transitions: the DAG form (nodes) takes no transitions; order nodes with "
                "depends_on, or write the flow in the state form"
            )
        if view.items == [] and (view.has_states or view.has_nodes):
            self.problems.append(f"{view.form}: the flow has no {self.noun}s; add at least one")
        if view.items is not None and len(view.items) > MAX_STATES:
            self.problems.append(
                f"{view.form}: the flow has {len(view.items):,} {self.noun}s, more than the "
                f"{MAX_STATES:,} a flow may have; split it into flows that start each other"
            )

    def _check_ids(self) -> None:
        assert self.view.items is not None
        for item in self.view.items:
            if item.id is None:
                continue  # a missing or invalid id is reported by the schema
            first = self.by_id.setdefault(item.id, item)
            if first is not item:
                self.problems.append(
                    f"{item.path}.id: duplicate id {item.id!r} (also {first.path}.id); "
                    f"give every {self.noun} its own id"
                )

    def _ids(self) -> str:
        return _names(self.by_id)

    def _outputs(self, state_id: str) -> dict[str, ValueType] | None:
        """Declared outputs of a known state; None if it is unknown or failed the schema."""
        item = self.by_id.get(state_id)
        if item is None or item.step is None or "outputs" in item.broken:
            return None
        return {o.name: o.type for o in item.step.outputs}

    # -- one state or node

    def _check_step(self, item: _Item, step: State | Node) -> None:
        path = item.path
        self._check_agent(item, step)
        self._resolve_inputs(item, step)
        seen_outputs: dict[str, int] = {}
        for j, output in enumerate(step.outputs):
            if output.name in seen_outputs:
                self.problems.append(
                    f"{path}.outputs[{j}].name: duplicate output {output.name!r} "
                    f"(also outputs[{seen_outputs[output.name]}])"
                )
            seen_outputs.setdefault(output.name, j)
        if step.lifecycle == "resident" and step.outputs:
            self.problems.append(
                f"{path}.outputs: a resident {self.noun} may not declare outputs (it keeps "
                "running and never settles with an answer); remove outputs or use lifecycle: task"
            )
        names = [inp.name for _, inp in item.inputs]
        # a key that failed the schema is left out of `step`: judging placeholders or
        # foreach against what is left would report problems that are not there
        inputs_known = not item.broken & {"inputs", "depends_on"}
        template = step.prompt if inputs_known and "subagent" not in item.broken else None
        if inputs_known and "prompt" not in item.broken and step.subagent is not None:
            sub = self.view.subagents.get(step.subagent)
            template = sub.prompt if sub is not None else None
        if template is not None:
            for name in placeholders(template):
                if name in names:
                    continue
                if step.prompt is not None:
                    self.problems.append(
                        f"{path}.prompt: {{{name}}} is not an input of {self.noun} "
                        f"{step.id!r} (inputs: {_names(names)}); declare it under inputs, "
                        f"or write {{{{{name}}}}} for literal braces"
                    )
                else:
                    self.problems.append(
                        f"{path}.subagent: subagent {step.subagent!r} uses {{{name}}}, which "
                        f"is not an input of {self.noun} {step.id!r} "
                        f"(inputs: {_names(names)}); declare it under inputs"
                    )
        if step.foreach is not None and inputs_known:
            over = step.foreach.over
            found = next((inp for _, inp in item.inputs if inp.name == over), None)
            if found is None:
                self.problems.append(
                    f"{path}.foreach.over: {over!r} is not an input of {self.noun} "
                    f"{step.id!r} (inputs: {_names(names)}); foreach runs over a json input"
                )
            elif self._input_type(found) != "json":
                self.problems.append(
                    f"{path}.foreach.over: input {over!r} is text; foreach runs over a JSON "
                    "list, so the input (and its source output) must be type: json"
                )

    def _check_agent(self, item: _Item, step: State | Node) -> None:
        path = item.path
        subagents = _names(self.view.subagents)
        if item.broken:
            pass  # a bad or misspelled key: whether it has a prompt or a subagent is unknown
        elif step.prompt is not None and step.subagent is not None:
            self.problems.append(
                f"{path}: has both prompt and subagent; keep one (a subagent brings its own "
                "prompt; model settings next to subagent override the subagent's)"
            )
        elif step.prompt is None and step.subagent is None:
            self.problems.append(
                f"{path}: has neither prompt nor subagent; write a prompt template or name "
                + (f"a subagent (subagents: {subagents})" if self.view.subagents else "a subagent")
            )
        if step.prompt is not None:
            self.problems.extend(f"{path}.prompt: {p}" for p in parse_template(step.prompt)[1])
        if step.subagent is not None and step.subagent not in self.view.subagents:
            self.problems.append(
                f"{path}.subagent: unknown subagent {step.subagent!r} "
                + (f"(subagents: {subagents})" if self.view.subagents else "(no subagents defined)")
            )

    def _input_type(self, inp: Input) -> ValueType:
        if inp.type is not None:
            return inp.type
        if inp.from_ is not None and "." in inp.from_:
            source, output = inp.from_.split(".", 1)
            outputs = self._outputs(source) or {}
            return outputs.get(output, "text")
        return "text"

    def _resolve_inputs(self, item: _Item, step: State | Node) -> None:
        """Check the declared inputs and, in the DAG form, bind and add the inputs that come
        from dependencies; `item.inputs` ends up as the state's resolved inputs."""
        path = item.path
        deps = list(dict.fromkeys(step.depends_on)) if isinstance(step, Node) else []
        seen: dict[str, int] = {}
        for j, inp in enumerate(step.inputs):
            where = f"{path}.inputs[{j}]"
            if inp.name in seen:
                self.problems.append(
                    f"{where}.name: duplicate input {inp.name!r} (also inputs[{seen[inp.name]}])"
                )
            seen.setdefault(inp.name, j)
            if inp.from_ is None and deps:
                inp = self._bind_to_dependency(where, inp, deps)
            if inp.from_ is None:
                self._note_param(where, inp)
            else:
                self._check_source(where, inp, step, deps, "depends_on" not in item.broken)
            item.inputs.append((where, inp))
        if isinstance(step, Node):
            self._check_dependencies(item, step)

    def _bind_to_dependency(self, where: str, inp: Input, deps: list[str]) -> Input:
        """A DAG node's input without `from`, named like a dependency's output, reads it."""
        owners = [d for d in deps if inp.name in (self._outputs(d) or {})]
        if len(owners) > 1:
            self.problems.append(
                f"{where}: {inp.name!r} is an output of several dependencies "
                f"({_names(owners)}); say which with from: {owners[0]}.{inp.name}"
            )
        if len(owners) == 1:
            return inp.model_copy(update={"from_": f"{owners[0]}.{inp.name}"})
        return inp

    def _note_param(self, where: str, inp: Input) -> None:
        kind = inp.type or "text"
        known = self.params.get(inp.name)
        if known is None:
            self.params[inp.name] = (kind, inp.optional, where)
            return
        if known[0] != kind:
            self.problems.append(
                f"{where}.type: flow input {inp.name!r} is {kind} here but {known[0]} at "
                f"{known[2]}; give it one type everywhere"
            )
        self.params[inp.name] = (known[0], known[1] and inp.optional, known[2])

    def _check_source(
        self, where: str, inp: Input, step: State | Node, deps: list[str], deps_known: bool
    ) -> None:
        source_ref = inp.from_ or ""
        source, dot, output = source_ref.partition(".")
        if not dot or not _NAME.fullmatch(source) or not _NAME.fullmatch(output):
            self.problems.append(
                f"{where}.from: {source_ref!r} is not STATE.OUTPUT; write the source "
                f"{self.noun}'s id and one of its outputs, e.g. 'draft.text'"
            )
            return
        if source not in self.by_id:
            self.problems.append(
                f"{where}.from: unknown {self.noun} {source!r} ({self.noun}s: {self._ids()})"
            )
            return
        if isinstance(step, Node) and deps_known and source not in deps:
            self.problems.append(
                f"{where}.from: {source_ref!r} comes from node {source!r}, which is not in "
                f"depends_on; add {source!r} to depends_on so that {step.id!r} waits for it"
            )
        outputs = self._outputs(source)
        if outputs is None:
            return
        if output not in outputs:
            declared = f"outputs: {', '.join(outputs)}" if outputs else "it declares no outputs"
            self.problems.append(
                f"{where}.from: {self.noun} {source!r} has no output {output!r} ({declared})"
            )
            return
        if inp.type is not None and inp.type != outputs[output]:
            self.problems.append(
                f"{where}.type: {inp.type} does not match output {source_ref}, which is "
                f"{outputs[output]}; remove type or make them agree"
            )

    def _check_dependencies(self, item: _Item, node: Node) -> None:
        """depends_on names known nodes, once each, not itself; each dependency gives the node
        at least one required input (that is what makes it wait); unread outputs of the
        dependencies become inputs named after them."""
        path = item.path
        taken = {inp.name for _, inp in item.inputs}
        seen: set[str] = set()
        for k, dep in enumerate(node.depends_on):
            where = f"{path}.depends_on[{k}]"
            if dep in seen:
                self.problems.append(f"{where}: {dep!r} is listed twice; list it once")
                continue
            seen.add(dep)
            if dep == node.id:
                self.problems.append(f"{where}: a node cannot depend on itself")
                continue
            if dep not in self.by_id:
                self.problems.append(f"{where}: unknown node {dep!r} (nodes: {self._ids()})")
                continue
            outputs = self._outputs(dep)
            if outputs is None:
                continue
            read = {inp.from_ for _, inp in item.inputs}
            for output, kind in outputs.items():
                if f"{dep}.{output}" in read:
                    continue
                if output in taken:
                    self.problems.append(
                        f"{where}: output {output!r} of {dep!r} would become an input named "
                        f"like another input of {node.id!r}; declare inputs with from to "
                        "name them apart"
                    )
                    continue
                taken.add(output)
                implicit = Input.model_validate({"name": output, "type": kind})
                implicit = implicit.model_copy(update={"from_": f"{dep}.{output}"})
                item.inputs.append((where, implicit))
            waits = any(
                inp.from_ is not None and inp.from_.partition(".")[0] == dep and not inp.optional
                for _, inp in item.inputs
            )
            if not waits:
                why = (
                    "it declares no outputs"
                    if not outputs
                    else f"every input of {node.id!r} from it is optional"
                )
                self.problems.append(
                    f"{where}: {node.id!r} would not wait for {dep!r}: {why}; a node waits "
                    f"for a dependency through a required input, so give {dep!r} an output"
                    + (" or make an input from it required" if outputs else "")
                )

    # -- transitions

    def _check_transition(self, edge: _Edge, transition: Transition) -> None:
        path = edge.path
        for key, ref in (("from", transition.from_), ("to", transition.to)):
            if ref not in self.by_id:
                self.problems.append(f"{path}.{key}: unknown state {ref!r} (states: {self._ids()})")
        guard = transition.when
        if guard is None:
            return
        where = f"{path}.when"
        self.problems.extend(_json_problems(guard.value, f"{where}.value"))
        has_value = "value" in guard.model_fields_set
        if guard.op == "exists" and has_value:
            self.problems.append(f"{where}.value: op exists takes no value; remove value")
        elif guard.op != "exists" and not has_value:
            self.problems.append(
                f"{where}: op {guard.op} needs a value; add value (write value: null to "
                "compare with null)"
            )
        elif guard.op in NUMERIC_OPS and (
            isinstance(guard.value, bool) or not isinstance(guard.value, int | float)
        ):
            self.problems.append(
                f"{where}.value: op {guard.op} compares numbers, got {_describe(guard.value)}; "
                "give a number"
            )
        if guard.path is not None:
            try:
                parse_path(guard.path)
            except ValueError as exc:
                self.problems.append(f"{where}.path: {exc}")
        outputs = self._outputs(transition.from_)
        if outputs is None:
            return
        if guard.output not in outputs:
            declared = f"outputs: {', '.join(outputs)}" if outputs else "it declares no outputs"
            self.problems.append(
                f"{where}.output: state {transition.from_!r} has no output {guard.output!r} "
                f"({declared}); a guard tests an output of the transition's from state"
            )
            return
        if outputs[guard.output] == "text":
            ref = f"{transition.from_}.{guard.output}"
            if guard.path is not None:
                self.problems.append(
                    f"{where}.path: output {ref} is text, which has no parts; declare it "
                    "type: json or remove path"
                )
            elif guard.op in NUMERIC_OPS:
                self.problems.append(
                    f"{where}.op: output {ref} is text, which is never a number, so "
                    f"{guard.op} could never pass; use eq or contains, or declare it type: json"
                )
            elif guard.op in ("eq", "ne", "contains") and not isinstance(guard.value, str):
                self.problems.append(
                    f"{where}.value: output {ref} is text, so op {guard.op} compares it with "
                    f"a string, got {_describe(guard.value)}; quote the value or declare the "
                    "output type: json"
                )

    # -- the machine as a whole

    def _check_entries(self) -> None:
        """At least one entry state, and every state reachable from one (guards ignored)."""
        items = self.view.items
        if not items:
            return
        entries = [item.id for item in items if item.entry and item.id is not None]
        if not entries:
            self.problems.append(
                "states: no state has entry: true; mark the state(s) the flow starts in"
            )
            return
        if any(edge.target is None or edge.source is None for edge in self.view.edges):
            return  # a broken transition: reachability would be guesswork
        reached = set(entries)
        frontier = list(entries)
        while frontier:
            current = frontier.pop()
            for edge in self.view.edges:
                if edge.source == current and edge.target not in reached:
                    assert edge.target is not None
                    reached.add(edge.target)
                    frontier.append(edge.target)
        for item in items:
            if item.id is not None and item.id not in reached and self.by_id[item.id] is item:
                self.problems.append(
                    f"{item.path}: state {item.id!r} can never run: it is not an entry state "
                    "and no transition from a reachable state leads to it; add entry: true "
                    "or a transition to it"
                )

    def _check_input_cycles(self) -> None:
        """A cycle of required inputs means none of its states can ever start."""
        assert self.view.items is not None
        needs: dict[str, list[tuple[str, str, str]]] = {}  # id -> [(source, ref, path)]
        for item in self.view.items:
            if item.id is None or item.step is None or self.by_id[item.id] is not item:
                continue
            for where, inp in item.inputs:
                if inp.from_ is None or inp.optional:
                    continue
                source = inp.from_.partition(".")[0]
                if source in self.by_id:
                    needs.setdefault(item.id, []).append((source, inp.from_, f"{where}.from"))
        graph = {node: [edge[0] for edge in edges] for node, edges in needs.items()}
        for cycle in _cycles(list(self.by_id), graph):
            steps = []
            first_path = ""
            for a, b in zip(cycle, [*cycle[1:], cycle[0]], strict=True):
                source, ref, where = next(e for e in needs[a] if e[0] == b)
                steps.append(f"{a} needs {ref}")
                first_path = first_path or where
            self.problems.append(
                f"{first_path}: required inputs form a cycle ({', '.join(steps)}), so none "
                "of these states can ever start; make one of these inputs optional: true"
            )

    def _check_dependency_cycles(self) -> None:
        assert self.view.items is not None
        graph: dict[str, list[str]] = {}
        paths: dict[str, str] = {}
        for item in self.view.items:
            if item.id is None or not isinstance(item.step, Node):
                continue
            if self.by_id[item.id] is item:
                # a self-dependency is reported on its own, not as a cycle
                graph[item.id] = [
                    d for d in item.step.depends_on if d in self.by_id and d != item.id
                ]
                paths[item.id] = item.path
        for cycle in _cycles(list(self.by_id), graph):
            steps = ", ".join(
                f"{a} depends on {b}" for a, b in zip(cycle, [*cycle[1:], cycle[0]], strict=True)
            )
            self.problems.append(
                f"{paths[cycle[0]]}.depends_on: dependencies form a cycle ({steps}); "
                "a DAG has no cycles, so none of these nodes could start"
            )


def _cycles(order: list[str], graph: dict[str, list[str]]) -> list[list[str]]:
    """One cycle per strongly connected component that has one (a self-loop counts), each
    starting at the component's first node in `order` and following edges in their order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(node: str) -> None:  # Tarjan; flows are small, recursion depth is fine
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, []):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            components.append(component)

    for node in order:
        if node not in index:
            connect(node)
    cycles = []
    rank = {node: i for i, node in enumerate(order)}
    for component in sorted(components, key=lambda c: min(rank.get(n, 0) for n in c)):
        members = set(component)
        start = min(component, key=lambda n: rank.get(n, 0))
        if len(component) == 1 and start not in graph.get(start, []):
            continue
        cycles.append(_path_back(start, graph, members))
    return cycles


def _path_back(start: str, graph: dict[str, list[str]], members: set[str]) -> list[str]:
    """The shortest path from `start` back to itself inside one component (breadth first)."""
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in graph.get(node, []):
                if nxt not in members:
                    continue
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return list(reversed(path))
                if nxt not in previous:
                    previous[nxt] = node
                    following.append(nxt)
        frontier = following
    return [start]  # unreachable: every component with more than one member has a cycle

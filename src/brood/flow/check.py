"""Every problem of a flow spec at once, each as `path: message`: pydantic's schema errors
told the way a spec author wrote the spec, the checks that span fields (ids, references,
templates, guards, reachability, cycles), and the `InvalidSpec` that lists them in the
order of the spec.

A state that fails the schema is checked from what passes of it (`view_from_raw`), so it
causes no follow-on problems.

Each problem is told two ways (`Problem`): with the values and names involved, for the
user's own specs, and in the schema's own words only (its key names, indices and bounds,
never a value, a name or an unknown key taken from the spec), for a spec that model code
sent: an error is journaled and shown, and it must not carry the text it was given back
out (DESIGN.md section 14).
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
    MAX_STATES,
    NAME_PATTERN,
    NAME_RULE,
    FlowSpec,
    Input,
    Node,
    SpecModel,
    State,
    SubAgent,
    Transition,
    ValueType,
)
from brood.flow.template import parse_template, placeholders

__all__ = ["Problem", "check_spec"]

TOP: Final = "(top level)"  # the path shown for problems of the spec as a whole
NAMED: Final = "[…]"  # a name the spec chose (a subagent's, a key of a value), left out
# Problems listed in one InvalidSpec, and kept while checking: a spec of a megabyte can hold
# hundreds of thousands of problems, and each would name the ids of the spec.
MAX_SHOWN: Final = 100
MAX_KEPT: Final = 1_000
NAMES_SHOWN: Final = 20  # names listed in a problem (the states a reference could name)


@dataclass(frozen=True)
class Problem:
    """One problem of a spec. `path: message` tells it with the values and names involved;
    `where: what` in the schema's own words only (`where` is `path` with the names the spec
    chose left out, when it holds one)."""

    path: str
    message: str
    what: str
    where: str | None = None

    def told(self, quote: bool) -> str:
        if quote:
            return f"{self.path}: {self.message}"
        return f"{self.where or self.path}: {self.what}"


# ---- the report ----------------------------------------------------------------------------


_SECTIONS: Final = ("name", "description", "run", "subagents", "states", "nodes", "transitions")
_PLACE = re.compile(r"([A-Za-z_]+)(?:\[(\d+)\])?")


def _place(problem: Problem) -> tuple[int, int]:
    """Where a problem sits in a spec, to list problems in the order of the spec."""
    m = _PLACE.match(problem.path)
    if problem.path.startswith(TOP) or not m or m.group(1) not in _SECTIONS:
        return (-1, -1)
    return (_SECTIONS.index(m.group(1)), int(m.group(2) or -1))


def raise_problems(label: str, problems: list[Problem], *, quote: bool = True) -> None:
    """InvalidSpec listing `problems` in the order of the spec, at most MAX_SHOWN of them;
    with `quote` False, each in the schema's own words (problems that then read alike are
    listed once)."""
    told = list(dict.fromkeys(p.told(quote) for p in sorted(problems, key=_place)))
    if not told:
        return
    more = len(told) > MAX_SHOWN or len(problems) >= MAX_KEPT
    if more:
        count = f"over {MAX_SHOWN} problems"
        told = [*told[:MAX_SHOWN], f"and more past these {MAX_SHOWN}; fix them and check again"]
    else:
        count = f"{len(told)} problem" + ("s" if len(told) != 1 else "")
    lines = "".join(f"\n  {p}" for p in told)
    raise InvalidSpec(f"invalid flow spec {label}: {count}{lines}")


def check_spec(spec: FlowSpec) -> list[str]:
    """Every problem of a schema-valid spec that spans fields, as `path: message` lines
    (empty when the spec is valid)."""
    return [p.told(True) for p in Checker(view_from_spec(spec)).run()]


# ---- schema problems -----------------------------------------------------------------------


def _format_path(loc: Iterable[Any]) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif NAME_PATTERN.fullmatch(str(part)):
            path += f".{part}" if path else str(part)
        else:
            path += f"[{json.dumps(str(part))}]"
    return path or TOP


def kind_of(value: Any) -> str:
    """`string`, `number`, `null`, `list`, `mapping`: a value's JSON-ish kind, no more."""
    if value is None:
        return "null"
    kinds = {bool: "boolean", int: "integer", float: "number", str: "string", list: "list"}
    kind = next((k for t, k in kinds.items() if type(value) is t), type(value).__name__)
    return "mapping" if isinstance(value, dict) else kind


def describe_value(value: Any) -> str:
    """`string 'x'`, `float nan`, `null`, `list [1, 2]`: a value with its JSON-ish kind."""
    if value is None:
        return "null"
    shown = json.dumps(value) if isinstance(value, bool) else repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return f"{kind_of(value)} {shown}"


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


def _unknown_key(loc: tuple[Any, ...], quote: bool = True) -> str:
    key = str(loc[-1])
    model = _model_at(loc[:-1])
    if model is None:
        return "unknown key" if quote else "an unknown key"
    allowed = sorted(f.alias or name for name, f in model.model_fields.items())
    listed = f"(allowed: {', '.join(allowed)})"
    if not quote:  # no hint: a near miss would tell what the key is like
        return f"an unknown key {listed}"
    hint = _KEY_HINTS.get((model.__name__, key))
    if hint is None:
        close = difflib.get_close_matches(key, allowed, n=1)
        hint = f"did you mean {close[0]!r}?" if close else ""
    return f"unknown key; {hint} {listed}" if hint else f"unknown key {listed}"


def _schema_path(loc: Iterable[Any]) -> str:
    """`loc` as a path in the schema's own words: indices and the key names of the schema;
    a name the spec chose (a subagent's, a key of a mapping) is NAMED."""
    loc = tuple(loc)
    path = ""
    for i, part in enumerate(loc):
        model = _model_at(loc[:i])
        if isinstance(part, int) and model is None:
            path += f"[{part}]"
        elif model is not None and part in {f.alias or n for n, f in model.model_fields.items()}:
            path += f".{part}" if path else str(part)
        else:
            path += NAMED
    return path or TOP


def _bound(value: Any) -> Any:
    """0.0 -> 0: a bound as the spec author would write it."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


# pydantic's bound errors: the comparison a value failed, and the key of its bound in ctx
_BOUNDS: Final = {
    "greater_than_equal": (">=", "ge"),
    "greater_than": (">", "gt"),
    "less_than_equal": ("<=", "le"),
    "less_than": ("<", "lt"),
}
# Why a field has an upper bound, told beside it (a bound with no reason reads arbitrary).
_BOUND_WHY: Final[dict[tuple[str, str], str]] = {
    ("RunSettings", "max_parallel"): "state instances of one flow running at once",
    ("RunSettings", "max_transitions"): "transitions one flow fires in all, so a loop ends",
}


def _field_at(loc: tuple[Any, ...]) -> tuple[str, Any] | None:
    """(model name, pydantic FieldInfo) of the schema field at `loc`, if it is one."""
    model = _model_at(loc[:-1]) if loc else None
    if model is None:
        return None
    fields = {f.alias or name: f for name, f in model.model_fields.items()}
    found = fields.get(loc[-1])
    return None if found is None else (model.__name__, found)


def _bound_why(loc: tuple[Any, ...]) -> str:
    at = _field_at(loc)
    why = None if at is None else _BOUND_WHY.get((at[0], str(loc[-1])))
    return f" ({why})" if why else ""


def _bound_fix(loc: tuple[Any, ...]) -> str:
    """`; use a whole number from 1 to 64`: the values a field bounded on both sides takes
    (a bound on one side says it all already)."""
    at = _field_at(loc)
    if at is None:
        return ""
    info = at[1]
    low = next((m.ge for m in info.metadata if getattr(m, "ge", None) is not None), None)
    high = next((m.le for m in info.metadata if getattr(m, "le", None) is not None), None)
    if low is None or high is None:
        return ""
    kind = "a whole number" if _unwrap(info.annotation) is int else "a number"
    return f"; use {kind} from {_bound(low)} to {_bound(high)}"


# pydantic's error types, as what a value must be; the telling with values adds what it got
_MUST: Final = {
    "int_type": "must be a whole number",
    "int_parsing": "must be a whole number",
    "int_from_float": "must be a whole number",
    "float_type": "must be a number",
    "float_parsing": "must be a number",
    "finite_number": "must be a finite number",
    "bool_type": "must be true or false",
    "bool_parsing": "must be true or false",
    "string_type": "must be a string",
    "list_type": "must be a list",
    "dict_type": "must be a mapping",
    "model_type": "must be a mapping",
    "model_attributes_type": "must be a mapping",
}


def schema_problems(exc: ValidationError) -> list[Problem]:
    """The schema's errors as problems, each with the path it is at."""
    problems: list[Problem] = []
    for error in exc.errors()[:MAX_KEPT]:
        loc = tuple(error["loc"])
        kind = error["type"]
        ctx = error.get("ctx") or {}
        where = _schema_path(loc)
        got = f", got {describe_value(error.get('input'))}"
        if kind == "missing":
            what, got = "required, but missing", ""
        elif kind == "extra_forbidden":  # the key itself is the spec's: told at its mapping
            where = _schema_path(loc[:-1])
            problems.append(
                Problem(_format_path(loc), _unknown_key(loc), _unknown_key(loc, False), where)
            )
            continue
        elif kind == "literal_error":
            what = f"must be {ctx.get('expected')}"  # the schema's own choices
        elif kind in _MUST:
            what = _MUST[kind]
            if kind in ("dict_type", "model_type", "model_attributes_type") and (
                len(loc) >= 2 and loc[-2] in ("inputs", "outputs")
            ):
                what = "must be a name or a mapping with name"
        elif kind in _BOUNDS:
            op, key = _BOUNDS[kind]
            what = f"must be {op} {_bound(ctx.get(key))}{_bound_why(loc)}"
            fix = _bound_fix(loc)
            problems.append(Problem(_format_path(loc), what + got + fix, what + fix, where))
            continue
        elif kind == "string_too_short":
            what, got = "must not be empty", ""
        elif kind == "value_error":  # the schema's only check of its own: the name rule
            message = str(error["msg"]).removeprefix("Value error, ")
            problems.append(
                Problem(_format_path(loc), message, f"not a valid name; {NAME_RULE}", where)
            )
            continue
        else:  # pydantic's own words name the schema's bounds, never the value
            what, got = str(error["msg"]), ""
        problems.append(Problem(_format_path(loc), what + got, what, where))
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


def view_from_spec(spec: FlowSpec) -> _View:
    """A view of a spec that passed the schema, for the checks that span fields."""
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


def _validated(model: type[SpecModel], raw: Any) -> tuple[Any, frozenset[str]]:
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


def view_from_raw(data: Mapping[str, Any]) -> _View:
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
                    raw_id if isinstance(raw_id, str) and NAME_PATTERN.fullmatch(raw_id) else None,
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
    """`a, b, c`, or `none`; a long list is cut after NAMES_SHOWN names (and says so)."""
    listed = list(names)
    if len(listed) > NAMES_SHOWN:
        return ", ".join(listed[:NAMES_SHOWN]) + f", ... ({len(listed):,} in all)"
    return ", ".join(listed) or "none"


def _json_problems(value: Any, path: str) -> list[Problem]:
    """Problems that keep `value` from being finite JSON, each with its path (in the
    schema's own words: `path` itself, the keys inside the value being the spec's)."""
    if value is None or isinstance(value, bool | str | int):
        return []
    if isinstance(value, float):
        if math.isfinite(value):
            return []
        return [
            _inner(path, f"{value} is not JSON (only finite numbers are); give a finite number")
        ]
    if isinstance(value, list):
        return [p for i, item in enumerate(value) for p in _json_problems(item, f"{path}[{i}]")]
    if isinstance(value, dict):
        problems = []
        for key, item in value.items():
            if not isinstance(key, str):
                problems.append(
                    _inner(
                        path, f"the key {key!r} is a {type(key).__name__}; JSON keys are strings"
                    )
                )
                continue
            step = f".{key}" if NAME_PATTERN.fullmatch(key) else f"[{json.dumps(key)}]"
            problems.extend(_json_problems(item, path + step))
        return problems
    if isinstance(value, tuple | set | frozenset):
        return [_inner(path, f"a {type(value).__name__} is not JSON; use a list")]
    return [
        _inner(
            path,
            f"a {type(value).__name__} is not JSON; use null, true/false, a number, "
            "a string, a list or a mapping",
        )
    ]


def _inner(path: str, message: str) -> Problem:
    """A problem inside a guard's value at `path`: told in the schema's own words at the
    value itself (`...when.value`)."""
    where = path[: path.index(".value") + len(".value")]
    return Problem(
        path,
        message,
        "holds something that is not JSON (only null, true/false, "
        "finite numbers, strings, lists and mappings with string keys are)",
        where,
    )


class Checker:
    """Runs every cross-field check over a view, collecting problems instead of stopping at
    the first; `_Compiler` (brood.flow.compile) then builds the machine from the same
    resolved view."""

    def __init__(self, view: _View) -> None:
        self.view = view
        self.problems: list[Problem] = []
        self.noun = "node" if view.form == "nodes" else "state"
        self.by_id: dict[str, _Item] = {}
        self.params: dict[str, tuple[ValueType, bool, str]] = {}  # name -> (type, optional, path)
        self._listed: str | None = None  # the ids, as problems list them

    def _add(self, path: str, message: str, what: str | None = None) -> None:
        """A problem at `path` (a path of the schema's own key names and indices): `message`
        with the values involved, `what` without them (None: `message` holds none)."""
        self._keep([Problem(path, message, message if what is None else what)])

    def _keep(self, problems: Iterable[Problem]) -> None:
        for problem in problems:
            if len(self.problems) >= MAX_KEPT:
                return
            self.problems.append(problem)

    def run(self) -> list[Problem]:
        view = self.view
        self._check_form()
        for name, sub in view.subagents.items():
            path = _format_path(["subagents", name])
            where = f"subagents{NAMED}"
            if not NAME_PATTERN.fullmatch(name):
                self._keep(
                    [
                        Problem(
                            path,
                            f"{name!r} is not a valid name; {NAME_RULE}",
                            f"a subagent's name is not a valid name; {NAME_RULE}",
                            where,
                        )
                    ]
                )
            if sub is not None:
                self._keep(
                    Problem(f"{path}.prompt", p, p, f"{where}.prompt")
                    for p in parse_template(sub.prompt)[1]
                )
        if view.items is None or len(view.items) > MAX_STATES:
            return self.problems  # a flow too large is refused for its size alone
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
            self._add(
                TOP,
                "has both states and nodes; write states (with transitions) for the state "
                "form or nodes (with depends_on) for the DAG form, not both",
            )
        elif not view.has_states and not view.has_nodes:
            self._add(TOP, "a flow needs states (the state form) or nodes (the DAG form)")
        if view.has_nodes and view.has_transitions:
            self._add(
                "transitions",
                "the DAG form (nodes) takes no transitions; order nodes with depends_on, or "
                "write the flow in the state form",
            )
        if view.items == [] and (view.has_states or view.has_nodes):
            self._add(view.form, f"the flow has no {self.noun}s; add at least one")
        if view.items is not None and len(view.items) > MAX_STATES:
            self._add(
                view.form,
                f"the flow has {len(view.items):,} {self.noun}s, more than the "
                f"{MAX_STATES:,} a flow may have; split it into flows that start each other",
                f"the flow has more {self.noun}s than the {MAX_STATES:,} a flow may have; "
                "split it into flows that start each other",
            )

    def _check_ids(self) -> None:
        assert self.view.items is not None
        for item in self.view.items:
            if item.id is None:
                continue  # a missing or invalid id is reported by the schema
            first = self.by_id.setdefault(item.id, item)
            if first is not item:
                self._add(
                    f"{item.path}.id",
                    f"duplicate id {item.id!r} (also {first.path}.id); give every {self.noun} "
                    "its own id",
                    f"duplicate id (also {first.path}.id); give every {self.noun} its own id",
                )

    def _ids(self) -> str:
        if self._listed is None:  # by_id is complete once _check_ids has run
            self._listed = _names(self.by_id)
        return self._listed

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
                also = f"(also outputs[{seen_outputs[output.name]}])"
                self._add(
                    f"{path}.outputs[{j}].name",
                    f"duplicate output {output.name!r} {also}",
                    f"duplicate output {also}",
                )
            seen_outputs.setdefault(output.name, j)
        if step.lifecycle == "resident" and step.outputs:
            self._add(
                f"{path}.outputs",
                f"a resident {self.noun} may not declare outputs (it keeps running and never "
                "settles with an answer); remove outputs or use lifecycle: task",
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
                    self._add(
                        f"{path}.prompt",
                        f"{{{name}}} is not an input of {self.noun} {step.id!r} (inputs: "
                        f"{_names(names)}); declare it under inputs, or write {{{{{name}}}}} "
                        "for literal braces",
                        f"a placeholder is not an input of the {self.noun}; declare it under "
                        "inputs, or write {{ and }} for literal braces",
                    )
                else:
                    self._add(
                        f"{path}.subagent",
                        f"subagent {step.subagent!r} uses {{{name}}}, which is not an input of "
                        f"{self.noun} {step.id!r} (inputs: {_names(names)}); declare it under "
                        "inputs",
                        f"the subagent uses a placeholder that is not an input of the "
                        f"{self.noun}; declare it under inputs",
                    )
        if step.foreach is not None and inputs_known:
            over = step.foreach.over
            found = next((inp for _, inp in item.inputs if inp.name == over), None)
            if found is None:
                self._add(
                    f"{path}.foreach.over",
                    f"{over!r} is not an input of {self.noun} {step.id!r} (inputs: "
                    f"{_names(names)}); foreach runs over a json input",
                    f"not an input of the {self.noun}; foreach runs over a json input",
                )
            elif self._input_type(found) != "json":
                self._add(
                    f"{path}.foreach.over",
                    f"input {over!r} is text; foreach runs over a JSON list, so the input (and "
                    "its source output) must be type: json",
                    "the input is text; foreach runs over a JSON list, so the input (and its "
                    "source output) must be type: json",
                )

    def _check_agent(self, item: _Item, step: State | Node) -> None:
        path = item.path
        subagents = _names(self.view.subagents)
        if item.broken:
            pass  # a bad or misspelled key: whether it has a prompt or a subagent is unknown
        elif step.prompt is not None and step.subagent is not None:
            self._add(
                path,
                "has both prompt and subagent; keep one (a subagent brings its own prompt; "
                "model settings next to subagent override the subagent's)",
            )
        elif step.prompt is None and step.subagent is None:
            self._add(
                path,
                "has neither prompt nor subagent; write a prompt template or name "
                + (f"a subagent (subagents: {subagents})" if self.view.subagents else "a subagent"),
                "has neither prompt nor subagent; write a prompt template or name a subagent",
            )
        if step.prompt is not None:
            for p in parse_template(step.prompt)[1]:
                self._add(f"{path}.prompt", p)  # braces and their places only
        if step.subagent is not None and step.subagent not in self.view.subagents:
            self._add(
                f"{path}.subagent",
                f"unknown subagent {step.subagent!r} "
                + (
                    f"(subagents: {subagents})" if self.view.subagents else "(no subagents defined)"
                ),
                "names no subagent of the spec",
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
                also = f"(also inputs[{seen[inp.name]}])"
                self._add(
                    f"{where}.name",
                    f"duplicate input {inp.name!r} {also}",
                    f"duplicate input {also}",
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
            self._add(
                where,
                f"{inp.name!r} is an output of several dependencies ({_names(owners)}); say "
                f"which with from: {owners[0]}.{inp.name}",
                "its name is an output of several dependencies; say which with from",
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
            self._add(
                f"{where}.type",
                f"flow input {inp.name!r} is {kind} here but {known[0]} at {known[2]}; give it "
                "one type everywhere",
                f"the flow input is {kind} here but {known[0]} at {known[2]}; give it one type "
                "everywhere",
            )
        self.params[inp.name] = (known[0], known[1] and inp.optional, known[2])

    def _check_source(
        self, where: str, inp: Input, step: State | Node, deps: list[str], deps_known: bool
    ) -> None:
        source_ref = inp.from_ or ""
        source, dot, output = source_ref.partition(".")
        if not dot or not NAME_PATTERN.fullmatch(source) or not NAME_PATTERN.fullmatch(output):
            fix = f"write the source {self.noun}'s id and one of its outputs, e.g. 'draft.text'"
            self._add(
                f"{where}.from",
                f"{source_ref!r} is not STATE.OUTPUT; {fix}",
                f"not STATE.OUTPUT; {fix}",
            )
            return
        if source not in self.by_id:
            self._add(
                f"{where}.from",
                f"unknown {self.noun} {source!r} ({self.noun}s: {self._ids()})",
                f"names no {self.noun} of the spec",
            )
            return
        if isinstance(step, Node) and deps_known and source not in deps:
            self._add(
                f"{where}.from",
                f"{source_ref!r} comes from node {source!r}, which is not in depends_on; add "
                f"{source!r} to depends_on so that {step.id!r} waits for it",
                "comes from a node that is not in depends_on; add it to depends_on so that "
                "the node waits for it",
            )
        outputs = self._outputs(source)
        if outputs is None:
            return
        if output not in outputs:
            declared = f"outputs: {', '.join(outputs)}" if outputs else "it declares no outputs"
            self._add(
                f"{where}.from",
                f"{self.noun} {source!r} has no output {output!r} ({declared})",
                f"names an output its {self.noun} does not declare",
            )
            return
        if inp.type is not None and inp.type != outputs[output]:
            self._add(
                f"{where}.type",
                f"{inp.type} does not match output {source_ref}, which is {outputs[output]}; "
                "remove type or make them agree",
                f"{inp.type} does not match the output it reads, which is {outputs[output]}; "
                "remove type or make them agree",
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
                self._add(
                    where, f"{dep!r} is listed twice; list it once", "listed twice; list it once"
                )
                continue
            seen.add(dep)
            if dep == node.id:
                self._add(where, "a node cannot depend on itself")
                continue
            if dep not in self.by_id:
                self._add(
                    where,
                    f"unknown node {dep!r} (nodes: {self._ids()})",
                    "names no node of the spec",
                )
                continue
            outputs = self._outputs(dep)
            if outputs is None:
                continue
            read = {inp.from_ for _, inp in item.inputs}
            for output, kind in outputs.items():
                if f"{dep}.{output}" in read:
                    continue
                if output in taken:
                    self._add(
                        where,
                        f"output {output!r} of {dep!r} would become an input named like another "
                        f"input of {node.id!r}; declare inputs with from to name them apart",
                        "an output of this dependency would become an input named like another "
                        "input of the node; declare inputs with from to name them apart",
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
                self._add(
                    where,
                    f"{node.id!r} would not wait for {dep!r}: {why}; a node waits for a "
                    f"dependency through a required input, so give {dep!r} an output"
                    + (" or make an input from it required" if outputs else ""),
                    "the node would not wait for this dependency (it has no required input "
                    "from it); a node waits for a dependency through a required input",
                )

    # -- transitions

    def _check_transition(self, edge: _Edge, transition: Transition) -> None:
        path = edge.path
        for key, ref in (("from", transition.from_), ("to", transition.to)):
            if ref not in self.by_id:
                self._add(
                    f"{path}.{key}",
                    f"unknown state {ref!r} (states: {self._ids()})",
                    "names no state of the spec",
                )
        guard = transition.when
        if guard is None:
            return
        where = f"{path}.when"
        self._keep(_json_problems(guard.value, f"{where}.value"))
        has_value = "value" in guard.model_fields_set
        if guard.op == "exists" and has_value:
            self._add(f"{where}.value", "op exists takes no value; remove value")
        elif guard.op != "exists" and not has_value:
            self._add(
                where,
                f"op {guard.op} needs a value; add value (write value: null to compare with null)",
            )
        elif guard.op in NUMERIC_OPS and (
            isinstance(guard.value, bool) or not isinstance(guard.value, int | float)
        ):
            self._add(
                f"{where}.value",
                f"op {guard.op} compares numbers, got {describe_value(guard.value)}; give a number",
                f"op {guard.op} compares numbers, got {kind_of(guard.value)}; give a number",
            )
        if guard.path is not None:
            try:
                parse_path(guard.path)
            except ValueError as exc:
                self._add(
                    f"{where}.path", str(exc), "not a path into the output; write it as a.b[0].c"
                )
        outputs = self._outputs(transition.from_)
        if outputs is None:
            return
        if guard.output not in outputs:
            declared = f"outputs: {', '.join(outputs)}" if outputs else "it declares no outputs"
            self._add(
                f"{where}.output",
                f"state {transition.from_!r} has no output {guard.output!r} ({declared}); a "
                "guard tests an output of the transition's from state",
                "names an output the from state does not declare; a guard tests an output "
                "of the transition's from state",
            )
            return
        if outputs[guard.output] == "text":
            ref = f"{transition.from_}.{guard.output}"
            if guard.path is not None:
                self._add(
                    f"{where}.path",
                    f"output {ref} is text, which has no parts; declare it type: json or "
                    "remove path",
                    "the output is text, which has no parts; declare it type: json or remove path",
                )
            elif guard.op in NUMERIC_OPS:
                self._add(
                    f"{where}.op",
                    f"output {ref} is text, which is never a number, so {guard.op} could never "
                    "pass; use eq or contains, or declare it type: json",
                    f"the output is text, which is never a number, so {guard.op} could never "
                    "pass; use eq or contains, or declare it type: json",
                )
            elif guard.op in ("eq", "ne", "contains") and not isinstance(guard.value, str):
                self._add(
                    f"{where}.value",
                    f"output {ref} is text, so op {guard.op} compares it with a string, got "
                    f"{describe_value(guard.value)}; quote the value or declare the output "
                    "type: json",
                    f"the output is text, so op {guard.op} compares it with a string, got "
                    f"{kind_of(guard.value)}; quote the value or declare the output type: json",
                )

    # -- the machine as a whole

    def _check_entries(self) -> None:
        """At least one entry state, and every state reachable from one (guards ignored)."""
        items = self.view.items
        if not items:
            return
        entries = [item.id for item in items if item.entry and item.id is not None]
        if not entries:
            self._add("states", "no state has entry: true; mark the state(s) the flow starts in")
            return
        if any(edge.target is None or edge.source is None for edge in self.view.edges):
            return  # a broken transition: reachability would be guesswork
        leads: dict[str | None, list[str | None]] = {}
        for edge in self.view.edges:
            leads.setdefault(edge.source, []).append(edge.target)
        reached = set(entries)
        frontier = list(entries)
        while frontier:
            for target in leads.get(frontier.pop(), []):
                if target not in reached:
                    assert target is not None
                    reached.add(target)
                    frontier.append(target)
        for item in items:
            if item.id is not None and item.id not in reached and self.by_id[item.id] is item:
                fix = (
                    "it is not an entry state and no transition from a reachable state leads "
                    "to it; add entry: true or a transition to it"
                )
                self._add(
                    item.path,
                    f"state {item.id!r} can never run: {fix}",
                    f"the state can never run: {fix}",
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
            paths = []
            for a, b in zip(cycle, [*cycle[1:], cycle[0]], strict=True):
                source, ref, where = next(e for e in needs[a] if e[0] == b)
                steps.append(f"{a} needs {ref}")
                paths.append(where)
            fix = "so none of these states can ever start; make one of these inputs optional: true"
            self._add(
                paths[0],
                f"required inputs form a cycle ({', '.join(steps)}), {fix}",
                f"required inputs form a cycle ({', '.join(paths)}), {fix}",
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
            pairs = list(zip(cycle, [*cycle[1:], cycle[0]], strict=True))
            steps = ", ".join(f"{a} depends on {b}" for a, b in pairs)
            fix = "a DAG has no cycles, so none of these nodes could start"
            self._add(
                f"{paths[cycle[0]]}.depends_on",
                f"dependencies form a cycle ({steps}); {fix}",
                f"dependencies form a cycle ({', '.join(paths[a] for a, _ in pairs)}); {fix}",
            )


def _cycles(order: list[str], graph: dict[str, list[str]]) -> list[list[str]]:
    """One cycle per strongly connected component that has one (a self-loop counts), each
    starting at the component's first node in `order` and following edges in their order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for root in order:
        if root in index:
            continue
        # Tarjan's algorithm with a stack of (node, its next edge) instead of recursion: a
        # chain of 1,024 states would pass Python's recursion limit.
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        work = [(root, 0)]
        while work:
            node, i = work[-1]
            edges = graph.get(node, [])
            if i < len(edges):
                work[-1] = (node, i + 1)
                nxt = edges[i]
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(component)
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

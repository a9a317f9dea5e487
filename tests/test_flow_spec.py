"""Flow specs: loading, every validation problem at once with its path and fix, the DAG
form compiling to the same machine, JSON-strict guards, prompt rendering and output reading."""

from __future__ import annotations

import ast
import copy
import datetime
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

import brood
from brood.errors import BroodError, InvalidArgument, InvalidSpec
from brood.flow import (
    Condition,
    FlowSpec,
    Guard,
    OutputError,
    compile_spec,
    evaluate,
    json_equal,
    load_spec,
    parse_path,
    parse_template,
    read_output,
    render_prompt,
)
from brood.flow.load import load_spec_text

FLOW_SRC = Path(brood.__file__).parent / "flow"

YAML_SPEC = """\
name: write-review
run: {max_parallel: 2, budget: 600, failure_policy: continue, max_transitions: 20}
subagents:
  reviewer:
    prompt: "Review this draft:\\n{draft}"
    model: openai:gpt-4.1-mini
    temperature: 0.2
states:
  - id: draft
    entry: true
    prompt: "Write about {topic}."
    inputs:
      - topic
      - {name: feedback, from: review.notes, optional: true}
    outputs: [text]
    max_entries: 3
  - id: review
    subagent: reviewer
    temperature: 0.7
    inputs: [{name: draft, from: draft.text}]
    outputs: [{name: verdict, type: json}, notes]
transitions:
  - {from: draft, to: review}
  - from: review
    to: draft
    when: {output: verdict, path: ok, op: eq, value: false}
"""


def base() -> dict[str, Any]:
    """A valid two-state flow as a dict, for tests to break one thing at a time."""
    return {
        "states": [
            {
                "id": "draft",
                "entry": True,
                "prompt": "Write about {topic}. Feedback: {feedback}",
                "inputs": [
                    {"name": "topic"},
                    {"name": "feedback", "from": "review.notes", "optional": True},
                ],
                "outputs": ["text"],
                "max_entries": 3,
            },
            {
                "id": "review",
                "prompt": "Review:\n{draft}",
                "inputs": [{"name": "draft", "from": "draft.text"}],
                "outputs": [{"name": "verdict", "type": "json"}, "notes"],
            },
        ],
        "transitions": [
            {"from": "draft", "to": "review"},
            {
                "from": "review",
                "to": "draft",
                "when": {"output": "verdict", "path": "ok", "op": "eq", "value": False},
            },
        ],
    }


def problems(source: Any) -> list[str]:
    """The problem lines of the InvalidSpec that loading `source` raises."""
    with pytest.raises(InvalidSpec) as info:
        load_spec(source)
    header, *lines = str(info.value).splitlines()
    assert header.startswith("invalid flow spec "), header
    count = len(lines)
    assert header.endswith(f"{count} problem" + ("s" if count != 1 else "")), header
    return [line.strip() for line in lines]


def only_problem(source: Any) -> str:
    found = problems(source)
    assert len(found) == 1, found
    return found[0]


def has(found: list[str], path: str, *fragments: str) -> None:
    """Some problem is at `path` and its message holds every fragment."""
    at = [p for p in found if p.startswith(f"{path}: ")]
    assert at, f"no problem at {path}: {found}"
    assert any(all(f in p for f in fragments) for p in at), (fragments, at)


# ---- loading --------------------------------------------------------------------------------


def test_yaml_json_text_and_dict_forms_load_to_the_same_spec(tmp_path: Path) -> None:
    data = yaml.safe_load(YAML_SPEC)
    yaml_file = tmp_path / "flow.yaml"
    yaml_file.write_text(YAML_SPEC)
    json_file = tmp_path / "flow.json"
    json_file.write_text(json.dumps(data, indent=2))
    yml_file = tmp_path / "flow.yml"
    yml_file.write_text(YAML_SPEC)
    specs = [
        load_spec(yaml_file),
        load_spec(str(yaml_file)),
        load_spec(yml_file),
        load_spec(json_file),
        load_spec(YAML_SPEC),
        load_spec(json.dumps(data)),
        load_spec(data),
    ]
    assert all(isinstance(s, FlowSpec) for s in specs)
    assert all(s == specs[0] for s in specs)
    assert specs[0].run.failure_policy == "continue"
    assert specs[0].run.budget == 600


def test_a_file_of_another_suffix_is_read_as_json_or_yaml(tmp_path: Path) -> None:
    spec = tmp_path / "flow.spec"
    spec.write_text(YAML_SPEC)
    assert load_spec(spec) == load_spec(YAML_SPEC)


def test_the_loaded_spec_compiles_to_a_machine_with_everything_resolved() -> None:
    machine = compile_spec(load_spec(YAML_SPEC))
    assert machine.name == "write-review"
    assert list(machine.states) == ["draft", "review"]
    assert machine.entry == ("draft",)
    assert machine.run.max_parallel == 2 and machine.run.max_transitions == 20
    draft, review = machine.states["draft"], machine.states["review"]
    assert draft.max_entries == 3 and review.max_entries == 1
    assert draft.failure_policy == "continue"  # inherited from run
    assert [(i.name, i.type, i.source, i.output, i.optional) for i in draft.inputs] == [
        ("topic", "text", None, None, False),
        ("feedback", "text", "review", "notes", True),
    ]
    assert review.prompt == "Review this draft:\n{draft}"  # the subagent's template
    assert review.subagent == "reviewer"
    assert review.settings.model == "openai:gpt-4.1-mini"  # from the subagent
    assert review.settings.temperature == 0.7  # the state overrides the subagent
    assert review.output_type("verdict") == "json"
    assert [p.name for p in machine.params.values()] == ["topic"]
    back = machine.transitions_from("review")
    assert len(back) == 1 and back[0].target == "draft"
    assert back[0].guard == Condition(output="verdict", op="eq", path="ok", value=False)
    assert machine.transitions_from("draft")[0].guard is None


def test_compile_spec_refuses_a_spec_built_without_load_spec() -> None:
    bad = base()
    bad["transitions"][0]["to"] = "nowhere"
    spec = FlowSpec.model_validate(bad)  # the schema alone passes
    with pytest.raises(InvalidSpec, match=r"transitions\[0\]\.to: unknown state 'nowhere'"):
        compile_spec(spec)


def test_a_yaml_file_with_broken_syntax_names_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "flow.yaml"
    path.write_text("states:\n  - id: a\n    prompt: [unclosed\n")
    with pytest.raises(InvalidSpec) as info:
        load_spec(path)
    message = str(info.value)
    assert message.startswith(f"invalid flow spec {path}: not valid YAML: line ")
    assert "\n" not in message


def test_a_json_file_with_broken_syntax_names_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "flow.json"
    path.write_text('{"states": [\n  {"id": "a",}\n]}')
    with pytest.raises(InvalidSpec, match=r"flow\.json: not valid JSON: line 2, column \d+"):
        load_spec(path)


def test_a_file_that_is_neither_yaml_nor_json_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "flow.txt"
    path.write_text("states: [\n  {id: a\n")
    with pytest.raises(InvalidSpec, match=r"flow\.txt: neither JSON \(.*\) nor YAML \(.*\)"):
        load_spec(path)
    binary = tmp_path / "flow.bin"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff")
    with pytest.raises(InvalidSpec, match=r"flow\.bin: not UTF-8 text .*YAML or JSON"):
        load_spec(binary)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", "it is empty"),
        ("# only a comment\n", "it is empty"),
        ("- a\n- b\n", "must be a mapping with states .* got list"),
        ("just words", "must be a mapping .* got string 'just words'"),
        ("states: [\n", "neither JSON .* nor YAML"),
    ],
)
def test_text_that_is_not_a_spec_mapping_is_refused(text: str, match: str) -> None:
    with pytest.raises(InvalidSpec, match=match):
        load_spec(text)


def test_missing_files_directories_and_other_sources(tmp_path: Path) -> None:
    with pytest.raises(InvalidSpec, match=r"nope\.yaml: no such file"):
        load_spec(str(tmp_path / "nope.yaml"))
    with pytest.raises(InvalidSpec, match="a directory"):
        load_spec(tmp_path)
    with pytest.raises(InvalidSpec, match="a path, YAML or JSON text, or a dict; got int"):
        load_spec(42)  # type: ignore[arg-type]


def test_yaml_reads_like_json_booleans_dates_and_duplicate_keys() -> None:
    text = """\
states:
  - id: a
    entry: true
    prompt: go
    outputs: [{name: r, type: json}]
  - id: b
    prompt: go
transitions:
  - {from: a, to: b, when: {output: r, op: eq, value: no}}
  - {from: a, to: b, when: {output: r, op: eq, value: 2024-01-02}}
  - {from: a, to: b, when: {output: r, op: eq, value: true}}
"""
    guards = [t.when for t in load_spec(text).transitions]
    assert [g.value for g in guards if g] == ["no", "2024-01-02", True]
    with pytest.raises(InvalidSpec, match=r"line 4, column 5: .*key 'prompt' twice"):
        load_spec("states:\n  - id: a\n    prompt: one\n    prompt: two\n")
    with pytest.raises(InvalidSpec, match="key 'id' twice"):
        load_spec('{"states": [{"id": "a", "id": "b"}]}')


# ---- validation: one problem, its path and its fix ------------------------------------------


def broken(change: Any) -> dict[str, Any]:
    spec = base()
    change(spec)
    return spec


def set_in(*path: Any, value: Any) -> Any:
    def change(spec: dict[str, Any]) -> None:
        target = spec
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return change


def append_to(*path: Any, value: Any) -> Any:
    def change(spec: dict[str, Any]) -> None:
        target = spec
        for key in path:
            target = target[key]
        target.append(value)

    return change


def drop(*path: Any) -> Any:
    def change(spec: dict[str, Any]) -> None:
        target = spec
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]

    return change


def _case_id(value: Any) -> str:
    """Name a case by its path; pytest appends a number to repeated ids."""
    return value if isinstance(value, str) else ""


CASES = [
    # references
    (
        set_in("states", 1, "inputs", 0, "from", value="drat.text"),
        "states[1].inputs[0].from",
        ["unknown state 'drat' (states: draft, review)"],
    ),
    (
        set_in("states", 1, "inputs", 0, "from", value="draft.txt"),
        "states[1].inputs[0].from",
        ["state 'draft' has no output 'txt' (outputs: text)"],
    ),
    (
        set_in("states", 1, "inputs", 0, "from", value="draft"),
        "states[1].inputs[0].from",
        ["'draft' is not STATE.OUTPUT", "e.g. 'draft.text'"],
    ),
    (
        set_in("transitions", 0, "to", value="reviw"),
        "transitions[0].to",
        ["unknown state 'reviw' (states: draft, review)"],
    ),
    (
        set_in("transitions", 0, "from", value="drafts"),
        "transitions[0].from",
        ["unknown state 'drafts'"],
    ),
    (
        set_in("states", 1, "inputs", 0, "type", value="json"),
        "states[1].inputs[0].type",
        ["json does not match output draft.text, which is text", "remove type"],
    ),
    # guards
    (
        set_in("transitions", 1, "when", "output", value="verdikt"),
        "transitions[1].when.output",
        ["state 'review' has no output 'verdikt' (outputs: verdict, notes)"],
    ),
    (
        set_in("transitions", 1, "when", "value", value=math.nan),
        "transitions[1].when.value",
        ["nan is not JSON", "finite number"],
    ),
    (
        set_in("transitions", 1, "when", "value", value=[1, {"x": math.inf}]),
        "transitions[1].when.value[1].x",
        ["inf is not JSON"],
    ),
    (
        set_in("transitions", 1, "when", "value", value=(1, 2)),
        "transitions[1].when.value",
        ["a tuple is not JSON; use a list"],
    ),
    (
        set_in("transitions", 1, "when", "value", value={1, 2}),
        "transitions[1].when.value",
        ["a set is not JSON; use a list"],
    ),
    (
        set_in("transitions", 1, "when", "value", value=datetime.date(2024, 1, 2)),
        "transitions[1].when.value",
        ["a date is not JSON", "a string"],
    ),
    (
        set_in("transitions", 1, "when", "value", value=b"ok"),
        "transitions[1].when.value",
        ["a bytes is not JSON"],
    ),
    (
        set_in("transitions", 1, "when", "value", value={1: "a"}),
        "transitions[1].when.value",
        ["the key 1 is a int; JSON keys are strings"],
    ),
    (
        set_in("transitions", 1, "when", value={"output": "verdict", "op": "exists", "value": 1}),
        "transitions[1].when.value",
        ["op exists takes no value; remove value"],
    ),
    (
        set_in("transitions", 1, "when", value={"output": "verdict", "op": "eq"}),
        "transitions[1].when",
        ["op eq needs a value", "value: null"],
    ),
    (
        set_in("transitions", 1, "when", value={"output": "verdict", "op": "gt", "value": "7"}),
        "transitions[1].when.value",
        ["op gt compares numbers, got string '7'; give a number"],
    ),
    (
        set_in("transitions", 1, "when", value={"output": "verdict", "op": "lte", "value": True}),
        "transitions[1].when.value",
        ["op lte compares numbers, got boolean true"],
    ),
    (
        set_in("transitions", 1, "when", "op", value="equals"),
        "transitions[1].when.op",
        ["must be 'eq', 'ne', 'gt', 'gte', 'lt', 'lte', 'exists' or 'contains'", "'equals'"],
    ),
    (
        set_in("transitions", 1, "when", "path", value="a..b"),
        "transitions[1].when.path",
        ["empty key at character 3 of 'a..b'"],
    ),
    (
        set_in("transitions", 1, "when", value={"output": "notes", "path": "a", "op": "exists"}),
        "transitions[1].when.path",
        ["output review.notes is text, which has no parts", "type: json"],
    ),
    (
        set_in("transitions", 1, "when", value={"output": "notes", "op": "gt", "value": 3}),
        "transitions[1].when.op",
        ["output review.notes is text, which is never a number", "gt could never pass"],
    ),
    (
        set_in("transitions", 1, "when", value={"output": "notes", "op": "eq", "value": 3}),
        "transitions[1].when.value",
        ["output review.notes is text, so op eq compares it with a string, got integer 3"],
    ),
    # lifecycle, foreach, counts, budgets, policies
    (
        set_in("states", 1, "lifecycle", value="resident"),
        "states[1].outputs",
        ["a resident state may not declare outputs", "lifecycle: task"],
    ),
    (
        set_in("states", 1, "lifecycle", value="daemon"),
        "states[1].lifecycle",
        ["must be 'task' or 'resident', got string 'daemon'"],
    ),
    (
        set_in("states", 1, "foreach", value={"over": "items"}),
        "states[1].foreach.over",
        ["'items' is not an input of state 'review' (inputs: draft)"],
    ),
    (
        set_in("states", 1, "foreach", value={"over": "draft"}),
        "states[1].foreach.over",
        ["input 'draft' is text", "type: json"],
    ),
    (
        set_in("states", 1, "foreach", value={"over": "draft", "max": 0}),
        "states[1].foreach.max",
        ["must be >= 1, got integer 0"],
    ),
    (set_in("states", 0, "max_entries", value=0), "states[0].max_entries", ["must be >= 1"]),
    (set_in("states", 0, "retries", value=-1), "states[0].retries", ["must be >= 0, got"]),
    (set_in("states", 0, "retries", value=1.5), "states[0].retries", ["a whole number"]),
    (set_in("states", 0, "budget", value=0), "states[0].budget", ["must be > 0, got integer 0"]),
    (set_in("states", 0, "budget", value="60"), "states[0].budget", ["must be a number"]),
    (set_in("run", value={"budget": -1}), "run.budget", ["must be > 0"]),
    (set_in("run", value={"budget": math.inf}), "run.budget", ["must be a finite number"]),
    (set_in("run", value={"max_parallel": 0}), "run.max_parallel", ["must be >= 1"]),
    (
        set_in("run", value={"max_parallel": 65}),
        "run.max_parallel",
        ["must be <= 64 (state instances", "got integer 65; use a whole number from 1 to 64"],
    ),
    (
        set_in("run", value={"max_transitions": 10_001}),
        "run.max_transitions",
        ["must be <= 10000", "got integer 10001; use a whole number from 1 to 10000"],
    ),
    (set_in("run", value={"max_transitions": 0}), "run.max_transitions", ["must be >= 1"]),
    (
        set_in("run", value={"failure_policy": "retry"}),
        "run.failure_policy",
        ["must be 'fail_fast', 'continue' or 'escalate', got string 'retry'"],
    ),
    (
        set_in("states", 0, "failure_policy", value="ignore"),
        "states[0].failure_policy",
        ["must be 'fail_fast', 'continue' or 'escalate'"],
    ),
    (set_in("states", 0, "entry", value="yes"), "states[0].entry", ["must be true or false"]),
    # prompts and subagents
    (
        set_in("states", 1, "subagent", value="reviewer"),
        "states[1]",
        ["has both prompt and subagent; keep one"],
    ),
    (drop("states", 1, "prompt"), "states[1]", ["has neither prompt nor subagent"]),
    (
        set_in("states", 1, "prompt", value="Review {draft} for {audience}"),
        "states[1].prompt",
        ["{audience} is not an input of state 'review' (inputs: draft)", "{{audience}}"],
    ),
    (
        set_in("states", 1, "prompt", value='Answer like {"ok": true}'),
        "states[1].prompt",
        ["'{' at line 1, column 13 starts no placeholder", "write '{{'"],
    ),
    (
        set_in("states", 1, "prompt", value="a }\nb"),
        "states[1].prompt",
        ["'}' at line 1, column 3 closes no placeholder", "write '}}'"],
    ),
    # ids, names, duplicates
    (
        set_in("states", 1, "id", value="draft"),
        "states[1].id",
        ["duplicate id 'draft' (also states[0].id)"],
    ),
    (
        set_in("states", 1, "id", value="re.view"),
        "states[1].id",
        ["'re.view' is not a valid name", "letters, digits"],
    ),
    (set_in("states", 1, "id", value=7), "states[1].id", ["must be a string, got integer 7"]),
    (drop("states", 1, "id"), "states[1].id", ["required, but missing"]),
    (
        append_to("states", 1, "inputs", value={"name": "draft", "from": "draft.text"}),
        "states[1].inputs[1].name",
        ["duplicate input 'draft' (also inputs[0])"],
    ),
    (
        set_in("states", 1, "outputs", 1, value="verdict"),
        "states[1].outputs[1].name",
        ["duplicate output 'verdict' (also outputs[0])"],
    ),
    (
        set_in("states", 1, "outputs", 1, value=3),
        "states[1].outputs[1]",
        ["must be a name or a mapping with name, got integer 3"],
    ),
    (set_in("states", 1, "inputs", value="draft"), "states[1].inputs", ["must be a list"]),
    # unknown keys say what is allowed
    (
        set_in("states", 1, "promt", value="x"),
        "states[1].promt",
        ["unknown key; did you mean 'prompt'?", "(allowed: budget, description, entry"],
    ),
    (
        set_in("states", 1, "depends_on", value=["draft"]),
        "states[1].depends_on",
        ["unknown key; depends_on belongs to the DAG form"],
    ),
    (
        set_in("transitions", 0, "if", value={"output": "text", "op": "exists"}),
        "transitions[0].if",
        ["a transition's condition is written under when"],
    ),
    (
        set_in("edges", value=[]),
        "edges",
        ["unknown key; edges are transitions", "(allowed: description, name, nodes"],
    ),
    # the machine as a whole
    (set_in("states", 0, "entry", value=False), "states", ["no state has entry: true"]),
    (
        set_in("transitions", value=[]),
        "states[1]",
        ["state 'review' can never run", "add entry: true or a transition to it"],
    ),
    (
        set_in("states", 0, "inputs", 1, "optional", value=False),
        "states[0].inputs[1].from",
        [
            "required inputs form a cycle (draft needs review.notes, review needs draft.text)",
            "optional: true",
        ],
    ),
    (
        set_in("states", 0, "inputs", 1, value={"name": "feedback", "from": "draft.text"}),
        "states[0].inputs[1].from",
        ["required inputs form a cycle (draft needs draft.text)"],
    ),
    (
        append_to("states", 1, "inputs", value={"name": "topic", "type": "json"}),
        "states[1].inputs[1].type",
        ["flow input 'topic' is json here but text at states[0].inputs[0]"],
    ),
    (set_in("states", value=[]), "states", ["the flow has no states; add at least one"]),
    (
        set_in("nodes", value=[{"id": "x", "prompt": "p"}]),
        "(top level)",
        ["has both states and nodes"],
    ),
    (drop("states"), "(top level)", ["a flow needs states (the state form) or nodes"]),
]


@pytest.mark.parametrize(("change", "path", "fragments"), CASES, ids=lambda v: _case_id(v))
def test_each_invalid_spec_names_the_path_and_the_fix(
    change: Any, path: str, fragments: list[str]
) -> None:
    has(problems(broken(change)), path, *fragments)


@pytest.mark.parametrize(("change", "path", "fragments"), CASES[:9], ids=lambda v: _case_id(v))
def test_the_same_problems_come_from_yaml_text(
    change: Any, path: str, fragments: list[str]
) -> None:
    spec = broken(change)
    has(problems(yaml.safe_dump(spec)), path, *fragments)


def test_a_subagent_must_exist_and_its_placeholders_must_be_inputs() -> None:
    spec = base()
    spec["states"][1] = {
        "id": "review",
        "subagent": "critic",
        "inputs": [{"name": "draft", "from": "draft.text"}],
        "outputs": [{"name": "verdict", "type": "json"}, "notes"],
    }
    assert only_problem(spec) == (
        "states[1].subagent: unknown subagent 'critic' (no subagents defined)"
    )
    spec["subagents"] = {"reviewer": {"prompt": "Review {draft} against {rubric}"}}
    assert only_problem(spec) == (
        "states[1].subagent: unknown subagent 'critic' (subagents: reviewer)"
    )
    spec["states"][1]["subagent"] = "reviewer"
    has(
        problems(spec),
        "states[1].subagent",
        "subagent 'reviewer' uses {rubric}, which is not an input of state 'review'",
        "declare it under inputs",
    )
    spec["states"][1]["inputs"].append({"name": "rubric"})
    assert compile_spec(load_spec(spec)).states["review"].prompt.startswith("Review {draft}")
    spec["subagents"]["bad name"] = {"prompt": "x {"}
    found = problems(spec)
    has(found, 'subagents["bad name"]', "'bad name' is not a valid name")
    has(found, 'subagents["bad name"].prompt', "starts no placeholder")


def test_literal_braces_and_back_edges_through_optional_inputs_are_legal() -> None:
    spec = base()
    spec["states"][1]["prompt"] = 'Review {draft}; answer {{"ok": true}}'
    machine = compile_spec(load_spec(spec))
    assert machine.transitions_from("review")[0].target == "draft"


def test_every_problem_is_reported_at_once_with_a_header_naming_the_file(
    tmp_path: Path,
) -> None:
    spec = base()
    spec["run"] = {"max_parallel": 0}
    spec["states"][0]["retries"] = -2
    spec["states"][1]["inputs"][0]["from"] = "reviw.text"
    spec["states"][1]["lifecycle"] = "resident"
    spec["transitions"][1]["when"]["output"] = "nope"
    spec["transitions"][0]["to"] = "gone"
    path = tmp_path / "flow.json"
    path.write_text(json.dumps(spec))
    with pytest.raises(InvalidSpec) as info:
        load_spec(path)
    header, *lines = str(info.value).splitlines()
    assert header == f"invalid flow spec {path}: 7 problems"
    found = [line.strip() for line in lines]
    has(found, "run.max_parallel", "must be >= 1")
    has(found, "states[0].retries", "must be >= 0")
    has(found, "states[1].inputs[0].from", "unknown state 'reviw'")
    has(found, "states[1].outputs", "resident")
    has(found, "states[1]", "state 'review' can never run")  # transitions[0] led to it
    has(found, "transitions[0].to", "unknown state 'gone'")
    has(found, "transitions[1].when.output", "no output 'nope'")
    # listed in the order of the spec
    assert [p.split(":")[0] for p in found] == [
        "run.max_parallel",
        "states[0].retries",
        "states[1].inputs[0].from",
        "states[1].outputs",
        "states[1]",
        "transitions[0].to",
        "transitions[1].when.output",
    ]


def test_a_state_that_fails_the_schema_causes_no_follow_on_problems() -> None:
    spec = base()
    spec["states"][0]["promt"] = spec["states"][0].pop("prompt")  # misspelled key
    spec["states"][1]["outputs"][0] = {"name": "verdict", "type": "yaml"}  # bad output
    found = problems(spec)
    # no "neither prompt nor subagent" for draft, and no "no output 'verdict'" for the
    # guard on review, whose outputs failed the schema: only the two real problems
    assert len(found) == 2, found
    has(found, "states[0].promt", "did you mean 'prompt'?")
    has(found, "states[1].outputs[0].type", "must be 'text' or 'json'")


def test_one_line_yaml_text_is_not_taken_for_a_path() -> None:
    assert only_problem("states: []") == "states: the flow has no states; add at least one"
    assert only_problem("{name: x.yaml}").startswith("(top level): a flow needs states")


# ---- the DAG form --------------------------------------------------------------------------

DAG = {
    "name": "essay",
    "nodes": [
        {
            "id": "outline",
            "prompt": "Outline {topic}",
            "inputs": ["topic"],
            "outputs": [{"name": "sections", "type": "json"}],
        },
        {
            "id": "draft",
            "depends_on": ["outline"],
            "prompt": "Draft from {sections}",
            "outputs": ["text"],
            "retries": 2,
        },
        {
            "id": "critique",
            "depends_on": ["outline", "draft"],
            "prompt": "Critique {text} against {sections}",
            "inputs": [{"name": "style", "optional": True}],
            "outputs": ["notes"],
            "failure_policy": "continue",
        },
    ],
}

EQUIVALENT_STATES = {
    "name": "essay",
    "states": [
        {
            "id": "outline",
            "entry": True,
            "prompt": "Outline {topic}",
            "inputs": ["topic"],
            "outputs": [{"name": "sections", "type": "json"}],
        },
        {
            "id": "draft",
            "prompt": "Draft from {sections}",
            "inputs": [{"name": "sections", "from": "outline.sections"}],
            "outputs": ["text"],
            "retries": 2,
        },
        {
            "id": "critique",
            "prompt": "Critique {text} against {sections}",
            "inputs": [
                {"name": "style", "optional": True},
                {"name": "sections", "from": "outline.sections"},
                {"name": "text", "from": "draft.text"},
            ],
            "outputs": ["notes"],
            "failure_policy": "continue",
        },
    ],
    "transitions": [
        {"from": "outline", "to": "draft"},
        {"from": "outline", "to": "critique"},
        {"from": "draft", "to": "critique"},
    ],
}


def test_the_dag_form_compiles_to_the_same_machine_as_the_state_form() -> None:
    dag = compile_spec(load_spec(DAG))
    states = compile_spec(load_spec(EQUIVALENT_STATES))
    assert dag == states
    assert dag.entry == ("outline",)
    critique = dag.states["critique"]
    assert [(i.name, i.type, i.source) for i in critique.inputs] == [
        ("style", "text", None),
        ("sections", "json", "outline"),
        ("text", "text", "draft"),
    ]
    assert all(s.max_entries == 1 for s in dag.states.values())


def test_a_dag_input_named_like_a_dependency_output_reads_it() -> None:
    spec = copy.deepcopy(DAG)
    spec["nodes"][1]["inputs"] = [{"name": "sections", "type": "json"}]
    draft = compile_spec(load_spec(spec)).states["draft"]
    assert [(i.name, i.source, i.output) for i in draft.inputs] == [
        ("sections", "outline", "sections")
    ]


def dag_with(change: Any) -> dict[str, Any]:
    spec = copy.deepcopy(DAG)
    change(spec)
    return spec


DAG_CASES = [
    (
        set_in("nodes", 1, "depends_on", value=["outlin"]),
        "nodes[1].depends_on[0]",
        ["unknown node 'outlin' (nodes: outline, draft, critique)"],
    ),
    (
        set_in("nodes", 1, "depends_on", value=["outline", "draft"]),
        "nodes[1].depends_on[1]",
        ["a node cannot depend on itself"],
    ),
    (
        set_in("nodes", 1, "depends_on", value=["outline", "outline"]),
        "nodes[1].depends_on[1]",
        ["'outline' is listed twice"],
    ),
    (
        set_in("nodes", 0, "depends_on", value=["critique"]),
        "nodes[0].depends_on",
        ["dependencies form a cycle (outline depends on critique, critique depends on"],
    ),
    (
        set_in("nodes", 0, "outputs", value=[]),
        "nodes[1].depends_on[0]",
        ["'draft' would not wait for 'outline': it declares no outputs"],
    ),
    (
        set_in("nodes", 1, "inputs", value=[{"name": "s", "from": "critique.notes"}]),
        "nodes[1].inputs[0].from",
        ["comes from node 'critique', which is not in depends_on", "add 'critique'"],
    ),
    (
        set_in("nodes", 1, "outputs", value=["sections"]),
        "nodes[2].depends_on[1]",
        ["output 'sections' of 'draft' would become an input named like another input"],
    ),
    (
        set_in("nodes", 2, "inputs", value=[{"name": "text", "optional": True}]),
        "nodes[2].depends_on[1]",
        ["'critique' would not wait for 'draft': every input of 'critique' from it is optional"],
    ),
    (
        set_in("nodes", 2, "entry", value=True),
        "nodes[2].entry",
        ["unknown key; in the DAG form the nodes without depends_on are the entries"],
    ),
    (
        set_in("transitions", value=[]),
        "transitions",
        ["the DAG form (nodes) takes no transitions"],
    ),
    (set_in("nodes", value=[]), "nodes", ["the flow has no nodes"]),
]


@pytest.mark.parametrize(("change", "path", "fragments"), DAG_CASES, ids=lambda v: _case_id(v))
def test_each_invalid_dag_names_the_path_and_the_fix(
    change: Any, path: str, fragments: list[str]
) -> None:
    has(problems(dag_with(change)), path, *fragments)


def test_a_dag_input_named_after_outputs_of_two_dependencies_must_say_which() -> None:
    spec = copy.deepcopy(DAG)
    spec["nodes"][1]["outputs"] = ["text", {"name": "sections", "type": "json"}]
    spec["nodes"][2]["inputs"] = [{"name": "sections", "type": "json"}]
    has(
        problems(spec),
        "nodes[2].inputs[0]",
        "'sections' is an output of several dependencies (outline, draft)",
        "from: outline.sections",
    )


# ---- guards ---------------------------------------------------------------------------------

OUT = {
    "verdict": {"ok": True, "score": 7, "ratio": 0.5, "tags": ["a", 1, True, None], "n": None},
    "count": 1,
    "flag": True,
    "text": "looks good to me",
}


def g(output: str, op: str, value: Any = None, path: str | None = None) -> Condition:
    return Condition(output=output, op=op, path=path, value=value)


@pytest.mark.parametrize(
    ("guard", "expected"),
    [
        # true is not 1, false is not 0, 1 is 1.0
        (g("flag", "eq", True), True),
        (g("flag", "eq", 1), False),
        (g("count", "eq", True), False),
        (g("count", "eq", 1.0), True),
        (g("count", "ne", True), True),
        (g("verdict", "eq", 1, "ok"), False),
        (g("verdict", "eq", True, "ok"), True),
        (g("verdict", "eq", None, "n"), True),
        (g("verdict", "eq", False, "n"), False),
        (g("verdict", "eq", ["a", 1, True, None], "tags"), True),
        (g("verdict", "eq", ["a", True, True, None], "tags"), False),
        (g("verdict", "eq", {"x": 1}), False),
        # paths
        (g("verdict", "eq", 1, "tags[1]"), True),
        (g("verdict", "exists", path="tags[3]"), True),  # null is a value
        (g("verdict", "exists", path="n"), True),
        (g("verdict", "exists", path="tags[4]"), False),
        (g("verdict", "exists", path="missing.deeper"), False),
        (g("verdict", "exists", path="ok.deeper"), False),
        (g("text", "exists", path="0"), False),
        (g("nothing", "exists"), False),
        (g("nothing", "ne", 1), False),  # missing is false for every op but exists
        (g("verdict", "ne", 1, "missing"), False),
        (g("verdict", "eq", None, "missing"), False),
        # numeric ops need numbers; a boolean is not one
        (g("verdict", "gt", 5, "score"), True),
        (g("verdict", "gte", 7, "score"), True),
        (g("verdict", "lt", 7, "score"), False),
        (g("verdict", "lte", 0.5, "ratio"), True),
        (g("verdict", "gt", 0, "ok"), False),
        (g("flag", "gte", 0), False),
        (g("count", "gt", True), False),
        (g("text", "gt", 1), False),
        # contains
        (g("text", "contains", "good"), True),
        (g("text", "contains", "bad"), False),
        (g("text", "contains", 1), False),
        (g("verdict", "contains", 1, "tags"), True),
        (g("verdict", "contains", True, "tags"), True),
        (g("verdict", "contains", None, "tags"), True),
        (g("verdict", "contains", 0, "tags"), False),
        (g("verdict", "contains", "ok"), False),  # an object: false, test keys with exists
        (g("count", "contains", 1), False),
    ],
)
def test_guards_are_json_strict(guard: Condition, expected: bool) -> None:
    assert evaluate(guard, OUT) is expected


def test_the_spec_guard_model_evaluates_like_the_compiled_condition() -> None:
    guard = Guard(output="verdict", path="score", op="gte", value=7)
    assert evaluate(guard, OUT) is True


def test_json_equal_treats_nan_as_unequal_and_unknown_types_as_unequal() -> None:
    assert not json_equal(math.nan, math.nan)
    assert not json_equal((1,), [1])
    assert json_equal({"a": [1, 2.0]}, {"a": [1.0, 2]})
    assert not json_equal({"a": 1}, {"a": 1, "b": 2})


@pytest.mark.parametrize(
    ("path", "parts"),
    [
        ("a", ("a",)),
        ("a.b[0].c", ("a", "b", 0, "c")),
        ("[2].name", (2, "name")),
        ("a[0][1]", ("a", 0, 1)),
        ('a["x.y"].z', ("a", "x.y", "z")),
        ("a.0", ("a", "0")),
        ("with-dash.and_underscore", ("with-dash", "and_underscore")),
    ],
)
def test_parse_path(path: str, parts: tuple[str | int, ...]) -> None:
    assert parse_path(path) == parts


@pytest.mark.parametrize("path", ["", ".a", "a.", "a..b", "a[-1]", "a[x]", "a[0]b", "a.[0]"])
def test_a_bad_path_is_refused(path: str) -> None:
    with pytest.raises(ValueError):
        parse_path(path)


# ---- prompts --------------------------------------------------------------------------------


def test_render_fills_placeholders_and_appends_the_other_inputs() -> None:
    prompt = render_prompt(
        "Write about {topic}. Use {{braces}} literally.\n",
        {"topic": "owls", "notes": None, "data": {"a": [1, 2.5, True]}, "more": "two\nlines"},
    )
    assert prompt == (
        "Write about owls. Use {braces} literally.\n"
        "\n## Inputs\n"
        "\n### notes\nnull\n"
        '\n### data\n{"a":[1,2.5,true]}\n'
        "\n### more\ntwo\nlines"
    )


def test_render_json_values_compactly_in_place_and_keeps_unicode() -> None:
    assert render_prompt("{x} {y} {z}", {"x": [1, {"k": "é"}], "y": 3, "z": None}) == (
        '[1,{"k":"é"}] 3 null'
    )
    assert render_prompt("{x}{x}", {"x": "a"}) == "aa"


def test_render_with_an_empty_template_is_only_the_inputs() -> None:
    assert render_prompt("", {"a": 1}) == "## Inputs\n\n### a\n1"
    assert render_prompt("Plain.", {}) == "Plain."


def test_render_refuses_missing_inputs_bad_templates_and_non_json_values() -> None:
    with pytest.raises(InvalidArgument, match=r"placeholder \{topic\} .* \(inputs: x\)"):
        render_prompt("{topic}", {"x": 1})
    with pytest.raises(InvalidSpec, match="starts no placeholder"):
        render_prompt('{"a": 1}', {})
    with pytest.raises(InvalidArgument, match="input 'x' is not JSON"):
        render_prompt("{x}", {"x": math.nan})
    with pytest.raises(InvalidArgument, match="input 'y' is not JSON"):
        render_prompt("", {"y": {1, 2}})


def test_parse_template_caps_the_brace_problems() -> None:
    parts, found = parse_template("{ " * 7)
    assert len(found) == 4 and found[-1] == "and 4 more unmatched braces"
    assert parts == ["{ " * 7]


# ---- outputs --------------------------------------------------------------------------------

ANSWER = """I looked at it twice.

```json verdict
{"ok": false}
```

On reflection:

```json verdict
{"ok": true, "score": 7}
```

```md summary
Fine overall.
```
"""


def test_yaml_anchors_and_merge_keys_work() -> None:
    spec = """\
states:
  - &draft {id: draft, entry: true, prompt: go, outputs: [text], retries: 2}
  - <<: *draft
    id: again
    entry: false
transitions: [{from: draft, to: again}]
"""
    again = compile_spec(load_spec(spec)).states["again"]
    assert again.retries == 2 and again.prompt == "go" and not again.entry


def test_a_yaml_alias_bomb_is_refused_before_it_expands(tmp_path: Path) -> None:
    # 425 bytes whose aliases, nested eight deep, would expand to 9**9 values.
    lines = ['a0: &a0 ["x","x","x","x","x","x","x","x","x"]']
    lines += [f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 9)]
    bomb = "\n".join([*lines, "states: *a8"])
    path = tmp_path / "bomb.yaml"
    path.write_text(bomb)
    for source in (bomb, path):
        with pytest.raises(InvalidSpec, match="expands to over 100,000 values"):
            load_spec(source)


def test_a_spec_over_the_size_bound_is_refused_unread(tmp_path: Path) -> None:
    big = "# padding\n" * 200_000 + "states: []\n"
    path = tmp_path / "big.yaml"
    path.write_text(big)
    for source in (big, path):
        with pytest.raises(InvalidSpec, match=r"over the 1,048,576-byte bound of a spec"):
            load_spec(source)


def test_a_json_output_is_the_last_block_labelled_with_its_name() -> None:
    assert read_output(ANSWER, "verdict", "json") == {"ok": True, "score": 7}
    assert read_output("```verdict\n[1, 2]\n```", "verdict", "json") == [1, 2]
    assert read_output("~~~json verdict\n3\n~~~", "verdict", "json") == 3


def test_a_json_output_without_a_labelled_block_is_the_whole_answer() -> None:
    assert read_output('  {"a": 1}\n', "x", "json") == {"a": 1}
    assert read_output("```json\n[1, 2]\n```\n", "x", "json") == [1, 2]
    assert read_output('```\n"s"\n```', "x", "json") == "s"


def test_a_json_output_binds_from_the_trailing_fence_that_carries_its_name() -> None:
    """As the factory binds: the fences scanned trailing-first, the first whose object
    holds the output's name gives that key's value; one answer carries every output."""
    answer = (
        'Plan:\n```json\n{"plan": ["a", "b"], "verdict": {"approved": false}}\n```\n'
        'Notes:\n```json\n{"notes": "later fence, no verdict"}\n```'
    )
    assert read_output(answer, "verdict", "json") == {"approved": False}
    assert read_output(answer, "plan", "json") == ["a", "b"]
    assert read_output(answer, "notes", "json") == "later fence, no verdict"
    # A plain json fence that is the whole answer: its object's key, or the object whole.
    assert read_output('```json\n{"verdict": {"approved": true}}\n```', "verdict", "json") == {
        "approved": True
    }
    assert read_output('```json\n{"approved": true}\n```', "verdict", "json") == {"approved": True}
    assert read_output('{"verdict": 3, "x": 1}', "verdict", "json") == 3
    # A fence labelled with the name still gives its whole value.
    assert read_output('```json verdict\n{"verdict": 1}\n```', "verdict", "json") == {"verdict": 1}


def test_an_unclosed_labelled_block_runs_to_the_end() -> None:
    assert read_output('Here:\n```json x\n{"a": [1,\n 2]}', "x", "json") == {"a": [1, 2]}


@pytest.mark.parametrize(
    ("answer", "where"),
    [
        ("The answer is yes.", "the whole answer"),
        ('```json x\n{"a": }\n```', "the last ```json x block"),
        ("NaN", "NaN is not JSON"),
        ('```json y\n{"a": 1}\n```', "the whole answer (no ```json block carries 'x')"),
        ('```python x\n{"a": 1}\n```', "the whole answer"),
    ],
)
def test_a_json_output_that_does_not_parse_raises_output_error(answer: str, where: str) -> None:
    with pytest.raises(OutputError) as info:
        read_output(answer, "x", "json")
    assert "output 'x' is not valid JSON" in str(info.value)
    assert where in str(info.value)
    assert "```json x" in str(info.value)
    assert isinstance(info.value, BroodError)


def test_a_text_output_is_its_labelled_block_or_the_whole_answer() -> None:
    assert read_output(ANSWER, "summary", "text") == "Fine overall."
    assert read_output(ANSWER, "verdict", "text") == '{"ok": true, "score": 7}'
    assert read_output("  Just this.\n", "summary") == "Just this."
    assert read_output("```summary\nline 1\nline 2\n```", "summary") == "line 1\nline 2"


def test_read_output_refuses_an_unknown_type() -> None:
    with pytest.raises(InvalidArgument, match="'text' or 'json'"):
        read_output("x", "x", "xml")


# ---- layering ------------------------------------------------------------------------------


def test_the_flow_package_imports_nothing_above_it() -> None:
    # DESIGN's layering: flows sit beside the supervisor; they may use the lifecycle, never
    # the supervisor, stores, backends, the API or a front end (the executor gets its host).
    for path in FLOW_SRC.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top == "brood":
                    ok = name.startswith("brood.flow") or name in (
                        "brood.errors",
                        "brood.limits",
                        "brood.lifecycle",
                        "brood.spec_text",  # a leaf the worker shares: size bound, path rule
                    )
                else:
                    ok = top in ("pydantic", "yaml") or top in sys.stdlib_module_names
                assert ok, f"{path.name} imports {name}"


def test_an_upper_bound_is_told_in_brood_words_with_the_values_to_use() -> None:
    """pydantic's own text ("Input should be less than or equal to 64") is not shown: the
    field, its bound, why, and the values it takes are, in both tellings of a problem."""
    spec = {"run": {"max_parallel": 65}, "states": [{"id": "a", "entry": True, "prompt": "p"}]}
    told = {}
    with pytest.raises(InvalidSpec) as info:
        load_spec(spec)
    told["quoted"] = str(info.value)
    with pytest.raises(InvalidSpec) as info:
        load_spec_text(json.dumps(spec))
    told["schema words"] = str(info.value)
    for how, message in told.items():
        assert "Input should" not in message, how
        line = message.splitlines()[1].strip()
        assert line.startswith("run.max_parallel: must be <= 64 ("), (how, line)
        assert line.endswith("; use a whole number from 1 to 64"), (how, line)
    assert "got integer 65" in told["quoted"] and "65" not in told["schema words"]


def test_the_factory_defaults_and_bounds_of_the_run_settings() -> None:
    """failure_policy escalate, max_parallel 8 (1..64), max_transitions 10 x states (at most
    10,000), 1..1,024 states; out of range is a validation error with its path."""
    states = [{"id": f"s{i}", "entry": True, "prompt": "p"} for i in range(3)]
    machine = compile_spec(load_spec({"states": states}))
    assert machine.run.failure_policy == "escalate"
    assert machine.run.max_parallel == 8
    assert machine.run.max_transitions == 30
    many = [{"id": f"s{i}", "entry": True, "prompt": "p"} for i in range(1024)]
    assert compile_spec(load_spec({"states": many})).run.max_transitions == 10_000
    for run, path in [
        ({"max_parallel": 0}, "run.max_parallel"),
        ({"max_parallel": 65}, "run.max_parallel"),
        ({"max_transitions": 10_001}, "run.max_transitions"),
        ({"max_transitions": 0}, "run.max_transitions"),
    ]:
        with pytest.raises(InvalidSpec, match=path.replace(".", r"\.")):
            load_spec({"run": run, "states": states})
    too_many = [{"id": f"s{i}", "entry": True, "prompt": "p"} for i in range(1025)]
    with pytest.raises(InvalidSpec, match="1,025 states, more than the 1,024"):
        load_spec({"states": too_many})

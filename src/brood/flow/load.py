"""Reading a flow spec: a path, YAML or JSON text, or a dict, within size bounds; YAML is read
close to JSON and YAML 1.2. `load_spec` then validates what it read (`brood.flow.check`)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import yaml
from pydantic import ValidationError

from brood.errors import InvalidSpec
from brood.flow.check import (
    _Checker,
    _describe,
    _raise,
    _schema_problems,
    _view_from_raw,
    check_spec,
)
from brood.flow.schema import FlowSpec

__all__ = ["load_spec"]

SPEC_SUFFIXES: Final = (".yaml", ".yml", ".json")

MAX_SPEC_BYTES: Final = 1 << 20  # a spec's text; a real one is a few KB
# Nodes of a spec once its YAML aliases are expanded: aliases nested a few levels deep
# (an "alias bomb" of a few hundred bytes) would otherwise expand to billions.
MAX_SPEC_NODES: Final = 100_000


class _SpecLoader(yaml.SafeLoader):
    """PyYAML's safe loader made closer to JSON and YAML 1.2: only true/false are booleans,
    timestamps stay strings, and a key given twice in one mapping is an error (PyYAML would
    silently keep the last). Aliases are counted as what they expand to, and a document
    that would expand past MAX_SPEC_NODES is refused before anything is built from it."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._sizes: dict[int, int] = {}  # id(node) -> its size once aliases are expanded

    def compose_node(self, parent: Any, index: Any) -> Any:
        node = super().compose_node(parent, index)
        if id(node) in self._sizes:  # an alias: the same node again
            return node
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        else:
            children = []
        size = 1 + sum(self._sizes.get(id(child), 1) for child in children)
        if size > MAX_SPEC_NODES:
            raise yaml.composer.ComposerError(
                None,
                None,
                f"the document expands to over {MAX_SPEC_NODES:,} values (YAML aliases "
                "repeat what they name); write the spec out, or make it smaller",
                node.start_mark,
            )
        self._sizes[id(node)] = size
        return node

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen: set[str] = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != _MERGE_TAG:
                if key_node.value in seen:
                    raise yaml.constructor.ConstructorError(
                        "while reading a mapping",
                        node.start_mark,
                        f"found the key {key_node.value!r} twice",
                        key_node.start_mark,
                    )
                seen.add(key_node.value)
        return super().construct_mapping(node, deep=deep)


_MERGE_TAG = "tag:yaml.org,2002:merge"
_BOOL_TAG = "tag:yaml.org,2002:bool"
_TIMESTAMP_TAG = "tag:yaml.org,2002:timestamp"
_SpecLoader.yaml_implicit_resolvers = {
    first: [(tag, regex) for tag, regex in resolvers if tag not in (_BOOL_TAG, _TIMESTAMP_TAG)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_SpecLoader.add_implicit_resolver(
    _BOOL_TAG, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def _json_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"found the key {key!r} twice in one object")
        result[key] = value
    return result


def _parse_json(text: str) -> Any:
    """JSON, with duplicate keys refused (NaN is let through for the schema to name)."""
    try:
        return json.loads(text, object_pairs_hook=_json_pairs)
    except json.JSONDecodeError as exc:
        raise ValueError(f"line {exc.lineno}, column {exc.colno}: {exc.msg}") from None


def _parse_yaml(text: str) -> Any:
    try:
        return yaml.load(text, Loader=_SpecLoader)  # a SafeLoader subclass: safe
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        what = exc.problem or exc.context or "invalid YAML"
        if exc.context and exc.problem:
            what = f"{exc.context}, {exc.problem}"
        raise ValueError(f"{where}{what}") from None
    except yaml.YAMLError as exc:
        raise ValueError(str(exc)) from None


def _read_source(source: str | Path | Mapping[str, Any]) -> tuple[str, Any]:
    """(label, data) of a spec source; raises InvalidSpec when it is not a readable spec."""
    if isinstance(source, Mapping):
        return "(dict)", source
    if isinstance(source, str) and not _looks_like_path(source):
        _check_size(len(source.encode()), "(text)")
        return "(text)", _parse_json_or_yaml(source, "(text)", "fix the syntax")
    if not isinstance(source, str | Path):
        raise InvalidSpec(
            f"a flow spec is a path, YAML or JSON text, or a dict; got {type(source).__name__}"
        )
    path = Path(source)
    label = str(source)
    try:
        _check_size(path.stat().st_size, label)
        raw = path.read_bytes()
    except FileNotFoundError:
        raise InvalidSpec(f"invalid flow spec {label}: no such file") from None
    except IsADirectoryError:
        raise InvalidSpec(f"invalid flow spec {label}: a directory, not a spec file") from None
    except OSError as exc:
        raise InvalidSpec(f"invalid flow spec {label}: cannot read it ({exc})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidSpec(
            f"invalid flow spec {label}: not UTF-8 text (byte {exc.start}); "
            "a spec is a YAML or JSON file"
        ) from None
    suffix = path.suffix.lower()
    try:
        if suffix == ".json":
            return label, _parse_json(text)
        if suffix in (".yaml", ".yml"):
            return label, _parse_yaml(text)
    except ValueError as exc:
        kind = "JSON" if suffix == ".json" else "YAML"
        raise InvalidSpec(f"invalid flow spec {label}: not valid {kind}: {exc}") from None
    return label, _parse_json_or_yaml(text, label, "a spec is a .yaml, .yml or .json file")


def _check_size(size: int, label: str) -> None:
    if size > MAX_SPEC_BYTES:
        raise InvalidSpec(
            f"invalid flow spec {label}: {size:,} bytes, over the {MAX_SPEC_BYTES:,}-byte "
            "bound of a spec; a spec describes states, it does not carry data (pass data as "
            "inputs)"
        )


def _parse_json_or_yaml(text: str, label: str, fix: str) -> Any:
    """JSON if it parses as JSON, else YAML; InvalidSpec naming both errors otherwise."""
    try:
        return _parse_json(text)
    except ValueError as json_error:
        try:
            return _parse_yaml(text)
        except ValueError as yaml_error:
            raise InvalidSpec(
                f"invalid flow spec {label}: neither JSON ({json_error}) nor YAML "
                f"({yaml_error}); {fix}"
            ) from None


def _looks_like_path(source: str) -> bool:
    """A one-line string is a path if it names an existing file, or ends in .yaml, .yml or
    .json and holds no ': ' or '{' (which one-line YAML or JSON would); else it is text."""
    if "\n" in source or not source.strip():
        return False
    try:
        if Path(source).is_file():
            return True
    except (OSError, ValueError):  # a name too long for the OS, a NUL byte
        return False
    return source.strip().lower().endswith(SPEC_SUFFIXES) and not (": " in source or "{" in source)


def load_spec(source: str | Path | Mapping[str, Any]) -> FlowSpec:
    """Read and validate a flow spec.

    `source` is a `Path`, a one-line string naming a .yaml/.yml/.json file (or any existing
    file), YAML or JSON text, or a dict. A `.json` file is read as JSON, `.yaml`/`.yml` as
    YAML, anything else as JSON and then YAML. Returns the `FlowSpec` when the spec is valid;
    otherwise raises `InvalidSpec` whose message starts with a header naming the source and
    the number of problems, then lists every problem found, one per line, as
    `path: message` (e.g. `states[2].inputs[0].from: unknown state 'reviw' (states: draft,
    review)`). Schema problems and the checks that span fields are reported together: a
    state that fails the schema is left out of the cross-field checks, so it causes no
    follow-on noise.
    """
    label, data = _read_source(source)
    if data is None:
        raise InvalidSpec(f"invalid flow spec {label}: it is empty; write states or nodes")
    if not isinstance(data, Mapping):
        raise InvalidSpec(
            f"invalid flow spec {label}: the spec must be a mapping with states (the state "
            f"form) or nodes (the DAG form), got {_describe(data)}"
        )
    spec: FlowSpec | None = None
    try:
        spec = FlowSpec.model_validate(data)
    except ValidationError as exc:
        problems = _schema_problems(exc) + _Checker(_view_from_raw(data)).run()
    else:
        problems = check_spec(spec)
    _raise(label, problems)
    assert spec is not None  # no problem means the schema passed
    return spec

"""Reading a flow spec: a path, YAML or JSON text, or a dict, within bounds of size and of
nesting; YAML is read close to JSON and YAML 1.2. `load_spec` then validates what it read
(`brood.flow.check`).

Two entry points: `load_spec` for the user's own specs (a path is read, problems quote the
values), and `load_spec_text` for text alone (never taken for a path; problems told in the
schema's own words unless asked otherwise), which is how the supervisor reads a spec that
model code sent (DESIGN.md section 14).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import yaml
from pydantic import ValidationError

from brood.errors import InvalidSpec
from brood.flow.check import (
    Checker,
    Problem,
    describe_value,
    kind_of,
    raise_problems,
    schema_problems,
    view_from_raw,
    view_from_spec,
)
from brood.flow.schema import FlowSpec
from brood.spec_text import MAX_SPEC_BYTES, looks_like_path, over_bound, read_bounded

__all__ = ["MAX_SPEC_BYTES", "MAX_SPEC_DEPTH", "load_spec", "load_spec_text"]

# Levels of nesting of a spec (mappings and lists in one another). A real spec has about
# six; parsers, pydantic and the checks recurse once per level, and JSON or YAML of a
# megabyte could nest hundreds of thousands of levels deep.
MAX_SPEC_DEPTH: Final = 64
# Nodes of a spec once its YAML aliases are expanded: aliases nested a few levels deep
# (an "alias bomb" of a few hundred bytes) would otherwise expand to billions.
MAX_SPEC_NODES: Final = 100_000


def _too_deep() -> str:
    return (
        f"nested more than {MAX_SPEC_DEPTH} levels deep (the bound of a spec); a spec holds "
        "states, not deep data (pass data as inputs)"
    )


class _TooDeep(ValueError):
    """Text nested past MAX_SPEC_DEPTH (as JSON or as YAML)."""


class _SpecLoader(yaml.SafeLoader):
    """PyYAML's safe loader made closer to JSON and YAML 1.2: only true/false are booleans,
    timestamps stay strings, and a key given twice in one mapping is an error (PyYAML would
    silently keep the last). Aliases are counted as what they expand to, and a document
    that would expand past MAX_SPEC_NODES values, or nest past MAX_SPEC_DEPTH levels, is
    refused before anything is built from it. `quote` False: its own errors name no key."""

    def __init__(self, stream: Any, quote: bool = True) -> None:
        super().__init__(stream)
        self.quote = quote
        self._open = 0  # collections being composed around the next node
        # id(node) -> (its values, its levels of collections), once aliases are expanded
        self._sizes: dict[int, tuple[int, int]] = {}

    def compose_node(self, parent: Any, index: Any) -> Any:
        # PyYAML composes a collection's values by recursing: the depth is counted before
        # each level is entered, so no document recurses past the bound.
        opens = self.check_event(yaml.SequenceStartEvent, yaml.MappingStartEvent)
        self._open += opens
        try:
            if self._open > MAX_SPEC_DEPTH:
                raise yaml.composer.ComposerError(
                    None, None, _too_deep(), self.peek_event().start_mark
                )
            node = super().compose_node(parent, index)
        finally:
            self._open -= opens
        if id(node) in self._sizes:  # an alias: the same node again
            return node
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        else:
            self._sizes[id(node)] = (1, 0)
            return node
        known = [self._sizes.get(id(child), (1, 0)) for child in children]
        size = 1 + sum(s for s, _ in known)
        levels = 1 + max((d for _, d in known), default=0)
        if size > MAX_SPEC_NODES:
            raise yaml.composer.ComposerError(
                None,
                None,
                f"the document expands to over {MAX_SPEC_NODES:,} values (YAML aliases "
                "repeat what they name); write the spec out, or make it smaller",
                node.start_mark,
            )
        if levels > MAX_SPEC_DEPTH:  # aliases nest what they name in one another
            raise yaml.composer.ComposerError(None, None, _too_deep(), node.start_mark)
        self._sizes[id(node)] = (size, levels)
        return node

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen: set[str] = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != _MERGE_TAG:
                if key_node.value in seen:
                    raise yaml.constructor.ConstructorError(
                        "while reading a mapping",
                        node.start_mark,
                        f"found the key {key_node.value!r} twice"
                        if self.quote
                        else "found a key twice",
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


def _json_pairs(pairs: list[tuple[str, Any]], quote: bool = True) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(
                f"found the key {key!r} twice in one object" if quote else "found a key twice"
            )
        result[key] = value
    return result


# What matters to the depth of JSON text: brackets, and the quotes and backslashes that
# tell whether a bracket is inside a string. One character at a time, so the scan is
# linear in the text, whatever it holds.
_JSON_MARK = re.compile(r'[\[\]{}"\\]')


def _check_json_depth(text: str) -> None:
    """ValueError when `text`, read as JSON, nests past MAX_SPEC_DEPTH: counted over its
    brackets before it is parsed, as json.loads recurses once per level."""
    if text.count("[") + text.count("{") <= MAX_SPEC_DEPTH:
        return  # too few brackets to nest that deep: a real spec, mostly
    depth = 0
    in_string = False
    escaped = -1  # the position of a character a backslash escapes
    for m in _JSON_MARK.finditer(text):
        at, mark = m.start(), m.group()
        if at == escaped:
            continue
        if in_string:
            if mark == "\\":
                escaped = at + 1
            elif mark == '"':
                in_string = False
        elif mark == '"':
            in_string = True
        elif mark in "[{":
            depth += 1
            if depth > MAX_SPEC_DEPTH:
                line = text.count("\n", 0, at) + 1
                column = at - (text.rfind("\n", 0, at) + 1) + 1
                raise _TooDeep(f"line {line}, column {column}: {_too_deep()}")
        elif mark in "]}":
            depth -= 1


def _check_data_depth(data: Any, label: str) -> None:
    """InvalidSpec when a spec given as a dict nests past MAX_SPEC_DEPTH (a walk without
    recursion; a dict that holds itself is refused too)."""
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, Mapping):
            inner: Any = value.values()
        elif isinstance(value, list | tuple):
            inner = value
        else:
            continue
        if depth > MAX_SPEC_DEPTH:
            raise InvalidSpec(f"invalid flow spec {label}: {_too_deep()}")
        stack.extend((v, depth + 1) for v in inner)


def _parse_json(text: str, quote: bool = True) -> Any:
    """JSON, with duplicate keys refused (NaN is let through for the schema to name)."""
    _check_json_depth(text)
    try:
        return json.loads(text, object_pairs_hook=functools.partial(_json_pairs, quote=quote))
    except json.JSONDecodeError as exc:  # its messages name places, never the text
        raise ValueError(f"line {exc.lineno}, column {exc.colno}: {exc.msg}") from None


# Quoted in one of PyYAML's messages, and kept: the name of one of its own tokens
# ('<block end>') or a single character; anything else quoted is text of the document.
_KEPT_QUOTE = re.compile(r"'<[a-z ]+>'|'.'")


def _unquoted(message: str) -> str:
    """One of PyYAML's messages with what it quotes of the document left out (`…`)."""
    out = []
    i = 0
    while i < len(message):
        quote = message[i]
        if quote not in "'\"":
            j = min((k for k in (message.find("'", i), message.find('"', i)) if k >= 0), default=-1)
            out.append(message[i:] if j < 0 else message[i:j])
            i = len(message) if j < 0 else j
            continue
        j = i + 1
        while j < len(message) and message[j] != quote:
            j += 2 if message[j] == "\\" else 1
        quoted = message[i : j + 1]
        out.append(quoted if _KEPT_QUOTE.fullmatch(quoted) else "…")
        i = j + 1
    return "".join(out)


def _parse_yaml(text: str, quote: bool = True) -> Any:
    try:  # a SafeLoader subclass: safe. Its reader checks every character as it is made.
        loader = _SpecLoader(text, quote)
    except yaml.YAMLError as exc:
        raise ValueError(str(exc) if quote else "a character YAML does not take") from None
    try:
        return loader.get_single_data()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        what = exc.problem or exc.context or "invalid YAML"
        if exc.context and exc.problem:
            what = f"{exc.context}, {exc.problem}"
        error = _TooDeep if what == _too_deep() else ValueError
        raise error(f"{where}{what if quote else _unquoted(what)}") from None
    except yaml.YAMLError as exc:  # the reader's: a character YAML does not take
        raise ValueError(str(exc) if quote else "a character YAML does not take") from None
    finally:
        loader.dispose()


def _read_source(source: str | Path | Mapping[str, Any]) -> tuple[str, Any]:
    """(label, data) of a spec source; raises InvalidSpec when it is not a readable spec."""
    if isinstance(source, Mapping):
        _check_data_depth(source, "(dict)")
        return "(dict)", source
    if isinstance(source, str) and not looks_like_path(source):
        return "(text)", _parse_text(source, "(text)", quote=True)
    if not isinstance(source, str | Path):
        raise InvalidSpec(
            f"a flow spec is a path, YAML or JSON text, or a dict; got {type(source).__name__}"
        )
    path = Path(source)
    label = str(source)
    try:
        raw = _read_bounded(path, label)
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


def _read_bounded(path: Path, label: str) -> bytes:
    """The bytes of the user's spec file, refused past MAX_SPEC_BYTES without reading on
    (a file whose size says nothing, such as a pipe or /dev/zero, is read up to the bound)."""
    with open(path, "rb") as f:  # a directory raises IsADirectoryError
        return read_bounded(f, label)


def _parse_text(text: str, label: str, *, quote: bool) -> Any:
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_SPEC_BYTES:
        raise InvalidSpec(over_bound(label, size))
    return _parse_json_or_yaml(text, label, "fix the syntax", quote=quote)


def _parse_json_or_yaml(text: str, label: str, fix: str, *, quote: bool = True) -> Any:
    """JSON if it parses as JSON, else YAML; InvalidSpec naming both errors otherwise."""
    try:
        return _parse_json(text, quote)
    except ValueError as json_error:
        try:
            return _parse_yaml(text, quote)
        except ValueError as yaml_error:
            if isinstance(json_error, _TooDeep) and isinstance(yaml_error, _TooDeep):
                raise InvalidSpec(f"invalid flow spec {label}: {json_error}") from None
            raise InvalidSpec(
                f"invalid flow spec {label}: neither JSON ({json_error}) nor YAML "
                f"({yaml_error}); {fix}"
            ) from None


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
    follow-on noise. A spec over MAX_SPEC_BYTES or nested more than MAX_SPEC_DEPTH levels
    deep is refused before it is parsed (or as its parser reaches that depth).
    """
    label, data = _read_source(source)
    return _validated(label, data, quote=True)


def load_spec_text(text: str, label: str = "(text)", *, quote: bool = False) -> FlowSpec:
    """Read and validate a flow spec given as YAML or JSON text; never a path, whatever the
    text looks like. Bounded as `load_spec` is, before parsing. With `quote` False (the
    default, for text from model code) each problem is told in the schema's own words: its
    path of key names and indices, and what is wrong, with no value, name or unknown key
    taken from the text (`states[0]: an unknown key (allowed: ...)`)."""
    if not isinstance(text, str):
        raise InvalidSpec(f"a flow spec's text is a str, got {type(text).__name__}")
    return _validated(label, _parse_text(text, label, quote=quote), quote=quote)


def _validated(label: str, data: Any, *, quote: bool) -> FlowSpec:
    if data is None:
        raise InvalidSpec(f"invalid flow spec {label}: it is empty; write states or nodes")
    if not isinstance(data, Mapping):
        got = describe_value(data) if quote else f"a {kind_of(data)}"
        raise InvalidSpec(
            f"invalid flow spec {label}: the spec must be a mapping with states (the state "
            f"form) or nodes (the DAG form), got {got}"
        )
    spec: FlowSpec | None = None
    problems: list[Problem]
    try:
        spec = FlowSpec.model_validate(data)
    except ValidationError as exc:
        problems = schema_problems(exc) + Checker(view_from_raw(data)).run()
    else:
        problems = Checker(view_from_spec(spec)).run()
    raise_problems(label, problems, quote=quote)
    assert spec is not None  # no problem means the schema passed
    return spec

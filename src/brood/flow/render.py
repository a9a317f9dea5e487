"""From inputs to a sub-agent's prompt, and from its answer to its outputs.

`render_prompt` fills a state's prompt template; no input value is ever dropped: an input
the template has no placeholder for is appended under an `## Inputs` heading.

`read_output` takes one declared output from a settled state's answer. The convention a
prompt should teach the model: put each output in a fenced block whose info string is the
type and the output's name, and put it last:

    ```json verdict
    {"ok": true, "score": 7}
    ```

The last block labelled with the name wins (a model that corrects itself repeats the
block); without one the whole answer is the value.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Final

from brood.errors import InvalidArgument, InvalidSpec, OutputError
from brood.flow.template import Placeholder, parse_template

__all__ = ["Block", "OutputError", "fenced_blocks", "read_output", "render_input", "render_prompt"]

INPUTS_HEADING: Final = "## Inputs"

_OPEN = re.compile(r"^[ \t]{0,3}(`{3,}|~{3,})[ \t]*([^`]*?)[ \t]*$")
_WHOLE_FENCE = re.compile(r"\A\s*(`{3,}|~{3,})[ \t]*(?:json)?[ \t]*\n(.*?)\n[ \t]*\1\s*\Z", re.S)


def render_input(name: str, value: Any) -> str:
    """An input value as prompt text: a string as it is, anything else as compact JSON
    (`null` for a missing optional input). Raises InvalidArgument for a value that is not
    JSON (NaN, a set, an object)."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(
            f"input {name!r} is not JSON ({exc}); pass text or JSON values "
            "(null, true/false, numbers, strings, lists, mappings)"
        ) from None


def render_prompt(template: str, inputs: dict[str, Any]) -> str:
    """Fill a prompt template's `{name}` placeholders with `inputs` (see `render_input`;
    `{{`/`}}` are literal braces), then append every input that has no placeholder, in the
    order of `inputs`, as:

        ## Inputs

        ### name
        value

    so that no value is dropped. Raises InvalidSpec for a template with an unmatched brace
    and InvalidArgument for a placeholder that `inputs` does not hold (pass optional inputs
    that have no value as None).
    """
    parts, problems = parse_template(template)
    if problems:
        raise InvalidSpec(f"prompt template: {problems[0]}")
    used: set[str] = set()
    text: list[str] = []
    for part in parts:
        if isinstance(part, Placeholder):
            if part.name not in inputs:
                raise InvalidArgument(
                    f"the prompt has a placeholder {{{part.name}}} but no input of that name "
                    f"was given (inputs: {', '.join(inputs) or 'none'}); pass every declared "
                    "input, None for a missing optional one"
                )
            used.add(part.name)
            text.append(render_input(part.name, inputs[part.name]))
        else:
            text.append(part)
    rendered = "".join(text)
    rest = [name for name in inputs if name not in used]
    if not rest:
        return rendered
    sections = [f"### {name}\n{render_input(name, inputs[name])}" for name in rest]
    head = rendered.rstrip()
    return (f"{head}\n\n" if head else "") + INPUTS_HEADING + "\n\n" + "\n\n".join(sections)


@dataclass(frozen=True)
class Block:
    """A fenced block of an answer: its info string split into words, and its body."""

    info: tuple[str, ...]
    body: str


def fenced_blocks(text: str) -> list[Block]:
    """The fenced blocks (``` or ~~~, three or more) of `text`, in order. A block closes at
    a line of the same fence character at least as long; an unclosed block runs to the end
    of the text (as in CommonMark), since a model may stop before its closing fence."""
    blocks: list[Block] = []
    fence = ""
    info: tuple[str, ...] = ()
    body: list[str] = []
    for line in text.splitlines():
        if not fence:
            if m := _OPEN.match(line):
                fence, info, body = m.group(1), tuple(m.group(2).split()), []
            continue
        stripped = line.strip()
        if stripped and set(stripped) == {fence[0]} and len(stripped) >= len(fence):
            blocks.append(Block(info, "\n".join(body)))
            fence = ""
        else:
            body.append(line)
    if fence:
        blocks.append(Block(info, "\n".join(body)))
    return blocks


def _labelled(block: Block, name: str, kind: str) -> bool:
    """Whether a block carries output `name`: its info string is `NAME`, or `json NAME`
    for a json output, or `LANG NAME` (any language) for a text output."""
    if block.info == (name,):
        return True
    if len(block.info) != 2 or block.info[1] != name:
        return False
    return kind == "text" or block.info[0].lower() == "json"


def _reject_constant(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


def read_output(answer: str, name: str, type: str = "text") -> Any:
    """Output `name` of `type` (`text` or `json`) from a state's final answer, bound as the
    factory executor binds it, so one answer can carry every output of its state.

    json: the answer's fenced blocks are scanned trailing-first; the first that is labelled
    ```` ```json NAME ```` (or ```` ```NAME ````) gives its whole value, and the first
    ```` ```json ```` block whose object holds key NAME gives that key's value. Else the
    whole answer (with one enclosing ```` ```json ```` fence removed if the answer is
    nothing but that block) is parsed: an object holding NAME gives that key's value,
    anything else is the value whole. Strict JSON (NaN and Infinity are refused). Raises
    OutputError naming the output, where it was read from, the line and column of the
    parse error, and how the answer should carry it.

    text: the body of the last block labelled ```` ```NAME ```` or ```` ```LANG NAME ````,
    else the whole answer with surrounding whitespace stripped.
    """
    if type not in ("text", "json"):
        raise InvalidArgument(f"output type must be 'text' or 'json', got {type!r}")
    blocks = fenced_blocks(answer)
    if type == "text":
        labelled = [b for b in blocks if _labelled(b, name, type)]
        return labelled[-1].body if labelled else answer.strip()
    for block in reversed(blocks):
        if _labelled(block, name, type):
            return _parse_output(block.body, name, f"the last ```json {name} block")
        if block.info[:1] == ("json",):
            try:
                value = _loads(block.body)
            except ValueError:
                continue  # not this block: it cannot carry the output
            if isinstance(value, dict) and name in value:
                return value[name]
    if m := _WHOLE_FENCE.match(answer):
        text, where = m.group(2), "the answer's only fenced block"
    else:
        text, where = answer, f"the whole answer (no ```json block carries {name!r})"
    value = _parse_output(text, name, where)
    return value[name] if isinstance(value, dict) and name in value else value


def _loads(text: str) -> Any:
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except RecursionError:  # an answer is model output: it may nest past what Python parses
        raise ValueError(
            "nested deeper than JSON can be read here; keep the output's value shallow"
        ) from None


def _parse_output(text: str, name: str, where: str) -> Any:
    try:
        return _loads(text)
    except json.JSONDecodeError as exc:
        detail = f"{exc.msg} at line {exc.lineno}, column {exc.colno}"
    except ValueError as exc:
        detail = str(exc)
    raise OutputError(
        f"output {name!r} is not valid JSON, read from {where}: {detail}; the answer should "
        f"end with a fenced block ```json holding {{{name!r}: value}} (or ```json {name})"
    )

"""Prompt templates: literal text with `{name}` placeholders; `{{` and `}}` are literal
braces."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

__all__ = ["Placeholder", "parse_template", "placeholders"]

MAX_BRACE_PROBLEMS: Final = 3  # per template; a pasted JSON example would list every brace


@dataclass(frozen=True)
class Placeholder:
    """A `{name}` in a prompt template."""

    name: str


_TEMPLATE_TOKEN = re.compile(r"\{\{|\}\}|\{([A-Za-z_][A-Za-z0-9_-]*)\}|[{}]|[^{}]+")


def parse_template(template: str) -> tuple[list[str | Placeholder], list[str]]:
    """Split a prompt template into literal text and `{name}` placeholders.

    `{{` and `}}` are literal braces. Returns the parts and the problems: each other `{` or
    `}` is one, naming its line and column and the fix (at most MAX_BRACE_PROBLEMS, then a
    count of the rest).
    """
    parts: list[str | Placeholder] = []
    problems: list[str] = []
    stray = 0
    text: list[str] = []
    for m in _TEMPLATE_TOKEN.finditer(template):
        token = m.group(0)
        if m.group(1) is not None:
            if text:
                parts.append("".join(text))
                text = []
            parts.append(Placeholder(m.group(1)))
        elif token in ("{{", "}}"):
            text.append(token[0])
        elif token in ("{", "}"):
            stray += 1
            if stray <= MAX_BRACE_PROBLEMS:
                line = template.count("\n", 0, m.start()) + 1
                column = m.start() - (template.rfind("\n", 0, m.start()) + 1) + 1
                what = "starts no placeholder {name}" if token == "{" else "closes no placeholder"
                problems.append(
                    f"'{token}' at line {line}, column {column} {what}; "
                    f"write '{token * 2}' for a literal brace"
                )
            text.append(token)
        else:
            text.append(token)
    if text:
        parts.append("".join(text))
    if stray > MAX_BRACE_PROBLEMS:
        problems.append(f"and {stray - MAX_BRACE_PROBLEMS} more unmatched braces")
    return parts, problems


def placeholders(template: str) -> list[str]:
    """The names of a template's placeholders, first occurrence order, without repeats."""
    names = [p.name for p in parse_template(template)[0] if isinstance(p, Placeholder)]
    return list(dict.fromkeys(names))

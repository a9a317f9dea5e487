"""The Python API's words in an error, as a user of the `brood` command reads them.

Errors are written once, in the words of the Python API (`Limits.max_depth`,
`Supervisor(model=...)`, `ray_address=None`), because most of them are raised below the
command line. What reaches a person through `brood` names the flag that person sets
instead: `for_cli` rewrites a message with the one table below, at the CLI's boundary.
"""

from __future__ import annotations

import re
from collections.abc import Callable

__all__ = ["LIMIT_FLAGS", "for_cli"]

# The Limits fields a brood command sets from a flag of the same name (`--max-depth`).
# A field with no flag keeps its Python name: there is nothing else to point at.
LIMIT_FLAGS = frozenset(
    {
        "max_depth",
        "max_children",
        "max_concurrency",
        "max_iterations",
        "child_timeout",
        "token_budget",
        "cost_budget",
        "fs_read",
        "fs_write",
        "network",
        "confine",
    }
)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _limit(match: re.Match[str]) -> str:
    """`Limits.NAME`, `Limits.NAME=VALUE` or `Limits(NAME=VALUE)` as its flag."""
    name, value = match["name"], match["value"]
    if name not in LIMIT_FLAGS:
        return match[0]
    if value is None or value == "...":
        return _flag(name)
    return f"{_flag(name)} {value.strip(chr(39) + '[]')}"


Rewrite = tuple[re.Pattern[str], str | Callable[[re.Match[str]], str]]

# In order: the specific phrases first, then the names they contain.
REWRITES: tuple[Rewrite, ...] = (
    (
        re.compile(r"Supervisor\(model=[^)]*\)"),
        "--model SPEC (e.g. openai:MODEL@URL; --model echo tries brood with no server)",
    ),
    (re.compile(r", or pass a chat_fn callable or a brood\.Model"), ""),
    (
        re.compile(r"Supervisor\.resume_conversation\('([^']*)'\)( in a new supervisor)?"),
        r"brood chat --resume \1",
    ),
    (re.compile(r"Supervisor\.resume_conversation(\(run_id\))?"), "brood chat --resume RUN"),
    (re.compile(r"Supervisor\.conversation\(\)"), "brood chat"),
    (re.compile(r"\bray_address=None\b"), "--ray local (a bare --ray)"),
    (re.compile(r"\bray_address\b"), "--ray"),
    (re.compile(r"\bstore='([^']*)'"), r"--store \1"),
    (
        re.compile(r"(?:OpenAI|Anthropic|Gemini)Model\(timeout=\.\.\.\)"),
        "--model-timeout (or ?timeout= of --model)",
    ),
    (re.compile(r"^timeout must be"), "--timeout must be"),
    # A flag left out is its default: the command line has no None to pass.
    (re.compile(r", or None for no limit|; use None for no limit| or None \(no limit\)"), ""),
    (re.compile(r"Limits\((?P<name>\w+)=(?P<value>[^)]*)\)"), _limit),
    (re.compile(r"Limits\.(?P<name>\w+)(?:=(?P<value>\d+(?:,\d{3})*(?:\.\d+)?))?"), _limit),
)


def for_cli(message: str) -> str:
    """`message` with the Python API's names of settings replaced by the flags that set
    them (`Limits.max_depth` -> `--max-depth`); text that names no setting is unchanged."""
    for pattern, replacement in REWRITES:
        message = pattern.sub(replacement, message)
    return message

"""The reference pages of the docs site, generated from the code at build time so that they
cannot drift from it (a MkDocs hook: `hooks:` in mkdocs.yml).

- reference/python.md: every name of `brood.__all__`, through mkdocstrings;
- reference/repl.md: the REPL helpers, from the docstrings the system prompt is built from,
  and the system prompt itself as a model reads it;
- reference/cli.md: every `brood` command's own `--help`;
- reference/http.md: `brood serve`'s OpenAPI document (paths, methods, bodies, answers);
- reference/errors.md: the tree of brood's errors, from their classes.

The build fails, naming each one, when a public object has no docstring summary line (a
name of `brood.__all__`, a public method or property of its classes, a REPL helper, a CLI
command), and when the hand-written table of `Limits` fields in reference/limits.md names a
field `Limits` does not have, leaves one out, or gives a default that is not the field's.

`python docs/hooks.py OUT_DIR` writes the generated pages to OUT_DIR, to read them as
markdown; `python docs/hooks.py --check` runs only the docstring check.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# The sections of reference/python.md, in order; every name of brood.__all__ must be in one.
API_SECTIONS: list[tuple[str, str, list[str]]] = [
    (
        "Supervisor and handles",
        "A supervisor owns trees of runs: it starts them, enforces their limits, journals "
        "them and confirms every worker's exit.",
        ["Supervisor", "RunHandle", "RunResult", "RunInfo", "FlowHandle"],
    ),
    (
        "Conversations",
        "One root REPL and its model history across user turns (`Supervisor.conversation`).",
        ["Conversation"],
    ),
    (
        "Session",
        "A root run a trainer drives step by step (an RL environment), here or on a "
        "`brood serve` elsewhere.",
        ["Session", "Observation", "RemoteSession"],
    ),
    ("Cluster", "Trees on the nodes of a Ray cluster (the `[ray]` extra).", ["Cluster"]),
    (
        "Models",
        "What answers a run's model calls. A spec string (`openai:MODEL@URL`, `echo`, ...) "
        "resolves to one of these.",
        [
            "Model",
            "Completion",
            "CallableModel",
            "OpenAIModel",
            "AnthropicModel",
            "GeminiModel",
            "ScriptedModel",
            "Price",
        ],
    ),
    ("Tools", "The user's functions in every run's REPL.", ["Tool", "tool"]),
    (
        "Run states",
        "The lifecycle of a run: its states and the table of legal moves.",
        ["RunState", "TRANSITIONS"],
    ),
    (
        "Confinement",
        "Names that configure the confinement of model code (see also [Limits](limits.md)).",
        ["PI_RLM_BLOCKED_BUILTINS"],
    ),
]
# Documented on pages of their own.
OWN_PAGES = {"Limits": "limits.md"}


def _summary(obj: object) -> str:
    """The first line of an object's own docstring ("" when it has none: a class's docstring
    is not inherited here, nor is a method's from the method it overrides)."""
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else getattr(obj, "__doc__", None)
    if not isinstance(doc, str):
        return ""
    return inspect.cleandoc(doc).partition("\n")[0].strip()


def _members(cls: type) -> Iterator[tuple[str, object]]:
    """The public methods and properties a class defines itself."""
    for name, value in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(value, property):
            yield name, value.fget
        elif isinstance(value, staticmethod | classmethod):
            yield name, value.__func__
        elif inspect.isfunction(value):
            yield name, value


def missing_docstrings() -> list[str]:
    """Every public object without a docstring summary line, by name."""
    import brood
    from brood import errors
    from brood.worker.verbs import helpers_in_order

    missing = []
    objects: dict[str, object] = {name: getattr(brood, name) for name in brood.__all__}
    objects |= {f"errors.{name}": getattr(errors, name) for name in errors.__all__}
    for name, obj in objects.items():
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue  # a constant: documented where its section says what it is
        if not _summary(obj):
            missing.append(f"brood.{name.removeprefix('errors.')}")
        if inspect.isclass(obj) and obj.__module__.startswith("brood"):
            missing += [
                f"brood.{obj.__name__}.{member}"
                for member, fn in _members(obj)
                if fn is None or not _summary(fn)
            ]
    missing += [
        f"REPL helper {name}" for name, fn in helpers_in_order().items() if not _summary(fn)
    ]
    missing += [
        f"CLI command `brood {' '.join(path)}`"
        for path, command in _cli_commands()
        if not (command.help or command.short_help or "").strip()
    ]
    return sorted(set(missing))


def _table_value(text: str) -> object:
    """A default as the Limits table writes it: a Python literal, or `N GiB` / `N MiB`."""
    size = re.fullmatch(r"(\d+) (GiB|MiB)", text)
    if size:
        return int(size.group(1)) * (2**30 if size.group(2) == "GiB" else 2**20)
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def limits_table_problems(page: str) -> list[str]:
    """What the hand-written table of `Limits` (rows `| NAME | DEFAULT | MEANING |`) gets
    wrong: a field `Limits` does not have, a field it leaves out, a default that is not the
    field's."""
    from brood import Limits

    real = {
        f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
        for f in dataclasses.fields(Limits)
    }
    named: set[str] = set()
    problems = []
    for match in re.finditer(r"^\| `([a-z_]+)`(?: / `([a-z_]+)`)? \| `([^`]*)` \|", page, re.M):
        default = _table_value(match.group(3))
        for name in filter(None, match.groups()[:2]):
            named.add(name)
            if name in real and default != real[name]:
                problems.append(
                    f"the Limits table gives `{name}` the default `{match.group(3)}`; "
                    f"it is {real[name]!r}"
                )
    problems += [
        f"the Limits table names `{name}`, which Limits has no field of"
        for name in sorted(named - real.keys())
    ]
    problems += [
        f"the Limits table leaves out the field `{name}`" for name in sorted(real.keys() - named)
    ]
    return problems


# ---- the Python API ---------------------------------------------------------------------------


def python_page() -> str:
    import brood
    from brood import errors

    placed = [name for _, _, names in API_SECTIONS for name in names] + list(OWN_PAGES)
    placed += [name for name in errors.__all__ if name in brood.__all__]  # errors.md
    unplaced = sorted(set(brood.__all__) - set(placed))
    gone = sorted(set(placed) - set(brood.__all__))
    if unplaced or gone:
        raise RuntimeError(
            "docs/hooks.py API_SECTIONS is out of step with brood.__all__: "
            f"not placed: {unplaced}; not public: {gone}"
        )
    lines = [
        "# Python API",
        "",
        "Generated from the docstrings of every name `import brood` exports "
        "(`brood.__all__`). [`Limits`](limits.md) and the [errors](errors.md) have pages "
        "of their own.",
        "",
    ]
    for title, intro, names in API_SECTIONS:
        lines += [f"## {title}", "", intro, ""]
        for name in names:
            lines += [f"::: brood.{name}", ""]
    return "\n".join(lines)


# ---- the errors -------------------------------------------------------------------------------


def _first_sentence(obj: object) -> str:
    paragraph = inspect.cleandoc(getattr(obj, "__doc__", None) or "").split("\n\n")[0]
    return re.split(r"(?<=\.)\s", " ".join(paragraph.split()))[0]


def errors_page() -> str:
    """The tree of brood's errors, from their classes, then each class's docstring."""
    from brood import errors

    classes = [getattr(errors, name) for name in errors.__all__]
    classes = [c for c in classes if inspect.isclass(c) and issubclass(c, errors.BroodError)]
    lines = [
        "# Errors",
        "",
        "Generated from `brood.errors`: every error brood raises on purpose.",
        "",
    ]
    tree = ["```text"]

    def walk(cls: type, depth: int) -> None:
        also = [b.__name__ for b in cls.__bases__ if not issubclass(b, errors.BroodError)]
        also = [] if cls is errors.BroodError else also
        name = cls.__name__ + (f" (also {', '.join(also)})" if also else "")
        tree.append(f"{'    ' * depth}{name:<{40 - 4 * depth}} {_first_sentence(cls)}")
        for sub in sorted((c for c in classes if cls in c.__bases__), key=classes.index):
            walk(sub, depth + 1)

    walk(errors.BroodError, 0)
    lines += [*tree, "```", "", "## The classes", "", "::: brood.errors", "    options:"]
    lines += ["      heading_level: 3", ""]
    return "\n".join(lines)


# ---- the REPL helpers -------------------------------------------------------------------------


def repl_page() -> str:
    from brood.worker import prompt
    from brood.worker.verbs import helpers_in_order
    from brood.worker.verbs.base import model_signature

    lines = [
        "# REPL helpers",
        "",
        "The functions every run's REPL holds, generated from the docstrings the model reads: "
        "brood builds each run's system prompt from these same texts "
        "(`brood.worker.prompt`), so this page and the prompt cannot differ. "
        "The helpers are listed in the prompt's order.",
        "",
    ]
    for name, fn in helpers_in_order().items():
        signature = str(model_signature(fn)).replace("'", "")
        doc = inspect.cleandoc(fn.__doc__ or "")
        lines += [f"## `{name}`", "", "```python", f"{name}{signature}", "```", "", "```text"]
        lines += [doc, "```", ""]
    lines += [
        "## The system prompt",
        "",
        "What a run that may start children reads first, whole (a run's prompt then adds "
        "its tools, its context's shape and its budget):",
        "",
        "````text",
        prompt.cached_system_prompt(True),
        "````",
        "",
    ]
    return "\n".join(lines)


# ---- the CLI ----------------------------------------------------------------------------------


def _cli_commands() -> list[tuple[tuple[str, ...], Any]]:
    """Every `brood` command and group, depth first, by its path of names."""
    import typer.main

    from brood.cli.main import app

    found: list[tuple[tuple[str, ...], Any]] = []

    def walk(path: tuple[str, ...], command: Any) -> None:
        found.append((path, command))
        for name, sub in (getattr(command, "commands", None) or {}).items():  # a group's
            walk((*path, name), sub)

    walk((), typer.main.get_command(app))
    return found


def cli_help(path: tuple[str, ...]) -> str:
    """`brood PATH --help` as it prints, 100 columns wide, without colour."""
    from typer.testing import CliRunner

    from brood.cli.main import app

    env = {"COLUMNS": "100"}
    out = CliRunner().invoke(app, [*path, "--help"], env=env, prog_name="brood")
    if out.exit_code != 0:
        raise RuntimeError(f"`brood {' '.join(path)} --help` failed: {out.output}")
    return "\n".join(line.rstrip() for line in out.output.splitlines()).strip("\n")


def cli_page() -> str:
    lines = [
        "# Command line",
        "",
        "Every `brood` command's own `--help`, generated at build time "
        "(`-h` is `--help` on every command).",
        "",
    ]
    for path, _ in _cli_commands():
        title = " ".join(("brood", *path))
        lines += [f"## `{title}`", "", "```text", cli_help(path), "```", ""]
    return "\n".join(lines)


# ---- the HTTP API -----------------------------------------------------------------------------


def _schema(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=2, ensure_ascii=False)


def http_page() -> str:
    from brood.serve.schema import openapi

    doc = openapi()
    lines = [
        "# HTTP API",
        "",
        "`brood serve`'s endpoints, generated from the OpenAPI document the server itself "
        "serves at `GET /openapi.json` (`brood.serve.schema.openapi`). Every call needs "
        "`Authorization: Bearer TOKEN`; see [brood serve behind a reverse "
        "proxy](../how-to/serve.md).",
        "",
        f"OpenAPI {doc['openapi']}, {doc['info']['title']} {doc['info']['version']}: "
        f"{doc['info'].get('description', '')}",
        "",
    ]
    errors: dict[str, str] = {}
    for path, operations in doc["paths"].items():
        for method, op in operations.items():
            lines += [f"## `{method.upper()} {path}`", "", op.get("summary", "") + ".", ""]
            if op.get("description"):
                lines += [op["description"], ""]
            params = op.get("parameters", [])
            if params:
                lines += ["| parameter | in | schema | |", "|---|---|---|---|"]
                for p in params:
                    schema = json.dumps(p.get("schema", {}))
                    what = p.get("description", "")
                    lines.append(f"| `{p['name']}` | {p['in']} | `{schema}` | {what} |")
                lines.append("")
            body = op.get("requestBody")
            if body:
                for kind, content in body.get("content", {}).items():
                    lines += [f"Request body (`{kind}`):", "", "```json"]
                    lines += [_schema(content.get("schema", {})), "```", ""]
            for status, answer in op.get("responses", {}).items():
                if not status.startswith("2"):
                    errors.setdefault(status, answer.get("description", ""))
                    continue
                lines += [f"**{status}**: {answer.get('description', '')}", ""]
                for kind, content in answer.get("content", {}).items():
                    lines += [f"`{kind}`:", "", "```json", _schema(content.get("schema", {}))]
                    lines += ["```", ""]
    lines += [
        "## Errors",
        "",
        "Every error answer is JSON of this shape:",
        "",
        "```json",
        _schema(doc["components"]["schemas"]["Error"]),
        "```",
        "",
        "| status | when |",
        "|---|---|",
    ]
    lines += [f"| {status} | {what} |" for status, what in sorted(errors.items())]
    return "\n".join([*lines, ""])


# ---- the hook ---------------------------------------------------------------------------------

PAGES: dict[str, Callable[[], str]] = {
    "reference/python.md": python_page,
    "reference/repl.md": repl_page,
    "reference/cli.md": cli_page,
    "reference/http.md": http_page,
    "reference/errors.md": errors_page,
}


def hand_part(page: str) -> str:
    """The hand-written part of a generated page (docs/reference/_NAME.md for NAME.md): what
    the code does not say of itself, placed after the page's opening paragraph."""
    path = Path(__file__).resolve().parent / page.replace("reference/", "reference/_")
    return path.read_text(encoding="utf-8") if path.is_file() else ""


def with_hand_part(page: str, text: str) -> str:
    head, sep, rest = text.partition("\n\n## ")
    part = hand_part(page)
    if not part or not sep:
        return text + part
    return f"{head}\n\n{part.rstrip()}\n\n## {rest}"


def on_files(files: Any, config: Any) -> Any:
    """Fail the build on a missing docstring, then add the generated pages."""
    from mkdocs.exceptions import PluginError
    from mkdocs.structure.files import File

    problems = [f"{name} has no docstring summary line" for name in missing_docstrings()]
    limits = Path(config["docs_dir"]) / "reference" / "limits.md"
    problems += limits_table_problems(limits.read_text(encoding="utf-8"))
    if problems:
        raise PluginError("the reference cannot be generated:\n  " + "\n  ".join(problems))
    for path, make in PAGES.items():
        try:
            content = with_hand_part(path, make())
        except RuntimeError as exc:
            raise PluginError(f"{path}: {exc}") from exc
        files.append(File.generated(config, path, content=content))
    return files


def main(argv: list[str]) -> int:
    missing = missing_docstrings()
    for name in missing:
        print(f"{name} has no docstring summary line", file=sys.stderr)
    if argv[1:] == ["--check"]:
        return 1 if missing else 0
    out = Path(argv[1] if len(argv) > 1 else "site-reference")
    for path, make in PAGES.items():
        (out / path).parent.mkdir(parents=True, exist_ok=True)
        (out / path).write_text(with_hand_part(path, make()), encoding="utf-8")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

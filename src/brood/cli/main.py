"""`brood` commands: run, demo."""

from __future__ import annotations

import json
import os
import sys
from importlib import resources
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.tree import Tree

import brood
from brood.models.demo import ROOT_TASK

app = typer.Typer(
    help="brood: run recursive language models with managed child runs.",
    no_args_is_help=True,
    add_completion=False,
)
DEFAULT_STORE = "sqlite:///.brood/brood.db"
STATE_STYLE = {
    "completed": "green",
    "failed": "red",
    "cancelled": "yellow",
    "timed_out": "magenta",
    "running": "cyan",
    "queued": "dim",
    "cancelling": "yellow",
}

StoreOpt = Annotated[str | None, typer.Option("--store", help="journal URL (or BROOD_STORE)")]


def _store(url: str | None) -> str:
    return url or os.environ.get("BROOD_STORE") or DEFAULT_STORE


def _fail(message: str, code: int = 2) -> None:
    print(f"error: {message}", file=sys.stderr)  # plain: a message must not be re-wrapped
    raise typer.Exit(code)


def render_tree(runs: list[dict[str, Any]], root_id: str) -> Tree:
    """A rich tree of a journaled tree of runs, with states and times."""
    by_parent: dict[str | None, list[dict[str, Any]]] = {}
    for r in runs:
        by_parent.setdefault(r["parent_id"], []).append(r)

    def label(r: dict[str, Any]) -> str:
        style = STATE_STYLE.get(r["state"], "")
        took = ""
        if r["started_at"] and r["ended_at"]:
            took = f" {r['ended_at'] - r['started_at']:.2f}s"
        why = f" ({r['reason']})" if r["reason"] and r["state"] != "completed" else ""
        prompt = r["prompt"] if len(r["prompt"]) <= 60 else r["prompt"][:57] + "..."
        return f"[bold]{r['id']}[/bold] [{style}]{r['state']}[/{style}]{took}{why}  {prompt}"

    root = next(r for r in runs if r["id"] == root_id)
    tree = Tree(label(root))

    def add(node: Tree, run_id: str) -> None:
        for child in by_parent.get(run_id, []):
            add(node.add(label(child)), child["id"])

    add(tree, root_id)
    return tree


@app.command()
def run(
    prompt: Annotated[str, typer.Argument(help="the task")],
    context: Annotated[
        Path | None, typer.Option(help="a file whose text becomes `context`")
    ] = None,
    model: Annotated[
        str | None, typer.Option(help="model spec, e.g. openai:MODEL@URL (or BROOD_MODEL)")
    ] = None,
    store: StoreOpt = None,
    max_depth: Annotated[int | None, typer.Option(help="run levels including the root")] = None,
    max_children: Annotated[int | None, typer.Option(help="child runs in the tree")] = None,
    max_concurrency: Annotated[int | None, typer.Option(help="runs computing at once")] = None,
    max_iterations: Annotated[int | None, typer.Option(help="model turns per run")] = None,
    child_timeout: Annotated[float | None, typer.Option(help="seconds per child run")] = None,
    timeout: Annotated[float | None, typer.Option(help="seconds for the whole run")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the RunResult as JSON")] = False,
) -> None:
    """Run PROMPT as a root run and print its answer."""
    text = None
    if context is not None:
        try:
            text = context.read_text()
        except OSError as exc:
            _fail(f"--context {context}: {exc.strerror}")
    given: dict[str, Any] = {
        "max_depth": max_depth,
        "max_children": max_children,
        "max_concurrency": max_concurrency,
        "max_iterations": max_iterations,
        "child_timeout": child_timeout,
    }
    try:
        limits = brood.Limits(**{k: v for k, v in given.items() if v is not None})
        with brood.Supervisor(
            model or os.environ.get("BROOD_MODEL"), limits=limits, store=_store(store)
        ) as sup:
            result = sup.run(prompt, context=text, timeout=timeout)
    except brood.BroodError as exc:
        _fail(str(exc))
        return
    if as_json:
        print(json.dumps(result._asdict()))
    elif result.state == "completed":
        print(result.answer)
    if result.state != "completed":
        _fail(f"run {result.run_id} {result.state}: {result.error}", code=1)


@app.command()
def demo(store: StoreOpt = None) -> None:
    """A built-in scenario on a scripted model: a root fans out to children without
    blocking, keeps working, collects them, cancels one, and answers."""
    console = Console()
    notes = resources.files("brood").joinpath("data/field_notes.md").read_text()
    limits = brood.Limits(max_depth=2, max_concurrency=4, shutdown_grace=0.5, term_grace=0.5)
    console.print(f"[bold]task:[/bold] {ROOT_TASK}")
    with brood.Supervisor("scripted:demo", limits=limits, store=_store(store)) as sup:
        result = sup.run(ROOT_TASK, context=notes)
        runs = sup.store.runs(result.run_id)
    console.print(render_tree(runs, result.run_id))
    console.print(f"[bold]answer:[/bold] {result.answer}")
    if result.state != "completed":
        _fail(f"the demo's root {result.state}: {result.error}", code=1)


def main() -> None:  # pragma: no cover - console entry
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())

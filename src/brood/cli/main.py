"""`brood`: run trees of runs and watch them from the terminal.

Every read command reads the journal (`--store URL` or BROOD_STORE, default
sqlite:///.brood/brood.db), so it works from another terminal while a tree runs and after
it ended, and never changes the journal. `--json` prints only JSON on stdout.
"""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, NoReturn

import typer
from rich.console import Group
from rich.live import Live
from rich.table import Table
from rich.tree import Tree

import brood
from brood.api import os_user
from brood.cli.interrupt import EXIT_CODE as INTERRUPTED
from brood.cli.interrupt import Interrupt, interruptible
from brood.cli.terminal import Terminal, clean, echo, literal, plain, print_json
from brood.cli.words import for_cli
from brood.errors import install_hint
from brood.exports import EXPORT_FORMATS, write_jsonl
from brood.journal import Journal, default_store_url
from brood.lifecycle import FLOW_ENDED, TERMINAL_VALUES, FlowStatus
from brood.limits import MOST_WORKERS, WORKER_SHARE, check_timeout
from brood.models import resolve_model
from brood.models.demo import ROOT_TASK
from brood.models.prices import Price, cost_text, dollars, parse_price
from brood.protocol import MAX_CONTEXT_BYTES

if TYPE_CHECKING:
    from brood.cluster import ClusterFlowHandle, ClusterHandle

# Every command takes -h as well as --help. Help texts are Markdown: typer joins the lines
# of a paragraph and rich wraps it to the terminal, so a docstring's own line breaks never
# break a sentence on screen (and `[ray]` is text, not a rich style).
CONTEXT = {"help_option_names": ["-h", "--help"]}
HELP_MARKUP: Literal["markdown"] = "markdown"
app = typer.Typer(
    help="brood: run recursive language models with managed child runs.",
    no_args_is_help=True,
    context_settings=CONTEXT,
    rich_markup_mode=HELP_MARKUP,
)
REFRESH_S = 0.25  # how often live views and --follow re-read the journal
STATE_STYLE = {
    "completed": "green",
    "failed": "red",
    "cancelled": "yellow",
    "timed_out": "magenta",
    "running": "cyan",
    "queued": "dim",
    "cancelling": "yellow",
}

StoreOpt = Annotated[
    str | None,
    typer.Option("--store", metavar="URL", help="journal URL (default: BROOD_STORE or .brood)"),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="print JSON only")]
RAY_HERE = "local"  # --ray with no address: a Ray started here, for this command
RayOpt = Annotated[
    str | None,
    typer.Option(
        "--ray",
        help="run on a Ray cluster: its head's HOST:PORT, 'auto', or 'local' (a bare --ray: "
        "one started here); several nodes need a Postgres --store (the [ray] extra)",
    ),
]
ToolOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--tool",
        metavar="MODULE:FUNCTION",
        help="a function of yours placed in every run's REPL, run by the supervisor "
        "(importable from here; repeatable)",
    ),
]
McpOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--mcp",
        metavar="CMD|URL",
        help="an MCP server whose tools join every run's REPL: a command (quoted, started "
        "here) or a streamable-HTTP URL, either after NAME= (repeatable; the [mcp] extra)",
    ),
]
RunArg = Annotated[str, typer.Argument(metavar="RUN", help="a run id, e.g. r-8f3a2c")]
FsReadOpt = Annotated[
    list[Path] | None,
    typer.Option("--fs-read", metavar="PATH", help="a path model code may also read (repeatable)"),
]
FsWriteOpt = Annotated[
    list[Path] | None,
    typer.Option(
        "--fs-write", metavar="PATH", help="a path model code may also read and write (repeatable)"
    ),
]
NetworkOpt = Annotated[
    bool, typer.Option("--network", help="let model code open network connections")
]
ConfineOpt = Annotated[
    bool,
    typer.Option(
        "--confine/--no-confine",
        help="confine model code (the default); --no-confine is for trusted code only",
    ),
]


ModelTimeoutOpt = Annotated[
    float | None,
    typer.Option(
        "--model-timeout", help="seconds of one try of a model call (default 120, 3 tries)"
    ),
]


PriceOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--price",
        metavar="IN,OUT",
        help="the model's price in dollars per million input and output tokens, e.g. "
        "0.15,0.6 (MODEL=IN,OUT prices another model; repeatable); without it, the price "
        "genai-prices knows, else the cost is unknown",
    ),
]


def _prices(given: list[str] | None, spec: str | None) -> dict[str, Price] | None:
    """The --price options as `prices` by model name: `IN,OUT` is the price of the
    command's own model (the spec, or BROOD_MODEL), `MODEL=IN,OUT` another's."""
    if not given:
        return None
    prices: dict[str, Price] = {}
    for text in given:
        name, price = parse_price(text)
        if name is None:
            spec = spec or os.environ.get("BROOD_MODEL")
            if spec is None:
                raise brood.InvalidArgument(
                    f"--price {text!r} prices the command's model, and there is none: pass "
                    "--model SPEC (or set BROOD_MODEL), or write --price MODEL=IN,OUT"
                )
            name = resolve_model(spec).name or spec
        prices[name] = price
    return prices


ROOT_TIMEOUT_S = 3600.0  # brood run's default bound on a tree: never unbounded by mistake


def _model(spec: str | None, timeout: float | None) -> str | None:
    """The model spec (or BROOD_MODEL), with --model-timeout folded into it."""
    spec = spec or os.environ.get("BROOD_MODEL")
    if timeout is None or spec is None:
        return spec
    if not spec.startswith(("openai:", "anthropic:", "gemini:")):
        raise brood.InvalidArgument(
            f"--model-timeout applies to openai:, anthropic: and gemini: models, not "
            f"{spec!r}; a chat_fn bounds its own calls"
        )
    return f"{spec}{'&' if '?' in spec else '?'}timeout={timeout!r}"


def _confinement(
    fs_read: list[Path] | None, fs_write: list[Path] | None, network: bool, confine: bool
) -> dict[str, Any]:
    """The Limits fields the confinement options set (DESIGN.md section 14)."""
    return {
        "fs_read": tuple(str(p) for p in fs_read or ()),
        "fs_write": tuple(str(p) for p in fs_write or ()),
        "network": network,
        "confine": confine,
    }


def _fail(message: str, code: int = 2) -> None:
    echo(f"error: {message}", err=True)  # plain: a message must not be re-wrapped
    raise typer.Exit(code)


def _refused(exc: BaseException, code: int = 2) -> None:
    """Fail with an error raised below the command line, in the words of its flags."""
    _fail(for_cli(str(exc)), code)


@contextmanager
def _journal(store: str | None) -> Iterator[Journal]:
    try:
        journal = Journal(store or default_store_url())
    except brood.BroodError as exc:
        _refused(exc)
        raise  # unreachable: _fail exits
    try:
        yield journal
    except brood.BroodError as exc:
        _refused(exc)
    finally:
        journal.close()


# ---- rendering ---------------------------------------------------------------------------
def _secs(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 1:
        return f"{value * 1000:.0f}ms"
    return f"{value:.1f}s" if value < 100 else f"{value / 60:.1f}m"


def _usage_text(u: dict[str, Any]) -> str:
    tokens = int(u.get("input_tokens", 0)) + int(u.get("output_tokens", 0))
    return f"{int(u.get('model_calls', 0))} calls, {tokens} tok, {cost_text(u)}"


def _state_text(run: dict[str, Any]) -> str:
    style = STATE_STYLE.get(run["state"], "")
    stale = " [red](stale)[/red]" if run.get("stale") else ""
    asks = run.get("waiting_for")
    waiting = literal(", ".join(asks or ()))
    person = f" [magenta](waiting for a person: {waiting})[/magenta]" if asks else ""
    # A run asleep for a long wait, or a tree with some (`brood ps`).
    n = run.get("hibernating_runs", 0)
    sleeping = " [blue](hibernating)[/blue]" if run.get("hibernating") else ""
    sleeping += f" [blue]({n} hibernating)[/blue]" if n and not run.get("hibernating") else ""
    return f"[{style}]{run['state']}[/{style}]{stale}{person}{sleeping}"


def _short(text: str | None, n: int = 60) -> str:
    """Model text on one line of at most `n` characters, for rich markup."""
    text = " ".join(clean(text or "").split())
    return literal(text if len(text) <= n else text[: n - 3] + "...")


def render_tree(node: dict[str, Any]) -> Tree:
    """A rich tree of runs: state, depth, duration, model calls, tokens, last output."""

    def label(r: dict[str, Any]) -> str:
        reason = _why(r["state"], r["reason"])
        why = f" ({literal(reason)})" if reason else ""
        own, sub = r["usage"], r["subtree_usage"]
        usage = _usage_text(own)
        if r["children"]:
            usage += f"; subtree {_usage_text(sub)}"
        line = f"  [dim]» {_short(r['last_line'], 50)}[/dim]" if r.get("last_line") else ""
        attempt = f" attempt {r['attempt'] + 1}" if r.get("attempt") else ""
        pool = f" [dim]pool {literal(r['pool'])}[/dim]" if r.get("pool") else ""
        return (
            f"[bold]{r['id']}[/bold]{attempt} {_state_text(r)}{why}{pool} d{r['depth']} "
            f"{_secs(r['duration'])} [dim]{usage}[/dim]  {_short(r['prompt'])}{line}"
        )

    tree = Tree(label(node))
    stack = [(tree, node)]
    while stack:
        branch, run = stack.pop()
        for child in run["children"]:
            stack.append((branch.add(label(child)), child))
    return tree


def _report(result: brood.RunResult, as_json: bool, url: str) -> None:
    """Print how a run ended: its answer (or the RunResult as JSON), and on stderr why it
    ended when it completed other than by FINAL; exit 1 unless it completed."""
    if as_json:
        print_json(result._asdict())
    elif result.state == "completed":
        echo(result.answer)
        try:
            with Journal(url) as journal:
                reason = journal.run(result.run_id)["reason"]
        except brood.BroodError:  # a journal of this process only (sqlite:///:memory:)
            reason = None
        if why := _why(result.state, reason):
            echo(f"note: run {result.run_id} completed ({_explained(why)})", err=True)
    if result.state != "completed":
        _fail(for_cli(f"run {result.run_id} {result.state}: {result.error}"), code=1)


# How a run that completed other than by the model's FINAL came to its answer.
ENDINGS = {
    "answer after max_iterations": "no FINAL within its model turns (--max-iterations); "
    "the answer is its reply when told to answer at once",
}
PLAIN_ENDS = frozenset({"answer", "flow finished"})  # a completed run's usual reasons


def _why(state: str, reason: str | None) -> str | None:
    """The reason a run ended, when it is worth saying: always unless it completed the
    usual way."""
    if not reason or (state == "completed" and reason in PLAIN_ENDS):
        return None
    return reason


def _explained(reason: str) -> str:
    """A reason with what it means, where it needs saying."""
    return f"{reason}: {ENDINGS[reason]}" if reason in ENDINGS else reason


def _runner(
    model: str | None,
    limits: brood.Limits,
    url: str,
    ray: str | None,
    prices: dict[str, Price] | None = None,
    tools: list[str] | None = None,
    mcp: list[str] | None = None,
) -> brood.Supervisor | brood.Cluster:
    """A local supervisor, or with --ray a cluster on the Ray cluster at that address
    (`local`: one started here for this command)."""
    if ray is None:
        return brood.Supervisor(
            model, limits=limits, store=url, prices=prices, tools=tools, mcp_servers=mcp
        )
    if tools or mcp:
        raise brood.InvalidArgument("--tool and --mcp run with a local supervisor only; drop --ray")
    if model is None and not os.environ.get("BROOD_MODEL"):
        raise brood.InvalidArgument(
            "no model: pass --model SPEC (e.g. openai:MODEL@URL), or set BROOD_MODEL"
        )
    address = None if ray == RAY_HERE else ray
    return brood.Cluster(
        model or os.environ["BROOD_MODEL"],
        store=url,
        ray_address=address,
        limits=limits,
        prices=prices,
    )


def _watch(
    handle: brood.RunHandle | ClusterHandle, url: str, live: bool, interrupt: Interrupt
) -> brood.RunResult:
    """Draw the live tree while the run goes (on a terminal), then its RunResult. At Ctrl-C,
    the run is cancelled (its whole tree, every exit confirmed) and the command exits 130."""
    if live and sys.stderr.isatty():
        with Journal(url) as journal:
            _live_tree(journal, handle.id, lambda: handle.done, interrupt)
    result = None if interrupt.hit else interrupt.result_of(handle.wait_result)
    if result is None or interrupt.hit:
        _cancel_interrupted(handle, interrupt)
    assert result is not None
    return result


def _stop_if_interrupted(interrupt: Interrupt) -> None:
    """Ctrl-C while the supervisor started: no run was started; the supervisor closes."""
    if interrupt.hit:
        Terminal(stderr=True).print("interrupted before the run started")
        raise typer.Exit(INTERRUPTED)


def _cancel_interrupted(handle: brood.RunHandle | ClusterHandle, interrupt: Interrupt) -> NoReturn:
    interrupt.cleaning = True
    state = handle.cancel()
    Terminal(stderr=True).print(f"interrupted: {handle.id} {state}")
    raise typer.Exit(INTERRUPTED)


def _live_tree(
    journal: Journal, run_id: str, done: Callable[[], bool], interrupt: Interrupt
) -> None:
    """Redraw the tree on stderr until `done()` or Ctrl-C."""
    console = Terminal(stderr=True)
    with Live(console=console, refresh_per_second=8, transient=False) as live:
        while True:
            finished = done()
            live.update(render_tree(journal.tree(run_id)))
            if finished or interrupt.wait(REFRESH_S):
                return


def _print_version(asked: bool) -> None:
    if asked:
        echo(f"brood {brood.__version__}")
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_print_version, is_eager=True, help="print brood's version"
        ),
    ] = False,
) -> None:
    """brood: run recursive language models with managed child runs."""


# ---- commands: running ---------------------------------------------------------------------
def _context_text(context: Path | None) -> str | None:
    """The text of --context FILE (None without it); fails naming the file and the fix."""
    if context is None:
        return None
    try:
        size = context.stat().st_size
        if size > MAX_CONTEXT_BYTES:  # refused before a byte is read or journaled
            _fail(
                f"--context {context}: {size:,} bytes, over the {MAX_CONTEXT_BYTES:,}-byte "
                "bound of a run's context; pass less, or let the run read the file "
                "(--fs-read PATH)"
            )
        return context.read_bytes().decode("utf-8")
    except OSError as exc:
        _fail(f"--context {context}: {exc.strerror}")
    except UnicodeDecodeError as exc:
        _fail(
            f"--context {context}: not UTF-8 text (byte {exc.start}); `context` is text: "
            "pass a text file, or decode the data first"
        )
    return None


@app.command()
def run(
    prompt: Annotated[str, typer.Argument(metavar="PROMPT", help="the task")],
    context: Annotated[
        Path | None, typer.Option(help="a file whose text becomes `context`")
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(
            help="model spec: openai:MODEL@URL, python:MODULE:FUNCTION, echo (needs no "
            "server), … (or BROOD_MODEL)"
        ),
    ] = None,
    store: StoreOpt = None,
    max_depth: Annotated[int | None, typer.Option(help="run levels including the root")] = None,
    max_children: Annotated[int | None, typer.Option(help="child runs in the tree")] = None,
    max_concurrency: Annotated[int | None, typer.Option(help="runs computing at once")] = None,
    max_iterations: Annotated[int | None, typer.Option(help="model turns per run")] = None,
    compact_at: Annotated[
        int | None,
        typer.Option(
            help="compact a run's history past this size: the prompt tokens the model "
            "reports, else characters (Limits.compact_at)"
        ),
    ] = None,
    child_timeout: Annotated[float | None, typer.Option(help="seconds per child run")] = None,
    token_budget: Annotated[int | None, typer.Option(help="tokens for the whole tree")] = None,
    cost_budget: Annotated[
        float | None,
        typer.Option(help="dollars for the whole tree, counted from the calls' prices"),
    ] = None,
    timeout: Annotated[
        float, typer.Option(help="wall-clock seconds for the whole tree (a number > 0)")
    ] = ROOT_TIMEOUT_S,
    fs_read: FsReadOpt = None,
    fs_write: FsWriteOpt = None,
    network: NetworkOpt = False,
    confine: ConfineOpt = True,
    model_timeout: ModelTimeoutOpt = None,
    price: PriceOpt = None,
    live: Annotated[bool, typer.Option(help="show the live tree on stderr")] = True,
    as_json: JsonOpt = False,
    ray: RayOpt = None,
    tool: ToolOpt = None,
    mcp: McpOpt = None,
) -> None:
    """Run PROMPT as a root run, show its tree live, and print its answer."""
    text = _context_text(context)
    given: dict[str, Any] = {
        "max_depth": max_depth,
        "max_children": max_children,
        "max_concurrency": max_concurrency,
        "max_iterations": max_iterations,
        "compact_at": compact_at,
        "child_timeout": child_timeout,
        "token_budget": token_budget,
        "cost_budget": cost_budget,
    }
    url = store or default_store_url()
    try:
        limits = brood.Limits(
            **{k: v for k, v in given.items() if v is not None},
            **_confinement(fs_read, fs_write, network, confine),
        )
        spec = _model(model, model_timeout)
        prices = _prices(price, spec)
        with interruptible() as interrupt:
            runner = _runner(spec, limits, url, ray, prices, tool, mcp)
            with runner:
                _stop_if_interrupted(interrupt)
                handle = runner.spawn(prompt, context=text, timeout=timeout)
                result = _watch(handle, url, live, interrupt)
    except brood.BroodError as exc:
        _refused(exc)
        return
    _report(result, as_json, url)


@app.command()
def resume(
    run_id: RunArg,
    model: Annotated[
        str | None,
        typer.Option(
            help="model spec for the live part (default: the spec the tree was started "
            "with, as journaled; else BROOD_MODEL)"
        ),
    ] = None,
    store: StoreOpt = None,
    fs_read: FsReadOpt = None,
    fs_write: FsWriteOpt = None,
    network: NetworkOpt = False,
    confine: ConfineOpt = True,
    model_timeout: ModelTimeoutOpt = None,
    price: PriceOpt = None,
    live: Annotated[bool, typer.Option(help="show the live tree on stderr")] = True,
    as_json: JsonOpt = False,
    tool: ToolOpt = None,
    mcp: McpOpt = None,
) -> None:
    """Resume a crashed tree from its journal: replay what was recorded (no new model calls
    for it, journaled children adopted, not started again), then go on live. Pass the
    --tool and --mcp options the tree was started with."""
    url = store or default_store_url()
    try:
        limits = brood.Limits(**_confinement(fs_read, fs_write, network, confine))
        spec = _model(model or _journaled_model(url, run_id), model_timeout)
        prices = _prices(price, spec)
        with (
            interruptible() as interrupt,
            brood.Supervisor(
                spec, limits=limits, store=url, prices=prices, tools=tool, mcp_servers=mcp
            ) as sup,
        ):
            _stop_if_interrupted(interrupt)
            handle = sup.resume(run_id)
            if handle.id in sup.flows():  # a flow's own tree: say where it stands
                status = sup.flow(handle.id).status()["status"]
                paused = status == FlowStatus.PAUSED
                hint = f"; `brood flow resume {handle.id}` lets it go on" * paused
                Terminal(stderr=True).print(f"flow {handle.id} resumed, {status}{hint}")
            result = _watch(handle, url, live, interrupt)
            try:
                handle.result()
            except brood.ReplayDiverged as exc:
                _refused(exc, code=1)
            except brood.ChildFailed:
                pass
    except brood.BroodError as exc:
        _refused(exc)
        return
    _report(result, as_json, url)


CHAT_EXIT = frozenset({"exit", "quit"})  # a line that ends `brood chat`, as EOF does


@app.command()
def chat(
    model: Annotated[
        str | None,
        typer.Option(
            help="model spec: openai:MODEL@URL, python:MODULE:FUNCTION, echo, … (or "
            "BROOD_MODEL; with --resume, the spec the conversation was started with)"
        ),
    ] = None,
    store: StoreOpt = None,
    context: Annotated[
        Path | None, typer.Option(help="a file whose text becomes `context`")
    ] = None,
    resume: Annotated[
        str | None,
        typer.Option(
            "--resume",
            metavar="RUN",
            help="go on with the journaled conversation RUN (one left by Ctrl-C or a crash)",
        ),
    ] = None,
    max_iterations: Annotated[int | None, typer.Option(help="model turns per user turn")] = None,
    timeout: Annotated[
        float | None, typer.Option(help="wall-clock seconds of one turn (a number > 0)")
    ] = None,
    fs_read: FsReadOpt = None,
    fs_write: FsWriteOpt = None,
    network: NetworkOpt = False,
    confine: ConfineOpt = True,
    model_timeout: ModelTimeoutOpt = None,
    price: PriceOpt = None,
    tool: ToolOpt = None,
    mcp: McpOpt = None,
) -> None:
    """A conversation in the terminal: each line you type is a turn of one root run,
    whose REPL variables and history persist from turn to turn; its answer is printed.
    `exit`, `quit` or end of input (Ctrl-D) closes the conversation. Ctrl-C leaves it
    journaled between turns (a turn under way is cancelled): `brood chat --resume RUN`
    goes on with it, its REPL rebuilt from the journal."""
    text = _context_text(context)
    if resume is not None and text is not None:
        _fail("--context is the context of a new conversation; a resumed one keeps its own")
    url = store or default_store_url()
    given: dict[str, Any] = {"max_iterations": max_iterations}
    try:
        check_timeout(timeout)
        limits = brood.Limits(
            **{k: v for k, v in given.items() if v is not None},
            **_confinement(fs_read, fs_write, network, confine),
        )
        journaled = _journaled_model(url, resume) if resume and not model else None
        spec = _model(model or journaled, model_timeout)
        prices = _prices(price, spec)
        with (
            interruptible() as interrupt,
            brood.Supervisor(
                spec, limits=limits, store=url, prices=prices, tools=tool, mcp_servers=mcp
            ) as sup,
        ):
            _stop_if_interrupted(interrupt)
            conv = sup.resume_conversation(resume) if resume else sup.conversation(text)
            code = _converse(conv, interrupt, timeout)
    except brood.BroodError as exc:
        _refused(exc)
        return
    if code:
        raise typer.Exit(code)


def _converse(conv: brood.Conversation, interrupt: Interrupt, timeout: float | None) -> int:
    """Read lines and send each as a turn until `exit` or end of input (then close the
    conversation: 0), a turn that ends the conversation (1), or Ctrl-C (130; the
    conversation stays resumable between turns). Answers go to stdout; the rest to
    stderr, so `brood chat < questions.txt > answers.txt` keeps only the answers."""
    err = Terminal(stderr=True)
    interactive = sys.stdin.isatty()
    verb = "resumed" if conv.turns() else "started"
    err.print(
        f"conversation {conv.id} {verb}; `exit` or Ctrl-D closes it, Ctrl-C keeps it for "
        f"`brood chat --resume {conv.id}`",
        markup=False,
    )
    while True:
        if interactive:
            err.print("> ", end="", markup=False)
        line = interrupt.result_of(sys.stdin.readline)
        if line is None or interrupt.hit:
            err.print(f"\ninterrupted: continue with `brood chat --resume {conv.id}`", markup=False)
            return INTERRUPTED
        prompt = line.strip()
        if not line or prompt in CHAT_EXIT:
            ended = conv.close()
            err.print(f"conversation {conv.id} closed ({ended.state})", markup=False)
            return 0
        if not prompt:
            continue
        result = interrupt.result_of(functools.partial(conv.send, prompt, timeout=timeout))
        if result is None or interrupt.hit:
            interrupt.cleaning = True
            ended = conv.close()  # the turn under way is cancelled, every exit confirmed
            err.print(f"interrupted: conversation {conv.id} {ended.state}", markup=False)
            return INTERRUPTED
        if result.state != "completed":
            err.print(
                f"conversation {conv.id} {result.state}: {result.error}",
                markup=False,
            )
            return 1
        echo(result.answer or "")


def _journaled_model(url: str, run_id: str) -> str | None:
    """The model spec the tree of `run_id` was started (or last resumed) with, as its
    journal holds it; else BROOD_MODEL. Fails, saying why, when neither is there: the
    journal never holds a spec that carries a secret, nor a chat_fn."""
    with _journal(url) as journal:
        record = journal.model_spec(run_id)
        root = journal.run(journal.run(run_id)["root_id"])
    if record is not None and record.get("spec"):
        return str(record["spec"])
    if os.environ.get("BROOD_MODEL"):
        return None  # Supervisor takes it
    if root["state"] in TERMINAL_VALUES:  # said before any word about its model
        _fail(f"run {root['id']} is {root['state']}; a tree that has ended has nothing to resume")
    if record is None:
        why, fix = "it was journaled by a brood that kept no model spec", "pass it"
    elif record.get("secret"):
        why = f"{record['withheld']}, and a journal never holds a secret"
        fix = "it must be given again"
    else:
        why, fix = f"{record['withheld']} the journal could hold", "pass one"
    _fail(
        f"the journal does not say which model the tree of run {run_id} was started with: "
        f"{why}; {fix}: brood resume {run_id} --model SPEC (or set BROOD_MODEL)"
    )
    return None  # unreachable: _fail exits


@app.command()
def demo(
    store: StoreOpt = None,
    model: Annotated[
        str | None,
        typer.Option(help="a real model for the demo task, e.g. local:smollm2 (default: scripted)"),
    ] = None,
) -> None:
    """A built-in scenario on a scripted model: a root fans out to children without
    blocking, keeps working, collects them, cancels one, and answers. With --model, the same
    task for a real model (a few turns), showing what it did whatever its quality."""
    console = Terminal()
    notes = resources.files("brood").joinpath("data/field_notes.md").read_text()
    real = model is not None
    limits = brood.Limits(
        max_depth=2,
        max_concurrency=4,
        shutdown_grace=0.5,
        term_grace=0.5,
        max_iterations=3 if real else 20,  # a small local model takes ~40 s a turn here
        step_timeout=60.0,
    )
    url = store or default_store_url()
    console.print(f"[bold]task:[/bold] {ROOT_TASK}")
    try:
        with brood.Supervisor(model or "scripted:demo", limits=limits, store=url) as sup:
            result = sup.run(ROOT_TASK, context=notes)
    except brood.BroodError as exc:
        _refused(exc)
        raise  # unreachable: _fail exits
    with Journal(url) as journal:
        console.print(render_tree(journal.tree(result.run_id)))
        if real:
            for step in journal.steps(result.run_id):
                console.print(f"[bold]step {step['step']}[/bold]")
                console.print(plain(_indent(step["code"], "  > ")))
    if result.state == "completed":
        answer = result.answer or ""
        if real and len(answer) > 600:  # a small model may ramble; the journal has it all
            answer = answer[:600] + f" … ({len(result.answer or ''):,} characters)"
        console.print(plain(f"answer: {answer}"))
    else:
        console.print(f"[bold]{result.state}:[/bold] {literal(result.error)}")
    console.print(f"[dim]journal: {url}; try `brood show {result.run_id}`[/dim]")
    if result.state != "completed" and not real:
        _fail(f"the demo's root {result.state}: {result.error}", code=1)


# ---- commands: reading the journal ---------------------------------------------------------
@app.command()
def ps(
    limit: Annotated[int, typer.Option(help="how many trees")] = 20,
    store: StoreOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """The most recent trees, newest first; `stale` marks runs whose supervisor is gone."""
    with _journal(store) as journal:
        roots = journal.roots(limit)
    if as_json:
        keys = (
            "runs",
            "open",
            "asks_open",
            "hibernating_runs",
            "workers",
            "memory_bytes",
            "quarantined",
        )
        print_json([_flat(r) | {k: r[k] for k in keys} for r in roots])
        return
    table = Table(
        "RUN", "STATE", "RUNS", "CALLS", "TOKENS", "COST", "TIME", "WORKERS", "PROMPT", box=None
    )
    for r in roots:
        u = r["subtree_usage"]
        table.add_row(
            r["id"],
            _state_text(r),
            f"{r['runs']}"
            + (f" ({r['open']} open)" if r["open"] else "")
            + (f" ({r['asks_open']} asks open)" if r["asks_open"] else "")
            + (f" ({r['quarantined']} quarantined)" if r["quarantined"] else ""),
            str(int(u.get("model_calls", 0))),
            str(int(u.get("input_tokens", 0)) + int(u.get("output_tokens", 0))),
            _cost_cell(u),
            _secs(r["duration"]),
            _workers_text(r["workers"], r["memory_bytes"]),
            _short(r["prompt"], 50),
        )
    Terminal().print(table)


def _cost_cell(u: dict[str, Any]) -> str:
    """A tree's cost in `brood ps`: `$0.0123`, `$0.0123+` (some calls unpriced), `?` (no
    call priced) or `-` (no call yet)."""
    cost = u.get("cost")
    if cost is None:
        return "?" if u.get("model_calls") else "-"
    return dollars(float(cost)) + ("+" if u.get("unpriced_calls") else "")


def _workers_text(workers: int, memory: int | None) -> str:
    """Live workers of a tree and the memory they hold alone, e.g. `3 · 41 MiB`."""
    if not workers:
        return ""
    return f"{workers} · {memory / 2**20:.0f} MiB" if memory is not None else str(workers)


def _flat(run: dict[str, Any]) -> dict[str, Any]:
    """A run as the JSON read commands print it (children as nested objects, if any)."""
    keys = (
        "run_id",
        "parent_id",
        "root_id",
        "depth",
        "key",
        "state",
        "stale",
        "reason",
        "prompt",
        "answer",
        "products",
        "waiting_for",
        "hibernating",
        "error",
        "model",
        "pool",
        "attempt",
        "usage",
        "subtree_usage",
        "duration",
        "created_at",
        "started_at",
        "ended_at",
        "pid",
        "last_line",
    )
    out = {k: run.get(k) for k in keys}
    if run.get("children") and isinstance(run["children"][0], dict):
        out["children"] = [_flat(c) for c in run["children"]]
    elif "children" in run:
        out["children"] = run["children"]
    return out


@app.command()
def tree(run_id: RunArg, store: StoreOpt = None, as_json: JsonOpt = False) -> None:
    """The tree under RUN with states, times, model calls and tokens."""
    with _journal(store) as journal:
        node = journal.tree(run_id)
    if as_json:
        print_json(_flat(node))
    else:
        Terminal().print(render_tree(node))


@app.command()
def show(run_id: RunArg, store: StoreOpt = None, as_json: JsonOpt = False) -> None:
    """One run: prompt, answer, error, usage (own and subtree) and its REPL steps."""
    with _journal(store) as journal:
        run = journal.run(run_id)
        steps = journal.steps(run_id)
    if as_json:
        print_json(_flat(run) | {"steps": steps})
        return
    console = Terminal()
    console.print(
        f"[bold]{run['id']}[/bold] {_state_text(run)} depth {run['depth']}"
        f" {_secs(run['duration'])}" + (f"  parent {run['parent_id']}" if run["parent_id"] else "")
    )
    console.print(plain(f"prompt: {run['prompt']}"))
    if run["answer"] is not None:
        console.print(plain(f"answer: {run['answer']}"))
    if run.get("products") is not None:
        console.print(plain(f"products: {json.dumps(run['products'])}"))
    if why := _why(run["state"], run["reason"]):
        console.print(plain(f"reason: {_explained(why)}"))
    if run["error"]:
        console.print(plain(f"error: {run['error'].strip().splitlines()[-1]}"))
    console.print(
        f"usage: {_usage_text(run['usage'])}; subtree {_usage_text(run['subtree_usage'])}"
    )
    if run["children"]:
        console.print(f"children: {', '.join(run['children'])}")
    for s in steps:
        console.print(f"[bold]step {s['step']}[/bold] [dim]{s['duration']:.3f}s[/dim]")
        console.print(plain(_indent(s["code"], "  > ")))
        out = (s["stdout"] or "") + (s["stderr"] or "")
        if out.strip():
            console.print(plain(_indent(out.rstrip(), "    ")))


def _call_cost(cost: float | None) -> str:
    return "cost unknown" if cost is None else dollars(float(cost))


def _indent(text: str, prefix: str) -> str:
    """Model text with `prefix` before each line, cleaned first: `splitlines` would also
    break a line at a carriage return and at other controls that `clean` takes out."""
    return "\n".join(prefix + line for line in clean(text).splitlines())


# What `brood logs` shows by default: what the run did (model turns, steps, messages,
# asks) and what happened to it (retries, pools, resumes, lost workers, quarantined worker
# groups, unenforced confinement). The rest is the journal's own bookkeeping
# (`step_begun`, the system prompt by reference, remembered values, scratch paths,
# placements, the model spec), which `--all` shows too.
LOG_KINDS = frozenset(
    {
        "model_call",
        "compacted",
        "cost_unknown",
        "step",
        "tool_call",
        "message",
        "ask",
        "attempt",
        "pool",
        "confinement",
        "resume",
        "resumed",
        "zygote_lost",
        "retry_refused",
        "adopt_failed",
        "quarantined",
        "released",
        "flow",
        "user_turn",
        "turn_answer",
        "suspended",
    }
)
FLOW_BOOKKEEPING = frozenset({"spec"})  # a flow's ledger entry holding its whole spec


def _shown(ev: dict[str, Any]) -> bool:
    if ev["kind"] == "flow":
        return ev["data"].get("kind") not in FLOW_BOOKKEEPING
    return ev["kind"] in LOG_KINDS


def _fields(data: dict[str, Any], skip: tuple[str, ...] = ()) -> str:
    """An event's data as `key=value` pairs, for rich markup."""
    pairs = (f"{k}={json.dumps(v, default=str)}" for k, v in data.items() if k not in skip)
    return literal(" ".join(pairs))


def _call_text(d: dict[str, Any]) -> str:
    """A journaled tool call as Python: name(arg, key=value), shortened, for rich markup."""
    try:
        name, args, kwargs = json.loads(d["call"])
        given = [json.dumps(a) for a in args] + [f"{k}={json.dumps(v)}" for k, v in kwargs.items()]
        text = f"{name}({', '.join(given)})"
    except (ValueError, TypeError, KeyError):
        text = str(d.get("tool"))
    return _short(text, 120)


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


def _event_lines(ev: dict[str, Any]) -> Group:
    d, kind = ev["data"], ev["kind"]
    stamp = time.strftime("%H:%M:%S", time.localtime(ev["at"]))
    head = f"[dim]{stamp}[/dim] [bold]{kind}[/bold]"
    if kind == "model_call":
        head = (
            f"[dim]{stamp}[/dim] [bold]model[/bold] {d['kind']} {literal(d.get('model') or '')} "
            f"{d['latency']:.2f}s {d['input_tokens']}+{d['output_tokens']} tok"
            + ("" if "cost" not in d else f" {_call_cost(d['cost'])}")
        )
        body = d.get("response") or (f"error: {d['error']}" if d.get("error") else "")
        return Group(head, plain(_indent(body, "  | ")))
    if kind == "step":
        out = (d["stdout"] or "") + (d["stderr"] or "")
        parts: list[Any] = [
            f"[dim]{stamp}[/dim] [bold]step {d['step']}[/bold]",
            plain(_indent(d["code"], "  > ")),
        ]
        if out.strip():
            parts.append(plain(_indent(out.rstrip(), "    ")))
        return Group(*parts)
    if kind == "tool_call":
        head = f"[dim]{stamp}[/dim] [bold]tool[/bold] {_call_text(d)} {d['duration']:.2f}s"
        body = f"error: {d['error']}" if d.get("error") else json.dumps(d.get("result"))
        return Group(head, plain(_indent(_clip(body, 2000), "  | ")))
    if kind == "message":
        return Group(f"{head} {literal(d['message'])}")
    if kind == "prompt":
        return Group(
            f"{head} system prompt {d['ref']} "
            f"({len(d['content'])} chars; `brood export` puts it in each request)"
        )
    if kind == "ask":
        what = d.get("question") or (d.get("result") or {}).get("summary") or d.get("reason")
        return Group(f"{head} {literal(d['ask'])} {d['op']}: {_short(str(what), 200)}")
    if kind == "flow":
        return Group(f"{head} {literal(d.get('kind', ''))} {_fields(d, ('kind',))}")
    if kind == "pool" and d.get("waiting"):
        holders = literal(", ".join(d.get("holders", [])))
        return Group(f"{head} waiting for pool {literal(repr(d['pool']))} (held by {holders})")
    if kind == "user_turn":
        return Group(
            f"[dim]{stamp}[/dim] [bold]user turn {d['turn']}[/bold]",
            plain(_indent(d["prompt"], "  | ")),
        )
    if kind == "turn_answer":
        head = f"[dim]{stamp}[/dim] [bold]turn {d['turn']} answered[/bold] ({literal(d['reason'])})"
        return Group(head, plain(_indent(d["answer"], "  | ")))
    if kind == "confinement":
        gaps = "; ".join(d.get("unenforced", []))
        return Group(f"{head} not enforced on this machine: {literal(gaps)}")
    return Group(f"{head} {_fields(d)}")


@app.command()
def logs(
    run_id: RunArg,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="wait for more")] = False,
    show_all: Annotated[
        bool,
        typer.Option(
            "--all", help="also the journal's bookkeeping events (step_begun, prompt, ...)"
        ),
    ] = False,
    store: StoreOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """The trajectory of RUN: model turns, REPL steps, messages and asks in order, and how
    it ended (JSON lines with --json)."""
    console = Terminal()
    with _journal(store) as journal:
        after = 0
        while True:
            # Whether the run has ended is read before its events, so the last read after
            # the end still prints what landed meanwhile.
            run = journal.run(run_id)
            ended = run["state"] in TERMINAL_VALUES or run["stale"]
            for ev in journal.events(run_id, after=after):
                after = ev["seq"]
                if not (show_all or _shown(ev)):
                    continue
                if as_json:
                    print_json(ev)
                else:
                    console.print(_event_lines(ev))
            if not follow or ended:
                break
            time.sleep(REFRESH_S)
    if not as_json and run["state"] in TERMINAL_VALUES:
        why = _why(run["state"], run["reason"])
        ending = f"{run['state']} ({_explained(why)})" if why else run["state"]
        console.print(plain(f"ended: {ending}"))


@app.command()
def export(
    run_id: RunArg,
    fmt: Annotated[str, typer.Option("--format", help="jsonl, openai-chat or verifiers")] = "jsonl",
    store: StoreOpt = None,
) -> None:
    """The tree under RUN as JSON lines, streamed: per model call (jsonl: messages,
    response, usage), per run (openai-chat: a fine-tuning example with its metadata and
    reward) or per tree (verifiers: a rollout, the children's turns in its info). A tree
    still running is refused: wait for it or cancel it first."""
    if fmt not in EXPORT_FORMATS:
        _fail(f"--format {fmt!r} is not supported; use --format {', '.join(EXPORT_FORMATS)}")
    with _journal(store) as journal:
        write_jsonl(journal.export(run_id, fmt), sys.stdout)
        sys.stdout.flush()


# ---- commands: acting on a tree another process runs ---------------------------------------
@app.command()
def cancel(run_id: RunArg, store: StoreOpt = None, as_json: JsonOpt = False) -> None:
    """Cancel RUN and its subtree; returns once every exit is confirmed."""
    with _journal(store) as journal:
        state = journal.cancel(run_id)
    if as_json:
        print_json({"run_id": run_id, "state": state})
    else:
        echo(f"{run_id} {state}")


@app.command()
def send(
    run_id: RunArg,
    message: Annotated[str, typer.Argument(help="the follow-up")],
    store: StoreOpt = None,
) -> None:
    """Send RUN a follow-up message, delivered before its next model turn."""
    with _journal(store) as journal:
        journal.send(run_id, message)
    echo(f"sent to {run_id}")


@app.command()
def asks(store: StoreOpt = None, as_json: JsonOpt = False) -> None:
    """The open asks to a person of every live run: id, run, question, options, deadline."""
    with _journal(store) as journal:
        found = journal.asks()
    if as_json:
        print_json(found)
        return
    if not found:
        echo("no open asks")
        return
    console = Terminal()
    now = time.time()
    for a in found:
        left = f"  [dim]deadline in {a['deadline'] - now:.0f} s[/dim]" if a["deadline"] else ""
        console.print(f"[bold]{literal(a['id'])}[/bold] run {literal(a['run_id'])}{left}")
        console.print(plain(f"  {a['question']}"))
        for o in a["options"]:
            same = o["id"] == o["label"]
            console.print(plain(f"  - {o['id']}" + ("" if same else f": {o['label']}")))


@app.command()
def answer(
    ask_id: Annotated[str, typer.Argument(metavar="ASK", help="the ask's id (a-...)")],
    value: Annotated[str, typer.Argument(help="an option id or label, or the answer text")],
    by: Annotated[
        str | None, typer.Option("--as", help="who answers (default: the OS user)")
    ] = None,
    store: StoreOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Answer an open ask; the run that asked goes on with the answer."""
    with _journal(store) as journal:
        result = journal.answer(ask_id, value, by or os_user())
    if as_json:
        print_json(result)
    else:
        echo(f"{ask_id} answered: {result['summary']}")


# ---- flows ----------------------------------------------------------------------------------
flow_app = typer.Typer(
    help="Flows: state-machine workflows of sub-agents.",
    no_args_is_help=True,
    context_settings=CONTEXT,
    rich_markup_mode=HELP_MARKUP,
)
app.add_typer(flow_app, name="flow")
SpecArg = Annotated[Path, typer.Argument(metavar="SPEC", help="a flow spec file (YAML or JSON)")]


def _inputs(pairs: list[str], json_pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for raw, parse in [(p, False) for p in pairs] + [(p, True) for p in json_pairs]:
        name, sep, value = raw.partition("=")
        if not sep or not name:
            _fail(f"--input {raw!r}: write NAME=VALUE")
        try:
            out[name] = json.loads(value) if parse else value
        except ValueError as exc:
            _fail(f"--input-json {raw!r}: the value is not JSON ({exc})")
    return out


@flow_app.command("validate")
def flow_validate(spec: SpecArg, as_json: JsonOpt = False) -> None:
    """Check a spec and report every problem with its path; starts nothing."""
    from brood.flow import compile_spec, load_spec

    try:
        machine = compile_spec(load_spec(spec))
    except brood.InvalidSpec as exc:
        if as_json:
            print_json({"valid": False, "problems": [p.strip() for p in str(exc).splitlines()[1:]]})
            raise typer.Exit(2) from None
        _refused(exc)
        return
    summary = {
        "valid": True,
        "name": machine.name,
        "states": list(machine.states),
        "entry": list(machine.entry),
        "transitions": len(machine.transitions),
        "inputs": sorted(machine.params),
    }
    if as_json:
        print_json(summary)
    else:
        echo(
            f"valid: {len(machine.states)} states ({', '.join(machine.states)}), "
            f"{len(machine.transitions)} transitions, entry {', '.join(machine.entry)}"
        )


@flow_app.command("run")
def flow_run(
    spec: SpecArg,
    inputs: Annotated[list[str] | None, typer.Option("--input", help="NAME=TEXT")] = None,
    json_inputs: Annotated[list[str] | None, typer.Option("--input-json", help="NAME=JSON")] = None,
    model: Annotated[str | None, typer.Option(help="model spec (or BROOD_MODEL)")] = None,
    store: StoreOpt = None,
    max_concurrency: Annotated[int | None, typer.Option(help="runs computing at once")] = None,
    fs_read: FsReadOpt = None,
    fs_write: FsWriteOpt = None,
    network: NetworkOpt = False,
    confine: ConfineOpt = True,
    model_timeout: ModelTimeoutOpt = None,
    price: PriceOpt = None,
    live: Annotated[bool, typer.Option(help="show the live tree on stderr")] = True,
    as_json: JsonOpt = False,
    ray: RayOpt = None,
) -> None:
    """Run a flow until it ends; while it is paused, `brood flow resume RUN` (from another
    terminal) lets it go on, and `brood flow stop RUN` stops it. With --ray the flow runs
    on a node of that Ray cluster (the spec file is read here)."""
    params = _inputs(inputs or [], json_inputs or [])
    url = store or default_store_url()
    given: dict[str, Any] = {"max_concurrency": max_concurrency} if max_concurrency else {}
    try:
        limits = brood.Limits(**given, **_confinement(fs_read, fs_write, network, confine))
        model_spec = _model(model, model_timeout)
        prices = _prices(price, model_spec)
        with (
            interruptible() as interrupt,
            _runner(model_spec, limits, url, ray, prices) as runner,
        ):
            _stop_if_interrupted(interrupt)
            flow = runner.flow_run(spec, inputs=params)
            if not as_json:
                echo(f"flow {flow.id} started: {', '.join(flow.started)}", err=True)
            if live and sys.stderr.isatty():
                with Journal(url) as journal:
                    _live_tree(
                        journal,
                        flow.id,
                        lambda: flow.status()["status"] in FLOW_ENDED,
                        interrupt,
                    )
            while (status := _flow_wait(flow, interrupt)) == FlowStatus.PAUSED:
                echo(
                    f"paused: {flow.status()['reason']}; `brood flow resume {flow.id}` goes on",
                    err=True,
                )
                if interrupt.result_of(flow.wait_change) is None and interrupt.hit:
                    _stop_interrupted_flow(flow, interrupt)
            report = flow.status() | {"outputs": flow.outputs()}
    except brood.BroodError as exc:
        _refused(exc)
        return
    if as_json:
        print_json(report)
    else:
        echo(
            f"flow {report['run_id']} {status}"
            + (f": {report['reason']}" if report["reason"] else "")
        )
        echo(json.dumps(report["outputs"], indent=2, default=str))
    if status != FlowStatus.FINISHED:
        raise typer.Exit(1)


def _flow_wait(flow: brood.FlowHandle | ClusterFlowHandle, interrupt: Interrupt) -> str:
    status = None if interrupt.hit else interrupt.result_of(flow.wait)
    if status is None or interrupt.hit:
        _stop_interrupted_flow(flow, interrupt)
    return status


def _stop_interrupted_flow(
    flow: brood.FlowHandle | ClusterFlowHandle, interrupt: Interrupt
) -> NoReturn:
    """Ctrl-C during `brood flow run`: the flow is stopped (its instances cancelled, every
    exit confirmed) and the command exits 130."""
    interrupt.cleaning = True
    state = flow.stop()["state"]
    Terminal(stderr=True).print(f"interrupted: flow {flow.id} stopped in {state}")
    raise typer.Exit(INTERRUPTED)


@flow_app.command("status")
def flow_status(run_id: RunArg, store: StoreOpt = None, as_json: JsonOpt = False) -> None:
    """Per-state entries used / max, each entry's instances, milestones, recent events."""
    with _journal(store) as journal:
        status = journal.flow(run_id, "status")
    if as_json:
        print_json(status)
        return
    console = Terminal()
    console.print(
        f"[bold]{status['run_id']}[/bold] {status['status']}"
        + (f" ({literal(status['reason'])})" if status.get("reason") else "")
        + f", {status['transitions_fired']} transitions fired"
    )
    table = Table("STATE", "ENTRIES", "INSTANCES", box=None)
    for sid, st in status["states"].items():
        insts = ", ".join(f"{i['run_id']} {i['state']}" for i in st["instances"][-4:])
        more = len(st["instances"]) - 4
        table.add_row(
            literal(sid),
            f"{st['entries']}/{st.get('max_entries', '?')}",
            literal(insts) + (f" (+{more})" if more > 0 else ""),
        )
    console.print(table)
    if status["milestones"]:
        console.print("milestones: " + literal(", ".join(status["milestones"])))


@flow_app.command("stop")
def flow_stop(run_id: RunArg, store: StoreOpt = None) -> None:
    """Stop a flow another process runs: admit nothing, cancel its running children."""
    with _journal(store) as journal:
        echo(f"{run_id} {journal.flow(run_id, 'stop')}")


@flow_app.command("resume")
def flow_resume(run_id: RunArg, store: StoreOpt = None) -> None:
    """Let a paused flow (escalate, max_transitions) go on."""
    with _journal(store) as journal:
        echo(f"{run_id} {journal.flow(run_id, 'resume')}")


# ---- serve ----------------------------------------------------------------------------------
@app.command()
def serve(
    store: StoreOpt = None,
    host: Annotated[
        str, typer.Option(help="address to listen on; one that is not loopback needs --token")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port to listen on (0: a free one)")] = 8765,
    model: Annotated[
        str | None,
        typer.Option(help="model spec of the runs started through the server (or BROOD_MODEL)"),
    ] = None,
    token: Annotated[
        str | None,
        typer.Option(
            envvar="BROOD_TOKEN",
            help="the token every call must send as Authorization: Bearer TOKEN (or "
            "BROOD_TOKEN); without one, the server makes one and prints a login URL",
        ),
    ] = None,
    max_streams: Annotated[
        int | None,
        typer.Option(help="event streams, live trees and chat completions at once (default 64)"),
    ] = None,
    max_queued: Annotated[
        int | None,
        typer.Option(help="runs a client has started here that have not started yet (default 64)"),
    ] = None,
    max_sessions: Annotated[
        int | None,
        typer.Option(help="remote sessions (/v1/sessions) open at once (default 16)"),
    ] = None,
    session_idle: Annotated[
        float | None,
        typer.Option(help="seconds after which an idle remote session is closed (default 900)"),
    ] = None,
    price: PriceOpt = None,
) -> None:
    """Serve the journal: a live dashboard at /, a JSON API under /v1 (runs, trees, events,
    asks, flows, remote sessions) and an OpenAI-compatible /v1/chat/completions whose answer
    is an RLM tree's. Every call needs the server's token; without --token it makes one and prints a
    login URL that carries it."""
    try:
        import uvicorn

        from brood.hosts import is_loopback, listen
        from brood.serve import make_app
        from brood.serve.caps import MAX_QUEUED, MAX_STREAMS
        from brood.serve.sessions import MAX_SESSIONS, SESSION_IDLE_S
    except ModuleNotFoundError as exc:
        _fail(f"brood serve needs {exc.name}: {install_hint('serve')}")
        return
    token = token or None  # an empty BROOD_TOKEN is no token
    if token is None and not is_loopback(host):
        _fail(
            f"--host {host} is not a loopback address, and there is no --token: a server "
            "that makes its own token answers loopback names only; pass --token TOKEN (or "
            "set BROOD_TOKEN) to serve other names, or serve on 127.0.0.1"
        )
    try:
        server_app = make_app(
            store_url=store or default_store_url(),
            model=model,
            prices=_prices(price, model),
            token=token,
            max_streams=MAX_STREAMS if max_streams is None else max_streams,
            max_queued=MAX_QUEUED if max_queued is None else max_queued,
            max_sessions=MAX_SESSIONS if max_sessions is None else max_sessions,
            session_idle=SESSION_IDLE_S if session_idle is None else session_idle,
        )
    except brood.BroodError as exc:
        _refused(exc)
        return
    try:
        sock = listen(host, port)
    except brood.BroodError as exc:
        _refused(exc)
        return
    bound = sock.getsockname()[1]
    where = f"http://{f'[{host}]' if ':' in host else host}:{bound}"
    lines = [
        f"brood serve: the dashboard at {where}/, the API under {where}/v1 "
        "(schema at /openapi.json); every call sends Authorization: Bearer TOKEN"
    ]
    if server_app.state.token_made:  # printed once: a token is made at each start
        lines.append(
            f"brood serve: log in at {where}/?token={server_app.state.token} "
            "(the URL carries the token made for this server; TOKEN is its token= part)"
        )
    else:
        lines.append("brood serve: TOKEN is the --token it was given (or BROOD_TOKEN)")
    echo("\n".join(lines), err=True)
    server = uvicorn.Server(uvicorn.Config(server_app, log_level="warning"))
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()


# ---- OpenEnv ---------------------------------------------------------------------------------
openenv_app = typer.Typer(
    help="brood as an OpenEnv environment (the [openenv] extra).",
    no_args_is_help=True,
    context_settings=CONTEXT,
    rich_markup_mode=HELP_MARKUP,
)
app.add_typer(openenv_app, name="openenv")


@openenv_app.command("serve")
def openenv_serve(
    model: Annotated[
        str | None,
        typer.Option(
            help="model spec of the children and plain calls of episodes (or BROOD_MODEL)"
        ),
    ] = None,
    host: Annotated[
        str, typer.Option(help="address to listen on; one that is not loopback needs --token")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port to listen on (0: a free one)")] = 8000,
    store: StoreOpt = None,
    rubric: Annotated[
        str | None,
        typer.Option(
            metavar="MODULE:FUNCTION",
            help="the reward: a function reward(answer, trajectory) -> float, or an "
            "openenv-core Rubric (importable from here)",
        ),
    ] = None,
    token: Annotated[
        str | None,
        typer.Option(
            envvar="BROOD_TOKEN",
            help="every request must send Authorization: Bearer TOKEN (or BROOD_TOKEN); "
            "openenv-core's stock clients send none, BroodEnv(url, token=...) does",
        ),
    ] = None,
    max_envs: Annotated[
        int | None, typer.Option(help="sessions (WebSocket clients) at once (default 64)")
    ] = None,
    max_depth: Annotated[int | None, typer.Option(help="run levels including the root")] = None,
    max_children: Annotated[
        int | None, typer.Option(help="child runs in one episode's tree")
    ] = None,
    max_concurrency: Annotated[
        int | None,
        typer.Option(
            help="workers computing at once, all episodes together (default: 8 for each of "
            "--max-envs)"
        ),
    ] = None,
    max_iterations: Annotated[int | None, typer.Option(help="model turns per child run")] = None,
    child_timeout: Annotated[float | None, typer.Option(help="seconds per child run")] = None,
    step_timeout: Annotated[
        float | None, typer.Option(help="seconds of one step's own compute")
    ] = None,
    token_budget: Annotated[int | None, typer.Option(help="tokens for one episode's tree")] = None,
    price: PriceOpt = None,
) -> None:
    """Serve brood as an OpenEnv environment with openenv-core's own HTTP and WebSocket
    server: each session's `reset` starts an episode (a brood tree of its own, journaled),
    each `step` runs an action's code in the episode's root REPL, and the rubric's reward
    comes back when the episode is done. `reset`, `close` and the end of a session end
    the episode's workers with confirmed exit.

    Without --token the server listens on loopback only; openenv-core's clients send no
    credentials. Same as `python -m brood.integrations.openenv`."""
    try:
        from brood.integrations.openenv import DEFAULT_MAX_ENVS, load_rubric, serve, served_limits
    except ModuleNotFoundError as exc:
        _fail(
            f"brood openenv serve needs the [openenv] extra ({exc.name} is missing): "
            f"{install_hint('openenv')}"
        )
        return
    given: dict[str, Any] = {
        "max_depth": max_depth,
        "max_children": max_children,
        "max_concurrency": max_concurrency,
        "max_iterations": max_iterations,
        "child_timeout": child_timeout,
        "step_timeout": step_timeout,
        "token_budget": token_budget,
    }
    envs = DEFAULT_MAX_ENVS if max_envs is None else max_envs
    try:
        serve(
            model,
            host=host,
            port=port,
            token=token or None,
            rubric=load_rubric(rubric) if rubric else None,
            limits=served_limits(envs, **{k: v for k, v in given.items() if v is not None}),
            store=store or default_store_url(),
            max_concurrent_envs=envs,
            prices=_prices(price, model),
        )
    except brood.BroodError as exc:
        _refused(exc)


# ---- doctor ---------------------------------------------------------------------------------
@app.command()
def doctor(store: StoreOpt = None, as_json: JsonOpt = False) -> None:
    """Show which worker confinement this machine enforces, what the default policy lacks,
    and the quarantined worker groups of the journal (exit never confirmed)."""
    import msgspec

    from brood.backends.confinement import unenforced, worker_settings
    from brood.worker import disk
    from brood.worker.confine import SCRATCH_WATCHED, probe, scratch_bound

    support = probe()
    settings = worker_settings(brood.Limits())
    lines = unenforced(settings)
    bound = scratch_bound(settings.policy, support)
    quarantined = _quarantined(store)
    max_workers = brood.Limits().effective_max_workers()  # Limits.max_workers=None, here
    if as_json:
        print_json(
            {"support": msgspec.to_builtins(support), "scratch_disk": bound, "gaps": lines}
            | {"quarantined": quarantined, "max_workers": max_workers}
        )
        return
    abi = support.landlock_abi

    def row(name: str, ok: bool, detail: str) -> None:
        table.add_row(name, "[green]yes[/green]" if ok else "[red]no[/red]", detail)

    table = Table("MECHANISM", "HERE", "DETAIL", box=None)
    row("landlock", abi >= 1, f"ABI {abi}" if abi else support.landlock_error)
    row("  files", abi >= 1, "read-only Python and system, read-write scratch")
    row("  TCP", abi >= 4, "bind and connect refused unless network (ABI 4)")
    row("  signals, sockets", abi >= 6, "no signals or abstract sockets outside (ABI 6)")
    row("  ptrace", abi >= 1, "none outside the worker")
    held = support.caps_held
    row("capability drop", support.drop_caps or not held, "all sets" if held else "none held")
    row("network namespace", support.netns, support.netns_error or "only a down loopback")
    row(
        "no_new_privs",
        support.no_new_privs,
        "exec gains no privileges" if support.no_new_privs else "the kernel lacks it (< 3.5)",
    )
    seccomp = support.seccomp
    row(
        "seccomp filter",
        seccomp,
        "refuses what Landlock does not scope" if seccomp else support.seccomp_error,
    )
    row("  other processes", seccomp, "no prlimit, setpriority, sched_set* on them")
    row("  user namespaces", seccomp, "unshare, setns, clone(CLONE_NEW*) refused")
    row("  memfd exec", seccomp, "memfd only with MFD_NOEXEC_SEAL; no fexecve")
    row("  unix sockets", seccomp, "none made; no datagram pairs")
    row("  without network", seccomp, "no netlink, vsock or addressed sends")
    row("rlimits", True, "memory (AS), cpu, file size, open files")
    if support.cgroup:
        row("cgroups", True, f"{support.cgroup}: pids per worker, memory per worker")
        row("  processes", True, "pids.max of the worker's cgroup")
    else:
        row("cgroups", False, support.cgroup_error or "not usable here")
        why = "root is exempt" if support.uid == 0 else "counts every process of the user"
        row("  processes", False, f"RLIMIT_NPROC: {why}")
    scratch = {
        disk.TMPFS: "tmpfs of worker_disk, own mount namespace",
        disk.TMPFS_USERNS: "tmpfs of worker_disk, own user namespace",
        SCRATCH_WATCHED: f"watched by the supervisor: {support.disk_error}",
    }
    row("scratch disk", bound != SCRATCH_WATCHED, scratch.get(bound, "not bounded"))
    console = Terminal()
    console.print(f"[bold]worker confinement on this machine[/bold] (uid {support.uid})")
    console.print(table)
    console.print(
        f"live workers per supervisor: at most {max_workers:,} by default (Limits.max_workers:"
        f" available memory / {WORKER_SHARE // 2**20} MiB, at most {MOST_WORKERS:,})"
    )
    if lines:
        console.print("[bold]gaps for the default policy:[/bold]")
        for line in lines:
            console.print(f"  - {line}", markup=False, highlight=False)
    else:
        console.print("gaps for the default policy: none")
    if quarantined:
        console.print("[bold]quarantined worker groups (exit never confirmed):[/bold]")
        for q in quarantined:
            present = q["present"]
            now = "on another host" if present is None else f"processes now: {present or 'none'}"
            console.print(
                plain(f"  - run {q['run_id']} (tree {q['root_id']}): group {q['group']}, {now}")
            )
    else:
        console.print("quarantined worker groups: none")


def _quarantined(store: str | None) -> list[dict[str, Any]]:
    """The journal's quarantined worker groups; [] when there is no journal to read."""
    url = store or default_store_url()
    try:
        with Journal(url) as journal:
            return journal.quarantined()
    except brood.BroodError:
        return []


def _ray_address(arg: str) -> bool:
    """Whether an argument after a bare `--ray` is its address (else it is the next one)."""
    return arg in ("auto", RAY_HERE) or arg.startswith("ray://") or bool(_ADDRESS.fullmatch(arg))


_ADDRESS = re.compile(r"[\w.\-\[\]:]+:\d+")


def with_bare_ray(args: list[str]) -> list[str]:
    """`--ray` given without an address means a Ray started here (`--ray local`); click
    cannot take an option whose value is optional, so the command line is completed."""
    out: list[str] = []
    for i, arg in enumerate(args):
        out.append(arg)
        if arg == "--ray" and (i + 1 == len(args) or not _ray_address(args[i + 1])):
            out.append(RAY_HERE)
    return out


def main() -> None:  # pragma: no cover - console entry
    """The `brood` command."""
    try:
        app(args=with_bare_ray(sys.argv[1:]), prog_name="brood")
    finally:
        # The command is over, its tree ended: a late Ctrl-C would only print a traceback
        # from the interpreter's shutdown (which waits for its threads), so it is ignored.
        signal.signal(signal.SIGINT, signal.SIG_IGN)


if __name__ == "__main__":  # pragma: no cover
    main()

"""What model calls cost: priced by the user, by the model itself or by genai-prices, each
call's cost journaled and summed into its run's and its tree's usage, unknown (null, said
once per run) where nobody knows it, `cost_budget` holding a tree to a known price, and
the cost shown by `brood show/tree/ps`, the dashboard and the OpenAI-compatible endpoint.

The openai model is the real `openai` client against tests/fake_openai.py; the model
names are real ones genai-prices knows (gpt-4o-mini) and one it does not.
"""

from __future__ import annotations

import math
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest
import uvicorn
from genai_prices import Usage, calc_price
from typer.testing import CliRunner

import brood
from brood.cli.main import app
from brood.journal import Journal
from brood.serve import make_app
from fake_openai import FakeOpenAI, Reply
from tests.util import fast

KNOWN = "gpt-4o-mini"  # genai-prices prices it (openai)
UNKNOWN = "brood-test-model-nobody-prices"
FENCE = "```"


def code(source: str) -> str:
    return f"{FENCE}repl\n{source}\n{FENCE}"


def price_of(model: str, tokens_in: int, tokens_out: int) -> float:
    """What genai-prices itself says a call costs: the truth the supervisor must match."""
    priced = calc_price(
        Usage(input_tokens=tokens_in, output_tokens=tokens_out),
        model_ref=model,
        provider_id="openai",
    )
    return float(priced.total_price)


@pytest.fixture(autouse=True)
def no_ambient_openai_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OPENAI_BASE_URL", "OPENAI_API_KEY", "BROOD_MODEL", "BROOD_STORE"):
        monkeypatch.delenv(name, raising=False)


def tree_script() -> dict[str, list[Reply]]:
    """A root that starts a child, whose code makes a plain call: three calls, two runs."""
    return {
        "root task": [
            Reply(
                code("FINAL('root got: ' + rlm_query('child task'))"),
                prompt_tokens=50_000,
                completion_tokens=900,
            )
        ],
        "child task": [
            Reply(
                code("FINAL('child says ' + llm_query('say hi'))"),
                prompt_tokens=40_000,
                completion_tokens=800,
            )
        ],
        "say hi": [Reply("hi", prompt_tokens=3_000, completion_tokens=100)],
    }


def events_of(sup: brood.Supervisor, run_id: str, kind: str) -> list[dict[str, Any]]:
    return [e["data"] for e in sup.store.events(run_id, kind)]


def cli(*args: str) -> str:
    """`brood ARGS` in this process (read commands: no worker); what it printed."""
    out = CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})  # type: ignore[arg-type]
    assert out.exit_code == 0, out.output
    return out.output


def run_tree(tmp_path: Path, model: str, **kw: Any) -> tuple[str, str, dict[str, Any]]:
    """The tree of tree_script() on `model` through the fake server: the journal's URL,
    the root's id, and each run's model_call and cost_unknown events by run id."""
    url = f"sqlite:///{tmp_path / 'brood.db'}"
    with FakeOpenAI(tree_script()) as srv:
        spec = f"openai:{model}@{srv.base_url}"
        with brood.Supervisor(spec, store=url, limits=fast(), **kw) as sup:
            result = sup.run("root task")
            assert (result.state, result.answer) == ("completed", "root got: child says hi")
            events = {
                r["id"]: {
                    kind: events_of(sup, r["id"], kind) for kind in ("model_call", "cost_unknown")
                }
                for r in sup.store.runs(result.run_id)
            }
    return url, result.run_id, events


def test_a_known_models_calls_are_priced_journaled_and_summed_through_the_tree(tmp_path):
    url, root_id, events = run_tree(tmp_path, KNOWN)
    with Journal(url) as journal:
        tree = journal.tree(root_id)
    (child,) = tree["children"]
    root_calls = events[root_id]["model_call"]
    child_calls = events[child["id"]]["model_call"]
    # Each call's cost is journaled on its event: what genai-prices says of its tokens.
    assert [c["cost"] for c in root_calls] == [price_of(KNOWN, 50_000, 900)]
    assert [c["cost"] for c in child_calls] == [
        price_of(KNOWN, 40_000, 800),
        price_of(KNOWN, 3_000, 100),
    ]
    assert all(c["cost"] > 0 for c in root_calls + child_calls)
    assert not events[root_id]["cost_unknown"] and not events[child["id"]]["cost_unknown"]
    # Summed into each run's own usage, and its subtree's.
    assert tree["usage"]["cost"] == pytest.approx(root_calls[0]["cost"])
    assert child["usage"]["cost"] == pytest.approx(sum(c["cost"] for c in child_calls))
    total = sum(c["cost"] for c in root_calls + child_calls)
    assert tree["subtree_usage"]["cost"] == pytest.approx(total)
    assert tree["subtree_usage"]["unpriced_calls"] == 0
    # gpt-4o-mini: $0.15 in, $0.60 out per million tokens, as its published price.
    assert total == pytest.approx((93_000 * 0.15 + 1_800 * 0.6) / 1e6)

    # The CLI shows it: brood show (own and subtree), brood tree, brood ps's COST column.
    own, whole = f"${tree['usage']['cost']:.4g}", f"${total:.4g}"
    shown = cli("show", root_id, "--store", url)
    assert f"usage: 1 calls, 50900 tok, {own}; subtree 3 calls, 94800 tok, {whole}" in shown
    drawn = cli("tree", root_id, "--store", url)
    assert whole in drawn and f"${child['usage']['cost']:.4g}" in drawn
    listed = cli("ps", "--store", url)
    assert "COST" in listed and whole in listed
    logged = cli("logs", child["id"], "--store", url)
    assert f"${child_calls[1]['cost']:.4g}" in logged
    assert cli("show", root_id, "--json", "--store", url).count('"cost"') == 2


def test_an_unknown_models_cost_is_null_said_once_per_run_and_not_zero(tmp_path):
    url = f"sqlite:///{tmp_path / 'brood.db'}"
    with FakeOpenAI(tree_script()) as srv:
        spec = f"openai:{UNKNOWN}@{srv.base_url}"
        # A cost_budget cannot hold what nobody prices: the tree runs, and the journal says so.
        with brood.Supervisor(spec, store=url, limits=fast(cost_budget=0.000001)) as sup:
            result = sup.run("root task")
            runs = sup.store.runs(result.run_id)
            said = {
                r["id"]: [e["data"] for e in sup.store.events(r["id"], "cost_unknown")]
                for r in runs
            }
            calls = {
                r["id"]: [e["data"] for e in sup.store.events(r["id"], "model_call")] for r in runs
            }
    assert result.state == "completed", result
    assert result.usage["cost"] is None and result.usage["unpriced_calls"] == 1
    child_id = next(r["id"] for r in runs if r["parent_id"] == result.run_id)
    assert [len(calls[result.run_id]), len(calls[child_id])] == [1, 2]
    assert all(c["cost"] is None for cs in calls.values() for c in cs)
    # Said once per run (the child made two unpriced calls and says it once), naming it.
    for run_id in (result.run_id, child_id):
        (event,) = said[run_id]
        assert event["model"] == UNKNOWN and event["provider"] == "openai"
        assert "genai-prices has no price" in event["why"] and "--price" in event["fix"]
        assert "not counted" in event["cost_budget"]
    with Journal(url) as journal:
        tree = journal.tree(result.run_id)
    assert tree["subtree_usage"]["cost"] is None
    assert tree["subtree_usage"]["unpriced_calls"] == 3
    assert "3 calls, 94800 tok, cost unknown" in cli("show", result.run_id, "--store", url)
    assert "cost unknown" in cli("tree", result.run_id, "--store", url)
    row = next(line for line in cli("ps", "--store", url).splitlines() if result.run_id in line)
    assert " ? " in row
    assert "cost_unknown" in cli("logs", child_id, "--store", url)


class Billed(brood.Model):
    """A model that reports its own cost: 100 input and 10 output tokens, $0.25 a call."""

    name = "billed"

    def complete(self, messages, model=None):
        return brood.Completion(
            code("FINAL(llm_query('q'))") if _turn(messages) else "a", 100, 10, 0.25
        )


def _turn(messages: list[dict[str, Any]]) -> bool:
    return any(m["role"] == "system" for m in messages)


def test_user_prices_override_the_models_own_and_genai_prices(tmp_path):
    # The model's own report counts when nobody else prices it.
    with brood.Supervisor(Billed(), limits=fast()) as sup:
        result = sup.run("task")
    assert result.usage["cost"] == pytest.approx(0.5) and result.usage["unpriced_calls"] == 0
    # The user's price wins over it, as a Price or an (input, output) pair...
    for given in (brood.Price(1.0, 2.0), (1.0, 2.0)):
        with brood.Supervisor(Billed(), limits=fast(), prices={"billed": given}) as sup:
            result = sup.run("task")
        assert result.usage["cost"] == pytest.approx(2 * (100 * 1.0 + 10 * 2.0) / 1e6)
    # ... and over genai-prices: a whole tree priced at the user's price.
    _, _, events = run_tree(tmp_path, KNOWN, prices={KNOWN: brood.Price(1000, 2000)})
    costs = [c["cost"] for e in events.values() for c in e["model_call"]]
    tokens = [(50_000, 900), (40_000, 800), (3_000, 100)]
    assert sorted(costs) == pytest.approx(sorted((i * 1000 + o * 2000) / 1e6 for i, o in tokens))
    # A scripted model has no provider: unknown, unless the user prices it.
    scripted = brood.ScriptedModel([code("FINAL('x')")], tokens_per_call=(1_000, 500))
    with brood.Supervisor(scripted, limits=fast()) as sup:
        assert sup.run("t").usage["cost"] is None
    with brood.Supervisor(scripted, limits=fast(), prices={"scripted": (3.0, 6.0)}) as sup:
        assert sup.run("t").usage["cost"] == pytest.approx((1_000 * 3 + 500 * 6) / 1e6)


def test_cost_budget_stops_a_tree_at_a_known_price():
    # Each call costs $0.15 (a million input tokens of gpt-4o-mini); the budget is $0.40.
    def answer(body: dict[str, Any]) -> Reply:
        if body["messages"][0]["role"] == "system":
            loop = "for i in range(20):\n    llm_query(f'q{i}')\nFINAL('outspent the budget')"
            return Reply(code(loop), prompt_tokens=1_000_000, completion_tokens=0)
        return Reply("ok", prompt_tokens=1_000_000, completion_tokens=0)

    with FakeOpenAI(answer) as srv:
        spec = f"openai:{KNOWN}@{srv.base_url}"
        with brood.Supervisor(spec, limits=fast(cost_budget=0.40)) as sup:
            result = sup.run("spend")
            calls = [e["data"] for e in sup.store.events(result.run_id, "model_call")]
    one = price_of(KNOWN, 1_000_000, 0)
    assert one == pytest.approx(0.15)
    assert result.state == "cancelled" and "budget: cost" in (result.error or ""), result
    # Stopped at the call that went over: the budget is overshot by one call at most.
    answered = [c for c in calls if c["error"] is None]
    assert len(answered) == math.ceil(0.40 / one + 1e-9) == 3
    assert result.usage["cost"] == pytest.approx(3 * one)


@contextmanager
def serving(tmp_path: Path, **kw: Any) -> Iterator[httpx.Client]:
    """brood serve's app in a thread on a loopback port; its hosted supervisor closed after."""
    server_app = make_app(store_url=f"sqlite:///{tmp_path / 'brood.db'}", token="t0ken", **kw)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(server_app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            assert thread.is_alive(), "the server did not start"
            threading.Event().wait(0.02)
        headers = {"Authorization": "Bearer t0ken"}
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=headers, timeout=60) as c:
            yield c
    finally:
        server.should_exit = True
        thread.join(60)
        sock.close()


def test_the_openai_compatible_endpoint_and_the_dashboard_show_the_trees_cost(tmp_path):
    script = {
        "root": [code("FINAL(rlm_query('child: a'))")],
        "child: a": [code("FINAL('from child')")],
    }
    model = brood.ScriptedModel(script, tokens_per_call=(10_000, 1_000))
    with serving(tmp_path, model=model, limits=fast(), prices={"scripted": (2.0, 8.0)}) as c:
        chat = {"model": "scripted", "messages": [{"role": "user", "content": "root"}]}
        reply = c.post("/v1/chat/completions", json=chat)
        assert reply.status_code == 200, reply.text
        usage = reply.json()["usage"]
        per_call = (10_000 * 2.0 + 1_000 * 8.0) / 1e6
        assert usage["cost"] == pytest.approx(2 * per_call) and usage["unpriced_calls"] == 0
        assert usage["total_tokens"] == 22_000
        run_id = reply.headers["x-brood-run-id"]
        page = c.get("/ui/runs").text + c.get(f"/ui/runs/{run_id}").text
        assert f"${2 * per_call:.4g}" in page


def refused(*args: str) -> str:
    """`brood ARGS` that must be refused (exit 2) before it starts anything: what it said."""
    env = {"COLUMNS": "200", "BROOD_MODEL": None, "BROOD_STORE": None}
    out = CliRunner().invoke(app, list(args), env=env)  # type: ignore[arg-type]
    assert out.exit_code == 2, out.output
    return " ".join(out.output.split())


@pytest.mark.parametrize(
    ("price", "said"),
    [
        ("abc,1", "--price 'abc,1' holds something that is not a number"),
        ("-1,2", "--price '-1,2': a price is a number >= 0"),
        ("0.5", "--price '0.5' is not two numbers"),
        ("1,2,3", "--price '1,2,3' is not two numbers"),
        ("nan,1", "--price 'nan,1': a price is a number >= 0"),
        ("=1,2", "--price '=1,2' names no model before '='"),
    ],
)
def test_a_bad_price_is_refused_naming_the_option_and_its_form(tmp_path, price, said):
    store = f"sqlite:///{tmp_path}/j.db"
    for command in (
        ["run", "a task", "--model", "scripted:demo"],
        ["flow", "run", str(tmp_path / "f.yaml"), "--model", "scripted:demo"],
        ["resume", "r-00000000", "--model", "scripted:demo"],
    ):
        output = refused(*command, "--store", store, "--price", price)
        assert said in output and "--price IN,OUT (dollars per million" in output, output
    assert not (tmp_path / "j.db").exists()  # refused before the journal was opened


def test_a_price_for_no_model_and_bad_prices_in_python_are_refused(tmp_path):
    output = refused("run", "t", "--store", f"sqlite:///{tmp_path}/j.db", "--price", "1,2")
    assert "--price '1,2' prices the command's model, and there is none" in output
    with pytest.raises(brood.InvalidArgument, match=r"prices\['m'\]: Price\(input=...\) must"):
        brood.Supervisor(brood.ScriptedModel(["x"]), prices={"m": (-1, 2)})
    with pytest.raises(brood.InvalidArgument, match=r"prices\['m'\] must be a brood.Price"):
        brood.Session(brood.ScriptedModel(["x"]), prices={"m": "1,2"})
    with pytest.raises(brood.InvalidArgument, match=r"Price\(output=\.\.\.\) must be dollars"):
        brood.Price(1, "2")  # type: ignore[arg-type]
    with pytest.raises(brood.InvalidArgument, match="prices must be a mapping"):
        brood.Supervisor(brood.ScriptedModel(["x"]), prices=[(1, 2)])  # type: ignore[arg-type]

"""FINAL(answer, products=...): a JSON object beside the answer, read by the parent with
rlm_products(h) / h.products(), kept in the journal, shown by `brood show` and `export`."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import brood
from brood.cli.main import app
from tests.util import FAST, Gate

FENCE = "```"


def code(source: str) -> str:
    return f"{FENCE}repl\n{source}\n{FENCE}"


def test_a_parent_reads_its_childs_products_and_the_journal_keeps_them(tmp_path):
    url = f"sqlite:///{tmp_path}/j.db"

    def chat_fn(messages):
        prompt = messages[1]["content"]
        if prompt.startswith("child"):
            return code("FINAL('built', products={'files': ['a.py'], 'score': 3})")
        return code(
            "h = rlm_spawn('child: build')\n"
            "rlm_wait(h)\n"
            "p = rlm_products(h)\n"
            "import json\n"
            "FINAL(json.dumps(p, sort_keys=True), products={'child': h.id})"
        )

    with brood.Supervisor(chat_fn, store=url, limits=FAST) as sup:
        h = sup.spawn("root")
        answer = h.wait(timeout=60)
        root_products = h.products()
        child_row = next(r for r in sup.store.runs(h.id) if r["parent_id"] == h.id)
    assert json.loads(answer) == {"files": ["a.py"], "score": 3}
    assert root_products == {"child": child_row["id"]}
    assert child_row["products"] == {"files": ["a.py"], "score": 3}

    shown = CliRunner().invoke(app, ["show", child_row["id"], "--store", url])
    assert shown.exit_code == 0, shown.output
    assert 'products: {"files": ["a.py"], "score": 3}' in shown.output
    shown = CliRunner().invoke(app, ["show", child_row["id"], "--store", url, "--json"])
    assert json.loads(shown.output)["products"] == {"files": ["a.py"], "score": 3}
    exported = CliRunner().invoke(app, ["export", h.id, "--store", url])
    records = [json.loads(line) for line in exported.output.splitlines()]
    last_of_child = [r for r in records if r["run_id"] == child_row["id"]][-1]
    assert last_of_child["products"] == {"files": ["a.py"], "score": 3}
    assert [r for r in records if r["run_id"] == h.id][-1]["products"] == root_products


def test_a_run_without_products_has_none():
    with brood.Supervisor(lambda m: code("FINAL('plain')"), limits=FAST) as sup:
        h = sup.spawn("root")
        assert h.wait(timeout=60) == "plain"
        assert h.products() is None
        assert sup.store.get_run(h.id)["products"] is None


@pytest.mark.parametrize(
    ("products", "message"),
    [
        ("[1, 2]", "products must be a JSON object (a dict with str keys), got list"),
        ("{1: 'x'}", "products must be a JSON object (a dict with str keys), got dict"),
        ("{'x': float('nan')}", "products must be JSON (Out of range float values"),
        ("{'x': object()}", "products must be JSON (Object of type object"),
    ],
)
def test_products_that_are_not_a_json_object_are_refused_and_the_run_goes_on(products, message):
    replies = [
        code(
            f"try:\n    FINAL('bad', products={products})\n"
            "except InvalidArgument as e:\n    print(e)"
        ),
        lambda m: code(f"FINAL({m[-1]['content']!r})"),
    ]
    with brood.Supervisor(brood.ScriptedModel({"root": replies}), limits=FAST) as sup:
        result = sup.run("root")
    assert result.state == "completed"
    assert message in result.answer, result.answer


def test_rlm_products_of_a_child_going_or_failed_raises_like_rlm_result(tmp_path):
    gate = Gate(tmp_path, "child")

    def chat_fn(messages):
        prompt = messages[1]["content"]
        if prompt.startswith("child dies"):
            return code("import os; os._exit(3)")
        if prompt.startswith("child"):
            return gate.blocking_reply(code("FINAL('x')"))(messages)
        return code(
            "out = []\n"
            "h = rlm_spawn('child slow')\n"
            "try:\n    rlm_products(h)\nexcept ChildNotReady:\n    out.append('not ready')\n"
            f"open({gate.path!r}, 'w').write('go')\n"
            "rlm_wait(h)\n"
            "out.append(repr(rlm_products(h)))\n"
            "d = rlm_spawn('child dies')\n"
            "try:\n    rlm_products(d) if rlm_wait_any([d]) else None\n"
            "except ChildFailed as e:\n    out.append(e.status)\n"
            "try:\n    rlm_products('r-x')\nexcept InvalidArgument:\n    out.append('bad')\n"
            "FINAL(','.join(out))"
        )

    with brood.Supervisor(chat_fn, limits=FAST) as sup:
        result = sup.run("root")
    assert result.answer == "not ready,None,failed,bad", result

"""Flows at scale: a 1,000-node fan (DAG form) and a 10,000-item foreach complete.

The 10,000-item foreach is marked `scale` (make test-all; about 100 s here): make test runs
its smaller version, the 1,000-item foreach of test_flow_more.

Replies are self-contained lambdas over the prompt: a reply that calls a function of this
module would make every worker import the test module (and pytest with it).
"""

from __future__ import annotations

import pytest

import brood
from tests.test_flow_run import split_then_each
from tests.util import fast

LIMITS = fast(max_depth=2, max_concurrency=16)
FINAL_OK = "```repl\nFINAL('ok')\n```"


def test_a_thousand_node_fan_completes():
    nodes = [{"id": "root", "prompt": "Root", "outputs": ["text"]}] + [
        {"id": f"n{i}", "prompt": f"Leaf {i} {{text}}", "depends_on": ["root"], "outputs": ["text"]}
        for i in range(1000)
    ]
    model = brood.ScriptedModel({"Root": [FINAL_OK], "Leaf": [FINAL_OK]})
    with brood.Supervisor(model, limits=LIMITS) as sup:
        flow = sup.flow_run({"name": "fan", "run": {"max_parallel": 16}, "nodes": nodes})
        assert flow.wait(timeout=600) == "finished"
        status = flow.status()
        runs = sup.store.runs(flow.id)
    assert all(status["states"][f"n{i}"]["entries"] == 1 for i in range(1000))
    assert len(runs) == 1 + 1 + 1000 and {r["state"] for r in runs} == {"completed"}


@pytest.mark.scale
@pytest.mark.timeout(300)  # about 100 s here; a loaded machine must not fail it
def test_a_ten_thousand_item_foreach_completes():
    spec = split_then_each("Item {item}", max_items=10000) | {"run": {"max_parallel": 16}}
    model = brood.ScriptedModel(
        {
            "Split": ["```repl\nFINAL(str(list(range(10000))))\n```"],
            "Item": [lambda m: "```repl\nFINAL(" + repr(m[1]["content"].split()[1]) + ")\n```"],
        }
    )
    with brood.Supervisor(model, limits=LIMITS) as sup:
        flow = sup.flow_run(spec)
        assert flow.wait(timeout=900) == "finished"
        out = flow.outputs()["each"]["text"]
        counts = flow.status()["states"]["each"]["counts"]
    assert out == [str(i) for i in range(10000)]
    assert counts == {"completed": 10000}

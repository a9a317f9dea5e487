"""Tracing on a Ray cluster of two nodes on this machine (Postgres journal): a child placed
on the other node (placement="spread") carries its span there, so the runs it starts there
are in the same trace, under it. Spans are made in the agents' processes, so what is read
here is what every node journals of its spans (each run's `trace` event: trace id, span id,
parent span id)."""

from __future__ import annotations

import sys

import pytest

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.ray

import cloudpickle  # noqa: E402

import brood  # noqa: E402
from brood.store.base import open_store  # noqa: E402
from tests.ray_util import BOUND_S, agent_pids, assert_nothing_left  # noqa: E402
from tests.util import FAST  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])

FENCE = "```"


def repl(code: str) -> str:
    return f"{FENCE}repl\n{code}\n{FENCE}"


def test_a_spread_childs_runs_on_the_other_node_are_under_its_span(ray_cluster, fresh_pg_url):
    model = brood.ScriptedModel(
        {
            "T0P-task": [repl("FINAL(rlm_wait(rlm_spawn('SPREAD-task', placement='spread')))")],
            "SPREAD-task": [repl("FINAL('spread: ' + rlm_query('LEAF-task'))")],
            "LEAF-task": [repl("FINAL('leaf')")],
        }
    )
    with brood.Cluster(model, store=fresh_pg_url, limits=FAST, tracing=True) as cluster:
        pids = agent_pids(cluster)
        h = cluster.spawn("T0P-task")
        assert h.wait(timeout=BOUND_S) == "spread: leaf"
    store = open_store(fresh_pg_url, readonly=True)
    try:
        rows = {r["prompt"]: r for r in store.runs(h.id)}
        traced = {e["run_id"]: e["data"] for e in store.events(kind="trace", root_id=h.id)}
    finally:
        store.close()
    top, spread, leaf = rows["T0P-task"], rows["SPREAD-task"], rows["LEAF-task"]
    # The spread child and the run it started ran on the other node.
    assert spread["supervisor"] == leaf["supervisor"] != top["supervisor"]
    assert set(traced) == {top["id"], spread["id"], leaf["id"]}
    assert len({d["trace_id"] for d in traced.values()}) == 1  # one trace, across nodes
    assert "parent_span_id" not in traced[top["id"]]
    assert traced[spread["id"]]["parent_span_id"] == traced[top["id"]]["span_id"]
    # Made on the other node, under the span the spread child's node sent with it.
    assert traced[leaf["id"]]["parent_span_id"] == traced[spread["id"]]["span_id"]
    assert_nothing_left(pids)

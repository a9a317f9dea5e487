"""Children placed on another node: rlm_query(..., placement="spread") on a Ray cluster of
two nodes on this machine, with a Postgres journal. A spread child runs under the other
node's agent and is still a child for every helper: status, wait, send, cancel with
confirmed exit, and the tree-wide limits its root's node keeps."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.ray

import cloudpickle  # noqa: E402

import brood  # noqa: E402
from brood.cluster import AgentLost  # noqa: E402
from brood.journal import Journal  # noqa: E402
from brood.models.scripted import read_log  # noqa: E402
from brood.store.base import open_store  # noqa: E402
from tests.ray_util import BOUND_S, agent_pids, assert_nothing_left, pid_gone, poll  # noqa: E402
from tests.util import FAST, fast  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])

FENCE = "```"


def repl(code: str) -> str:
    return f"{FENCE}repl\n{code}\n{FENCE}"


def wait_for_file(path: str) -> None:
    """In a scripted reply (the agent's gateway): block until the test creates `path`."""
    deadline = time.monotonic() + BOUND_S
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.02)


ROOT = repl(
    "import time\n"
    "s = rlm_spawn('child S: echo', placement='spread')\n"
    "rlm_send(s, 'extra words')\n"
    "t = rlm_spawn('child T: hang', placement='spread')\n"
    "while rlm_status(t) != 'running':\n"
    "    time.sleep(0.01)\n"
    "cancelled = rlm_cancel(t)\n"
    "answer = rlm_wait(s)\n"
    "FINAL(answer + '|' + cancelled + '|' + rlm_status(t) + '|' + str(len(rlm_children())))"
)


def spread_model(tmp_path: Path) -> brood.ScriptedModel:
    folder = str(tmp_path)

    def s_first(messages):
        wait_for_file(os.path.join(folder, "go-S"))
        return repl("print('S looked')")

    def s_second(messages):
        seen = any("extra words" in str(m.get("content")) for m in messages)
        return repl(f"FINAL({'got extra' if seen else 'no extra'!r})")

    def t_hang(messages):
        open(os.path.join(folder, "in-T"), "w").close()
        wait_for_file(os.path.join(folder, "release-T"))
        return repl("FINAL('T done')")

    return brood.ScriptedModel(
        {"root": [ROOT], "child S": [s_first, s_second], "child T": [t_hang]}
    )


def test_a_spread_child_runs_on_the_other_node_and_is_waited_messaged_and_cancelled(
    ray_cluster, fresh_pg_url, tmp_path
):
    model = spread_model(tmp_path)
    with brood.Cluster(model, store=fresh_pg_url, limits=FAST) as cluster:
        store = open_store(fresh_pg_url, readonly=True)
        try:
            pids = agent_pids(cluster)
            h = cluster.spawn("root task")

            def s_row():
                rows = [r for r in store.runs(h.id) if r["prompt"].startswith("child S")]
                if rows and store.events(rows[0]["id"], "message"):
                    return rows[0]

            s = poll(s_row, "the follow-up to S journaled")
            (tmp_path / "go-S").touch()
            assert h.wait(timeout=BOUND_S) == "got extra|cancelled|cancelled|2"
            rows = {r["prompt"].split(":")[0]: r for r in store.runs(h.id)}
            root, s, t = rows["root task"], rows["child S"], rows["child T"]
            # Both children ran under the other node's supervisor, and say where.
            assert s["supervisor"] == t["supervisor"] != root["supervisor"]
            assert (s["parent_id"], t["parent_id"]) == (h.id, h.id)
            placed = store.events(s["id"], "placed")
            assert placed and placed[0]["data"]["node_id"] != h.node_id
            assert (s["state"], s["answer"]) == ("completed", "got extra")
            assert t["state"] == "cancelled" and "cancelled by parent" in t["reason"]
            # rlm_cancel returned after the exit of T's worker on its node was confirmed.
            assert t["pid"] and pid_gone(t["pid"])
            # The export puts each request's system prompt back, journaled on either node.
            with Journal(fresh_pg_url) as journal:
                records = list(journal.export(h.id))
            s_turns = [r for r in records if r["run_id"] == s["id"]]
            assert len(s_turns) == 2
            assert all(r["messages"][0]["role"] == "system" for r in s_turns)
            assert "rlm_query" in s_turns[0]["messages"][0]["content"]
            (tmp_path / "release-T").touch()
        finally:
            store.close()
    assert_nothing_left(pids)


LIMITED_ROOT = repl(
    "s = rlm_spawn('child S: fan out', placement='spread')\nFINAL('root: ' + rlm_wait(s))"
)
FAN_OUT = repl(
    "a = rlm_query('leaf one')\n"
    "try:\n"
    "    rlm_query('leaf two')\n"
    "except Exception as e:\n"
    "    a += ' / ' + type(e).__name__ + ': ' + str(e)\n"
    "FINAL(a)"
)


def test_the_tree_wide_limits_hold_for_children_started_on_another_node(ray_cluster, fresh_pg_url):
    model = brood.ScriptedModel(
        {
            "root": [LIMITED_ROOT],
            "child S": [FAN_OUT],
            "leaf": [repl("FINAL('leaf')")],
        }
    )
    with brood.Cluster(model, store=fresh_pg_url, limits=fast(max_children=2)) as cluster:
        pids = agent_pids(cluster)
        answer = cluster.run("root task").answer or ""
    # S (1) and its first leaf (2) are admitted by the root's node; the second leaf is not.
    assert answer.startswith("root: leaf / LimitExceeded")
    assert "max_children" in answer
    assert_nothing_left(pids)


def test_the_tree_budget_holds_for_model_calls_made_on_another_node(ray_cluster, fresh_pg_url):
    model = brood.ScriptedModel(
        {
            "root": [repl("s = rlm_spawn('child S', placement='spread')\nFINAL(rlm_wait(s))")],
            "child S": [repl("for i in range(100):\n    llm_query(f'question {i}')\nFINAL('all')")],
            "question": ["an answer"],
        },
        tokens_per_call=(120, 40),
    )
    budget = 1000  # the root's turn, S's turn, then S's questions until it is spent
    with brood.Cluster(model, store=fresh_pg_url, limits=fast(token_budget=budget)) as cluster:
        pids = agent_pids(cluster)
        result = cluster.run("root task")
        store = open_store(fresh_pg_url, readonly=True)
        try:
            rows = store.runs(result.run_id)
        finally:
            store.close()
    assert result.state == "cancelled" and "budget: tokens" in (result.error or ""), result
    (s,) = [r for r in rows if r["parent_id"]]
    assert s["supervisor"] != rows[0]["supervisor"] and s["state"] == "cancelled"
    spent = sum(
        r["usage"].get("input_tokens", 0) + r["usage"].get("output_tokens", 0) for r in rows
    )
    # The root's node admitted S's calls one at a time against the tree's budget: it is
    # overshot by one call at most.
    assert budget < spent <= budget + 160
    assert_nothing_left(pids)


FLOW = {
    "name": "one",
    "states": [{"id": "ask", "entry": True, "prompt": "root task", "outputs": ["text"]}],
}


@pytest.mark.parametrize("method", ["spawn", "flow_run"])
def test_a_tree_journaled_by_an_agent_that_died_before_answering_is_resumed_not_doubled(
    ray_cluster, fresh_pg_url, monkeypatch, method
):
    model = brood.ScriptedModel(
        {"root": [repl("FINAL(rlm_query('child A'))")], "child A": [repl("FINAL('A done')")]}
    )
    with brood.Cluster(model, store=fresh_pg_url, limits=FAST) as cluster:
        pids = agent_pids(cluster)
        call = cluster._call
        died: list[object] = []

        def dies_after_starting(agent, name, *args, **kw):
            value = call(agent, name, *args, **kw)
            if name == method and not died:  # the tree is journaled and started there
                died.append(agent)
                ray.kill(agent.actor)
                raise AgentLost(agent)
            return value

        monkeypatch.setattr(cluster, "_call", dies_after_starting)
        if method == "spawn":
            h = cluster.spawn("root task")
            assert h.wait(timeout=BOUND_S) == "A done"
        else:
            h = cluster.flow_run(FLOW)
            assert h.wait(timeout=BOUND_S) == "finished"
            assert h.outputs()["ask"]["text"] == "A done"
        assert died and h.node_id != died[0].node_id
        store = open_store(fresh_pg_url, readonly=True)
        try:
            roots = store.roots(limit=10)
        finally:
            store.close()
    # One tree: the one the lost agent journaled, resumed elsewhere, not a second start.
    assert [r["id"] for r in roots] == [h.id]
    assert_nothing_left(pids)


def test_a_spread_child_takes_its_nodes_pool_and_is_retried_on_another_node(
    ray_cluster, fresh_pg_url, tmp_path
):
    folder = str(tmp_path)

    def r_turn(messages):  # the first attempt's worker dies; the second answers
        flag = os.path.join(folder, "first-attempt")
        if not os.path.exists(flag):
            open(flag, "w").close()
            return repl("import os\nos._exit(3)")
        return repl("FINAL('R done')")

    model = brood.ScriptedModel(
        {
            "root": [
                repl(
                    "r = rlm_query('child R', placement='spread', pool='gpu', retries=1)\n"
                    "FINAL('root:' + r)"
                )
            ],
            "child R": [r_turn],
        }
    )
    limits = fast(pools={"gpu": 1})
    with brood.Cluster(model, store=fresh_pg_url, limits=limits) as cluster:
        pids = agent_pids(cluster)
        result = cluster.run("root task")
        store = open_store(fresh_pg_url, readonly=True)
        try:
            rows = [r for r in store.runs(result.run_id) if r["parent_id"]]
            pool_events = {r["id"]: store.events(r["id"], "pool") for r in rows}
            root_owner = store.get_run(result.run_id)["supervisor"]
        finally:
            store.close()
    assert (result.state, result.answer) == ("completed", "root:R done")
    first, second = sorted(rows, key=lambda r: r["attempt"])
    assert (first["state"], second["state"]) == ("failed", "completed")
    assert "status 3" in first["reason"] and first["key"] == second["key"]
    for row in rows:  # each attempt on the other node, holding a place of that node's pool
        assert row["supervisor"] != root_owner
        assert any(e["data"].get("taken") for e in pool_events[row["id"]])
    assert_nothing_left(pids)


def test_a_spread_child_ends_with_its_parent(ray_cluster, fresh_pg_url, tmp_path):
    folder = str(tmp_path)

    def t_hang(messages):
        open(os.path.join(folder, "in-T"), "w").close()
        wait_for_file(os.path.join(folder, "release-T"))
        return repl("FINAL('T done')")

    model = brood.ScriptedModel(
        {
            "root": [repl("t = rlm_spawn('child T', placement='spread')\nFINAL('left')")],
            "child T": [t_hang],
        }
    )
    with brood.Cluster(model, store=fresh_pg_url, limits=FAST) as cluster:
        store = open_store(fresh_pg_url, readonly=True)
        try:
            pids = agent_pids(cluster)
            result = cluster.run("root task")
            assert (result.state, result.answer) == ("completed", "left")
            (t,) = [r for r in store.runs(result.run_id) if r["parent_id"]]
            # Its parent finished: the child on the other node was cancelled, its exit
            # confirmed there, before the root's end was journaled.
            assert t["state"] == "cancelled" and "parent finished" in t["reason"]
            assert t["ended_at"] <= store.get_run(result.run_id)["ended_at"]
            (tmp_path / "release-T").touch()
        finally:
            store.close()
    assert_nothing_left(pids)


def test_a_spread_childs_lost_node_has_its_subtree_resumed_by_the_parents_node(
    ray_cluster, fresh_pg_url, tmp_path
):
    folder = str(tmp_path)

    def s_second(messages):  # in the gateway of the agent running S (os.getpid() is its pid)
        open(os.path.join(folder, f"in-S2-{os.getpid()}"), "w").close()
        wait_for_file(os.path.join(folder, f"release-{os.getpid()}"))
        return repl("FINAL('S:' + g)")

    model = brood.ScriptedModel(
        {
            "root": [repl("s = rlm_spawn('child S', placement='spread')\nFINAL(rlm_wait(s))")],
            "child S": [repl("g = rlm_query('grandchild G')\nprint(g)"), s_second],
            "grandchild G": [repl("FINAL('g')")],
        },
        log_path=tmp_path / "calls.jsonl",
    )
    with brood.Cluster(model, store=fresh_pg_url, limits=FAST) as cluster:
        pids = agent_pids(cluster)
        h = cluster.spawn("root task")
        home = next(a for a in cluster._agents if a.node_id == h.node_id)
        other = next(a for a in cluster._agents if a is not home)
        (tmp_path / f"release-{home.pid}").touch()
        poll(lambda: (tmp_path / f"in-S2-{other.pid}").exists(), "S's second turn on its node")
        ray.kill(other.actor)  # the node agent holding S and G dies
        assert h.wait(timeout=BOUND_S) == "S:g"
        store = open_store(fresh_pg_url, readonly=True)
        try:
            rows = {r["prompt"]: r for r in store.runs(h.id)}
            s, g = rows["child S"], rows["grandchild G"]
            # S was resumed by its parent's node; G, which ended on the lost node, was
            # adopted by key with its journaled answer, not started again.
            assert s["supervisor"] == rows["root task"]["supervisor"] == home.token
            assert (s["state"], g["state"]) == ("completed", "completed")
            assert len(rows) == 3 and store.events(s["id"], "resume")
        finally:
            store.close()
    calls = read_log(tmp_path / "calls.jsonl")
    turns = [(c["key"], c["turn"], c["pid"]) for c in calls]
    # Recorded replies were not asked for again: S's first turn and G's once each; S's
    # second turn, never answered on the lost node, was asked again on the parent's.
    assert turns.count(("child S", 0, other.pid)) == 1
    assert [t for t in turns if t[0] == "grandchild G"] == [("grandchild G", 0, other.pid)]
    assert ("child S", 1, home.pid) in turns
    assert_nothing_left(pids)


def held_spread_child(tmp_path: Path, s_code: str) -> brood.ScriptedModel:
    """A root that places child S on another node and answers 'root:' + its answer. S's one
    turn announces itself (file `in-S-PID`, PID its agent's), waits for file `release-S`,
    then runs `s_code`; `grandchild G` answers 'g'."""
    folder = str(tmp_path)

    def s_turn(messages):
        open(os.path.join(folder, f"in-S-{os.getpid()}"), "w").close()
        wait_for_file(os.path.join(folder, "release-S"))
        return repl(s_code)

    return brood.ScriptedModel(
        {
            "root": [
                repl("s = rlm_spawn('child S', placement='spread')\nFINAL('root:' + rlm_wait(s))")
            ],
            "child S": [s_turn],
            "grandchild G": [repl("FINAL('g')")],
        },
        log_path=tmp_path / "calls.jsonl",
    )


def test_a_tree_whose_node_is_lost_takes_its_live_spread_child_back(
    ray_cluster, fresh_pg_url, tmp_path
):
    model = held_spread_child(tmp_path, "FINAL('S done')")
    with brood.Cluster(model, store=fresh_pg_url, limits=FAST) as cluster:
        pids = agent_pids(cluster)
        h = cluster.spawn("root task")
        victim = next(a for a in cluster._agents if a.node_id == h.node_id)
        other = next(a for a in cluster._agents if a is not victim)
        poll(lambda: (tmp_path / f"in-S-{other.pid}").exists(), "S running on the other node")
        ray.kill(victim.actor)  # the root's node agent dies; S's goes on
        poll(lambda: h.node_id == other.node_id, "the tree resumed on the other node")
        (tmp_path / "release-S").touch()
        assert h.wait(timeout=BOUND_S) == "root:S done"
        store = open_store(fresh_pg_url, readonly=True)
        try:
            (s,) = [r for r in store.runs(h.id) if r["parent_id"]]
            running = [t for t in store.transitions(s["id"]) if t["to"] == "running"]
            resumed = store.events(s["id"], "resume")
        finally:
            store.close()
    # S was not started again nor resumed: the resumed root adopted the live run by key.
    assert len(running) == 1 and not resumed
    assert s["state"] == "completed" and s["supervisor"] == other.token
    turns = [(c["key"], c["turn"]) for c in read_log(tmp_path / "calls.jsonl")]
    assert turns.count(("child S", 0)) == 1 and turns.count(("root", 0)) == 1
    assert_nothing_left(pids)


def test_a_node_that_joins_gets_an_agent_and_a_resumed_tree_follows_its_spread_child(
    ray_cluster, fresh_pg_url, tmp_path
):
    model = held_spread_child(tmp_path, "g = rlm_query('grandchild G')\nFINAL('S:' + g)")
    with brood.Cluster(model, store=fresh_pg_url, limits=fast(max_children=2)) as cluster:
        assert len(agent_pids(cluster)) == 2
        # Last in this module: a third node joins the module's Ray cluster, and gets an
        # agent of its own without the cluster being asked.
        ray_cluster.add_node(num_cpus=1)
        ray_cluster.wait_for_nodes()
        pids = poll(lambda: len(agent_pids(cluster)) == 3 and agent_pids(cluster), "3 agents")
        h = cluster.spawn("root task")
        victim = next(a for a in cluster._agents if a.node_id == h.node_id)
        s_home = poll(
            lambda: next(
                (a for a in cluster._agents if (tmp_path / f"in-S-{a.pid}").exists()), None
            ),
            "S running on another node",
        )
        ray.kill(victim.actor)  # the root's node agent dies; S's goes on
        third = next(a for a in cluster._agents if a not in (victim, s_home))
        poll(lambda: h.node_id == third.node_id, "the tree resumed on the third node")
        (tmp_path / "release-S").touch()
        # S's grandchild was admitted by the root's new node (the tree's 2nd child of 2).
        assert h.wait(timeout=BOUND_S) == "root:S:g"
        store = open_store(fresh_pg_url, readonly=True)
        try:
            rows = {r["prompt"]: r for r in store.runs(h.id)}
            running = store.transitions(rows["child S"]["id"])
        finally:
            store.close()
    assert rows["root task"]["supervisor"] == third.token
    assert rows["child S"]["supervisor"] == rows["grandchild G"]["supervisor"] == s_home.token
    assert [t["to"] for t in running].count("running") == 1
    turns = [(c["key"], c["turn"]) for c in read_log(tmp_path / "calls.jsonl")]
    assert turns.count(("child S", 0)) == 1 and turns.count(("root", 0)) == 1
    assert_nothing_left(pids)

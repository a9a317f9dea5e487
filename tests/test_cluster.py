"""brood.Cluster on a real Ray cluster of two nodes on this machine, with a Postgres journal.

The Ray cluster (`ray_cluster`, tests/ray_util.py) is started once for the module (about
12 s here) and shut down at its end. The autouse leak check of conftest.py looks for
processes whose brood owner is this test process; the node agents' workers are owned by the
agents' processes, so each test here checks those itself, by the agents' pids, after close().
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from importlib import resources
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

# Ray's driver leaves gRPC threads in this process, and a process forked beside them may
# crash (tests of confinement fork the test process): make test runs these in a pytest of
# their own (`-m ray`).
pytestmark = pytest.mark.ray

import cloudpickle  # noqa: E402

import brood  # noqa: E402
from brood.errors import RayMissing  # noqa: E402
from brood.models.demo import ROOT_TASK  # noqa: E402
from brood.models.scripted import read_log  # noqa: E402
from brood.store.base import open_store  # noqa: E402
from tests.ray_util import BOUND_S, agent_pids, assert_nothing_left, held, poll  # noqa: E402
from tests.util import FAST  # noqa: E402

# The scripted replies below are functions of this module, which Ray's workers cannot
# import: pickle them by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

FENCE = "```"


def repl(code: str) -> str:
    return f"{FENCE}repl\n{code}\n{FENCE}"


ROOT = [
    repl("h = rlm_spawn('child A: count')\nr = rlm_query('child B: slow')\nprint(r)"),
    repl("FINAL(rlm_wait(h) + '|' + r)"),
]
CHILD_A = [repl("FINAL('A done')")]


def assert_run_by_an_agent(url: str, run_id: str) -> None:
    """The journal's owner of `run_id` is a node agent, not this process."""
    store = open_store(url, readonly=True)
    try:
        owner = store.get_run(run_id)["supervisor"]
        assert store.supervisor(owner)["pid"] != os.getpid()
    finally:
        store.close()


def tree_model(tmp_path: Path) -> brood.ScriptedModel:
    """A root that starts children A and B and waits for both. Child B's model call
    announces itself (file `in-b-PID`, PID the agent's) and answers only in an agent whose
    pid has a `release-PID` file: the test releases the agents it chooses."""
    child_b = held(str(tmp_path), "b", repl("FINAL('B done')"))
    return brood.ScriptedModel(
        {"root": ROOT, "child A": CHILD_A, "child B": [child_b]},
        log_path=tmp_path / "calls.jsonl",  # key, turn and pid (the agent's) of each call
    )


def test_trees_are_placed_on_different_nodes_and_close_leaves_nothing(
    ray_cluster, fresh_pg_url, tmp_path
):
    model = tree_model(tmp_path)
    with brood.Cluster(model, store=fresh_pg_url, limits=FAST) as cluster:
        pids = agent_pids(cluster)
        assert len(pids) == 2
        for pid in pids:
            (tmp_path / f"release-{pid}").touch()
        handles = [cluster.spawn(f"root task {i}") for i in range(2)]
        nodes = {h.node_id for h in handles}
        assert len(nodes) == 2, "two trees on an idle two-node cluster go to both nodes"
        for h in handles:
            assert h.wait(timeout=BOUND_S) == "A done|B done"
            assert h.status() == "completed"
        result = cluster.run("root task 3")
        assert (result.state, result.answer) == ("completed", "A done|B done")
        # An agent's refusal arrives as brood's own error, not Ray's wrapper of it.
        with pytest.raises(brood.BroodError, match="has nothing to resume"):
            cluster.resume(result.run_id)
        with pytest.raises(brood.UnknownRun):
            cluster.resume("r-nosuchrun")
        stats = cluster.statistics()
        assert set(stats["nodes"]) == nodes
        assert stats["totals"]["runs"]["completed"] == 9
        # The journal names each tree's owner: two supervisors, each with its tree whole.
        store = open_store(fresh_pg_url, readonly=True)
        try:
            owners = {h.id: {r["supervisor"] for r in store.runs(h.id)} for h in handles}
        finally:
            store.close()
    assert all(len(o) == 1 for o in owners.values())
    assert len(set().union(*owners.values())) == 2
    assert_nothing_left(pids)


def test_cancel_and_a_failed_root_through_the_cluster(ray_cluster, fresh_pg_url, tmp_path):
    model = tree_model(tmp_path)  # nothing released: child B waits
    with brood.Cluster(model, store=fresh_pg_url, limits=FAST) as cluster:
        pids = agent_pids(cluster)
        h = cluster.spawn("root task")
        poll(lambda: list(tmp_path.glob("in-b-*")), "child B's model call")
        with pytest.raises(TimeoutError, match="keeps running"):
            h.wait(timeout=0.2)
        assert h.cancel() == "cancelled"
        with pytest.raises(brood.ChildFailed) as info:
            h.wait(timeout=BOUND_S)
        assert info.value.status == "cancelled"
        failed = cluster.run("no such key")
        assert failed.state == "failed" and "ScriptedModel" in (failed.error or "")
    assert_nothing_left(pids)
    with pytest.raises(brood.StaleHandle):
        h.status()
    with pytest.raises(brood.SupervisorClosed):
        cluster.spawn("root task")


def test_a_node_removed_mid_tree_is_resumed_on_the_other_node(ray_cluster, fresh_pg_url, tmp_path):
    model = tree_model(tmp_path)
    head = ray_cluster.head_node
    with brood.Cluster(model, store=fresh_pg_url, limits=FAST) as cluster:
        stats = cluster.statistics()["nodes"]
        head_id = next(n for n in stats if n == head.node_id)
        survivor_pid = stats[head_id]["pid"]
        lost_pid = next(s["pid"] for n, s in stats.items() if n != head_id)
        (tmp_path / f"release-{survivor_pid}").touch()  # only the head answers child B
        # An idle cluster places its first two trees on both nodes: take the other one's.
        handles = [cluster.spawn(f"root task {i}") for i in range(2)]
        h = next(h for h in handles if h.node_id != head_id)
        poll(lambda: (tmp_path / f"in-b-{lost_pid}").exists(), "child B's call on the lost node")
        other = next(n for n in ray_cluster.worker_nodes if n.node_id != head_id)
        ray_cluster.remove_node(other)
        assert h.wait(timeout=BOUND_S) == "A done|B done"
        assert h.node_id == head_id
        assert cluster.statistics()["lost_nodes"] == [other.node_id]
        for g in handles:
            assert g.wait(timeout=BOUND_S) == "A done|B done"
        store = open_store(fresh_pg_url, readonly=True)
        try:
            runs = store.runs(h.id)
            events = [e["kind"] for e in store.events(h.id)]
        finally:
            store.close()
    # One child per key: adopted on the resume, none started twice.
    children = sorted((r["key"], r["state"]) for r in runs if r["parent_id"])
    assert children == [("1:0", "completed"), ("1:1", "completed")]
    assert "resume" in events
    # No recorded model call was made again: the survivor asked the root's first turn once,
    # for its own tree; the resumed tree's first turn was replayed from the journal.
    on_survivor = [
        (c["key"], c["turn"])
        for c in read_log(tmp_path / "calls.jsonl")
        if c["pid"] == survivor_pid
    ]
    assert on_survivor.count(("root", 0)) == 1
    assert on_survivor.count(("root", 1)) == 2
    assert on_survivor.count(("child B", 0)) == 2
    assert_nothing_left([survivor_pid])
    # The lost node's processes went with it (Ray killed its workers); nothing of it stays.
    assert_nothing_left([lost_pid])
    ray_cluster.add_node(num_cpus=1)  # the next tests get two nodes again
    ray_cluster.wait_for_nodes()


def test_a_wrong_address_is_refused_within_seconds(fresh_pg_url):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free once closed: nothing listens there
    start = time.monotonic()
    with pytest.raises(
        brood.BackendError, match=f"no Ray cluster answers at ray_address '127.0.0.1:{port}'"
    ):
        brood.Cluster("scripted:demo", store=fresh_pg_url, ray_address=f"127.0.0.1:{port}")
    assert time.monotonic() - start < 10
    with pytest.raises(brood.InvalidArgument, match="ray_address must be HOST:PORT"):
        brood.Cluster("scripted:demo", store=fresh_pg_url, ray_address="nowhere")


def test_a_store_this_process_cannot_open_is_refused_before_ray(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # refused before Ray is even imported
    with pytest.raises(brood.StoreError, match="cannot open journal postgres"):
        brood.Cluster("scripted:demo", store="postgresql://u@/brood?host=/nonexistent")
    with pytest.raises(brood.InvalidArgument, match="private temporary journal"):
        brood.Cluster("scripted:demo", store="sqlite:///:memory:")


def test_sqlite_is_refused_on_two_nodes_and_store_is_required(ray_cluster, tmp_path):
    url = f"sqlite:///{tmp_path}/j.db"
    with pytest.raises(brood.InvalidArgument, match=r"SQLite file.*2 nodes: use a Postgres"):
        brood.Cluster("scripted:demo", store=url)
    with pytest.raises(brood.InvalidArgument, match="store is required"):
        brood.Cluster("scripted:demo", store=None)  # type: ignore[arg-type]
    lock = threading.Lock()

    def chat(messages):  # holds a lock: it cannot be pickled for the agents
        with lock:
            return "FINAL('x')"

    with pytest.raises(brood.InvalidArgument, match="model cannot be pickled"):
        brood.Cluster(chat, store=url)


def test_the_address_of_the_connected_cluster_is_accepted(ray_cluster, fresh_pg_url, tmp_path):
    model = tree_model(tmp_path)
    with brood.Cluster(model, store=fresh_pg_url, ray_address=ray_cluster.address) as cluster:
        pids = agent_pids(cluster)
        assert len(pids) == 2
    assert_nothing_left(pids)


def test_without_ray_the_error_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(RayMissing, match=r"pip install -e '\.\[ray\]'"):
        brood.Cluster("scripted:demo", store=f"sqlite:///{tmp_path}/j.db")
    assert issubclass(RayMissing, ImportError) and issubclass(RayMissing, brood.BroodError)


def test_a_killed_agent_on_a_live_node_has_its_tree_resumed_and_leaves_nothing(
    ray_cluster, fresh_pg_url, tmp_path
):
    model = tree_model(tmp_path)
    with brood.Cluster(model, store=fresh_pg_url, limits=FAST) as cluster:
        agents = {a.pid: a for a in cluster._agents}  # the test kills one by its actor
        first, second = (cluster.spawn(f"root task {i}") for i in range(2))
        victim = next(a for a in agents.values() if a.node_id == second.node_id)
        survivor = next(a for a in agents.values() if a is not victim)
        (tmp_path / f"release-{survivor.pid}").touch()
        poll(lambda: (tmp_path / f"in-b-{victim.pid}").exists(), "child B's call on the victim")
        ray.kill(victim.actor, no_restart=True)
        # No handle is used: the cluster's monitor finds the death and resumes the tree.
        poll(lambda: second.node_id == survivor.node_id, "the tree resumed on the survivor")
        assert second.wait(timeout=BOUND_S) == first.wait(timeout=BOUND_S) == "A done|B done"
        store = open_store(fresh_pg_url, readonly=True)
        try:
            runs = store.runs(second.id)
            lease = store.supervisor(victim.token)
        finally:
            store.close()
    assert lease is not None and lease["lease_until"] == 0  # revoked
    # The survivor owns what was unfinished (the root, child B); a child that had ended on
    # the victim (child A, if it was quick) keeps its owner there.
    owners = {r["key"] or "root": r["supervisor"] for r in runs}
    assert owners["root"] == owners["1:1"] == survivor.token
    assert sorted(r["key"] for r in runs if r["parent_id"]) == ["1:0", "1:1"]
    # The killed agent's zygote and workers, on a node that lives on, are gone too.
    assert_nothing_left([survivor.pid, victim.pid])


SINGLE_NODE = """
import json, sys
import ray
from ray.cluster_utils import Cluster
import brood
c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
try:
    model = brood.ScriptedModel(["```repl\\nFINAL(str(6*7))\\n```"])
    with brood.Cluster(model, store=sys.argv[1], ray_address=c.address) as cluster:
        nodes = len(cluster.statistics()["nodes"])
        result = cluster.run("any task")
        connected = ray.is_initialized()
    print(json.dumps({"nodes": nodes, "answer": result.answer, "connected": connected,
                      "after_close": ray.is_initialized()}))
finally:
    c.shutdown()
"""


def test_one_node_takes_a_relative_sqlite_file_and_close_disconnects_what_it_connected(
    tmp_path,
):
    """In a process of its own (this one is connected to the module's cluster): connect by
    address, run on the one node with a SQLite journal named relative to the working
    directory (the agent's own working directory is Ray's), and leave Ray at close."""
    proc = subprocess.run(
        [sys.executable, "-c", SINGLE_NODE, "sqlite:///j.db"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=BOUND_S * 2,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report == {"nodes": 1, "answer": "42", "connected": True, "after_close": False}
    assert (tmp_path / "j.db").exists()


def test_brood_run_with_ray_runs_the_tree_on_the_cluster(ray_cluster, fresh_pg_url):
    from typer.testing import CliRunner

    from brood.cli.main import app

    notes = resources.files("brood").joinpath("data", "field_notes.md")
    args = ["run", ROOT_TASK, "--context", str(notes), "--model", "scripted:demo"]
    args += ["--store", fresh_pg_url, "--ray", ray_cluster.address, "--json"]
    done = CliRunner().invoke(app, args)
    assert done.exit_code == 0, done.output
    result = json.loads(done.stdout)
    assert result["state"] == "completed" and result["answer"].startswith("15 sightings")
    assert_run_by_an_agent(fresh_pg_url, result["run_id"])

    wrong = ["run", "task", "--model", "scripted:demo", "--store", fresh_pg_url]
    refused = CliRunner().invoke(app, [*wrong, "--ray", "127.0.0.1:9"])
    assert refused.exit_code == 2 and "no Ray cluster answers" in refused.output


# ---- flows on the cluster ------------------------------------------------------------------

OWLS_FLOW = """
name: owls
states:
  - id: split
    entry: true
    prompt: "Split {topic}"
    inputs: [topic]
    outputs: [{name: items, type: json}]
  - id: each
    prompt: "Describe {item}"
    inputs: [{name: item, from: split.items, type: json}]
    foreach: {over: item, max: 4}
    outputs: [text]
transitions:
  - {from: split, to: each}
"""
OWLS_SCRIPT = {
    "Split": [repl("import json\nFINAL(json.dumps({'items': ['barn', 'snowy']}))")],
    "barn": [repl("FINAL('barn owl')")],
    "snowy": [repl("FINAL('snowy owl')")],
}


def test_a_flow_runs_on_a_node_and_its_outcome_is_in_the_journal(
    ray_cluster, fresh_pg_url, tmp_path, monkeypatch
):
    from brood.journal import Journal

    monkeypatch.chdir(tmp_path)  # the spec's path is relative to this process, not Ray's
    (tmp_path / "owls.yaml").write_text(OWLS_FLOW)
    model = brood.ScriptedModel(OWLS_SCRIPT)
    with brood.Cluster(model, store=fresh_pg_url, limits=FAST) as cluster:
        pids = agent_pids(cluster)
        # A bad spec is refused here, at once, as Supervisor.flow_run refuses it; a refusal
        # of the agent's (a missing input) arrives as brood's own error.
        with pytest.raises(brood.InvalidSpec, match="wrok"):
            cluster.flow_run(OWLS_FLOW.replace("to: each", "to: wrok"))
        with pytest.raises(brood.InvalidArgument, match="flow inputs missing: topic"):
            cluster.flow_run("owls.yaml")
        flow = cluster.flow_run("owls.yaml", inputs={"topic": "owls"})
        assert flow.started == ["split"]
        assert flow.node_id in cluster.statistics()["nodes"]
        assert flow.wait(timeout=BOUND_S) == "finished"
        outputs = flow.outputs()
        assert outputs["split"] == {"items": ["barn", "snowy"]}
        assert flow.status()["status"] == "finished"
        assert flow.stop()["cancelled"] == []  # an ended flow: nothing to cancel
        with pytest.raises(brood.BroodError, match="only a paused flow resumes"):
            flow.resume()
        assert cluster.flow(flow.id).started == ["split"]
    with pytest.raises(brood.StaleHandle):
        flow.status()
    with Journal(fresh_pg_url) as journal:
        status = journal.flow_status(flow.id)
        run = journal.store.get_run(flow.id)
        owner = journal.store.supervisor(run["supervisor"])
    assert status["status"] == "finished"
    described = status["states"]["each"]["instances"]
    assert sorted(i["item"] for i in described) == [0, 1]
    assert {i["state"] for i in described} == {"completed"}
    assert run["state"] == "completed" and json.loads(run["answer"]) == outputs
    assert owner is not None and owner["pid"] in pids  # a node agent ran it
    assert_nothing_left(pids)


def slow_flow_model(tmp_path: Path) -> brood.ScriptedModel:
    """One state whose model call announces itself (`in-slow-PID`, PID the agent's) and
    answers only in an agent whose pid has a `release-PID` file."""
    slow = held(str(tmp_path), "slow", repl("FINAL('slow done')"))
    return brood.ScriptedModel({"Go slow": [slow]})


def test_a_flow_whose_agent_is_killed_is_resumed_from_its_ledger_on_the_other_node(
    ray_cluster, fresh_pg_url, tmp_path
):
    spec = {
        "name": "slow",
        "states": [{"id": "slow", "entry": True, "prompt": "Go slow", "outputs": ["text"]}],
    }
    with brood.Cluster(slow_flow_model(tmp_path), store=fresh_pg_url, limits=FAST) as cluster:
        agents = list(cluster._agents)  # the test kills one by its actor
        flow = cluster.flow_run(spec)
        victim = next(a for a in agents if a.node_id == flow.node_id)
        survivor = next(a for a in agents if a is not victim)
        (tmp_path / f"release-{survivor.pid}").touch()
        poll(lambda: (tmp_path / f"in-slow-{victim.pid}").exists(), "the state's model call")
        ray.kill(victim.actor, no_restart=True)
        assert flow.wait(timeout=BOUND_S) == "finished"
        assert flow.node_id == survivor.node_id
        assert flow.outputs() == {"slow": {"text": "slow done"}}
        store = open_store(fresh_pg_url, readonly=True)
        try:
            runs = store.runs(flow.id)
            kinds = [e["data"]["kind"] for e in store.events(flow.id, "flow")]
        finally:
            store.close()
    assert {r["id"]: r["supervisor"] for r in runs}[flow.id] == survivor.token
    # One instance: its child was adopted by key on the resume, not started again.
    assert [r["state"] for r in runs if r["parent_id"]] == ["completed"]
    assert kinds.count("flow_started") == 1 and kinds[-1] == "flow_ended"
    assert_nothing_left([survivor.pid, victim.pid])


def test_brood_flow_run_with_ray_runs_the_flow_on_the_cluster(ray_cluster, fresh_pg_url, tmp_path):
    from typer.testing import CliRunner

    from brood.cli.main import app, with_bare_ray
    from tests.fake_openai import FakeOpenAI

    bare = with_bare_ray(["flow", "run", "owls.yaml", "--ray"])
    assert bare == ["flow", "run", "owls.yaml", "--ray", "local"]
    spec = tmp_path / "owls.yaml"
    spec.write_text(OWLS_FLOW)
    with FakeOpenAI(OWLS_SCRIPT) as server:
        args = ["flow", "run", str(spec), "--input", "topic=owls", "--no-live", "--json"]
        args += ["--model", f"openai:m@{server.base_url}", "--store", fresh_pg_url]
        done = CliRunner().invoke(app, [*args, "--ray", ray_cluster.address])
    assert done.exit_code == 0, done.output
    report = json.loads(done.stdout)
    assert report["status"] == "finished"
    assert report["outputs"]["split"] == {"items": ["barn", "snowy"]}
    assert_run_by_an_agent(fresh_pg_url, report["run_id"])


def test_close_names_the_node_and_pids_an_agent_could_not_confirm(ray_cluster, fresh_pg_url):
    from brood.cluster import AgentRef

    class StuckAgent:  # a node agent whose workers would not die: its close() says so
        def ping(self):
            return True

        def close(self):
            return {"error": "ChildCleanupError: group 4242 not confirmed", "pids": [4242, 4243]}

    cluster = brood.Cluster("scripted:demo", store=fresh_pg_url, limits=FAST)
    pids = agent_pids(cluster)
    stuck = ray.remote(num_cpus=0)(StuckAgent).remote()
    info = {"token": "t", "pid": 99999, "host": "node-x", "node_id": "n-stuck-0123456789"}
    cluster._agents.append(AgentRef(stuck, info))
    with pytest.raises(brood.ChildCleanupError) as caught:
        cluster.close()
    message = str(caught.value)
    assert "node n-stuck-0123456789 (node-x, agent pid 99999)" in message
    assert "[4242, 4243] not confirmed gone" in message and "kill them by pid" in message
    assert caught.value.pids == [4242, 4243]
    # The real agents closed all the same, confirming their own workers' exits.
    assert_nothing_left(pids)

"""brood.Cluster: trees per second on 1, 2 and 3 simulated Ray nodes, and the time from a
node agent's death to its trees running again on a survivor.

Everything runs on this one machine: a real PostgreSQL server (the Debian package's
binaries, a Unix socket in a temporary folder, as tests/pg.py starts it) holds the journal,
and `ray.cluster_utils.Cluster` simulates the nodes (one CPU each, no dashboard). The nodes
share this machine's cores (2 here, and other work may be running), so more nodes do not
bring more CPU: the node figures measure what placement across agents costs and gains on
one machine, not what separate machines would give. Read them that way.

Throughput. A tree is a root whose one scripted turn starts 3 children with
`rlm_query_batched` and returns their answers; each child answers FINAL at once. TREES trees
(`--trees N`, default 300) are spawned all at once and then waited, timed from the first
spawn to the last answer:

  local supervisor  one `brood.Supervisor` in this process on the Postgres journal (the floor)
  cluster, k nodes  `brood.Cluster` on a Ray cluster of k nodes (k = 1, 2, 3: nodes are added
                    to one Ray cluster between configurations; starting Ray and adding a node
                    are timed apart and not counted)

Each configuration gets a fresh database and one untimed warm-up tree per supervisor first.
The default is 300 trees, not the issue's 2,000: on this loaded 2-core machine 2,000 trees
in each of four configurations do not fit the few minutes a benchmark is given. Pass
`--trees 2000` for the issue's figure.

Recovery. On the 2-node cluster, ROUNDS times with a fresh database and a fresh
`brood.Cluster`: TREES_RECOVERY trees whose third child's model call blocks until a file
for its agent's pid exists (only the survivor's is written), then the other agent is killed
(`ray.kill`). Timed from just before the kill to each of the dead agent's trees running
again on the survivor: the `resume` event's timestamp in the journal, and (polled every
POLL_S) the root's journal row owned by the survivor's supervisor and `running`. Medians.

No targets are set: the issue asks for the numbers.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import sys
import tempfile
import time
from contextlib import AbstractContextManager
from typing import Any

import ray
from ray.cluster_utils import Cluster as RayCluster

import brood
from _common import MS, Row, finish, median, no_leftovers, wait_until

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from brood.backends.owners import processes_of
from brood.store.base import open_store
from tests.pg import local_postgres, new_database
from tests.ray_util import pid_gone, ray_pids

BENCH = "cluster"
TREES = 300
NODE_COUNTS = (1, 2, 3)
ROUNDS = 3  # recovery rounds
TREES_RECOVERY = 4  # per round, on two agents: two on the agent that is killed
POLL_S = 0.005
BOUND_S = 120.0  # every wait here gives up after this long

FENCE = "```"
ROOT = f"{FENCE}repl\nFINAL('|'.join(rlm_query_batched(['leaf 0', 'leaf 1', 'leaf 2'])))\n{FENCE}"
STALLED_ROOT = (
    f"{FENCE}repl\nFINAL('|'.join(rlm_query_batched(['leaf 0', 'leaf 1', 'stall 2'])))\n{FENCE}"
)
LEAF = f"{FENCE}repl\nFINAL('x')\n{FENCE}"
STALLED_ANSWER = "x|x|x"


def limits() -> brood.Limits:
    return brood.Limits(shutdown_grace=0.5, term_grace=0.5, step_timeout=None)


def stall_reply(folder: str) -> Any:
    """A model reply that announces itself (`in-PID-N`, PID the agent's) and answers only
    once `release-PID` exists."""

    def stall(messages: list[dict[str, Any]]) -> str:
        pid = os.getpid()
        open(os.path.join(folder, f"in-{pid}-{time.monotonic_ns()}"), "w").close()
        deadline = time.monotonic() + BOUND_S
        while not os.path.exists(os.path.join(folder, f"release-{pid}")):
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
        return LEAF

    return stall


# ---- Postgres: started as the tests start theirs (tests/pg.py) ----------------------------


def postgres() -> AbstractContextManager[str]:
    """A PostgreSQL server on a Unix socket in a temporary folder; its URL. Stopped after."""
    return local_postgres("54339", "max_connections=300")


def fresh_database(server: str) -> str:
    return new_database(server, prefix="brood_bench_")


# ---- Ray -----------------------------------------------------------------------------------


def agents(cluster: brood.Cluster) -> list[Any]:
    """The cluster's node agents (its internals: this benchmark kills one by its actor)."""
    return list(cluster._agents)


def agent_pids(cluster: brood.Cluster) -> list[int]:
    return [a.pid for a in agents(cluster)]


def check_agents_gone(pids: list[int]) -> None:
    """Every agent process has exited, and no brood process of any agent is left."""
    wait_until(
        lambda: not [p for a in pids for p in processes_of(a)], BOUND_S, "agents' workers gone"
    )
    wait_until(lambda: all(pid_gone(p) for p in pids), BOUND_S, "agent processes gone")


# ---- throughput ----------------------------------------------------------------------------


def wait_all(handles: list[Any]) -> None:
    for h in handles:
        answer = h.wait(timeout=BOUND_S * 5)
        if answer != "x|x|x":
            raise RuntimeError(f"tree {h.id} answered {answer!r}")


def local_trees(model: brood.ScriptedModel, url: str, trees: int) -> float:
    with brood.Supervisor(model, store=url, limits=limits()) as sup:
        wait_all([sup.spawn("tree warm-up")])
        t0 = time.perf_counter()
        handles = [sup.spawn(f"tree {i}") for i in range(trees)]
        wait_all(handles)
        return time.perf_counter() - t0


def cluster_trees(model: brood.ScriptedModel, url: str, trees: int, nodes: int) -> float:
    with brood.Cluster(model, store=url, limits=limits()) as cluster:
        pids = agent_pids(cluster)
        if len(pids) != nodes:
            raise RuntimeError(f"expected {nodes} node agents, got {len(pids)}")
        wait_all([cluster.spawn(f"tree warm-up {i}") for i in range(nodes)])  # one per agent
        t0 = time.perf_counter()
        handles = [cluster.spawn(f"tree {i}") for i in range(trees)]
        wait_all(handles)
        elapsed = time.perf_counter() - t0
    check_agents_gone(pids)
    return elapsed


# ---- recovery ------------------------------------------------------------------------------


def recovery_round(server: str, folder: str) -> list[tuple[float, float]]:
    """One kill; (seconds to the resume event, seconds to the row seen running on the
    survivor) for each tree of the killed agent."""
    for f in glob.glob(os.path.join(folder, "*")):
        os.unlink(f)
    model = brood.ScriptedModel(
        {"tree": [STALLED_ROOT], "leaf": [LEAF], "stall": [stall_reply(folder)]}
    )
    url = fresh_database(server)
    with brood.Cluster(model, store=url, limits=limits()) as cluster:
        pids = agent_pids(cluster)
        handles = [cluster.spawn(f"tree {i}") for i in range(TREES_RECOVERY)]
        placed = {
            a.node_id: [h for h in handles if h.node_id == a.node_id] for a in agents(cluster)
        }
        victim, survivor = sorted(agents(cluster), key=lambda a: len(placed[a.node_id]))[::-1]
        open(os.path.join(folder, f"release-{survivor.pid}"), "w").close()
        lost = placed[victim.node_id]
        if not lost:
            raise RuntimeError("no tree was placed on the agent to be killed")
        wait_until(
            lambda: len(glob.glob(os.path.join(folder, f"in-{victim.pid}-*"))) >= len(lost),
            BOUND_S,
            "the stalled children's model calls on the victim",
        )
        store = open_store(url, readonly=True)
        try:
            seen: dict[str, float] = {}
            wall0 = time.time()
            t0 = time.perf_counter()
            ray.kill(victim.actor, no_restart=True)
            deadline = t0 + BOUND_S
            while len(seen) < len(lost):
                if time.perf_counter() > deadline:
                    raise TimeoutError("the killed agent's trees were not resumed")
                for h in lost:
                    if h.id in seen:
                        continue
                    row = store.get_run(h.id)
                    if row["supervisor"] == survivor.token and row["state"] == "running":
                        seen[h.id] = time.perf_counter() - t0
                time.sleep(POLL_S)
            for h in handles:
                answer = h.wait(timeout=BOUND_S)
                if answer != STALLED_ANSWER:
                    raise RuntimeError(f"tree {h.id} answered {answer!r}")
            out = []
            for h in lost:
                events = store.events(h.id, "resume")
                if not events:
                    raise RuntimeError(f"tree {h.id} has no resume event")
                out.append((events[0]["at"] - wall0, seen[h.id]))
        finally:
            store.close()
    check_agents_gone(pids)
    return out


# ---- main ----------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", metavar="PATH", help="also write the result rows here")
    parser.add_argument(
        "--trees", type=int, default=TREES, help=f"trees per configuration ({TREES})"
    )
    args = parser.parse_args()
    trees: int = args.trees
    model = brood.ScriptedModel({"tree": [ROOT], "leaf": [LEAF]})
    folder = tempfile.mkdtemp(prefix="brood-bench-cluster-")
    rates: dict[str, float] = {}
    resumes: list[tuple[float, float]] = []
    starts: dict[str, float] = {}
    pids: list[int] = []
    try:
        with postgres() as server:
            rates["local"] = trees / local_trees(model, fresh_database(server), trees)
            print(f"local supervisor: {rates['local']:.1f} trees/s", flush=True)
            t0 = time.perf_counter()
            rc = RayCluster(
                initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False}
            )
            try:
                ray.init(address=rc.address, log_to_driver=False)
                rc.wait_for_nodes()
                starts["ray head"] = time.perf_counter() - t0
                for n in NODE_COUNTS:
                    while len(rc.worker_nodes) + 1 < n:
                        t0 = time.perf_counter()
                        rc.add_node(num_cpus=1)
                        rc.wait_for_nodes()
                        starts[f"node {len(rc.worker_nodes) + 1}"] = time.perf_counter() - t0
                    elapsed = cluster_trees(model, fresh_database(server), trees, n)
                    rates[f"{n} node"] = trees / elapsed
                    print(f"cluster, {n} node(s): {rates[f'{n} node']:.1f} trees/s", flush=True)
                    if n == 2:
                        for _ in range(ROUNDS):
                            resumes += recovery_round(server, folder)
                        print(f"recovery: {len(resumes)} trees resumed", flush=True)
            finally:
                pids = ray_pids(rc)
                ray.shutdown()
                rc.shutdown()
                wait_until(lambda: all(pid_gone(p) for p in pids), BOUND_S, "Ray's processes gone")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    left = no_leftovers(BENCH)
    ray_left = [p for p in pids if not pid_gone(p)]
    if ray_left:
        print(f"[{BENCH}] Ray processes left behind: {ray_left}")
        left += ray_left

    print(
        f"\n{trees} trees (root + 3 children) per configuration; machine: "
        f"{os.cpu_count()} cores shared by every simulated node. Not counted: "
        + ", ".join(f"{k} started in {v:.1f} s" for k, v in starts.items())
    )
    rows = [Row(BENCH, "trees/s, local supervisor", rates["local"], "/s")]
    for n in NODE_COUNTS:
        rate = rates[f"{n} node"]
        print(
            f"cluster on {n} node(s): {rate:7.1f} trees/s = {rate / rates['local']:.2f}x "
            f"the local supervisor's {rates['local']:.1f} trees/s"
        )
        rows.append(Row(BENCH, f"trees/s, cluster on {n} node(s)", rate, "/s", rates["local"]))
    to_event = [r[0] for r in resumes]
    to_row = [r[1] for r in resumes]
    print(
        f"recovery, {len(resumes)} trees over {ROUNDS} kills: kill to resume event median "
        f"{median(to_event) * MS:.0f} ms (max {max(to_event) * MS:.0f}); kill to root seen "
        f"running on the survivor median {median(to_row) * MS:.0f} ms (max {max(to_row) * MS:.0f})"
    )
    rows += [
        Row(BENCH, "agent killed -> resume event (median)", median(to_event), "s"),
        Row(BENCH, "agent killed -> root running on survivor (median)", median(to_row), "s"),
    ]
    finish(BENCH, rows, left, args.json)


if __name__ == "__main__":
    main()

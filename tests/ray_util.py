"""The Ray cluster the `ray` tests share, and the helpers that check a cluster left nothing.

`ray_cluster` is a real Ray cluster of two nodes on this machine (ray.cluster_utils), made
once per test module (about 12 s here): a module that removes a node gets a whole cluster
again in the next one. It is registered for every test module by conftest.py, and Ray is
imported only when a test asks for it, so `import tests.ray_util` works without Ray.

The autouse leak check of conftest.py looks for processes whose brood owner is the test
process; a node agent's workers are owned by the agent's process, so tests of a cluster
check those themselves, by the agents' pids, after close() (`assert_nothing_left`).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import cloudpickle
import pytest

from brood.backends.owners import processes_of

# Scripted replies made here run in the node agents, which cannot import this module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

if TYPE_CHECKING:
    import brood

BOUND_S = 60.0  # every poll in these tests gives up after this long
POLL_S = 0.05  # how often a poll looks again

T = TypeVar("T")


def poll(check: Callable[[], T], what: str, bound: float = BOUND_S) -> T:
    """Poll `check()` until it returns something true; fail naming `what` after `bound` s."""
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(POLL_S)
    pytest.fail(f"{what}: not seen within {bound} s")


def pid_gone(pid: int) -> bool:
    """True once `pid` has exited (a zombie has: only its parent has not reaped it yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def assert_nothing_left(agent_pids: list[int]) -> None:
    """No brood process of any agent is left; each agent process itself has exited."""
    poll(lambda: not [p for a in agent_pids for p in processes_of(a)], "agents' workers gone")
    poll(lambda: all(pid_gone(p) for p in agent_pids), "agent processes gone")


def agent_pids(cluster: brood.Cluster) -> list[int]:
    """The pids of a live cluster's node agents (read them before close())."""
    return [n["pid"] for n in cluster.statistics()["nodes"].values()]


def held(folder: str, name: str, reply: str) -> Callable[[Any], str]:
    """A scripted reply that announces itself (file `in-NAME-PID` in `folder`, PID the
    process making the call: a node agent's) and returns `reply` only once that agent has a
    `release-PID` file (or after BOUND_S): the test releases the agents it chooses."""

    def hold(messages: Any) -> str:
        open(os.path.join(folder, f"in-{name}-{os.getpid()}"), "w").close()
        release = os.path.join(folder, f"release-{os.getpid()}")
        deadline = time.monotonic() + BOUND_S
        while not os.path.exists(release) and time.monotonic() < deadline:
            time.sleep(0.02)
        return reply

    return hold


def ray_pids(cluster: Any) -> list[int]:
    """The pids of a `ray.cluster_utils.Cluster`'s own processes (GCS, raylets, workers)."""
    nodes = [cluster.head_node, *cluster.worker_nodes]
    return [
        info.process.pid
        for node in nodes
        if node is not None
        for infos in node.all_processes.values()
        for info in infos
        if info.process is not None
    ]


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    """A Ray cluster of two nodes (one CPU each) this process is connected to; shut down,
    with every process of Ray's confirmed gone, at the end of the module."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False}
    )
    try:
        cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        ray.shutdown()
        pids = ray_pids(cluster)
        cluster.shutdown()
        # Ray's own processes (GCS, raylets, their workers) are gone before the next module.
        poll(lambda: all(pid_gone(p) for p in pids), "Ray's processes gone")

"""Past one machine: trees placed on the nodes of a Ray cluster (DESIGN.md section 13).

`Cluster` has the `Supervisor` API. On each Ray node it starts one node agent, a Ray actor
pinned to that node, which hosts a supervisor's engine (as a `Supervisor` does): a tree
is placed whole on the least loaded agent and its children start locally there, with the
local spawn latency, limits and confirmed cleanup. Ray is used for what it is good at
(membership, placement, failure detection), not for children: an actor costs ~300 ms of
CPU to start, a local child ~3 ms.

The journal is one store shared by every node (Postgres; a SQLite file only on a single
node). When an agent dies (Ray reports the actor or its node dead), the cluster revokes
that agent's lease in the journal and resumes each of its unfinished trees on a surviving
agent with `Supervisor.resume`: replay from the journal, children adopted by key. The
trees' handles keep working; they now point at the new agent.

A child placed with `rlm_query(..., placement="spread")` goes to another node's agent
(`Spreader`, the agents' side of `Core.spreader`): the parent's agent journals it, the
other takes it over, and the parent's follows it there, so it stays a child for every verb.
The tree's limits and budgets stay with its root's agent, which admits children and model
calls made below a spread child.

Ray is imported only when a `Cluster` is made: `import brood` never imports it.

The package, by what each module does:
- `driver`: `Cluster`, in the process that drives Ray (agents started and watched, trees
  placed, a lost agent's trees resumed elsewhere);
- `agent`: `NodeAgent`, the Ray actor on each node that hosts a supervisor's `Engine`;
- `placement`: an agent's load, and `Spreader`, the agents' side of placement="spread";
- `handles`: `ClusterHandle` and `ClusterFlowHandle`, which follow their tree (they reach
  the cluster through its `TreeRouter`);
- `nodes`: Ray's import, the checks made before agents start, the driver's view of one
  agent, and the bounds on calls to agents.
"""

# Ray finds NodeAgent by its module, brood.cluster.agent.
from brood.cluster.agent import NodeAgent as NodeAgent
from brood.cluster.driver import Cluster
from brood.cluster.handles import ClusterFlowHandle, ClusterHandle
from brood.cluster.handles import Ended as Ended
from brood.cluster.nodes import ADDRESS_CHECK_S as ADDRESS_CHECK_S
from brood.cluster.nodes import AGENT_CONCURRENCY as AGENT_CONCURRENCY
from brood.cluster.nodes import AGENT_START_S as AGENT_START_S
from brood.cluster.nodes import CALL_S as CALL_S
from brood.cluster.nodes import CLOSE_S as CLOSE_S
from brood.cluster.nodes import INSTALL_HINT as INSTALL_HINT
from brood.cluster.nodes import JOIN_EVERY as JOIN_EVERY
from brood.cluster.nodes import MONITOR_S as MONITOR_S
from brood.cluster.nodes import PING_S as PING_S
from brood.cluster.nodes import WAIT_SLACK_S as WAIT_SLACK_S
from brood.cluster.nodes import AgentLost as AgentLost
from brood.cluster.nodes import AgentRef as AgentRef
from brood.cluster.nodes import check_address as check_address
from brood.cluster.nodes import import_ray as import_ray
from brood.cluster.nodes import ray_cause as ray_cause
from brood.cluster.nodes import shared_store as shared_store
from brood.cluster.placement import Peer as Peer
from brood.cluster.placement import Spreader as Spreader

__all__ = ["Cluster", "ClusterFlowHandle", "ClusterHandle"]

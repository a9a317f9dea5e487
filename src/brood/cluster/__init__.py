"""Past one machine: trees placed on the nodes of a Ray cluster (DESIGN.md section 13).

`Cluster` has the `Supervisor` API. On each Ray node it starts one node agent, a Ray actor
pinned to that node, which hosts an ordinary `Supervisor`: a tree is placed whole on the
least loaded agent and its children start locally there, with the local spawn latency,
limits and confirmed cleanup. Ray is used for what it is good at (membership, placement,
failure detection), not for children: an actor costs ~300 ms of CPU to start, a local
child ~3 ms.

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
- `agent`: `NodeAgent`, the Ray actor on each node that hosts a `Supervisor`;
- `placement`: an agent's load, and `Spreader`, the agents' side of placement="spread";
- `handles`: `ClusterHandle` and `ClusterFlowHandle`, which follow their tree;
- `nodes`: Ray's import, the checks made before agents start, the driver's view of one
  agent, and the bounds on calls to agents.
"""

# Every name this package had as one module stays importable from here (tests reach some of
# the private ones). Ray finds NodeAgent by its module, brood.cluster.agent.
from brood.cluster.agent import NodeAgent as NodeAgent
from brood.cluster.agent import _end_of as _end_of
from brood.cluster.agent import _now as _now
from brood.cluster.driver import Cluster
from brood.cluster.handles import _ERRORS as _ERRORS
from brood.cluster.handles import ClusterFlowHandle, ClusterHandle, Ended
from brood.cluster.handles import _Followed as _Followed
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
from brood.cluster.nodes import (
    AgentLost,
    AgentRef,
    check_address,
    import_ray,
    ray_cause,
    shared_store,
)
from brood.cluster.placement import Peer, Spreader
from brood.lifecycle import TERMINAL_VALUES

# Renamed when the module became this package; the old names stay importable.
_Ended = Ended
_AgentLost = AgentLost
_Agent = AgentRef
_check_address = check_address
_import_ray = import_ray
_cause = ray_cause
_shared_store = shared_store
_Peer = Peer
_Spreader = Spreader
TERMINAL = TERMINAL_VALUES  # the name this package gave the set before brood.lifecycle had it

__all__ = ["Cluster", "ClusterFlowHandle", "ClusterHandle"]

"""The driver's reach into Ray and the node agents: Ray's import, the address and journal
checks made before any agent starts, the cluster's view of one agent, and the bounds on
calls to agents."""

from __future__ import annotations

import os
import socket
from typing import Any

import cloudpickle

from brood.errors import BackendError, InvalidArgument, RayMissing, install_hint
from brood.store.base import open_store

ADDRESS_CHECK_S = 3.0  # a TCP connect to the GCS; a bare ray.init retries for minutes
AGENT_START_S = 120.0  # an agent's supervisor starts its zygote; a loaded machine is slow
CALL_S = 60.0  # a call to an agent that does not wait on a run (spawn, status, cancel)
CLOSE_S = 120.0  # an agent's close: cancel its runs, confirm every exit (escalation incl.)
MONITOR_S = 0.5  # how often the cluster asks each agent whether it is alive
JOIN_EVERY = 4  # every this many monitor rounds, nodes that joined get an agent
PING_S = 10.0  # a ping unanswered this long is not a death: Ray's detector decides that
WAIT_SLACK_S = 10.0  # an agent's bounded wait may return this much after its timeout
AGENT_CONCURRENCY = 1000  # blocked waits each hold one of an agent's threads

INSTALL_HINT = install_hint("ray")


def import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise RayMissing(
            f"brood.Cluster runs on Ray, which is not installed here: {INSTALL_HINT}"
        ) from exc
    return ray


def pickled_model(model: Any) -> bytes:
    """The model as every node agent gets its own copy of it."""
    try:
        return bytes(cloudpickle.dumps(model))
    except Exception as exc:
        raise InvalidArgument(
            f"model cannot be pickled for the node agents ({exc}); pass a spec string "
            "like 'openai:MODEL@URL' or a picklable model"
        ) from exc


def connect_ray(ray: Any, ray_address: str | None) -> bool:
    """Connect this process to Ray: to the cluster it is connected to already (refused
    when `ray_address` names another), else with `ray.init`. True when Ray was started
    here: the cluster's close shuts it down then."""
    if ray_address is not None:
        check_address(ray_address)
    if ray.is_initialized():
        current = ray.get_runtime_context().gcs_address
        if ray_address not in (None, "auto", current):
            raise BackendError(
                f"this process is already connected to the Ray cluster at {current}, "
                f"not {ray_address!r}; pass ray_address=None to use it, or "
                "ray.shutdown() first"
            )
        return False
    ray.init(address=ray_address)
    return True


def check_address(address: str) -> None:
    """Refuse a Ray address that does not answer, within seconds.

    A bare `ray.init` to a wrong port keeps retrying for minutes; a TCP connect to the GCS
    port tells at once whether anything listens there. `auto` (Ray's own discovery of a
    local cluster) is left to Ray.
    """
    if address == "auto":
        return
    hostport = address.split("://", 1)[1] if "://" in address else address
    host, sep, port_text = hostport.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise InvalidArgument(
            f"ray_address must be HOST:PORT (the head node's GCS, e.g. 10.0.0.5:6379), "
            f"ray://HOST:PORT or 'auto'; got {address!r}"
        )
    try:
        with socket.create_connection((host, int(port_text)), timeout=ADDRESS_CHECK_S):
            pass
    except OSError as exc:
        raise BackendError(
            f"no Ray cluster answers at ray_address {address!r} ({exc}); start one with "
            "`ray start --head` and pass the address it prints, or pass ray_address=None "
            "to start a local Ray instance"
        ) from exc


def shared_store(url: str) -> str:
    """The journal URL as every agent must see it. A shared one is opened here first: a
    store this process cannot open fails now with the store's own message, not once per
    node, and a fresh journal's schema is made once, before the agents open it."""
    scheme, _, rest = url.partition("://")
    if scheme == "sqlite":
        path = rest[1:] if rest.startswith("/") else rest
        if path in ("", ":memory:"):
            raise InvalidArgument(
                f"store {url!r} is a private temporary journal; a cluster needs one its "
                "nodes share: store='postgresql://USER@HOST/DB' (or a SQLite file on one node)"
            )
        # An agent's working directory is Ray's, not this process's. (Not opened here: on
        # several nodes it is refused, and that is known only once Ray is.)
        return f"sqlite:///{os.path.abspath(path)}"
    open_store(url).close()
    return url


def ray_cause(exc: BaseException) -> BaseException:
    """The exception an actor raised, out of Ray's wrapper."""
    return getattr(exc, "cause", None) or exc


class AgentRef:
    """The cluster's view of one node agent."""

    def __init__(self, actor: Any, info: dict[str, Any]) -> None:
        self.actor = actor
        self.token: str = info["token"]
        self.pid: int = info["pid"]
        self.host: str = info["host"]
        self.node_id: str = info["node_id"]
        self.placed = 0  # trees placed here by this cluster: the tie-break of placement
        self.dead = False

    def __repr__(self) -> str:
        return f"<agent pid {self.pid} on node {self.node_id[:12]}>"


class AgentLost(Exception):
    """An agent died (Ray reports its actor dead) while called: its trees go on elsewhere."""

    def __init__(self, agent: AgentRef) -> None:
        super().__init__(f"{agent} died")
        self.agent = agent

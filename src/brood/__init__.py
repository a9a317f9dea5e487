"""brood: a runtime for recursive language models with a managed child-run lifecycle."""

from brood.api import FlowHandle, RunHandle, RunInfo, RunResult, Supervisor
from brood.cluster import Cluster  # imports Ray only when a Cluster is made, never here
from brood.errors import (
    AskCancelled,
    BackendError,
    BroodError,
    ChildCleanupError,
    ChildFailed,
    ChildNotReady,
    ConfinementError,
    IllegalTransition,
    InvalidArgument,
    InvalidSpec,
    LimitExceeded,
    ModelError,
    NodeLost,
    OutputError,
    ProtocolError,
    RateLimited,
    RayMissing,
    ReplayDiverged,
    StaleHandle,
    StallTimeout,
    StoreError,
    SupervisorClosed,
    ToolError,
    UnknownRun,
)
from brood.lifecycle import TRANSITIONS, RunState
from brood.limits import PI_RLM_BLOCKED_BUILTINS, Limits
from brood.models import CallableModel, Completion, Model, OpenAIModel, ScriptedModel
from brood.session import Observation, Session
from brood.tools import Tool, tool

__version__ = "0.1.0"

__all__ = [
    "PI_RLM_BLOCKED_BUILTINS",
    "TRANSITIONS",
    "AskCancelled",
    "BackendError",
    "BroodError",
    "CallableModel",
    "ChildCleanupError",
    "ChildFailed",
    "ChildNotReady",
    "Cluster",
    "Completion",
    "ConfinementError",
    "FlowHandle",
    "IllegalTransition",
    "InvalidArgument",
    "InvalidSpec",
    "LimitExceeded",
    "Limits",
    "Model",
    "ModelError",
    "NodeLost",
    "Observation",
    "OpenAIModel",
    "OutputError",
    "ProtocolError",
    "RateLimited",
    "RayMissing",
    "ReplayDiverged",
    "RunHandle",
    "RunInfo",
    "RunResult",
    "RunState",
    "ScriptedModel",
    "Session",
    "StaleHandle",
    "StallTimeout",
    "StoreError",
    "Supervisor",
    "SupervisorClosed",
    "Tool",
    "ToolError",
    "UnknownRun",
    "tool",
]

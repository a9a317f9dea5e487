"""brood: a runtime for recursive language models with a managed child-run lifecycle.

Each public name is imported on first use (`_HOMES` says where): `import brood` costs
only what is used. The zygote that every worker is forked from imports the worker side
alone, so each worker forks, copies and exits a smaller process; `brood.Supervisor` and the
rest work as before.
"""

import importlib
import typing

if typing.TYPE_CHECKING:
    from brood.api import Conversation, FlowHandle, RunHandle, RunInfo, RunResult, Supervisor
    from brood.cluster import Cluster  # imports Ray only when a Cluster is made, never here
    from brood.errors import (
        AskCancelled,
        BackendError,
        BroodError,
        ChildCleanupError,
        ChildFailed,
        ChildNotReady,
        ConfinementError,
        ConversationClosed,
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
    from brood.models import (
        AnthropicModel,
        CallableModel,
        Completion,
        GeminiModel,
        Model,
        OpenAIModel,
        Price,
        ScriptedModel,
    )
    from brood.remote import RemoteSession  # urllib is imported when a session is opened
    from brood.session import Observation, Session
    from brood.tools import Tool, tool

__version__ = "0.1.0"

# Where the public names live, lightest first: a name is looked up in each in turn.
_HOMES = (
    "brood.errors",
    "brood.limits",
    "brood.lifecycle",
    "brood.tools",
    "brood.models",
    "brood.api",
    "brood.session",
    "brood.remote",
    "brood.cluster",
)


def __getattr__(name: str) -> typing.Any:
    if name in __all__:
        for home in _HOMES:
            module = importlib.import_module(home)
            if hasattr(module, name):
                value = getattr(module, name)
                globals()[name] = value  # once: later uses are plain attribute reads
                return value
    raise AttributeError(f"module 'brood' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
    "PI_RLM_BLOCKED_BUILTINS",
    "TRANSITIONS",
    "AnthropicModel",
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
    "Conversation",
    "ConversationClosed",
    "FlowHandle",
    "GeminiModel",
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
    "Price",
    "ProtocolError",
    "RateLimited",
    "RayMissing",
    "RemoteSession",
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

"""The REPL helpers' former home, kept so that existing imports keep working: the helpers
are in `brood.worker.verbs` (one module per family), the handles they return in
`brood.worker.handles`, what they share in `brood.worker.runtime`."""

from __future__ import annotations

from brood.worker.handles import AskHandle, ChildHandle, Handle, Task
from brood.worker.runtime import SPAWNED, Runtime
from brood.worker.verbs import ERRORS, HELPER_NAMES, make_helpers

__all__ = [
    "ERRORS",
    "HELPER_NAMES",
    "SPAWNED",
    "AskHandle",
    "ChildHandle",
    "Handle",
    "Runtime",
    "Task",
    "make_helpers",
]

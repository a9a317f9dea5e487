"""Test helpers for brood users: find processes a test left behind."""

from __future__ import annotations

import os

from brood.backends.local import OWNER_ENV, processes_owned

__all__ = ["OWNER_ENV", "leftover_processes"]


def leftover_processes() -> list[int]:
    """Pids of brood processes (zygotes, workers, their grandchildren) owned by this process."""
    mine = f"{os.getpid()}:"
    return sorted(pid for pid, token in processes_owned().items() if token.startswith(mine))

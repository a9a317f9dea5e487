"""Test helpers for brood users: find processes a test left behind."""

from __future__ import annotations

import os

from brood.backends.owners import OWNER_ENV, processes_of

__all__ = ["OWNER_ENV", "leftover_processes", "processes_of"]


def leftover_processes() -> list[int]:
    """Pids of brood processes (zygotes, workers, their grandchildren) owned by this process."""
    return processes_of(os.getpid())

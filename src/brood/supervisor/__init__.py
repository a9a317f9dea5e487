"""Supervisor side: the tree of runs, admission, cleanup, observers."""

from brood.supervisor.core import Core, Run, RunInfo

__all__ = ["Core", "Run", "RunInfo"]

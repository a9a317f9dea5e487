"""Backends start, signal and reap workers; policy stays in the supervisor."""

from brood.backends.base import Backend, WorkerConn, make_backend

__all__ = ["Backend", "WorkerConn", "make_backend"]

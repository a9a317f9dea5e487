"""Journal stores, chosen by URL: `sqlite:///path` (default)."""

from brood.store.base import Store, open_store

__all__ = ["Store", "open_store"]

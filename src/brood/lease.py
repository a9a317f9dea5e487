"""Who owns a tree: a lease in the journal, not a pid (DESIGN.md sections 7 and 13).

A supervisor's row in the journal holds `lease_until` (epoch seconds). The supervisor
renews it every RENEW_S to LEASE_S from now; a renewal that finds its lease lapsed or
revoked fences the supervisor: it stops writing to the journal at once (its runs end in
this process only), because another may already be resuming its trees.

A tree may be resumed by another supervisor once its owner is gone: its row closed, its
lease lapsed or revoked (`Store.revoke_lease`, what a cluster does when Ray reports a
node dead), or, on the owner's own host, its process gone (a crash here is seen at once,
without waiting for the lease to run out). A pid means nothing on another host, so there
the lease alone decides. Hosts' clocks are assumed to agree to well within LEASE_S.
"""

from __future__ import annotations

import socket
import time
from typing import Any

from brood.backends.owners import owner_alive

__all__ = ["LEASE_S", "RENEW_S", "lease_holder_gone"]

LEASE_S = 30.0  # how long a renewal holds a supervisor's trees
RENEW_S = 5.0  # how often a supervisor renews its lease


def lease_holder_gone(row: dict[str, Any] | None, now: float | None = None) -> bool:
    """Whether the supervisor of a journal row (`supervisors` table) no longer owns its
    trees: no such row, closed, lease lapsed or revoked, or (on this host) its process
    gone. A row of an older journal, with no lease, is judged by its process only."""
    if row is None or row["closed_at"] is not None:
        return True
    lease = row.get("lease_until")
    if lease is not None and lease < (time.time() if now is None else now):
        return True
    if lease is None or row["host"] == socket.gethostname():
        return not owner_alive(row["id"])
    return False

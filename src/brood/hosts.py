"""Host names of the servers brood runs (`brood serve`, the OpenEnv server): which are this
machine's loopback, and the host part of a `Host` header."""

from __future__ import annotations

import ipaddress

LOOPBACK_NAMES = frozenset({"localhost", "localhost."})


def is_loopback(host: str) -> bool:
    """Whether a host name or address is this machine's loopback (a bind or a Host)."""
    host = host.strip().strip("[]").lower()
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_of(authority: str) -> str:
    """The host part of `host[:port]` or `[v6]:port`."""
    if authority.startswith("["):
        return authority[1 : authority.find("]")]
    return authority.rsplit(":", 1)[0] if authority.count(":") == 1 else authority


__all__ = ["LOOPBACK_NAMES", "host_of", "is_loopback"]

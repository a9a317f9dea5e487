"""Host names of the servers brood runs (`brood serve`, the OpenEnv server): which are this
machine's loopback, the host part of a `Host` header, and the socket a server listens on."""

from __future__ import annotations

import ipaddress
import socket

from brood.errors import InvalidArgument

LISTEN_BACKLOG = 2048  # uvicorn's own default

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


def listen(host: str, port: int) -> socket.socket:
    """A socket listening on host:port (port 0: a free one). It listens before the server
    says where: a client that reads that and connects at once is queued, not refused, while
    the server is still starting. Raises InvalidArgument naming the address and the fix."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
    except (OSError, OverflowError) as exc:
        raise InvalidArgument(
            f"host {host!r} and port {port}: {exc}; pass an address of this machine"
        ) from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        sock.close()
        raise InvalidArgument(
            f"cannot listen on {host}:{port}: {exc.strerror}; pass another port "
            "(port 0 picks a free one)"
        ) from None
    return sock


__all__ = ["LISTEN_BACKLOG", "LOOPBACK_NAMES", "host_of", "is_loopback", "listen"]

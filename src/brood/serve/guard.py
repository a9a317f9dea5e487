"""Who may call the server, and the net under every endpoint (DESIGN.md sections 10, 14).

`Guard` refuses before any endpoint runs:
- a call to `/v1`, `/ui` or `/openapi.json` without `Authorization: Bearer TOKEN` (401;
  compared in constant time). Every server has a token: a loopback port is reachable by
  every process of the machine, model code run with `Limits(network=True)` included, so
  an address is no proof of who calls;
- on a server whose token was made for it (`brood serve` without `--token`, which listens
  on loopback only), a `Host` that is not a loopback name: a web page the user visits
  cannot reach the server by rebinding a name of its own to 127.0.0.1. A server given its
  token may sit behind a proxy that passes its own names on;
- a call from a web page of another origin (an `Origin` that is not this server's): no
  page may start or cancel runs in the user's name. The server sends no CORS headers, so
  a browser lets no other page read an answer either;
- a body whose Content-Length is over the bound (413).

`CatchAll` turns an error no endpoint expected into a JSON 500 and logs it: a client
never sees a traceback.
"""

from __future__ import annotations

import hmac
import logging

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from brood.hosts import host_of, is_loopback
from brood.serve.bodies import MAX_BODY_BYTES, too_large
from brood.serve.errors import ApiError, error_response

log = logging.getLogger("brood.serve")

# The dashboard's pages (`/`, `/runs/...`) and `/static/` hold no data; its bodies (`/ui/`) do.
PROTECTED = ("/v1/", "/openapi.json", "/ui/")  # "/v1" itself is matched too


class Guard:
    def __init__(self, app: ASGIApp, *, token: str, loopback_only: bool) -> None:
        self.app = app
        self.token = token
        self.loopback_only = loopback_only

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            self._check(scope)
        except ApiError as exc:
            await exc.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _check(self, scope: Scope) -> None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        host = headers.get("host", "")
        if self.loopback_only and not is_loopback(host_of(host)):
            raise ApiError(
                403,
                f"Host {host!r} is not a loopback name; a server started without --token "
                "answers only 127.0.0.1, ::1 and localhost",
                fix="start brood serve with --token to serve other names",
            )
        origin = headers.get("origin")
        if origin is not None and origin.partition("://")[2].lower() != host.lower():
            raise ApiError(
                403,
                f"a call from the web page of {origin!r} is refused: brood serve takes calls "
                "from programs, not from other sites' pages",
            )
        path: str = scope["path"]
        if path == "/v1" or path.startswith(PROTECTED):
            scheme, _, given = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                given.strip().encode(), self.token.encode()
            ):
                raise ApiError(
                    401,
                    "this server needs its token"
                    if "authorization" not in headers
                    else "the token does not match this server's",
                    fix="send the header Authorization: Bearer TOKEN",
                    headers={"WWW-Authenticate": "Bearer"},
                )
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            raise too_large(int(declared))


class CatchAll:
    """The last net: an unexpected error is logged, and the client gets a JSON 500 (if the
    response had not started; a stream that had is just ended)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception:
            log.exception("%s %s failed", scope.get("method"), scope.get("path"))
            if not started:
                response = error_response(
                    500, "the server failed to answer; its log says why", fix="try again"
                )
                await response(scope, receive, send)

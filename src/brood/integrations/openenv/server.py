"""The server: openenv-core's own HTTP and WebSocket app (`create_app`) over a
`BroodEnvironmentFactory`, with a guard in front, and `serve` to run it with uvicorn.

Every WebSocket session (`/ws`, what openenv-core's clients use) gets its own environment,
up to `max_concurrent_envs` at once; all their episodes are trees of the one supervisor
the factory holds. openenv-core's stateless `/reset` and `/step` make a new environment for
each request, so a `/step` there has no episode and says so in its observation.

Who may call: openenv-core's clients send no credentials, so a server without a token
listens on loopback only (and answers only loopback Host names, so a web page cannot reach
it by rebinding a name of its own). With a token, every request (HTTP and WebSocket) must
carry `Authorization: Bearer TOKEN` (`BroodEnv(base_url, token=...)` sends it), and the
server may listen on any address. A request from a web page of another origin is refused
either way: a browser lets any page open a WebSocket to a loopback port, and the episodes'
code would run on the user's model.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import sys
from typing import Any

from fastapi import FastAPI
from openenv.core.env_server.http_server import create_app
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocketDisconnect

from brood.errors import InvalidArgument
from brood.hosts import host_of, is_loopback, listen
from brood.integrations.openenv.environment import (
    BroodAction,
    BroodEnvironmentFactory,
    BroodObservation,
    RewardFn,
)
from brood.limits import Limits

__all__ = ["DEFAULT_MAX_ENVS", "DEFAULT_PORT", "make_app", "serve", "served_limits"]

DEFAULT_MAX_ENVS = 64  # WebSocket sessions at once
DEFAULT_PORT = 8000  # openenv's servers' own default


def served_limits(max_concurrent_envs: int, **fields: Any) -> Limits:
    """Limits for a server of `max_concurrent_envs` sessions: `fields` as given, and unless
    max_concurrency is among them, each session may have as many workers computing at once
    as a Session of its own (Limits().max_concurrency), so the episodes of a full server
    do not wait for each other's children."""
    if fields.get("max_concurrency") is None:
        fields["max_concurrency"] = Limits().max_concurrency * max_concurrent_envs
    return Limits(**fields)


def make_app(
    model: Any = None,
    *,
    rubric: Any = None,
    limits: Any = None,
    store: str | None = None,
    max_concurrent_envs: int = DEFAULT_MAX_ENVS,
    token: str | None = None,
    loopback_only: bool | None = None,
    **supervisor: Any,
) -> FastAPI:
    """openenv-core's app serving brood environments: `model`, `rubric`, `limits`, `store`
    and the other supervisor options are `BroodEnvironmentFactory`'s (`store` None: a
    temporary journal, removed at shutdown; `limits` None: `served_limits`). Every
    episode is a tree of its own for the tree-wide limits (max_children, token_budget,
    ...); max_concurrency counts the workers of all episodes together. `token`: every
    request must send `Authorization: Bearer TOKEN`. `loopback_only` (default: when there
    is no token) refuses a Host header that is not a loopback name. The supervisor is
    closed, every episode ended with confirmed exit, when the app shuts down
    (`app.state.environments` is the factory)."""
    if isinstance(max_concurrent_envs, bool) or not isinstance(max_concurrent_envs, int):
        raise InvalidArgument(
            f"max_concurrent_envs: must be a whole number >= 1, got {max_concurrent_envs!r}"
        )
    if max_concurrent_envs < 1:
        raise InvalidArgument(f"max_concurrent_envs: must be >= 1, got {max_concurrent_envs}")
    if token is not None and not (isinstance(token, str) and token.strip()):
        raise InvalidArgument("token: must be a non-empty string, or None for no token")
    if limits is None:
        limits = served_limits(max_concurrent_envs)
    factory = BroodEnvironmentFactory(
        model, rubric=rubric, limits=limits, store=store, **supervisor
    )
    try:
        app = create_app(
            factory,
            BroodAction,
            BroodObservation,
            env_name="brood",
            max_concurrent_envs=max_concurrent_envs,
        )
    except BaseException:
        factory.close()
        raise

    async def close_supervisor() -> None:
        await asyncio.to_thread(factory.close)

    app.router.on_shutdown.append(close_supervisor)
    app.state.environments = factory
    app.add_middleware(
        Guard, token=token, loopback_only=token is None if loopback_only is None else loopback_only
    )
    return app


def serve(
    model: Any = None,
    *,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    token: str | None = None,
    rubric: RewardFn | Any = None,
    limits: Any = None,
    store: str | None = None,
    max_concurrent_envs: int = DEFAULT_MAX_ENVS,
    **supervisor: Any,
) -> None:
    """Serve brood environments on host:port (port 0: a free one) until interrupted
    (SIGINT or SIGTERM), then end every episode with confirmed exit. A host that is not
    loopback needs a token. Says where it listens on stderr, in one line starting
    `brood openenv: serving`."""
    token = token or None
    if token is None and not is_loopback(host):
        raise InvalidArgument(
            f"host {host!r} is not a loopback address, and there is no token: openenv-core's "
            "clients send no credentials, so a server without one listens on 127.0.0.1 only; "
            "pass a token (--token, or BROOD_TOKEN) and connect with BroodEnv(url, token=...), "
            "or serve on 127.0.0.1"
        )
    import uvicorn

    app = make_app(
        model,
        rubric=rubric,
        limits=limits,
        store=store,
        max_concurrent_envs=max_concurrent_envs,
        token=token,
        **supervisor,
    )
    try:
        sock = listen(host, port)
    except BaseException:
        app.state.environments.close()
        raise
    bound = sock.getsockname()[1]
    where = f"http://{f'[{host}]' if ':' in host else host}:{bound}"
    auth = "every request sends Authorization: Bearer TOKEN" if token else "no token: loopback"
    print(
        f"brood openenv: serving at {where} (WebSocket {where.replace('http', 'ws', 1)}/ws, "
        f"up to {max_concurrent_envs} sessions; {auth}; journal "
        f"{app.state.environments.store_url})",
        file=sys.stderr,
        flush=True,
    )
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn raises the SIGINT it caught again, once shut down
        pass
    finally:
        sock.close()
        app.state.environments.close()  # when the lifespan did not run (a failed start)


class Guard:
    """Refuses a request before openenv-core's routes see it (see the module's docstring):
    401 without the server's token, 403 for a non-loopback Host on a loopback-only server
    or for a web page's request from another origin. A WebSocket is refused at its
    handshake with the same status and message."""

    def __init__(self, app: ASGIApp, *, token: str | None, loopback_only: bool) -> None:
        self.app = app
        self.token = token
        self.loopback_only = loopback_only

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        refused = self._refusal(scope)
        if refused is None:
            try:
                await self.app(scope, receive, send)
            except WebSocketDisconnect:
                # openenv-core's endpoint closes a socket whose client has already gone (at
                # a shutdown with sessions open) and raises; the session was ended before.
                if scope["type"] != "websocket":
                    raise
            return
        status, message = refused
        body = json.dumps({"error": message}).encode()
        headers = [(b"content-type", b"application/json")]
        if status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        await receive()  # the handshake's websocket.connect
        if "websocket.http.response" in scope.get("extensions", {}):
            await send(
                {"type": "websocket.http.response.start", "status": status, "headers": headers}
            )
            await send({"type": "websocket.http.response.body", "body": body})
        else:
            await send({"type": "websocket.close", "code": 1008, "reason": message[:120]})

    def _refusal(self, scope: Scope) -> tuple[int, str] | None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        host = headers.get("host", "")
        if self.loopback_only and not is_loopback(host_of(host)):
            return 403, (
                f"Host {host!r} is not a loopback name; a server without a token answers only "
                "127.0.0.1, ::1 and localhost (start it with a token to serve other names)"
            )
        origin = headers.get("origin")
        if origin is not None and origin.partition("://")[2].lower() != host.lower():
            return 403, (
                f"a request from the web page of {origin!r} is refused: this server takes "
                "requests from programs, not from other sites' pages"
            )
        if self.token is not None:
            scheme, _, given = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                given.strip().encode(), self.token.encode()
            ):
                return 401, (
                    "this server needs its token: send the header Authorization: Bearer TOKEN "
                    "(BroodEnv(base_url, token=TOKEN) does)"
                    if "authorization" not in headers
                    else "the token does not match this server's"
                )
        return None

"""What one server holds for its clients, bounded (DESIGN.md section 14): the responses that
follow a tree as it grows (event streams, the live tree, chat completions), and the runs
each client has started here that have not started yet.

A stream holds a connection and reads the journal every tenth of a second until its tree
ends, which may be an hour; a queued run holds its prompt and context (up to a MiB each)
until a slot frees. Without bounds, one client could hold them without end.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from brood.serve.errors import ApiError

# A dashboard tab holds one or two streams (a run page's live tree, a stream it follows),
# so 64 serves a few dozen tabs and scripts; each polls the journal, so thousands would
# turn the server into a journal reader for nobody.
MAX_STREAMS = 64
# A client that starts runs faster than the hosted supervisor starts them has at most this
# many waiting: a batch of 64 goes in at once, and a well-behaved client, which starts a
# run when one ends, never comes near it. 64 queued starts hold at most 64 MiB of bodies.
MAX_QUEUED = 64
RETRY_AFTER_S = "5"  # what a refused stream is told: a tab closes, a tree ends


class Streams:
    """The following responses the server serves at once, at most `cap`. Taken and given
    back on the event loop only, so a plain count is enough."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.open = 0

    def take(self) -> Callable[[], None]:
        """One stream, or a 503 naming the cap; returns the call that gives it back."""
        if self.open >= self.cap:
            raise ApiError(
                503,
                f"this server already follows {self.open} trees for its clients, its bound "
                f"of {self.cap} streams (event streams, live trees, chat completions)",
                fix="close a stream (a dashboard tab) and try again, or start brood serve "
                "with a larger --max-streams",
                headers={"Retry-After": RETRY_AFTER_S},
            )
        self.open += 1
        given = False

        def give() -> None:
            nonlocal given
            if not given:  # once, whichever of the paths that end a stream comes first
                given = True
                self.open -= 1

        return give

    def held(self, response: ASGIApp, give: Callable[[], None]) -> ASGIApp:
        """`response`, giving its stream back when it has been sent or cut short."""

        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            try:
                await response(scope, receive, send)
            finally:
                give()

        return app


class Queued:
    """Per client address, the runs started through the API that have not started yet.

    `status` reads a run's state from the hosted supervisor (never blocking); a run that has
    left `queued` is forgotten, so what is held is at most `cap` runs per client."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._lock = threading.Lock()  # starts come from the threadpool
        self._waiting: dict[str, list[Callable[[], str]]] = {}

    def admit(self, client: str, start: Callable[[], tuple[str, Callable[[], str]]]) -> str:
        """Call `start` (which returns a run id and a way to read the run's state) unless
        `client` has `cap` runs queued already (429, naming the cap)."""
        with self._lock:
            for who in list(self._waiting):
                still = [s for s in self._waiting[who] if s() == "queued"]
                if still:
                    self._waiting[who] = still
                else:
                    del self._waiting[who]
            waiting = self._waiting.get(client, [])
            if len(waiting) >= self.cap:
                raise ApiError(
                    429,
                    f"{client} has {len(waiting)} runs started here that have not started "
                    f"yet, the bound of {self.cap} queued starts per client",
                    fix="start more once some have started (GET /v1/runs?state=queued), or "
                    "start brood serve with a larger --max-queued",
                )
            run_id, status = start()
            self._waiting.setdefault(client, []).append(status)
            return run_id


def client_of(request: Request) -> str:
    """Who a start is counted against: the client's address (a proxy's, behind one)."""
    return request.client.host if request.client else "a client with no address"


def streams_of(request: Request) -> Streams:
    streams: Streams = request.app.state.streams
    return streams


def following(request: Request, response: ASGIApp) -> ASGIApp:
    """`response`, a stream that follows a tree, counted against the server's bound (503
    past it, before anything is sent)."""
    streams = streams_of(request)
    return streams.held(response, streams.take())

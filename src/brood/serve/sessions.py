"""Remote sessions (`/v1/sessions`): `reset` / `step` / `close` of a `brood.Session` over
HTTP, for trainers that keep their environments on another machine.

Each session is a `brood.Session` of this server's model, journal and limits (tightened
per session if the client asks), so its runs are journaled, shown on the dashboard and
confined like every run. Its calls block (a step runs model code), so endpoints make them
from a worker thread, one at a time per session: a second call while one runs is refused
(409) rather than queued behind it.

Bounded like the rest of the server: at most `cap` live sessions (429 past it) and
`per_client` per client address; a session idle for `idle_s` seconds is closed (a
reaper thread, and every open, looks); closing the server closes every session. Every
close ends the episode's tree and confirms its workers' exit before it answers.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import brood
from brood.serve.bodies import json_type
from brood.serve.errors import ApiError

log = logging.getLogger("brood.serve")
T = TypeVar("T")

# Each session is a supervisor of its own with its workers (a zygote and a worker per live
# run, tens of MB each): 16 serve a trainer's batch of environments on one machine.
MAX_SESSIONS = 16
MAX_SESSIONS_PER_CLIENT = 8  # one client cannot take every slot of a shared server
SESSION_IDLE_S = 900.0  # a trainer that went away without DELETE frees its slot after this
CLOSED_KEPT = 1024  # closed session ids remembered, so a late call hears "closed", not 404
# The limits a session may set for itself, each at most the server's: a client tightens
# its own episodes, never loosens the server's confinement or budgets.
SESSION_LIMITS = (
    "max_depth",
    "max_children",
    "max_children_per_run",
    "max_iterations",
    "child_timeout",
    "step_timeout",
    "token_budget",
    "cost_budget",
)


@dataclass
class Live:
    """One session and what the server knows of it between calls."""

    id: str
    client: str
    session: brood.Session
    used: float  # the clock at the end of its last call
    lock: threading.Lock = field(default_factory=threading.Lock)
    episode: int = 0
    last: brood.Observation | None = None


def observation(obs: brood.Observation, run_id: str | None) -> dict[str, Any]:
    return dataclasses.asdict(obs) | {"run_id": run_id}


class Sessions:
    def __init__(
        self,
        make: Callable[[brood.Limits | None], brood.Session],
        *,
        limits: brood.Limits | None,
        model_name: str | None,
        cap: int = MAX_SESSIONS,
        per_client: int = MAX_SESSIONS_PER_CLIENT,
        idle_s: float = SESSION_IDLE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.make = make
        self.limits = limits
        self.model_name = model_name
        self.cap = cap
        self.per_client = per_client
        self.idle_s = idle_s
        self.clock = clock
        self._live: dict[str, Live] = {}
        self._opening = 0  # sessions being made (counted against the caps meanwhile)
        self._closed: OrderedDict[str, str] = OrderedDict()  # id -> how it was closed
        self._lock = threading.Lock()
        self._shut = False
        self._wake = threading.Event()
        self._reaper: threading.Thread | None = None

    # ---- open ------------------------------------------------------------------------------
    def limits_for(self, asked: Mapping[str, Any] | None) -> brood.Limits | None:
        """The server's limits, tightened by the fields the client gave (each at most the
        server's value; 422 naming `limits.FIELD` otherwise; null keeps the server's)."""
        if not asked:
            return self.limits
        base = self.limits or brood.Limits()
        changes: dict[str, Any] = {}
        for name, value in asked.items():
            where = f"limits.{name}"
            if name not in SESSION_LIMITS:
                raise ApiError(
                    422,
                    f"{where} cannot be set per session; these can: {', '.join(SESSION_LIMITS)}",
                    field=where,
                )
            if value is None:
                continue  # the server's own
            if isinstance(value, bool) or not isinstance(value, int | float):
                got = json_type(value)
                raise ApiError(422, f"{where} must be a number, got {got}", field=where)
            server = getattr(base, name)
            if server is not None and value > server:
                raise ApiError(
                    422,
                    f"{where} is {value!r}, over this server's {server!r}; a session may "
                    "tighten the server's limits, never loosen them",
                    field=where,
                    fix=f"give {name} <= {server!r}, or leave it out",
                )
            changes[name] = value
        try:
            return dataclasses.replace(base, **changes)
        except brood.InvalidArgument as exc:
            raise ApiError(422, str(exc), field="limits") from None

    def open(self, client: str, limits: Mapping[str, Any] | None, model: str | None) -> str:
        """A new session for `client`; its id. 429 past the caps."""
        if model is not None and model != self.model_name:
            served = self.model_name or "none"
            raise ApiError(
                422,
                f"model {model!r} is not served here; this server's model is {served}",
                field="model",
                fix="leave model out, or give the id GET /v1/models lists",
            )
        session_limits = self.limits_for(limits)
        self.reap()
        with self._lock:
            if self._shut:
                raise ApiError(503, "the server is shutting down; it opens no more sessions")
            mine = sum(1 for s in self._live.values() if s.client == client)
            if len(self._live) + self._opening >= self.cap:
                raise ApiError(
                    429,
                    f"this server has {len(self._live) + self._opening} sessions open, its "
                    f"bound of {self.cap}",
                    fix="close one (DELETE /v1/sessions/ID) and try again, or start brood "
                    "serve with a larger --max-sessions",
                    headers={"Retry-After": "5"},
                )
            if mine >= self.per_client:
                raise ApiError(
                    429,
                    f"{client} has {mine} sessions open here, the bound of {self.per_client} "
                    "per client",
                    fix="close one (DELETE /v1/sessions/ID) and try again",
                    headers={"Retry-After": "5"},
                )
            self._opening += 1
        try:
            session = self.make(session_limits)
        finally:
            with self._lock:
                self._opening -= 1
        sid = "s-" + secrets.token_hex(6)
        with self._lock:
            self._live[sid] = Live(sid, client, session, self.clock())
            if self._reaper is None:
                self._reaper = threading.Thread(
                    target=self._reap_loop, name="brood-serve-sessions", daemon=True
                )
                self._reaper.start()
        return sid

    # ---- calls on one session --------------------------------------------------------------
    def _get(self, sid: str) -> Live:
        with self._lock:
            live = self._live.get(sid)
            how = self._closed.get(sid)
        if live is not None:
            return live
        if how is not None:
            fix = "POST /v1/sessions opens a new one"
            raise ApiError(409, f"session {sid} is closed ({how})", fix=fix)
        raise ApiError(404, f"no session {sid!r} on this server", fix="POST /v1/sessions opens one")

    def call(self, sid: str, fn: Callable[[Live], T]) -> T:
        """`fn(live)` with the session held, refused (409) while another call holds it."""
        live = self._get(sid)
        if not live.lock.acquire(blocking=False):
            raise ApiError(
                409,
                f"session {sid} is busy with another call (a step); one call at a time",
                fix="wait for the call it is running to answer, then call again",
            )
        try:
            if self._get(sid) is not live:  # closed while this call waited for it
                raise ApiError(409, f"session {sid} is closed")
            return fn(live)
        finally:
            live.used = self.clock()
            live.lock.release()

    def reset(self, sid: str, prompt: str, context: Any) -> dict[str, Any]:
        def reset(live: Live) -> dict[str, Any]:
            live.last = live.session.reset(prompt, context)
            live.episode += 1
            return observation(live.last, live.session.run_id)

        return self.call(sid, reset)

    def step(self, sid: str, code: str, timeout: float | None) -> dict[str, Any]:
        def step(live: Live) -> dict[str, Any]:
            live.last = live.session.step(code, timeout=timeout)
            return observation(live.last, live.session.run_id)

        return self.call(sid, step)

    def record_reward(
        self, sid: str, reward: float, info: Mapping[str, Any] | None
    ) -> dict[str, Any]:
        def record(live: Live) -> dict[str, Any]:
            live.session.record_reward(reward, info)
            return {"session_id": sid, "run_id": live.session.run_id, "reward": reward}

        return self.call(sid, record)

    def status(self, sid: str, state_of: Callable[[str], str]) -> dict[str, Any]:
        """What the server knows of a session, without waiting for a call it is running."""
        live = self._get(sid)
        run_id = live.session.run_id
        last = live.last
        return {
            "session_id": sid,
            "run_id": run_id,
            "episode": live.episode,
            "state": state_of(run_id) if run_id else None,
            "busy": live.lock.locked(),
            "done": bool(last and last.done),
            "answer": last.answer if last else None,
            "children": live.session.children(),
            "idle": max(0.0, self.clock() - live.used),
        }

    # ---- close -----------------------------------------------------------------------------
    def close(self, sid: str, how: str = "closed by DELETE") -> dict[str, Any]:
        """End the session's episode and stop its workers, exit confirmed. A step it is
        running is ended with its episode (it answers done, cancelled)."""
        live = self._get(sid)
        if live.lock.locked():
            # A step is running: its episode is ended first, so that the step answers now
            # (done, saying the episode was cancelled) rather than after its timeout.
            try:
                live.session.handle().cancel()
            except brood.BroodError:
                pass  # no episode, or it ended meanwhile: the step is ending anyway
        with live.lock:
            with self._lock:
                if self._live.get(sid) is not live:
                    raise ApiError(409, f"session {sid} is closed")
                del self._live[sid]
                self._closed[sid] = how
                while len(self._closed) > CLOSED_KEPT:
                    self._closed.popitem(last=False)
            run_id = live.session.run_id
            live.session.close()  # ChildCleanupError (500) if an exit cannot be confirmed
        return {"session_id": sid, "run_id": run_id, "closed": True}

    def reap(self) -> list[str]:
        """Close the sessions idle for `idle_s` or more (not one a call holds)."""
        now = self.clock()
        with self._lock:
            idle = [
                s.id
                for s in self._live.values()
                if now - s.used >= self.idle_s and not s.lock.locked()
            ]
        closed = []
        for sid in idle:
            try:
                self.close(sid, f"idle for {self.idle_s:g} s")
                closed.append(sid)
            except ApiError:
                pass  # closed or taken meanwhile
            except brood.BroodError:
                log.exception("an idle session %s did not close cleanly", sid)
        return closed

    def _reap_loop(self) -> None:
        # Wakes a few times per idle period; an idle session outlives its bound by a quarter
        # of it at most.
        while not self._wake.wait(max(0.05, self.idle_s / 4)):
            self.reap()

    def close_all(self) -> None:
        """Close every session (the server is shutting down), each exit confirmed."""
        with self._lock:
            self._shut = True
            ids = list(self._live)
        self._wake.set()
        for sid in ids:
            try:
                self.close(sid, "the server closed")
            except ApiError:
                pass
            except brood.BroodError:
                log.exception("session %s did not close cleanly", sid)
        if self._reaper is not None:
            self._reaper.join()

    def count(self) -> int:
        with self._lock:
            return len(self._live)

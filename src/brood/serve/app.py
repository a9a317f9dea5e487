"""`make_app`: the Starlette app behind `brood serve` (DESIGN.md section 10).

It reads the journal at one store URL and hosts one supervisor of its own for the runs
started through it. Reads come from the journal; actions reach the supervisor that owns
the run through its control socket (the hosted one's too, so there is one path). Every
answer is JSON, refusals included (`brood.serve.errors`); who may call is `guard`'s.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp

import brood
from brood.serve import dashboard, openai_compat
from brood.serve.bodies import (
    check_depth,
    int_param,
    json_type,
    object_field,
    read_object,
    seconds_field,
    text_field,
)
from brood.serve.caps import MAX_QUEUED, MAX_STREAMS, Streams, client_of, following
from brood.serve.errors import ApiError, Json, error_response, from_brood
from brood.serve.guard import CatchAll, Guard
from brood.serve.host import RUN_TIMEOUT_S, STATES, Host
from brood.serve.schema import openapi
from brood.serve.sessions import (
    MAX_SESSIONS,
    MAX_SESSIONS_PER_CLIENT,
    SESSION_IDLE_S,
    Sessions,
)
from brood.serve.stream import resume_point, tree_events

MAX_PAGE = 1000  # roots one GET /v1/runs returns at most
MAX_OFFSET = 10**9
ANSWERED_BY = "brood serve"  # who answers an ask when the call names nobody


def _host(request: Request) -> Host:
    host: Host = request.app.state.host
    return host


def _run_id(request: Request) -> str:
    return str(request.path_params["run_id"])


# ---- runs ---------------------------------------------------------------------------------
async def list_runs(request: Request) -> Response:
    state = request.query_params.get("state") or None
    if state is not None and state not in STATES:
        raise ApiError(
            422,
            f"state {state!r} is not a run state; use one of {', '.join(sorted(STATES))}",
            field="state",
        )
    limit = int_param(request, "limit", 20, 1, MAX_PAGE)
    offset = int_param(request, "offset", 0, 0, MAX_OFFSET)
    runs = await run_in_threadpool(_host(request).roots_page, state, limit, offset)
    return Json({"runs": runs, "limit": limit, "offset": offset})


async def runs(request: Request) -> Response:
    """GET lists roots, POST starts one: one route, so a 405 names both methods."""
    return await (start_run if request.method == "POST" else list_runs)(request)


async def start_run(request: Request) -> Response:
    body = await read_object(request, allowed=("prompt", "context", "timeout"))
    prompt = text_field(body, "prompt")
    timeout = seconds_field(body, "timeout", RUN_TIMEOUT_S)
    start = partial(_host(request).start, client=client_of(request))
    run_id = await run_in_threadpool(start, str(prompt), body.get("context"), timeout)
    return Json({"run_id": run_id}, status_code=201, headers={"Location": f"/v1/runs/{run_id}"})


async def get_run(request: Request) -> Response:
    host, run_id = _host(request), _run_id(request)
    return Json(await run_in_threadpool(host.journal.run, run_id))  # 404: UnknownRun


async def get_tree(request: Request) -> Response:
    host, run_id = _host(request), _run_id(request)
    return Json(await run_in_threadpool(host.journal.tree, run_id))  # 404: UnknownRun


async def run_events(request: Request) -> ASGIApp:
    host, run_id = _host(request), _run_id(request)
    after = resume_point(request)
    row = await run_in_threadpool(host.run_row, run_id)
    return following(request, tree_events(host, row["root_id"], after))


async def cancel_run(request: Request) -> Response:
    host, run_id = _host(request), _run_id(request)
    await run_in_threadpool(host.live_row, run_id)
    state = await run_in_threadpool(host.journal.cancel, run_id)
    return Json({"run_id": run_id, "state": state})


async def send_to_run(request: Request) -> Response:
    host, run_id = _host(request), _run_id(request)
    body = await read_object(request, allowed=("message",))
    message = str(text_field(body, "message"))
    await run_in_threadpool(host.live_row, run_id)
    await run_in_threadpool(host.journal.send, run_id, message)
    return Json({"run_id": run_id, "sent": True})


# ---- asks ---------------------------------------------------------------------------------
async def list_asks(request: Request) -> Response:
    return Json({"asks": await run_in_threadpool(_host(request).journal.asks)})


async def answer_ask(request: Request) -> Response:
    host, ask_id = _host(request), str(request.path_params["ask_id"])
    body = await read_object(request, allowed=("value", "by"))
    value = body.get("value")
    if not isinstance(value, str):
        raise ApiError(422, f"value must be a string, got {json_type(value)}", field="value")
    by = text_field(body, "by", required=False) or ANSWERED_BY
    await run_in_threadpool(host.open_ask, ask_id)  # 404 or 409 unless it is open
    result = await run_in_threadpool(host.journal.answer, ask_id, value, by)
    return Json(result)


# ---- flows --------------------------------------------------------------------------------
async def start_flow(request: Request) -> Response:
    body = await read_object(request, allowed=("spec", "inputs"))
    spec = body.get("spec")
    if isinstance(spec, str) and spec.strip():
        check_depth(spec, "the spec", field="spec")  # refused before anything parses it
    elif not isinstance(spec, dict):
        raise ApiError(
            422, f"spec must be an object or YAML/JSON text, got {json_type(spec)}", field="spec"
        )
    inputs = object_field(body, "inputs")
    host = _host(request)

    def start() -> brood.FlowHandle:
        from brood.flow.load import load_spec_text

        # A spec over HTTP is text, never a path on this machine, whatever it looks like.
        try:
            loaded = load_spec_text(spec, quote=True) if isinstance(spec, str) else spec
        except brood.InvalidSpec as exc:
            raise ApiError(422, str(exc), field="spec") from None
        return host.supervisor().flow_run(loaded, inputs=inputs)

    flow = await run_in_threadpool(start)
    return Json(
        {"run_id": flow.id, "started": flow.started},
        status_code=201,
        headers={"Location": f"/v1/flows/{flow.id}"},
    )


def _flow_row(host: Host, run_id: str, *, live: bool) -> None:
    row = host.live_row(run_id) if live else host.run_row(run_id)
    if row["model"] != "flow":
        raise ApiError(404, f"run {run_id} is not a flow", fix="POST /v1/flows starts one")


async def flow_status(request: Request) -> Response:
    host, run_id = _host(request), _run_id(request)
    await run_in_threadpool(partial(_flow_row, host, run_id, live=False))
    status = await run_in_threadpool(host.journal.flow, run_id, "status")
    return Json({"run_id": run_id} | status)


async def _flow_op(request: Request, op: str) -> Response:
    host, run_id = _host(request), _run_id(request)
    await run_in_threadpool(partial(_flow_row, host, run_id, live=True))
    state = await run_in_threadpool(host.journal.flow, run_id, op)
    return Json({"run_id": run_id, "state": state})


async def stop_flow(request: Request) -> Response:
    return await _flow_op(request, "stop")


async def resume_flow(request: Request) -> Response:
    return await _flow_op(request, "resume")


# ---- sessions: reset / step / close over HTTP -------------------------------------------------
def _sessions(request: Request) -> Sessions:
    sessions: Sessions = request.app.state.sessions
    return sessions


def _session_id(request: Request) -> str:
    return str(request.path_params["session_id"])


async def open_session(request: Request) -> Response:
    body = await read_object(request, allowed=("limits", "model"))
    limits = object_field(body, "limits")
    model = text_field(body, "model", required=False)
    start = partial(_sessions(request).open, client_of(request))
    sid = await run_in_threadpool(start, limits, model)
    return Json({"session_id": sid}, status_code=201, headers={"Location": f"/v1/sessions/{sid}"})


async def reset_session(request: Request) -> Response:
    body = await read_object(request, allowed=("prompt", "context"))
    prompt = str(text_field(body, "prompt"))
    reset = _sessions(request).reset
    return Json(await run_in_threadpool(reset, _session_id(request), prompt, body.get("context")))


async def step_session(request: Request) -> Response:
    body = await read_object(request, allowed=("code", "timeout"))
    code = body.get("code")
    if not isinstance(code, str):
        raise ApiError(422, f"code must be a string of Python, got {json_type(code)}", field="code")
    timeout = seconds_field(body, "timeout", 0.0) or None
    step = _sessions(request).step
    return Json(await run_in_threadpool(step, _session_id(request), code, timeout))


async def reward_session(request: Request) -> Response:
    body = await read_object(request, allowed=("reward", "info"))
    reward = body.get("reward")
    if isinstance(reward, bool) or not isinstance(reward, int | float):
        raise ApiError(422, f"reward must be a number, got {json_type(reward)}", field="reward")
    info = object_field(body, "info")
    record = _sessions(request).record_reward
    return Json(await run_in_threadpool(record, _session_id(request), float(reward), info))


async def session(request: Request) -> Response:
    """GET reads a session, DELETE closes it: one route, so a 405 names both methods."""
    sessions, sid = _sessions(request), _session_id(request)
    if request.method == "DELETE":
        return Json(await run_in_threadpool(sessions.close, sid))
    journal = _host(request).journal

    def state_of(run_id: str) -> str:
        return str(journal.store.get_run(run_id)["state"])

    return Json(await run_in_threadpool(sessions.status, sid, state_of))


# ---- OpenAI-compatible, and the schema ---------------------------------------------------
async def list_models(request: Request) -> Response:
    return Json(openai_compat.models(_host(request), request.app.state.started))


async def chat_completions(request: Request) -> ASGIApp:
    return await openai_compat.chat_completions(request, _host(request))


async def schema(request: Request) -> Response:
    return Json(openapi())


ROUTES = [
    Route("/openapi.json", schema, methods=["GET"]),
    Route("/v1/runs", runs, methods=["GET", "POST"]),
    Route("/v1/runs/{run_id}", get_run, methods=["GET"]),
    Route("/v1/runs/{run_id}/tree", get_tree, methods=["GET"]),
    Route("/v1/runs/{run_id}/events", run_events, methods=["GET"]),
    Route("/v1/runs/{run_id}/cancel", cancel_run, methods=["POST"]),
    Route("/v1/runs/{run_id}/send", send_to_run, methods=["POST"]),
    Route("/v1/asks", list_asks, methods=["GET"]),
    Route("/v1/asks/{ask_id}/answer", answer_ask, methods=["POST"]),
    Route("/v1/flows", start_flow, methods=["POST"]),
    Route("/v1/flows/{run_id}", flow_status, methods=["GET"]),
    Route("/v1/flows/{run_id}/stop", stop_flow, methods=["POST"]),
    Route("/v1/flows/{run_id}/resume", resume_flow, methods=["POST"]),
    Route("/v1/sessions", open_session, methods=["POST"]),
    Route("/v1/sessions/{session_id}", session, methods=["GET", "DELETE"]),
    Route("/v1/sessions/{session_id}/reset", reset_session, methods=["POST"]),
    Route("/v1/sessions/{session_id}/step", step_session, methods=["POST"]),
    Route("/v1/sessions/{session_id}/reward", reward_session, methods=["POST"]),
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    *dashboard.ROUTES,
]


# ---- refusals -----------------------------------------------------------------------------
async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return exc.response()


async def _brood_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, brood.BroodError)
    return from_brood(exc).response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"no endpoint {request.url.path}"
    elif exc.status_code == 405:
        message = f"{request.method} is not an endpoint of {request.url.path}"
    else:
        message = str(exc.detail)
    return error_response(
        exc.status_code, message, fix="GET /openapi.json lists the endpoints", headers=exc.headers
    )


def make_app(
    *,
    store_url: str,
    model: Any = None,
    token: str | None = None,
    limits: brood.Limits | None = None,
    prices: Mapping[str, brood.Price | tuple[float, float]] | None = None,
    max_streams: int = MAX_STREAMS,
    max_queued: int = MAX_QUEUED,
    max_sessions: int = MAX_SESSIONS,
    max_sessions_per_client: int = MAX_SESSIONS_PER_CLIENT,
    session_idle: float = SESSION_IDLE_S,
) -> Starlette:
    """The app of `brood serve`: the JSON API under `/v1` over the journal at `store_url`.

    `model` (a spec string, a chat_fn or a `brood.Model`; default `$BROOD_MODEL`) is the
    model of the one supervisor the app hosts, made at the first run started through it
    and closed, every worker's exit confirmed, when the app shuts down. Without a model the
    app still reads the journal and acts on other processes' trees, and refuses to start
    runs (503). `prices` are `Supervisor`'s. A bad store URL, model spec or price raises
    at once.

    Every `/v1`, `/ui` and `/openapi.json` call must carry `Authorization: Bearer TOKEN`.
    Without `token` the app makes one (`secrets.token_urlsafe(32)`), which a program
    reads from `app.state.token`, and answers only loopback `Host` names, as `brood serve`
    does without `--token`. Made rather than refused: there is no server without a token
    (a loopback port answers every process of the machine, model code that may open
    connections included), and a caller made to pick one tends to pick a weak one.

    `max_streams` bounds the responses that follow a tree at once (event streams, live
    trees, chat completions; 503 past it), `max_queued` the runs each client address has
    started here that have not started yet (429 past it).

    `/v1/sessions` opens `brood.Session`s of the app's model, journal and limits (reset /
    step / close over HTTP): at most `max_sessions` at once, `max_sessions_per_client` per
    client address (429 past either); one idle for `session_idle` seconds is closed, and
    every one is closed, exit confirmed, when the app shuts down.
    """
    if token is not None and (not isinstance(token, str) or not token.strip()):
        raise brood.InvalidArgument(
            "token must be a non-blank string, or None for a token made for this app"
        )
    if limits is not None and not isinstance(limits, brood.Limits):
        raise brood.InvalidArgument(
            f"limits must be brood.Limits(...), got {type(limits).__name__}"
        )
    for name, value in (
        ("max_streams", max_streams),
        ("max_queued", max_queued),
        ("max_sessions", max_sessions),
        ("max_sessions_per_client", max_sessions_per_client),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            flag = "--" + name.replace("_", "-")  # brood serve's name for it
            raise brood.InvalidArgument(
                f"{name} ({flag}) must be a whole number >= 1, got {value!r}"
            )
    made = token is None
    token = secrets.token_urlsafe(32) if token is None else token
    if isinstance(session_idle, bool) or not isinstance(session_idle, int | float):
        raise brood.InvalidArgument(f"session_idle must be seconds > 0, got {session_idle!r}")
    if not session_idle > 0:
        raise brood.InvalidArgument(f"session_idle must be seconds > 0, got {session_idle!r}")
    host = Host(store_url, model, limits, max_queued=max_queued, prices=prices)
    sessions = Sessions(
        host.session,
        limits=limits,
        model_name=host.model_name,
        cap=max_sessions,
        per_client=max_sessions_per_client,
        idle_s=float(session_idle),
    )

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            with anyio.CancelScope(shield=True):  # the workers' exits are confirmed
                try:
                    await run_in_threadpool(sessions.close_all)
                finally:
                    await run_in_threadpool(host.close)

    app = Starlette(
        routes=ROUTES,
        middleware=[
            Middleware(CatchAll),
            Middleware(Guard, token=token, loopback_only=made),
        ],
        exception_handlers={
            ApiError: _api_error,
            brood.BroodError: _brood_error,
            HTTPException: _http_error,
        },
        lifespan=lifespan,
    )
    app.state.host = host
    app.state.sessions = sessions
    app.state.token = token
    app.state.token_made = made  # brood serve prints a login URL for a token it made
    app.state.streams = Streams(max_streams)
    app.state.started = int(time.time())
    return app

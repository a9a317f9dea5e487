"""The OpenAPI 3 document of `brood serve`, written by hand: every route, what it takes,
what it answers. A test checks that it names every route the app has."""

from __future__ import annotations

from typing import Any

import brood
from brood.serve.bodies import MAX_BODY_BYTES, MAX_JSON_DEPTH
from brood.serve.sessions import SESSION_LIMITS

REF_ERROR = {"$ref": "#/components/schemas/Error"}
ANY_OBJECT: dict[str, Any] = {"type": "object", "additionalProperties": True}
RUN_ID = {"name": "run_id", "in": "path", "required": True, "schema": {"type": "string"}}
SESSION_ID = {"name": "session_id", "in": "path", "required": True, "schema": {"type": "string"}}
ASK_ID = {"name": "ask_id", "in": "path", "required": True, "schema": {"type": "string"}}
SSE = "text/event-stream"
NOT_BLANK = "\\S"  # a string with some text: the server refuses a blank one (422)
TEXT = {"type": "string", "pattern": NOT_BLANK}

ERRORS = {
    "400": f"malformed JSON, or JSON nested over {MAX_JSON_DEPTH} levels",
    "401": "a missing or wrong token",
    "403": "a Host or Origin this server does not answer",
    "404": "an unknown id",
    "409": "the run, ask, flow or session has ended (or is stale), or a session is busy",
    "413": f"a body over {MAX_BODY_BYTES:,} bytes",
    "422": "a field of the wrong type or value",
    "429": "the client has its bound of runs started here that have not started yet, or "
    "the server or the client its bound of open sessions",
    "503": "no model, the journal cannot be read, or the server follows its bound of streams",
}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"content": {"application/json": {"schema": schema}}}


def _obj(required: list[str], **props: Any) -> dict[str, Any]:
    return {"type": "object", "required": required, "properties": props}


def _body(required: list[str], **props: Any) -> dict[str, Any]:
    """A request body that takes these fields only (the server refuses others, 422)."""
    return _obj(required, **props) | {"additionalProperties": False}


def _op(
    summary: str,
    *,
    params: tuple[dict[str, Any], ...] = (),
    body: dict[str, Any] | None = None,
    status: str = "200",
    answer: dict[str, Any] | None = None,
    media: str = "application/json",
) -> dict[str, Any]:
    responses: dict[str, Any] = {
        status: {"description": summary, "content": {media: {"schema": answer or ANY_OBJECT}}}
    }
    for code, why in ERRORS.items():
        responses[code] = {"description": why} | _json(REF_ERROR)
    op: dict[str, Any] = {"summary": summary, "responses": responses}
    if params:
        op["parameters"] = list(params)
    if body is not None:
        op["requestBody"] = {"required": True} | _json(body)
    return op


def _query(name: str, schema: dict[str, Any], what: str) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "schema": schema, "description": what}


STATES = sorted(s.value for s in brood.RunState)
OBSERVATION = _obj(
    ["stdout", "stderr", "error", "done", "answer", "children", "run_id"],
    stdout={"type": "string"},
    stderr={"type": "string"},
    error={"type": ["string", "null"]},
    done={"type": "boolean"},
    answer={"type": ["string", "null"]},
    children={"type": "array", "items": ANY_OBJECT},
    run_id={"type": ["string", "null"]},
)
RUN_STATE = {
    "type": "object",
    "properties": {"run_id": {"type": "string"}, "state": {"type": "string"}},
}
MESSAGE = {
    "type": "object",
    "required": ["role"],
    "properties": {"role": {"type": "string"}, "content": {"type": ["string", "array", "null"]}},
}


def openapi() -> dict[str, Any]:
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "brood serve",
            "version": brood.__version__,
            "description": "Runs, trees, journal events, asks and flows of a brood journal, "
            "remote sessions (reset / step / close of a brood.Session), and an "
            "OpenAI-compatible chat completion whose answer is an RLM tree's.",
        },
        "components": {
            "schemas": {
                "Error": _obj(
                    ["error"],
                    error=_obj(
                        ["message"],
                        message={"type": "string"},
                        field={"type": "string"},
                        fix={"type": "string"},
                    ),
                )
            },
            "securitySchemes": {"token": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"token": []}],
        "paths": {
            "/openapi.json": {"get": _op("This document")},
            "/v1/runs": {
                "get": _op(
                    "Recent trees (their roots), newest first",
                    params=(
                        _query("state", {"type": "string", "enum": STATES}, "only roots in it"),
                        _query("limit", {"type": "integer", "minimum": 1, "maximum": 1000}, "20"),
                        _query("offset", {"type": "integer", "minimum": 0}, "0"),
                    ),
                    answer=_obj(["runs"], runs={"type": "array", "items": ANY_OBJECT}),
                ),
                "post": _op(
                    "Start a root run in the hosted supervisor; returns at once",
                    body=_body(
                        ["prompt"],
                        prompt=TEXT,
                        context={},
                        timeout={"type": "number", "exclusiveMinimum": 0, "default": 3600},
                    ),
                    status="201",
                    answer=_obj(["run_id"], run_id={"type": "string"}),
                ),
            },
            "/v1/runs/{run_id}": {
                "get": _op("A run, with its own and its subtree's usage", params=(RUN_ID,))
            },
            "/v1/runs/{run_id}/tree": {
                "get": _op("The run and its descendants, nested", params=(RUN_ID,))
            },
            "/v1/runs/{run_id}/tree/live": {
                "get": _op(
                    "The run's subtree as Server-Sent Events: `runs` events with the runs "
                    "whose rows changed (all of them first) and `wrote` (run id: its last "
                    "event seq), then `end` once the tree has ended. The dashboard draws its "
                    "live tree from it",
                    params=(RUN_ID,),
                    media=SSE,
                )
            },
            "/v1/runs/{run_id}/events": {
                "get": _op(
                    "The journal events of the run's tree as Server-Sent Events (id: seq, "
                    "event: kind, data: JSON), followed until the root ends; resumes after "
                    "Last-Event-ID or ?after=",
                    params=(
                        RUN_ID,
                        _query("after", {"type": "integer", "minimum": 0}, "a journal seq"),
                        {
                            "name": "Last-Event-ID",
                            "in": "header",
                            "required": False,
                            "schema": {"type": "integer", "minimum": 0},
                        },
                    ),
                    answer={"type": "string"},
                    media=SSE,
                )
            },
            "/v1/runs/{run_id}/cancel": {
                "post": _op(
                    "Cancel the run and its subtree; answers once every exit is confirmed",
                    params=(RUN_ID,),
                    answer=RUN_STATE,
                )
            },
            "/v1/runs/{run_id}/send": {
                "post": _op(
                    "A follow-up message the run sees before its next model turn",
                    params=(RUN_ID,),
                    body=_body(["message"], message=TEXT),
                )
            },
            "/v1/asks": {
                "get": _op(
                    "The open asks to a person of every live run",
                    answer=_obj(["asks"], asks={"type": "array", "items": ANY_OBJECT}),
                )
            },
            "/v1/asks/{ask_id}/answer": {
                "post": _op(
                    "Answer an open ask; returns the ask's result",
                    params=(ASK_ID,),
                    body=_body(["value"], value={"type": "string"}, by={"type": "string"}),
                )
            },
            "/v1/flows": {
                "post": _op(
                    "Start a flow in the hosted supervisor",
                    body=_body(
                        ["spec"],
                        spec={"type": ["object", "string"], "pattern": NOT_BLANK},
                        inputs={"type": "object"},
                    ),
                    status="201",
                    answer=_obj(
                        ["run_id", "started"],
                        run_id={"type": "string"},
                        started={"type": "array", "items": {"type": "string"}},
                    ),
                )
            },
            "/v1/flows/{run_id}": {"get": _op("A flow's status", params=(RUN_ID,))},
            "/v1/flows/{run_id}/stop": {
                "post": _op("Stop a flow", params=(RUN_ID,), answer=RUN_STATE)
            },
            "/v1/flows/{run_id}/resume": {
                "post": _op("Let a paused flow go on", params=(RUN_ID,), answer=RUN_STATE)
            },
            "/v1/sessions": {
                "post": _op(
                    "Open a session (brood.Session over HTTP) on this server's model and "
                    "journal; limits may tighten the server's, never loosen them",
                    body=_body(
                        [],
                        limits=_body(
                            [], **{name: {"type": ["number", "null"]} for name in SESSION_LIMITS}
                        ),
                        model={"type": "string"},
                    ),
                    status="201",
                    answer=_obj(["session_id"], session_id={"type": "string"}),
                )
            },
            "/v1/sessions/{session_id}": {
                "get": _op("A session: its episode's run, state, children", params=(SESSION_ID,)),
                "delete": _op(
                    "Close a session: its episode's tree ends, every worker's exit confirmed",
                    params=(SESSION_ID,),
                ),
            },
            "/v1/sessions/{session_id}/reset": {
                "post": _op(
                    "End the episode (if any) and start a new one whose root waits for steps",
                    params=(SESSION_ID,),
                    body=_body(["prompt"], prompt=TEXT, context={}),
                    answer=OBSERVATION,
                )
            },
            "/v1/sessions/{session_id}/step": {
                "post": _op(
                    "Run code in the episode root's REPL; done and answer once it calls FINAL",
                    params=(SESSION_ID,),
                    body=_body(
                        ["code"],
                        code={"type": "string"},
                        timeout={"type": "number", "exclusiveMinimum": 0},
                    ),
                    answer=OBSERVATION,
                )
            },
            "/v1/sessions/{session_id}/reward": {
                "post": _op(
                    "Journal the episode's reward (carried by brood export)",
                    params=(SESSION_ID,),
                    body=_body(["reward"], reward={"type": "number"}, info=ANY_OBJECT),
                )
            },
            "/v1/models": {"get": _op("The model this server's runs use (OpenAI's form)")},
            "/v1/chat/completions": {
                "post": _op(
                    "OpenAI chat completion: the last user message is the task of a root "
                    "run, the other messages its context; the answer is the tree's. "
                    "stream: true gives chat.completion.chunk events, then [DONE]. With "
                    'conversation_id ("new" starts one, with the other messages as its '
                    "context; an id continues it, reading only the last user message) it is "
                    "a turn of a conversation whose REPL and history persist; the answer "
                    "carries conversation_id (and the X-Brood-Conversation-Id header) to "
                    "continue with, and usage is the turn's",
                    body=_obj(
                        ["model", "messages"],
                        model={"type": "string"},
                        messages={"type": "array", "items": MESSAGE},
                        stream={"type": "boolean"},
                        conversation_id={"type": "string", "pattern": NOT_BLANK},
                    ),
                )
            },
        },
    }

"""The OpenAI-compatible face: `GET /v1/models` and `POST /v1/chat/completions`, whose
answer is a whole RLM tree's.

The last user message is the task; every other message goes into the run's `context` as a
list of `{"role", "content"}`, in order. The root runs in the hosted supervisor to its
end; `usage` sums the whole tree. A client that goes away cancels the tree (shielded, so
the cancel is not itself cut short), journaled as `client disconnected`.

With a `conversation_id` field (the openai client sends it with `extra_body`), the request
is a turn of a conversation (`Supervisor.conversation`) instead: `"new"` starts one (the
other messages are its context), a conversation's id continues it (its root keeps its own
history, so only the last user message is read). The answer carries the id to continue
with, as the `conversation_id` field and the X-Brood-Conversation-Id header; `usage` is
the turn's (the root's own model calls during it). A client that goes away does not end
the turn: its answer is journaled, and the conversation goes on.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import anyio
from sse_starlette.sse import EventSourceResponse, ServerSentEvent
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp

import brood
from brood.serve.bodies import json_type, read_object
from brood.serve.caps import client_of, streams_of
from brood.serve.errors import ApiError, Json
from brood.serve.host import START_ANOTHER, Host
from brood.serve.stream import SSE_SEP, tree_progress

RUN_HEADER = "X-Brood-Run-Id"
CONVERSATION_HEADER = "X-Brood-Conversation-Id"
CLIENT_GONE = 499  # nginx's "client closed request": the status of an answer nobody reads
CLIENT_GONE_REASON = "client disconnected"  # the reason journaled for a tree it cancels


def models(host: Host, created: int) -> dict[str, Any]:
    served = [] if host.model_name is None else [host.model_name]
    return {
        "object": "list",
        "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "brood"}
            for name in served
        ],
    }


def _text(content: Any, where: str) -> str:
    """A message's content: a string, or a list of text parts (joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise ApiError(
                    422,
                    f"{where}.content[{i}] is not a text part; brood takes text only",
                    field=f"{where}.content",
                )
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise ApiError(422, f"{where}.content must be a string, got {json_type(content)}", field=where)


def _task(messages: Any) -> tuple[str, list[dict[str, str]] | None]:
    """(the task, the context): the last user message, and every other message."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(422, "messages must be a non-empty list of messages", field="messages")
    plain: list[dict[str, str]] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(422, f"{where} must be an object with a role", field=where)
        plain.append({"role": m["role"], "content": _text(m.get("content"), where)})
    last = max((i for i, m in enumerate(plain) if m["role"] == "user"), default=None)
    if last is None or not plain[last]["content"].strip():
        raise ApiError(
            422,
            "messages hold no user message with text; the last one is the RLM's task",
            field="messages",
        )
    context = plain[:last] + plain[last + 1 :]
    return plain[last]["content"], context or None


def _check_model(host: Host, asked: Any) -> None:
    if asked == host.model_name and asked is not None:
        return
    served = f"it serves {host.model_name!r}" if host.model_name else "it serves no model"
    raise ApiError(
        404,
        f"model {asked!r} is not served here; {served}",
        field="model",
        fix="GET /v1/models lists the served model",
    )


async def chat_completions(request: Request, host: Host) -> ASGIApp:
    """The completion; it follows its tree to the end, so it counts as one of the server's
    streams from before its run starts (503 past the bound, and nothing is started)."""
    body = await read_object(request)
    _check_model(host, body.get("model"))
    task, context = _task(body.get("messages"))
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(
            422, f"stream must be true or false, got {json_type(stream)}", field="stream"
        )
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(
            422,
            f"stream_options must be an object, got {json_type(options)}",
            field="stream_options",
        )
    conversation_id = body.get("conversation_id")
    if conversation_id is not None and (
        not isinstance(conversation_id, str) or not conversation_id.strip()
    ):
        raise ApiError(
            422,
            f'conversation_id must be a conversation\'s id, or "new" to start one; got '
            f"{json_type(conversation_id)}",
            field="conversation_id",
        )
    streams = streams_of(request)
    give = streams.take()
    handed = False  # to the streamed response, which gives the stream back once sent
    try:
        if conversation_id is not None:
            turn = _Turn(host, str(body["model"]), usage_chunk=options.get("include_usage") is True)
            result = await run_in_threadpool(turn.send, conversation_id, task, context)
            if stream:
                chunks = EventSourceResponse(turn.chunks(result), sep=SSE_SEP, headers=turn.headers)
                handed = True
                return streams.held(chunks, give)
            return turn.whole(result)
        start = partial(host.start, client=client_of(request))
        run_id = await run_in_threadpool(start, task, context)
        reply = _Reply(
            host, run_id, str(body["model"]), usage_chunk=options.get("include_usage") is True
        )
        headers = {RUN_HEADER: run_id}
        if stream:
            chunks = EventSourceResponse(reply.chunks(), sep=SSE_SEP, headers=headers)
            handed = True
            return streams.held(chunks, give)
        return await reply.whole(request, headers)
    finally:
        if not handed:
            give()


class _Reply:
    """One chat completion: the tree under `run_id`, followed to its end."""

    def __init__(self, host: Host, run_id: str, model: str, *, usage_chunk: bool) -> None:
        self.host = host
        self.usage_chunk = usage_chunk  # stream_options.include_usage
        self.run_id = run_id
        self.model = model
        self.id = f"chatcmpl-{run_id}"
        self.created = int(time.time())
        self.ended = False

    def _outcome(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The root's row and the tree's usage in OpenAI's terms, with brood's `cost` of
        the tree (dollars; None when no call was priced) and `unpriced_calls`; 502 if it
        did not complete."""
        tree = self.host.journal.tree(self.run_id)
        if tree["state"] != "completed":
            raise ApiError(
                502,
                f"run {self.run_id} {tree['state']}: {tree['reason']}",
                fix=f"GET /v1/runs/{self.run_id}/tree shows what each run did",
                headers={RUN_HEADER: self.run_id},
            )
        u = tree["subtree_usage"]
        prompt, completion = int(u.get("input_tokens", 0)), int(u.get("output_tokens", 0))
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "cost": u.get("cost"),
            "unpriced_calls": int(u.get("unpriced_calls") or 0),
        }
        return tree, usage

    async def _cancel_if_going(self) -> None:
        """The client went away before the answer: the tree's work is for nobody."""
        if self.ended:
            return
        with anyio.CancelScope(shield=True):
            try:
                await run_in_threadpool(
                    partial(self.host.journal.cancel, self.run_id, reason=CLIENT_GONE_REASON)
                )
            except brood.BroodError:
                pass  # it ended meanwhile

    async def whole(self, request: Request, headers: dict[str, str]) -> Response:
        try:
            async for _ in tree_progress(self.host, self.run_id):
                if await request.is_disconnected():
                    return Response(status_code=CLIENT_GONE)  # the tree is cancelled below
            self.ended = True
        finally:
            await self._cancel_if_going()
        tree, usage = await run_in_threadpool(self._outcome)
        return Json(
            self._head("chat.completion")
            | {
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": tree["answer"] or ""},
                        "finish_reason": "stop",
                    }
                ],
                "usage": usage,
            },
            headers=headers,
        )

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> ServerSentEvent:
        chunk = self._head("chat.completion.chunk") | {
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]
        }
        return ServerSentEvent(json.dumps(chunk), sep=SSE_SEP)

    async def chunks(self) -> AsyncIterator[ServerSentEvent]:
        """OpenAI's streaming form: the role, progress as SSE comments while the tree
        grows, the answer as one content chunk, the finish, `[DONE]`. A tree that did not
        complete ends the stream with an error object, as OpenAI's servers do."""
        try:
            yield self._chunk({"role": "assistant", "content": ""})
            async for lines in tree_progress(self.host, self.run_id):
                for line in lines:
                    yield ServerSentEvent(comment=line, sep=SSE_SEP)
            self.ended = True
            try:
                tree, usage = await run_in_threadpool(self._outcome)
            except ApiError as exc:
                error = {"message": exc.message, "type": "run_failed", "code": exc.status}
                yield ServerSentEvent(json.dumps({"error": error}), sep=SSE_SEP)
                return
            yield self._chunk({"content": tree["answer"] or ""})
            yield self._chunk({}, finish="stop")
            if self.usage_chunk:
                yield ServerSentEvent(
                    json.dumps(
                        self._head("chat.completion.chunk") | {"choices": [], "usage": usage}
                    ),
                    sep=SSE_SEP,
                )
            yield ServerSentEvent("[DONE]", sep=SSE_SEP)
        finally:
            await self._cancel_if_going()


class _Turn:
    """One chat completion that is a turn of a conversation: sent, then answered whole or
    as chunks (the turn's answer comes at its end, as a tree's does)."""

    def __init__(self, host: Host, model: str, *, usage_chunk: bool) -> None:
        self.host = host
        self.model = model
        self.usage_chunk = usage_chunk
        self.created = int(time.time())
        self.id = ""
        self.headers: dict[str, str] = {}

    def send(self, conversation_id: str, prompt: str, context: Any) -> brood.RunResult:
        """The turn, run to its end (blocking: called on a worker thread)."""
        try:
            conv_id, result = self.host.conversation_turn(conversation_id, prompt, context)
        except brood.ConversationClosed as exc:
            raise ApiError(409, str(exc), field="conversation_id", fix=START_ANOTHER) from None
        self.headers = {RUN_HEADER: conv_id, CONVERSATION_HEADER: conv_id}
        self.id = f"chatcmpl-{conv_id}-{uuid.uuid4().hex[:8]}"
        if result.state != "completed":
            raise ApiError(
                502,
                f"conversation {conv_id} {result.state}: {result.error}",
                fix=f"GET /v1/runs/{conv_id}/tree shows what each run did; {START_ANOTHER}",
                headers=self.headers,
            )
        return result

    def _usage(self, result: brood.RunResult) -> dict[str, Any]:
        u = result.usage
        prompt, completion = int(u.get("input_tokens", 0)), int(u.get("output_tokens", 0))
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "cost": u.get("cost"),
            "unpriced_calls": int(u.get("unpriced_calls") or 0),
        }

    def _head(self, kind: str, conversation_id: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "conversation_id": conversation_id,
        }

    def whole(self, result: brood.RunResult) -> Response:
        message = {"role": "assistant", "content": result.answer or ""}
        return Json(
            self._head("chat.completion", result.run_id)
            | {
                "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                "usage": self._usage(result),
            },
            headers=self.headers,
        )

    def _chunk(self, result: brood.RunResult, **fields: Any) -> ServerSentEvent:
        chunk = self._head("chat.completion.chunk", result.run_id) | fields
        return ServerSentEvent(json.dumps(chunk), sep=SSE_SEP)

    async def chunks(self, result: brood.RunResult) -> AsyncIterator[ServerSentEvent]:
        """OpenAI's streaming form of the turn's answer: the role, the answer, the finish,
        the usage if asked for, `[DONE]`."""
        for delta, finish in (
            ({"role": "assistant", "content": ""}, None),
            ({"content": result.answer or ""}, None),
            ({}, "stop"),
        ):
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
            yield self._chunk(result, choices=[choice])
        if self.usage_chunk:
            yield self._chunk(result, choices=[], usage=self._usage(result))
        yield ServerSentEvent("[DONE]", sep=SSE_SEP)

"""Following a tree through the journal: its events as Server-Sent Events, and progress
lines while it grows. Both poll the journal, which is all a process that does not own the
tree can see; a stream of a tree the hosted supervisor runs reads it the same way."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import anyio
from sse_starlette.sse import EventSourceResponse, ServerSentEvent
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from brood.lifecycle import TERMINAL_VALUES
from brood.serve.errors import ApiError
from brood.serve.host import Host

POLL_S = 0.1  # how often a stream reads the journal again for what is new
PING_S = 15.0  # a comment line on a quiet stream, so proxies keep it open
SSE_SEP = "\n"  # what OpenAI's clients and most SSE parsers expect


def resume_point(request: Request) -> int:
    """The journal seq a stream resumes after: `Last-Event-ID` (a reconnecting client
    sends it), else `?after=`, else 0 (from the start)."""
    header = request.headers.get("last-event-id")
    raw, field = (
        (header, "Last-Event-ID")
        if header is not None
        else (
            request.query_params.get("after", "0"),
            "after",
        )
    )
    raw = raw.strip()
    if not raw.isdigit():
        raise ApiError(
            422, f"{field} must be an event id (a journal seq, 0 or more), got {raw!r}", field=field
        )
    return int(raw)


def tree_events(host: Host, root_id: str, after: int) -> EventSourceResponse:
    """Every journal event of the tree under `root_id` with seq > `after`, as SSE (`id:`
    its seq, `event:` its kind, `data:` the event as JSON), following new ones until the
    root has ended and all are sent."""

    async def stream() -> AsyncIterator[ServerSentEvent]:
        seen = after
        while True:
            # Whether the tree has ended is read before its events, so the last read after
            # the end still sends what landed meanwhile.
            done = await run_in_threadpool(host.tree_done, root_id)
            events = await run_in_threadpool(
                partial(host.journal.store.events, root_id=root_id, after=seen)
            )
            for ev in events:
                seen = ev["seq"]
                yield ServerSentEvent(
                    json.dumps(ev, default=str), event=ev["kind"], id=str(ev["seq"]), sep=SSE_SEP
                )
            if done:
                return
            await anyio.sleep(POLL_S)

    return EventSourceResponse(stream(), sep=SSE_SEP, ping=PING_S)


async def tree_progress(host: Host, root_id: str) -> AsyncIterator[list[str]]:
    """The tree's progress, one batch per read of the journal (often empty, so that a
    caller can look at its client between reads): a line per run the tree starts
    (`run r-… spawned r-…`) and per run of it that ends (`run r-… completed`), until the
    root has ended. Every run is told of, even one that came and went between two reads."""
    said: dict[str, str] = {}
    while True:
        done = await run_in_threadpool(host.tree_done, root_id)
        runs: list[dict[str, Any]] = await run_in_threadpool(host.journal.store.runs, root_id)
        lines = []
        for r in runs:
            if r["id"] == root_id:
                continue
            if r["id"] not in said:
                lines.append(f"run {r['parent_id']} spawned {r['id']}")
            if r["state"] in TERMINAL_VALUES and said.get(r["id"]) not in TERMINAL_VALUES:
                lines.append(f"run {r['id']} {r['state']}")
            said[r["id"]] = r["state"]
        yield lines
        if done:
            return
        await anyio.sleep(POLL_S)

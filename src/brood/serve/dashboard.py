"""The dashboard at `/` (DESIGN.md section 10): HTML rendered here and one script of brood's
own (`static/dash.js`); no build step, no front-end library.

A page (`/`, `/runs/{id}`, `/flows/{id}`, `/asks`) is one shell that holds no data. The
script fetches the page's body from `/ui/...` with the server's token in the
`Authorization` header, never in a cookie: another site's page can neither read the
dashboard nor act through it. The script takes the token from the login URL once
(`?token=`, which it removes from the address bar) or asks for it, and keeps it in the
browser's storage for this server's origin, forgetting it when the server refuses it.
Bodies are rendered by Jinja with autoescape on, so a prompt, an answer or a REPL output is
always shown as text. The live tree is the one thing the script draws itself, from
`GET /v1/runs/{id}/tree/live`: batches of the runs of the subtree whose rows changed, and
which runs wrote events.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Iterator
from functools import partial
from importlib import resources
from typing import Any

import anyio
import jinja2
from sse_starlette.sse import EventSourceResponse, ServerSentEvent
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp

from brood.lifecycle import TERMINAL_VALUES, FlowStatus
from brood.models.prices import cost_text, dollars
from brood.serve.bodies import int_param
from brood.serve.caps import following
from brood.serve.errors import ApiError
from brood.serve.host import STATES, Host
from brood.serve.stream import PING_S, SSE_SEP

PAGE = 50  # roots per page of the runs list
TRAJECTORY_CHILDREN = 200  # children a run page lists in its trajectory; the tree has all
SHORT = 160  # characters of a prompt or an output line a tree row carries
LIVE_POLL_S = 0.25  # the live tree reads the journal this often at least...
LIVE_LOAD = 4.0  # ...and never spends more than a fifth of its time reading
STATIC = {"dash.js": "text/javascript", "dash.css": "text/css"}
# The shell and the static files may be fetched by a browser with no token; none holds data.
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
    ),
    "X-Frame-Options": "DENY",  # no other page may frame the buttons that act
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
HIDDEN_EVENTS = frozenset({"prompt", "remember", "scratch", "step_begun", "flow", "model_spec"})

_env = jinja2.Environment(
    loader=jinja2.PackageLoader("brood.serve", "templates"),
    autoescape=True,
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)


def _when(at: float | None) -> str:
    return "" if at is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at))


def _seconds(value: float | None) -> str:
    if value is None:
        return "–"
    if value < 1:
        return f"{value * 1000:.0f} ms"
    if value < 120:
        return f"{value:.1f} s"
    minutes, seconds = divmod(int(value), 60)
    if minutes < 120:
        return f"{minutes} min {seconds:02d} s"
    return f"{minutes // 60} h {minutes % 60:02d} min"


def _tokens(usage: dict[str, Any] | None) -> str:
    usage = usage or {}
    total = int(usage.get("input_tokens", 0)) + int(usage.get("output_tokens", 0))
    return f"{total:,} tok"


def _cost(usage: dict[str, Any] | None) -> str:
    return cost_text(usage or {})


def _first_line(text: Any, limit: int = SHORT) -> str:
    line = str(text or "").strip().split("\n", 1)[0]
    return line if len(line) <= limit else line[: limit - 1] + "…"


_env.filters.update(
    when=_when,
    seconds=_seconds,
    tokens=_tokens,
    cost=_cost,
    dollars=dollars,
    first_line=_first_line,
)
_env.globals.update(terminal=TERMINAL_VALUES)


def _page(name: str, **values: Any) -> HTMLResponse:
    return HTMLResponse(_env.get_template(name).render(**values), headers=HEADERS)


# ---- the shell and its two files ----------------------------------------------------------
async def shell(request: Request) -> Response:
    return _page("shell.html")


async def static(request: Request) -> Response:
    name = str(request.path_params["name"])
    if name not in STATIC:
        raise ApiError(404, f"no file {name!r}", fix="the dashboard is at /")
    body = resources.files("brood.serve").joinpath("static", name).read_bytes()
    return Response(body, media_type=STATIC[name], headers=HEADERS)


def _host(request: Request) -> Host:
    host: Host = request.app.state.host
    return host


# ---- the runs list and the asks -----------------------------------------------------------
async def ui_runs(request: Request) -> Response:
    host = _host(request)
    state = request.query_params.get("state") or None
    if state is not None and state not in STATES:
        raise ApiError(422, f"state {state!r} is not a run state", field="state")
    offset = int_param(request, "offset", 0, 0, 10**9)
    runs = await run_in_threadpool(host.roots_page, state, PAGE + 1, offset)
    asks = await run_in_threadpool(host.journal.asks)
    return _page(
        "runs.html",
        runs=runs[:PAGE],
        more=len(runs) > PAGE,
        offset=offset,
        page=PAGE,
        state=state,
        states=sorted(STATES),
        asks=len(asks),
        can_start=host.model is not None,
        model=host.model_name,
    )


async def ui_asks(request: Request) -> Response:
    asks = await run_in_threadpool(_host(request).journal.asks)
    return _page("asks.html", asks=asks)


# ---- a run: its header, asks, live tree, trajectory ---------------------------------------
async def ui_run(request: Request) -> Response:
    host, run_id = _host(request), str(request.path_params["run_id"])
    run = await run_in_threadpool(host.journal.run, run_id)  # 404: UnknownRun
    entries, seq, children = await run_in_threadpool(trajectory, host, run_id, 0, 0)
    asks = [a for a in await run_in_threadpool(host.journal.asks) if a["run_id"] == run_id]
    return _page(
        "run.html",
        run=run,
        asks=asks,
        entries=entries,
        seq=seq,
        children=children,
        live=run["state"] not in TERMINAL_VALUES and not run["stale"],
    )


async def ui_trajectory(request: Request) -> Response:
    host, run_id = _host(request), str(request.path_params["run_id"])
    after = int_param(request, "after", 0, 0, 10**18)
    shown = int_param(request, "children", 0, 0, 10**9)
    entries, seq, children = await run_in_threadpool(trajectory, host, run_id, after, shown)
    return _page("trajectory.html", entries=entries, seq=seq, children=children)


def trajectory(
    host: Host, run_id: str, after: int, shown: int
) -> tuple[list[dict[str, Any]], int, int]:
    """A run's trajectory after journal seq `after` and its first `shown` children: entries
    in time order, the last seq read, and how many children are listed in all."""
    row = host.run_row(run_id)
    events = host.journal.store.events(run_id, after=after)
    kids = [r for r in host.journal.store.runs(row["root_id"]) if r["parent_id"] == run_id]
    listed = kids[:TRAJECTORY_CHILDREN]
    entries = [e for ev in events for e in _entry(ev)]
    begun = {ev["data"].get("step"): ev["at"] for ev in events if ev["kind"] == "step_begun"}
    for e in entries:  # a step is placed where it began: before the children it started
        if e["kind"] == "step":
            e["at"] = begun.get(e["step"], e["at"])
    entries += [
        {"kind": "child", "at": k["created_at"], "run": k, "seq": None} for k in listed[shown:]
    ]
    if len(kids) > TRAJECTORY_CHILDREN and shown < len(listed):
        entries.append(
            {
                "kind": "more_children",
                "at": listed[-1]["created_at"],
                "count": len(kids) - TRAJECTORY_CHILDREN,
                "seq": None,
            }
        )
    entries.sort(key=lambda e: e["at"])
    seq = events[-1]["seq"] if events else after
    return entries, seq, max(shown, len(listed))


def _entry(ev: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """What a person reads of one journal event (nothing for the bookkeeping ones)."""
    kind, data = ev["kind"], ev["data"]
    base = {"at": ev["at"], "seq": ev["seq"]}
    if kind in HIDDEN_EVENTS:
        return
    if kind == "model_call":
        sent = [
            {"role": m.get("role", "?"), "content": str(m.get("content", ""))}
            for m in data.get("request") or []
            if "prompt_ref" not in m  # the shared system prompt, the same in every run
        ]
        yield base | {
            # A compaction's summary call (Limits.compact_at) is shown as what it is.
            "kind": data.get("kind") if data.get("kind") in ("turn", "compact") else "query",
            "model": data.get("model"),
            "sent": sent,
            "response": data.get("response"),
            "error": data.get("error"),
            "tokens": int(data.get("input_tokens", 0)) + int(data.get("output_tokens", 0)),
            "cost": data.get("cost"),
            "latency": data.get("latency"),
        }
    elif kind == "step":
        yield base | {
            "kind": "step",
            "step": data.get("step"),
            "code": data.get("code", ""),
            "stdout": data.get("stdout", ""),
            "stderr": data.get("stderr", ""),
            "error": data.get("error"),
            "duration": data.get("duration"),
        }
    elif kind == "message":
        yield base | {"kind": "message", "message": data.get("message", "")}
    elif kind == "ask":
        yield base | {"kind": "ask", "op": data.get("op"), "ask": data.get("ask"), "data": data}
    else:
        shown = {k: v for k, v in data.items() if k not in ("value",)}
        yield base | {"kind": "note", "what": kind, "text": json.dumps(shown, default=str)}


# ---- a flow: its state machine drawn ------------------------------------------------------
BOX_W, BOX_H, GAP_X, GAP_Y, PAD = 200, 74, 70, 26, 16


async def ui_flow(request: Request) -> Response:
    host, run_id = _host(request), str(request.path_params["run_id"])
    run = await run_in_threadpool(host.journal.run, run_id)
    if run["model"] != "flow":
        raise ApiError(404, f"run {run_id} is not a flow", fix=f"its page is /runs/{run_id}")
    status = await run_in_threadpool(host.journal.flow_status, run_id)
    ledger = await run_in_threadpool(host.journal.store.events, run_id, "flow")
    spec: dict[str, Any] = next(
        (e["data"]["spec"] for e in ledger if e["data"]["kind"] == "spec"), {}
    )
    return _page(
        "flow.html",
        run=run,
        status=status,
        drawing=draw_machine(spec, status["states"]),
        live=status["status"] in (FlowStatus.RUNNING, FlowStatus.PAUSED),
    )


def draw_machine(spec: dict[str, Any], states: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Boxes and arrows of a flow's machine, laid out in columns by distance from its entry
    states (a DAG's nodes by their longest chain of dependencies)."""
    raw = spec.get("states") or spec.get("nodes") or []
    ids = [str(s.get("id")) for s in raw if isinstance(s, dict)]
    ids += [sid for sid in states if sid not in ids]  # a state the ledger knows of only
    if spec.get("nodes"):
        edges = [
            (str(dep), str(n.get("id")), "")
            for n in raw
            if isinstance(n, dict)
            for dep in n.get("depends_on") or []
        ]
        roots = [i for i in ids if not any(e[1] == i for e in edges)]
    else:
        edges = [
            (str(t.get("from")), str(t.get("to")), _guard_text(t.get("when")))
            for t in spec.get("transitions") or []
            if isinstance(t, dict)
        ]
        roots = [str(s.get("id")) for s in raw if isinstance(s, dict) and s.get("entry")]
    column = dict.fromkeys(roots or ids[:1], 0)
    frontier = list(column)
    while frontier:  # breadth first: a state's column is its shortest distance from entry
        nxt = []
        for a, b, _ in edges:
            if a in frontier and b not in column and b in ids:
                column[b] = column[a] + 1
                nxt.append(b)
        frontier = nxt
    for i in ids:
        column.setdefault(i, 0)
    rows: dict[int, int] = {}
    boxes = {}
    for i in ids:
        c = column[i]
        r = rows.get(c, 0)
        rows[c] = r + 1
        st = states.get(i, {"entries": 0, "instances": []})
        counts: dict[str, int] = {}
        for inst in st.get("instances", []):
            counts[inst["state"]] = counts.get(inst["state"], 0) + 1
        running = counts.get("running", 0)
        boxes[i] = {
            "id": i,
            "x": PAD + c * (BOX_W + GAP_X),
            "y": PAD + r * (BOX_H + GAP_Y),
            "entries": st.get("entries", 0),
            "max_entries": st.get("max_entries"),
            "counts": counts,
            "cls": "running" if running else ("entered" if st.get("entries") else "idle"),
            "entry": i in roots,
        }
    arrows = []
    for a, b, label in edges:
        if a not in boxes or b not in boxes:
            continue
        s, t = boxes[a], boxes[b]
        if t["x"] > s["x"]:  # forward: right side to left side
            x1, y1, x2, y2 = s["x"] + BOX_W, s["y"] + BOX_H / 2, t["x"], t["y"] + BOX_H / 2
            mid = (x1 + x2) / 2
            path = f"M{x1},{y1} C{mid},{y1} {mid},{y2} {x2},{y2}"
            lx, ly = mid, (y1 + y2) / 2 - 6
        else:  # back or same column: a loop under the boxes
            x1, y1 = s["x"] + BOX_W / 2 + 20, s["y"] + BOX_H
            x2, y2 = t["x"] + BOX_W / 2 - 20, t["y"] + BOX_H
            low = max(y1, y2) + GAP_Y + 6
            path = f"M{x1},{y1} C{x1},{low} {x2},{low} {x2},{y2}"
            lx, ly = (x1 + x2) / 2, low - 4
        arrows.append({"path": path, "label": label, "lx": lx, "ly": ly})
    width = PAD * 2 + (max(column.values(), default=0) + 1) * (BOX_W + GAP_X) - GAP_X
    height = PAD * 2 + max(rows.values(), default=1) * (BOX_H + GAP_Y) + GAP_Y
    return {
        "boxes": list(boxes.values()),
        "arrows": arrows,
        "w": width,
        "h": height,
        "bw": BOX_W,
        "bh": BOX_H,
    }


def _guard_text(when: Any) -> str:
    if not isinstance(when, dict):
        return ""
    path = f".{when['path']}" if when.get("path") else ""
    value = "" if when.get("value") is None else f" {json.dumps(when['value'])}"
    return _first_line(f"{when.get('output', '?')}{path} {when.get('op', '?')}{value}", 40)


# ---- the live tree ------------------------------------------------------------------------
def _compact(run: dict[str, Any]) -> dict[str, Any]:
    """What a node of the live tree shows of a run."""
    usage, subtree = run["usage"], run["subtree_usage"]
    return {
        "id": run["id"],
        "parent_id": run["parent_id"],
        "depth": run["depth"],
        "state": run["state"],
        "reason": run["reason"],
        "key": run["key"],
        "attempt": run["attempt"],
        "model": run["model"],
        "prompt": _first_line(run["prompt"]),
        "duration": run["duration"],
        "stale": run["stale"],
        "calls": usage.get("model_calls", 0),
        "tokens": usage.get("input_tokens", 0) + usage.get("output_tokens", 0),
        "subtree_tokens": subtree.get("input_tokens", 0) + subtree.get("output_tokens", 0),
        "cost": cost_text(usage),
        "subtree_cost": cost_text(subtree),
        "last_line": _first_line(run["last_line"]),
        "waiting_for": run["waiting_for"],
        "hibernating": run["hibernating"],
    }


def live_rows(host: Host, run_id: str) -> list[dict[str, Any]]:
    """The subtree under `run_id`, parents before children, as live tree nodes."""
    out, stack = [], [host.journal.tree(run_id)]
    while stack:
        node = stack.pop()
        out.append(_compact(node))
        stack.extend(reversed(node["children"]))
    return out


async def tree_live(request: Request) -> ASGIApp:
    """SSE: `runs` events, each `{"runs": [...], "wrote": {run_id: seq}}` with the runs of
    the subtree whose rows changed since the last one (all of them first) and the last
    event seq of each run that wrote events; then one `end` once the tree has ended."""
    host, run_id = _host(request), str(request.path_params["run_id"])
    root_id = (await run_in_threadpool(host.run_row, run_id))["root_id"]  # 404 first

    async def stream() -> AsyncIterator[ServerSentEvent]:
        sent: dict[str, dict[str, Any]] = {}
        seen, first = 0, True
        while True:
            began = time.monotonic()
            done = await run_in_threadpool(host.tree_done, root_id)
            rows = await run_in_threadpool(live_rows, host, run_id)
            marks = await run_in_threadpool(partial(host.journal.store.event_marks, root_id, seen))
            changed = [r for r in rows if sent.get(r["id"]) != r]
            wrote = {m["run_id"]: m["seq"] for m in marks}
            seen = marks[-1]["seq"] if marks else seen
            sent.update((r["id"], r) for r in changed)
            if changed or wrote or first:
                body = {"runs": changed, "wrote": wrote, "now": time.time()}
                yield ServerSentEvent(json.dumps(body), event="runs", sep=SSE_SEP)
            first = False
            if done:
                yield ServerSentEvent("{}", event="end", sep=SSE_SEP)
                return
            spent = time.monotonic() - began
            await anyio.sleep(max(LIVE_POLL_S, spent * LIVE_LOAD))

    return following(request, EventSourceResponse(stream(), sep=SSE_SEP, ping=PING_S))


SHELL_ROUTES = [
    Route(path, shell, methods=["GET"]) for path in ("/", "/runs/{run_id}", "/flows/{run_id}")
] + [Route("/asks", shell, methods=["GET"])]

ROUTES = [
    *SHELL_ROUTES,
    Route("/static/{name}", static, methods=["GET"]),
    Route("/ui/runs", ui_runs, methods=["GET"]),
    Route("/ui/asks", ui_asks, methods=["GET"]),
    Route("/ui/runs/{run_id}", ui_run, methods=["GET"]),
    Route("/ui/runs/{run_id}/trajectory", ui_trajectory, methods=["GET"]),
    Route("/ui/flows/{run_id}", ui_flow, methods=["GET"]),
    Route("/v1/runs/{run_id}/tree/live", tree_live, methods=["GET"]),
]

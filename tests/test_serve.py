"""`brood serve`: a real uvicorn server on a loopback port, a file journal, a scripted model
and real workers; the clients are httpx and the real `openai` client."""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2 as httpx
import openai
import psutil
import pytest
import uvicorn
from typer.testing import CliRunner

import brood
from brood.cli.main import app as cli
from brood.hosts import is_loopback
from brood.serve import make_app
from brood.serve.bodies import MAX_BODY_BYTES, MAX_JSON_DEPTH
from tests.trust_util import coder, outcome, task
from tests.trust_util import limits as trust_limits
from tests.util import fast, read_until, stop, until

TOKEN = "s3cret-token"
FENCE = "```"
USAGE_PER_CALL = (10, 5)  # input, output tokens of each scripted call


def code(source: str) -> str:
    return f"{FENCE}repl\n{source}\n{FENCE}"


def broken(messages: list[dict[str, Any]]) -> str:
    raise RuntimeError("the scripted model breaks here")


SCRIPT: dict[str, list[Any]] = {
    # a root that spawns a child, waits for it, and answers with its answer and its context
    "spawning root": [
        code(
            "h = rlm_spawn('child: a')\n"
            "said = context[0]['content'] if context else 'no context'\n"
            "FINAL(rlm_wait(h) + ' / ' + said)"
        )
    ],
    "child: a": [code("FINAL('from child')")],
    "quick root": [code("FINAL('quick')")],
    "asking root": [
        code("r = ask_person('Deploy?', options=['yes', 'no'])\nFINAL(r['answer']['id'])")
    ],
    "broken root": [broken],
    "Greet": [code("FINAL('hello ' + 'owls')")],
}


HOLD_S = 60.0  # the longest a held reply waits: a failing test frees its thread after it


class Hold:
    """Scripted replies that wait until the test lets them go (bounded, so a failing test
    does not hold a thread for long): the model runs in the server's process."""

    def __init__(self) -> None:
        self.released = threading.Event()

    def reply(self, text: str) -> Callable[[list[dict[str, Any]]], str]:
        def answer(messages: list[dict[str, Any]]) -> str:
            self.released.wait(HOLD_S)
            return text

        return answer


@pytest.fixture
def hold() -> Iterator[Hold]:
    h = Hold()
    yield h
    h.released.set()


until = functools.partial(until, timeout=30.0)


@dataclass
class Served:
    client: httpx.Client
    base_url: str
    app: Any


SCRIPTED = object()  # serving()'s default model: a ScriptedModel of `script`


@contextmanager
def serving(
    tmp_path: Path,
    model: Any = SCRIPTED,
    *,
    token: str | None = TOKEN,
    script: dict[str, list[Any]] | None = None,
    limits: brood.Limits | None = None,
    **caps: int,
) -> Iterator[Served]:
    """A server in a thread on a loopback port bound here (no race for the port); it is
    shut down, and its hosted supervisor closed, at the end. With `token=None` the app
    makes its own, and the client sends that one."""
    if model is SCRIPTED:
        model = brood.ScriptedModel(script or SCRIPT, tokens_per_call=USAGE_PER_CALL)
    app = make_app(
        store_url=f"sqlite:///{tmp_path / 'brood.db'}",
        model=model,
        token=token,
        limits=limits or fast(max_iterations=2),
        **caps,
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    headers = {"Authorization": f"Bearer {app.state.token}"}
    try:
        until(lambda: server.started or not thread.is_alive(), timeout=15)
        assert server.started, "the server did not start"
        with httpx.Client(base_url=base, headers=headers, timeout=30) as client:
            yield Served(client, base, app)
    finally:
        server.should_exit = True
        thread.join(60)
        sock.close()
        assert not thread.is_alive(), "the server did not stop"


def sse(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    """Server-Sent Events from lines: {"id", "event", "data", "comments"}, as they come."""
    event: dict[str, Any] = {}
    for line in lines:
        if not line:
            if event:
                yield event
            event = {}
        elif line.startswith(":"):
            event.setdefault("comments", []).append(line[1:].strip())
        else:
            name, _, value = line.partition(":")
            value = value.removeprefix(" ")
            event[name] = f"{event[name]}\n{value}" if name in event else value
    if event:
        yield event


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    assert "Traceback" not in response.text
    error: dict[str, Any] = response.json()["error"]
    assert error["message"]
    return error


def wait_state(client: httpx.Client, run_id: str, *states: str) -> dict[str, Any]:
    return until(lambda: (r := client.get(f"/v1/runs/{run_id}").json())["state"] in states and r)


# ---- runs -----------------------------------------------------------------------------------
def test_a_run_started_over_http_is_listed_read_and_its_tree_sums_usage(tmp_path):
    with serving(tmp_path) as s:
        assert s.client.get("/v1/runs").json() == {"runs": [], "limit": 20, "offset": 0}
        started = s.client.post("/v1/runs", json={"prompt": "spawning root", "timeout": 60})
        assert started.status_code == 201, started.text
        run_id = started.json()["run_id"]
        assert started.headers["location"] == f"/v1/runs/{run_id}"
        run = wait_state(s.client, run_id, "completed")
        assert run["run_id"] == run_id and run["answer"] == "from child / no context"
        assert run["subtree_usage"]["input_tokens"] == 2 * USAGE_PER_CALL[0]
        quick = s.client.post("/v1/runs", json={"prompt": "quick root", "context": [1, 2]})
        quick_id = quick.json()["run_id"]
        wait_state(s.client, quick_id, "completed")

        listed = s.client.get("/v1/runs").json()["runs"]
        assert [r["id"] for r in listed] == [quick_id, run_id]  # roots only, newest first
        assert listed[1]["runs"] == 2
        page = s.client.get("/v1/runs", params={"limit": 1, "offset": 1}).json()
        assert [r["id"] for r in page["runs"]] == [run_id]
        assert page["limit"] == 1 and page["offset"] == 1
        assert s.client.get("/v1/runs", params={"state": "failed"}).json()["runs"] == []
        done = s.client.get("/v1/runs", params={"state": "completed", "limit": 5}).json()
        assert len(done["runs"]) == 2

        tree = s.client.get(f"/v1/runs/{run_id}/tree").json()
        assert tree["id"] == run_id and len(tree["children"]) == 1
        child = tree["children"][0]
        assert child["prompt"] == "child: a" and child["state"] == "completed"
        assert tree["usage"]["model_calls"] == 1 and tree["subtree_usage"]["model_calls"] == 2


def test_cancel_and_send_reach_a_running_run_and_an_ended_one_is_a_conflict(tmp_path, hold):
    script = {"held root": [hold.reply(code("FINAL('late')"))]}
    with serving(tmp_path, script=script) as s:
        run_id = s.client.post("/v1/runs", json={"prompt": "held root"}).json()["run_id"]
        wait_state(s.client, run_id, "running")
        sent = s.client.post(f"/v1/runs/{run_id}/send", json={"message": "hurry up"})
        assert sent.json() == {"run_id": run_id, "sent": True}
        cancelled = s.client.post(f"/v1/runs/{run_id}/cancel")
        assert cancelled.json() == {"run_id": run_id, "state": "cancelled"}
        assert s.client.get(f"/v1/runs/{run_id}").json()["reason"].startswith("cancelled by user")
        events = s.client.get(f"/v1/runs/{run_id}/events").text
        assert "event: message" in events and "hurry up" in events

        again = error_of(s.client.post(f"/v1/runs/{run_id}/cancel"), 409)
        assert run_id in again["message"] and "cancelled" in again["message"]
        error_of(s.client.post(f"/v1/runs/{run_id}/send", json={"message": "x"}), 409)


# ---- events ---------------------------------------------------------------------------------
def test_events_resume_after_a_disconnect_with_exactly_the_rest(tmp_path):
    with serving(tmp_path) as s:
        run_id = s.client.post("/v1/runs", json={"prompt": "spawning root"}).json()["run_id"]
        wait_state(s.client, run_id, "completed")
        whole = list(sse(s.client.get(f"/v1/runs/{run_id}/events").text.splitlines()))
        seqs = [int(e["id"]) for e in whole]
        assert seqs == sorted(set(seqs)) and len(seqs) > 4
        runs = {json.loads(e["data"])["run_id"] for e in whole}
        assert len(runs) == 2  # the child's events are the tree's too
        for e in whole:
            data = json.loads(e["data"])
            assert data["seq"] == int(e["id"]) and data["kind"] == e["event"]

        first: list[dict[str, Any]] = []
        with s.client.stream("GET", f"/v1/runs/{run_id}/events") as response:
            for event in sse(response.iter_lines()):
                first.append(event)
                if len(first) == 3:
                    break  # and the connection is dropped
        resumed = s.client.get(
            f"/v1/runs/{run_id}/events", headers={"Last-Event-ID": first[-1]["id"]}
        )
        rest = list(sse(resumed.text.splitlines()))
        assert [e["id"] for e in first + rest] == [e["id"] for e in whole]
        after = s.client.get(f"/v1/runs/{run_id}/events", params={"after": seqs[-2]}).text
        assert [e["id"] for e in sse(after.splitlines())] == [str(seqs[-1])]


def test_events_follow_a_live_tree_and_end_when_its_root_has_ended(tmp_path, hold):
    script = dict(SCRIPT, **{"held root": [hold.reply(SCRIPT["spawning root"][0])]})
    with serving(tmp_path, script=script) as s:
        run_id = s.client.post("/v1/runs", json={"prompt": "held root"}).json()["run_id"]
        with s.client.stream("GET", f"/v1/runs/{run_id}/events") as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            hold.released.set()  # the root can answer only now, while the stream is open
            events = list(sse(response.iter_lines()))
        kinds = [e["event"] for e in events]
        assert kinds.count("step") == 2  # the root's and the child's
        assert s.client.get(f"/v1/runs/{run_id}").json()["state"] == "completed"


def test_the_live_tree_sends_changed_runs_then_ends(tmp_path, hold):
    script = dict(SCRIPT, **{"held root": [hold.reply(SCRIPT["spawning root"][0])]})
    with serving(tmp_path, script=script) as s:
        run_id = s.client.post("/v1/runs", json={"prompt": "held root"}).json()["run_id"]
        with s.client.stream("GET", f"/v1/runs/{run_id}/tree/live") as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            events = sse(response.iter_lines())
            first = json.loads(next(events)["data"])
            assert [r["id"] for r in first["runs"]] == [run_id]  # the whole subtree at first
            hold.released.set()
            rest = list(events)
        assert rest[-1]["event"] == "end"
        batches = [json.loads(e["data"]) for e in rest if e["event"] == "runs"]
        last: dict[str, dict[str, Any]] = {}
        for b in batches:
            last.update((r["id"], r) for r in b["runs"])
            assert all(isinstance(seq, int) for seq in b["wrote"].values())
        child = next(r for r in last.values() if r["id"] != run_id)
        assert child["parent_id"] == run_id and child["depth"] == 1
        assert child["prompt"] == "child: a" and child["state"] == "completed"
        assert last[run_id]["state"] == "completed"
        assert last[run_id]["subtree_tokens"] == 2 * sum(USAGE_PER_CALL)
        assert any(run_id in b["wrote"] for b in batches)  # the root's steps were seen
        error_of(s.client.get("/v1/runs/r-nope/tree/live"), 404)


def test_the_dashboard_shell_holds_no_data_and_its_bodies_need_the_token(tmp_path):
    with serving(tmp_path) as s:
        prompt = "<img src=x onerror=alert(1)> & quick root"
        script_prompt = s.client.post("/v1/runs", json={"prompt": prompt}).json()["run_id"]
        wait_state(s.client, script_prompt, "failed", "completed")
        for path in ("/", f"/runs/{script_prompt}", "/asks", "/flows/r-x"):
            page = httpx.get(s.base_url + path)  # no token: the shell only
            assert page.status_code == 200 and "<main" in page.text
            assert script_prompt not in page.text and "onerror" not in page.text
            assert "script-src 'self'" in page.headers["content-security-policy"]
            assert page.headers["x-frame-options"] == "DENY"
        assert "LiveTree" in httpx.get(s.base_url + "/static/dash.js").text
        error_of(httpx.get(s.base_url + "/static/secrets.py"), 404)
        for path in ("/ui/runs", "/ui/asks", f"/ui/runs/{script_prompt}"):
            error_of(httpx.get(s.base_url + path), 401)
        listed = s.client.get("/ui/runs")
        assert listed.headers["content-type"].startswith("text/html")
        body = s.client.get(f"/ui/runs/{script_prompt}").text
        assert "&lt;img src=x onerror=alert(1)&gt; &amp; quick root" in body
        assert "<img" not in body
        assert "&lt;img" in listed.text
        error_of(s.client.get("/ui/runs/r-nope"), 404)
        error_of(s.client.get("/ui/runs", params={"state": "happy"}), 422)
        flow_of_a_run = s.client.get(f"/ui/flows/{script_prompt}")
        assert "not a flow" in error_of(flow_of_a_run, 404)["message"]
        more = s.client.get(f"/ui/runs/{script_prompt}/trajectory", params={"after": 10**6})
        assert more.status_code == 200 and 'data-seq="1000000"' in more.text


# ---- asks -----------------------------------------------------------------------------------
def test_an_ask_is_listed_and_answered_and_bad_answers_are_refused(tmp_path):
    with serving(tmp_path) as s:
        run_id = s.client.post("/v1/runs", json={"prompt": "asking root"}).json()["run_id"]
        asks = until(lambda: s.client.get("/v1/asks").json()["asks"])
        (ask,) = asks
        assert ask["run_id"] == run_id and ask["question"] == "Deploy?"
        path = f"/v1/asks/{ask['id']}/answer"
        bad = error_of(s.client.post(path, json={"value": "maybe"}), 422)
        assert "maybe" in bad["message"]
        error_of(s.client.post(path, json={"value": 3}), 422)
        unknown = error_of(s.client.post("/v1/asks/a-nothing/answer", json={"value": "yes"}), 404)
        assert "a-nothing" in unknown["message"]

        answered = s.client.post(path, json={"value": "YES", "by": "alice"})
        assert answered.status_code == 200, answered.text
        assert answered.json()["resolved_by"] == "alice"
        assert answered.json()["answer"]["id"] == "yes"
        assert wait_state(s.client, run_id, "completed")["answer"] == "yes"
        assert s.client.get("/v1/asks").json() == {"asks": []}
        error_of(s.client.post(path, json={"value": "no"}), 409)


# ---- flows ----------------------------------------------------------------------------------
GREET = {
    "name": "greet",
    "states": [
        {"id": "greet", "entry": True, "prompt": "Greet {name}", "inputs": ["name"]},
    ],
}
BREAK = {
    "name": "break",
    "states": [{"id": "bad", "entry": True, "prompt": "broken root {name}", "inputs": ["name"]}],
}


# The state of a flow's run once the flow has ended so.
FLOW_ENDS = {"finished": "completed", "failed": "failed", "stopped": "cancelled"}


def flow_status(client: httpx.Client, flow_id: str, status: str) -> dict[str, Any]:
    """The flow's status once it is `status`; an ended status once the flow's run has ended
    too (a flow says `finished` before its run's end is journaled, and until then the run
    still takes a stop)."""
    path = f"/v1/flows/{flow_id}"
    found = until(lambda: (f := client.get(path).json())["status"] == status and f)
    if status in FLOW_ENDS:
        wait_state(client, flow_id, FLOW_ENDS[status])
    return found


def test_flows_start_report_pause_resume_and_stop(tmp_path):
    with serving(tmp_path) as s:
        started = s.client.post("/v1/flows", json={"spec": GREET, "inputs": {"name": "owls"}})
        assert started.status_code == 201, started.text
        flow_id = started.json()["run_id"]
        assert started.json()["started"] == ["greet"]
        finished = flow_status(s.client, flow_id, "finished")
        assert finished["run_id"] == flow_id
        error_of(s.client.post(f"/v1/flows/{flow_id}/stop"), 409)  # it has ended

        # a failed instance pauses the flow (failure_policy: escalate); resume runs it again
        text = json.dumps(BREAK)  # a spec may come as JSON or YAML text too
        broken = s.client.post("/v1/flows", json={"spec": text, "inputs": {"name": "x"}})
        broken_id = broken.json()["run_id"]
        paused = flow_status(s.client, broken_id, "paused")
        assert paused["states"]["bad"]["entries_used"] == 1
        resumed = s.client.post(f"/v1/flows/{broken_id}/resume")
        assert resumed.json() == {"run_id": broken_id, "state": "running"}
        until(lambda: s.client.get(f"/v1/flows/{broken_id}").json()["status"] == "paused")
        stopped = s.client.post(f"/v1/flows/{broken_id}/stop")
        assert stopped.json() == {"run_id": broken_id, "state": "stopped"}
        assert flow_status(s.client, broken_id, "stopped")["run_id"] == broken_id
        error_of(s.client.post(f"/v1/flows/{broken_id}/resume"), 409)


def test_flow_refusals_name_the_problem(tmp_path, hold):
    script = dict(SCRIPT, **{"held root": [hold.reply(code("FINAL('late')"))]})
    with serving(tmp_path, script=script) as s:
        run_id = s.client.post("/v1/runs", json={"prompt": "held root"}).json()["run_id"]
        wait_state(s.client, run_id, "running")
        not_flow = error_of(s.client.get(f"/v1/flows/{run_id}"), 404)
        assert run_id in not_flow["message"] and "not a flow" in not_flow["message"]
        stop_a_run = error_of(s.client.post(f"/v1/flows/{run_id}/stop"), 404)  # a live run
        assert "not a flow" in stop_a_run["message"]
        hold.released.set()
        wait_state(s.client, run_id, "completed")
        ended = error_of(s.client.post(f"/v1/flows/{run_id}/stop"), 409)  # ended before anything
        assert run_id in ended["message"] and "completed" in ended["message"]
        error_of(s.client.get("/v1/flows/r-nothing"), 404)

        bad = {"name": "bad", "states": [{"id": "a", "prompt": "x", "inputs": [{"from": "b.c"}]}]}
        invalid = error_of(s.client.post("/v1/flows", json={"spec": bad}), 422)
        assert "states[0]" in invalid["message"]
        error_of(s.client.post("/v1/flows", json={"spec": 3}), 422)
        error_of(s.client.post("/v1/flows", json={"spec": GREET, "inputs": []}), 422)
        # a spec sent as a path is text, never a file of the server's
        on_disk = tmp_path / "greet.json"
        on_disk.write_text(json.dumps(GREET))
        error_of(s.client.post("/v1/flows", json={"spec": str(on_disk)}), 422)
        assert s.client.get("/v1/runs").json()["runs"][0]["id"] == run_id  # nothing started


# ---- OpenAI-compatible ----------------------------------------------------------------------
def test_the_openai_client_gets_a_trees_answer_with_the_trees_usage(tmp_path):
    with serving(tmp_path) as s:
        client = openai.OpenAI(base_url=f"{s.base_url}/v1", api_key=TOKEN, max_retries=0)
        assert [m.id for m in client.models.list()] == ["scripted"]
        messages: list[Any] = [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "spawning root"},
        ]
        raw = client.chat.completions.with_raw_response.create(model="scripted", messages=messages)
        run_id = raw.headers["x-brood-run-id"]
        completion = raw.parse()
        assert completion.object == "chat.completion" and completion.model == "scripted"
        assert completion.choices[0].message.content == "from child / be brief"
        assert completion.choices[0].finish_reason == "stop"
        assert completion.usage is not None
        assert completion.usage.prompt_tokens == 2 * USAGE_PER_CALL[0]  # root and child
        assert completion.usage.completion_tokens == 2 * USAGE_PER_CALL[1]
        assert completion.usage.total_tokens == 2 * sum(USAGE_PER_CALL)
        assert s.client.get(f"/v1/runs/{run_id}/tree").json()["children"]

        chunks = list(
            client.chat.completions.create(model="scripted", messages=messages, stream=True)
        )
        assert all(c.object == "chat.completion.chunk" for c in chunks)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == "from child / be brief"
        assert chunks[-1].choices[0].finish_reason == "stop"

        with pytest.raises(openai.NotFoundError) as missing:
            client.chat.completions.create(model="gpt-9", messages=messages)
        assert "scripted" in str(missing.value)
        with pytest.raises(openai.APIStatusError) as failed:
            client.chat.completions.create(
                model="scripted", messages=[{"role": "user", "content": "broken root"}]
            )
        assert failed.value.status_code == 502
        failed_id = failed.value.response.headers["x-brood-run-id"]
        assert f"run {failed_id} failed" in str(failed.value)


def test_a_streamed_completion_tells_how_the_tree_grows_then_answers(tmp_path):
    with serving(tmp_path) as s:
        body = {
            "model": "scripted",
            "messages": [{"role": "user", "content": "spawning root"}],
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with s.client.stream("POST", "/v1/chat/completions", json=body) as response:
            run_id = response.headers["x-brood-run-id"]
            lines = list(response.iter_lines())
        comments = [line for line in lines if line.startswith(":")]
        child = s.client.get(f"/v1/runs/{run_id}/tree").json()["children"][0]["id"]
        assert f": run {run_id} spawned {child}" in comments
        assert f": run {child} completed" in comments
        data = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
        assert data[-1] == "[DONE]"
        chunks = [json.loads(d) for d in data[:-1]]
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert chunks[-1]["usage"]["total_tokens"] == 2 * sum(USAGE_PER_CALL)
        assert "from child / no context" in [
            c["choices"][0]["delta"].get("content") for c in chunks if c["choices"]
        ]

        bad = dict(body, messages=[{"role": "user", "content": "broken root"}])
        with s.client.stream("POST", "/v1/chat/completions", json=bad) as response:
            failed = [json.loads(line[6:]) for line in response.iter_lines() if "error" in line]
        assert failed and "failed" in failed[-1]["error"]["message"]


def newest_root(client: httpx.Client) -> str | None:
    runs = client.get("/v1/runs").json()["runs"]
    return runs[0]["id"] if runs else None


def test_a_client_that_goes_away_cancels_its_tree(tmp_path, hold):
    script = {"held root": [hold.reply(code("FINAL('late')"))]}
    body = {"model": "scripted", "messages": [{"role": "user", "content": "held root"}]}
    with serving(tmp_path, script=script) as s:
        with pytest.raises(httpx.ReadTimeout):
            s.client.post("/v1/chat/completions", json=body, timeout=0.5)
        run_id = until(lambda: newest_root(s.client))
        assert wait_state(s.client, run_id, "cancelled")["reason"] == "client disconnected"

        with s.client.stream("POST", "/v1/chat/completions", json=dict(body, stream=True)) as r:
            streamed_id = r.headers["x-brood-run-id"]
            next(r.iter_lines())  # the role chunk; then the client goes
        # journaled as what happened: nobody ran `brood cancel`
        assert wait_state(s.client, streamed_id, "cancelled")["reason"] == "client disconnected"


# ---- who may call ---------------------------------------------------------------------------
def test_a_missing_or_wrong_token_is_refused_and_the_schema_lists_every_route(tmp_path):
    with serving(tmp_path) as s:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
            for path in ("/v1/runs", "/v1/models", "/openapi.json", "/v1/nothing"):
                r = httpx.get(s.base_url + path, headers=headers)
                error = error_of(r, 401)
                assert "Authorization: Bearer" in error["fix"]
                assert r.headers["www-authenticate"] == "Bearer"
        refused = httpx.post(s.base_url + "/v1/runs", json={"prompt": "quick root"})
        error_of(refused, 401)
        assert s.client.get("/v1/runs").json()["runs"] == []  # nothing started
        assert "access-control-allow-origin" not in s.client.get("/v1/runs").headers

        other_site = s.client.post(
            "/v1/runs", json={"prompt": "quick root"}, headers={"Origin": "https://evil.test"}
        )
        assert "evil.test" in error_of(other_site, 403)["message"]

        schema = s.client.get("/openapi.json").json()
        assert schema["openapi"].startswith("3.")
        api = [r for r in s.app.routes if r.path.startswith(("/v1/", "/openapi.json"))]
        assert len(api) > 15
        for route in api:  # the dashboard's pages and bodies are not API
            for method in route.methods - {"HEAD"}:
                assert method.lower() in schema["paths"][route.path], (method, route.path)


def test_a_server_given_no_token_makes_one_and_answers_loopback_names_only(tmp_path, monkeypatch):
    monkeypatch.delenv("BROOD_MODEL", raising=False)
    with serving(tmp_path, model=None, token=None) as s:
        made = s.app.state.token
        assert s.app.state.token_made and len(made) >= 40  # secrets.token_urlsafe(32)
        for path in ("/v1/runs", "/ui/runs", "/openapi.json"):
            error_of(httpx.get(s.base_url + path), 401)  # no tokenless server, even here
        assert s.client.get("/v1/runs").status_code == 200
        assert s.client.get("/v1/runs", headers={"Host": "localhost"}).status_code == 200
        rebound = s.client.get("/v1/runs", headers={"Host": "attacker.test:8765"})
        assert "attacker.test" in error_of(rebound, 403)["message"]

        assert s.client.get("/v1/models").json() == {"object": "list", "data": []}
        no_model = error_of(s.client.post("/v1/runs", json={"prompt": "quick root"}), 503)
        assert "--model" in no_model["fix"]
        chat = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}]}
        assert (
            "no model" in error_of(s.client.post("/v1/chat/completions", json=chat), 404)["message"]
        )
    with serving(tmp_path, model=None) as given:  # given its token: a proxy's names too
        assert not given.app.state.token_made and given.app.state.token == TOKEN
        proxied = given.client.get("/v1/runs", headers={"Host": "brood.example.test"})
        assert proxied.status_code == 200
    other = make_app(store_url=f"sqlite:///{tmp_path / 'brood.db'}")
    other.state.host.close()
    assert other.state.token != made  # made anew for each app


# ---- bounds --------------------------------------------------------------------------------
CHAT = {"model": "scripted", "messages": [{"role": "user", "content": "quick root"}]}


def test_streams_past_the_bound_are_refused_with_503_and_a_closed_one_frees_its_place(
    tmp_path, hold
):
    script = dict(SCRIPT, **{"held root": [hold.reply(code("FINAL('late')"))]})
    with serving(tmp_path, script=script, max_streams=2) as s:
        run_id = s.client.post("/v1/runs", json={"prompt": "held root"}).json()["run_id"]
        with (
            s.client.stream("GET", f"/v1/runs/{run_id}/events") as events,
            s.client.stream("GET", f"/v1/runs/{run_id}/tree/live") as live,
        ):
            assert events.status_code == live.status_code == 200
            refused = s.client.get(f"/v1/runs/{run_id}/events")
            error = error_of(refused, 503)
            assert "bound of 2 streams" in error["message"] and "--max-streams" in error["fix"]
            assert refused.headers["retry-after"].isdigit()
            error_of(s.client.get(f"/v1/runs/{run_id}/tree/live"), 503)
            error_of(s.client.post("/v1/chat/completions", json=CHAT), 503)  # starts nothing
            assert [r["id"] for r in s.client.get("/v1/runs").json()["runs"]] == [run_id]
        until(lambda: s.app.state.streams.open == 0)  # the server saw both clients go
        hold.released.set()
        answered = s.client.post("/v1/chat/completions", json=CHAT)
        assert answered.json()["choices"][0]["message"]["content"] == "quick"
        whole = list(sse(s.client.get(f"/v1/runs/{run_id}/events").text.splitlines()))
        assert whole and s.app.state.streams.open == 0
    for bad in (0, -1, 2.5, True):
        with pytest.raises(brood.InvalidArgument, match="--max-streams"):
            make_app(store_url=f"sqlite:///{tmp_path / 'brood.db'}", max_streams=bad)
    with pytest.raises(brood.InvalidArgument, match="--max-queued"):
        make_app(store_url=f"sqlite:///{tmp_path / 'brood.db'}", max_queued=0)


def test_a_client_past_its_bound_of_queued_starts_gets_429_and_other_clients_do_not(tmp_path, hold):
    script = dict(SCRIPT, **{"held root": [hold.reply(code("FINAL('late')"))]})
    one_slot = fast(max_iterations=2, max_concurrency=1)  # the held root takes it
    with serving(tmp_path, script=script, limits=one_slot, max_queued=2) as s:
        held = s.client.post("/v1/runs", json={"prompt": "held root"}).json()["run_id"]
        wait_state(s.client, held, "running")
        queued = [
            s.client.post("/v1/runs", json={"prompt": "quick root"}).json()["run_id"]
            for _ in range(2)
        ]
        assert all(s.client.get(f"/v1/runs/{q}").json()["state"] == "queued" for q in queued)
        error = error_of(s.client.post("/v1/runs", json={"prompt": "quick root"}), 429)
        assert "127.0.0.1 has 2 runs" in error["message"] and "bound of 2" in error["message"]
        assert "--max-queued" in error["fix"]
        error_of(s.client.post("/v1/chat/completions", json=CHAT), 429)
        assert s.app.state.streams.open == 0  # the refused completion gave its stream back
        # Another address (loopback too) is another client, with its own count.
        other = httpx.HTTPTransport(local_address="127.0.0.2")
        with httpx.Client(base_url=s.base_url, headers=s.client.headers, transport=other) as c:
            assert c.post("/v1/runs", json={"prompt": "quick root"}).status_code == 201
        hold.released.set()  # the slot frees; the queued runs start, and the bound with them
        for q in queued:
            wait_state(s.client, q, "completed")
        again = s.client.post("/v1/runs", json={"prompt": "quick root"})
        assert again.status_code == 201, again.text
        wait_state(s.client, again.json()["run_id"], "completed")


def nested(depth: int) -> Any:
    """A list `depth` levels deep (depth 1: [])."""
    return json.loads("[" * depth + "]" * depth)


def test_json_nested_past_the_bound_is_refused_before_it_is_parsed(tmp_path):
    with serving(tmp_path) as s:
        c = s.client
        deep = b"[" * 100_000 + b"]" * 100_000
        body = b'{"prompt": "quick root", "context": ' + deep + b"}"
        error = error_of(c.post("/v1/runs", content=body), 400)
        assert error["message"] == (
            f"the body nests 100,001 levels deep, over the bound of {MAX_JSON_DEPTH} levels"
        )
        chat = b'{"model": "scripted", "messages": [{"role": "user", "content": ' + deep + b"}]}"
        assert (
            "100,003 levels"
            in error_of(c.post("/v1/chat/completions", content=chat), 400)["message"]
        )
        error_of(c.post("/v1/asks/a-x/answer", content=b'{"value": ' + deep + b"}"), 400)
        error_of(c.post("/v1/runs/r-x/send", content=deep), 400)
        # Brackets inside strings are text, and count for nothing.
        text = "[" * 100_000 + '"\\' + "{" * 10
        started = c.post("/v1/runs", json={"prompt": "quick root", "context": text})
        assert started.status_code == 201, started.text
        assert wait_state(c, started.json()["run_id"], "completed")["answer"] == "quick"
        # At the bound a body is taken (the object is one level, its context the rest).
        at_bound = {"prompt": "quick root", "context": nested(MAX_JSON_DEPTH - 1)}
        taken = c.post("/v1/runs", json=at_bound)
        assert taken.status_code == 201, taken.text
        wait_state(c, taken.json()["run_id"], "completed")
        over = {"prompt": "quick root", "context": nested(MAX_JSON_DEPTH)}
        assert "65 levels" in error_of(c.post("/v1/runs", json=over), 400)["message"]

        # A flow spec sent as text is parsed too: JSON by its brackets, YAML by indentation.
        spec_json = {"spec": "[" * 100_000 + "]" * 100_000}
        refused = error_of(c.post("/v1/flows", json=spec_json), 422)
        assert refused["field"] == "spec" and "100,000 levels" in refused["message"]
        yaml_text = "\n".join(" " * i + "a:" for i in range(1_400)) + " 1\n"
        refused = error_of(c.post("/v1/flows", json={"spec": yaml_text}), 422)
        assert refused["field"] == "spec" and "more than 64 levels" in refused["message"]
        assert len(c.get("/v1/runs").json()["runs"]) == 2  # the two runs taken above


# ---- bad input ------------------------------------------------------------------------------
def test_bad_bodies_and_unknown_ids_get_json_errors_naming_them(tmp_path):
    with serving(tmp_path) as s:
        c = s.client
        malformed = c.post(
            "/v1/runs", content=b"{nope", headers={"content-type": "application/json"}
        )
        assert "not JSON" in error_of(malformed, 400)["message"]
        error_of(c.post("/v1/runs", content=b""), 400)
        assert "object" in error_of(c.post("/v1/runs", json=["x"]), 422)["message"]
        assert error_of(c.post("/v1/runs", json={"prompt": 3}), 422)["field"] == "prompt"
        assert error_of(c.post("/v1/runs", json={"prompt": " "}), 422)["field"] == "prompt"
        assert (
            error_of(c.post("/v1/runs", json={"prompt": "x", "timeout": -1}), 422)["field"]
            == "timeout"
        )
        assert (
            error_of(c.post("/v1/runs", json={"prompt": "x", "promt": 1}), 422)["field"] == "promt"
        )
        assert (
            error_of(c.post("/v1/runs/r-1/send", json={"message": None}), 422)["field"] == "message"
        )
        chat = "/v1/chat/completions"
        assert (
            error_of(c.post(chat, json={"model": "scripted", "messages": []}), 422)["field"]
            == "messages"
        )
        only_system = {"model": "scripted", "messages": [{"role": "system", "content": "x"}]}
        assert error_of(c.post(chat, json=only_system), 422)["field"] == "messages"
        streamed = {
            "model": "scripted",
            "messages": [{"role": "user", "content": "x"}],
            "stream": "yes",
        }
        assert error_of(c.post(chat, json=streamed), 422)["field"] == "stream"

        big = b'{"prompt": "' + b"x" * MAX_BODY_BYTES + b'"}'
        error_of(c.post("/v1/runs", content=big), 413)

        def chunks() -> Iterator[bytes]:  # no Content-Length: the size is counted as read
            yield b'{"prompt": "'
            for _ in range(17):
                yield b"x" * (1 << 16)
            yield b'"}'

        error_of(c.post("/v1/runs", content=chunks()), 413)

        for method, path in [
            ("GET", "/v1/runs/r-nothing"),
            ("GET", "/v1/runs/r-nothing/tree"),
            ("GET", "/v1/runs/r-nothing/events"),
            ("POST", "/v1/runs/r-nothing/cancel"),
            ("GET", "/v1/flows/r-nothing"),
        ]:
            assert "r-nothing" in error_of(c.request(method, path), 404)["message"], path
        send = c.post("/v1/runs/r-nothing/send", json={"message": "hi"})
        assert "r-nothing" in error_of(send, 404)["message"]

        assert error_of(c.get("/v1/runs", params={"limit": "ten"}), 422)["field"] == "limit"
        assert error_of(c.get("/v1/runs", params={"limit": 0}), 422)["field"] == "limit"
        assert error_of(c.get("/v1/runs", params={"state": "done"}), 422)["field"] == "state"
        run_id = c.post("/v1/runs", json={"prompt": "quick root"}).json()["run_id"]
        resumed = c.get(f"/v1/runs/{run_id}/events", headers={"Last-Event-ID": "x"})
        assert error_of(resumed, 422)["field"] == "Last-Event-ID"
        error_of(c.get("/v1/nothing"), 404)
        error_of(c.delete("/v1/runs"), 405)
        wait_state(c, run_id, "completed")


def test_an_unexpected_error_is_a_json_500_without_a_traceback(tmp_path, caplog):
    with serving(tmp_path) as s:

        def fail() -> list[dict[str, Any]]:
            raise RuntimeError("a bug in the server")

        s.app.state.host.journal.asks = fail
        response = s.client.get("/v1/asks")
        error = error_of(response, 500)
        assert "a bug" not in error["message"]
        logged = [r for r in caplog.records if r.name == "brood.serve" and r.exc_info]
        assert logged and "GET /v1/asks" in logged[0].getMessage()


# ---- the command ----------------------------------------------------------------------------
def test_brood_serve_refuses_a_non_loopback_host_without_a_token(tmp_path, monkeypatch):
    monkeypatch.delenv("BROOD_TOKEN", raising=False)
    store = f"sqlite:///{tmp_path / 'brood.db'}"
    result = CliRunner().invoke(cli, ["serve", "--host", "0.0.0.0", "--store", store])
    assert result.exit_code == 2
    assert "--token" in result.output and "0.0.0.0" in result.output
    monkeypatch.setenv("BROOD_TOKEN", "")
    result = CliRunner().invoke(cli, ["serve", "--host", "192.0.2.7", "--store", store])
    assert result.exit_code == 2
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.8.0.1", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "192.0.2.7", "example.test"))


# ---- model code with the network, against brood serve ---------------------------------------
LOGIN = re.compile(r"log in at (http://127\.0\.0\.1:\d+)/\?token=([\w-]+)")
START_S = 60.0  # bound on the server's start-up; a failure, never a pace


@contextmanager
def brood_serve(store: str) -> Iterator[tuple[subprocess.Popen[bytes], str, str]]:
    """`brood serve` as its own process on a free loopback port, given no token: the process,
    its base URL and the token it printed. It is stopped (SIGTERM, as a terminal's Ctrl-C
    would be SIGINT) and reaped at the end, and nothing it started is left."""
    env = {k: v for k, v in os.environ.items() if k not in ("BROOD_TOKEN", "BROOD_MODEL")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "brood.cli.main", "serve", "--port", "0", "--store", store],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
    )
    try:
        found = read_until(proc, LOGIN, START_S)
        children = psutil.Process(proc.pid).children(recursive=True)
        yield proc, found[1], found[2]
    finally:
        status = stop(proc, START_S)
    # uvicorn shuts down, then raises the signal it caught again: SIGTERM is how it ends.
    assert status in (0, -signal.SIGTERM), status
    assert not [c for c in children if c.is_running()], "brood serve left processes"


# Model code: every call it makes to the server, with what it answered (status, body).
ATTACK = """import urllib.request, urllib.error
def call(method, path, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(BASE + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return [r.status, r.read().decode(errors="replace")[:400]]
    except urllib.error.HTTPError as e:
        return [e.code, e.read().decode(errors="replace")[:400]]
    except Exception as e:
        return [type(e).__name__, str(e)[:400]]
def read(path):
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")[:2000]
    except Exception as e:
        return type(e).__name__
R["list"] = call("GET", "/v1/runs")
R["answer"] = call("GET", f"/v1/runs/{DONE}")
R["tree"] = call("GET", f"/v1/runs/{DONE}/tree")
R["events"] = call("GET", f"/v1/runs/{DONE}/events")
R["page"] = call("GET", f"/ui/runs/{DONE}")
R["asks"] = call("GET", "/v1/asks")
R["schema"] = call("GET", "/openapi.json")
R["cancel"] = call("POST", f"/v1/runs/{LIVE}/cancel")
R["send"] = call("POST", f"/v1/runs/{LIVE}/send", {"message": "stop now"})
R["start"] = call("POST", "/v1/runs", {"prompt": "work for me"})
R["guess"] = call("GET", "/v1/runs?token=x")
R["shell"] = call("GET", "/")
R["cmdline"] = read(f"/proc/{SERVER}/cmdline")
R["environ"] = read(f"/proc/{SERVER}/environ")
"""
SECRET = "the victim's secret answer"


def test_model_code_with_the_network_gets_401_from_brood_serve_and_acts_on_nothing(tmp_path):
    store = f"sqlite:///{tmp_path / 'brood.db'}"
    release = threading.Event()

    def model(messages: list[dict[str, Any]]) -> str:
        if "victim holds" in str(messages[1].get("content", "")):
            release.wait(HOLD_S)  # the live victim's first turn waits for the test
        return coder(messages)

    with brood.Supervisor(model, limits=trust_limits(network=True), store=store) as sup:
        done = sup.run(task(f"FINAL({SECRET!r})"))
        assert done.answer == SECRET
        live = sup.spawn("victim holds\n" + task("FINAL('victim went on')"))
        until(lambda: live.status() == "running")
        sup.store.flush()
        with brood_serve(store) as (server, base, token):
            consts = f"BASE = {base!r}\nDONE = {done.run_id!r}\nLIVE = {live.id!r}\n"
            result, got = outcome(sup, consts + f"SERVER = {server.pid}\n" + ATTACK)
            for name in ("list", "answer", "tree", "events", "page", "asks", "schema"):
                assert got[name][0] == 401, (name, got[name])
            for name in ("cancel", "send", "start", "guess"):
                assert got[name][0] == 401, (name, got[name])
            assert got["shell"][0] == 200  # the dashboard's page, which holds no data
            assert SECRET not in json.dumps(got) and token not in json.dumps(got)

            assert live.status() == "running"  # untouched: no cancel, no message
            auth = {"Authorization": f"Bearer {token}"}
            with httpx.Client(base_url=base, headers=auth, timeout=30) as owner:
                assert owner.get(f"/v1/runs/{done.run_id}").json()["answer"] == SECRET
                roots = {r["id"] for r in owner.get("/v1/runs").json()["runs"]}
                assert roots == {done.run_id, live.id, result.run_id}  # nothing started
            events = sup.store.events(live.id)
            assert not [e for e in events if e["kind"] == "message"]
        release.set()
        assert live.wait(HOLD_S) == "victim went on"

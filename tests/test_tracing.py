"""OpenTelemetry tracing: spans of runs, model calls, steps, asks and pool waits, collected
with the SDK's in-memory exporter from real trees (real workers, a real journal, a scripted
model); nothing left open after a cancel or a close; links after a crash and a resume; a
span carried to another node with a placed child; and tracing off costing no import."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

import brood
from brood.cluster.placement import guest_data
from brood.journal import Journal
from brood.lifecycle import RunRecord
from brood.supervisor.tracing import NO_TRACING, SpanIds
from tests.util import FAST, Gate, Signal, fast

FENCE = "```"
TOKENS = (3, 5)  # what the scripted model reports for each call


def code(source: str) -> str:
    return f"{FENCE}repl\n{source}\n{FENCE}"


def final(text: str) -> str:
    return code(f"FINAL({text!r})")


class Recorder(SpanProcessor):
    """Every span started and every span ended, by span id (from any thread)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.started: dict[int, str] = {}
        self.ended: dict[int, str] = {}

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        with self.lock:
            self.started[span.context.span_id] = span.name

    def on_end(self, span: ReadableSpan) -> None:
        with self.lock:
            self.ended[span.context.span_id] = span.name

    def still_open(self) -> dict[int, str]:
        with self.lock:
            return {i: n for i, n in self.started.items() if i not in self.ended}


class Traced:
    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.recorder = Recorder()
        self.provider = TracerProvider()
        self.provider.add_span_processor(self.recorder)
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))

    def spans(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())

    def named(self, name: str) -> list[ReadableSpan]:
        return [s for s in self.spans() if s.name == name]

    def runs(self) -> dict[str, ReadableSpan]:
        """The run spans, by run id (each run has one)."""
        found: dict[str, ReadableSpan] = {}
        for s in self.named("brood.run"):
            rid = str(s.attributes["brood.run.id"])
            assert rid not in found, f"two spans for run {rid}"
            found[rid] = s
        return found

    def calls(self) -> list[ReadableSpan]:
        return [s for s in self.spans() if (s.attributes or {}).get("gen_ai.operation.name")]


@pytest.fixture
def traced() -> Iterator[Traced]:
    t = Traced()
    yield t
    t.provider.shutdown()


def parent_id(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def of_run(spans: list[ReadableSpan], run_id: str) -> list[ReadableSpan]:
    return [s for s in spans if s.attributes["brood.run.id"] == run_id]


# ---- a depth-3 tree with an ask and a pool ------------------------------------------------
def test_a_depth_three_tree_with_an_ask_and_a_pool_is_one_trace_of_nested_spans(tmp_path, traced):
    opened = Signal(tmp_path, "opened")
    mid = [
        code(f"a = ask_person('Go on?', options=['yes', 'no'], blocking=False)\n{opened.code}"),
        code(
            "got = rlm_wait(a)\n"
            "x = llm_query('PLAIN-q: 2+2')\n"
            "answers = rlm_query_batched(['LEAF-task one', 'LEAF-task two'], pool='p')\n"
            "print(got['answer']['id'], x, answers)"
        ),
        final("mid done"),
    ]
    model = brood.ScriptedModel(
        {
            "T0P-task": [code("FINAL(rlm_query('MID-task: go on'))")],
            "MID-task": mid,
            "LEAF-task": [final("leaf")],
            "PLAIN-q": ["4"],
        },
        tokens_per_call=TOKENS,
    )
    with brood.Supervisor(model, limits=fast(pools={"p": 1}), tracing=traced.provider) as sup:
        h = sup.spawn("T0P-task")
        opened.wait()
        (ask,) = sup.asks()
        sup.answer(ask["id"], "yes", by="tester")
        assert h.wait(timeout=60) == "mid done"
        sup.store.flush()
        rows = {r["id"]: r for r in sup.store.runs(h.id)}
        events = sup.store.events(root_id=h.id)
    assert traced.recorder.still_open() == {}

    # One span per run, each under its parent run's span, all in one trace.
    runs = traced.runs()
    assert set(runs) == set(rows) and len(rows) == 4
    assert {s.context.trace_id for s in runs.values()} == {runs[h.id].context.trace_id}
    for rid, row in rows.items():
        span = runs[rid]
        want = runs[row["parent_id"]].context.span_id if row["parent_id"] else None
        assert parent_id(span) == want, rid
        assert span.attributes["brood.depth"] == row["depth"]
        assert span.attributes["brood.root.id"] == h.id
        assert span.attributes["brood.state"] == "completed"
    assert max(r["depth"] for r in rows.values()) == 2  # three levels

    # One span per model call and per step, as many as the journal holds, under their run.
    steps = traced.named("brood.step")
    calls = traced.calls()
    journaled = Counter((e["run_id"], e["kind"]) for e in events)
    for rid in rows:
        assert len(of_run(calls, rid)) == journaled[(rid, "model_call")] > 0, rid
        assert len(of_run(steps, rid)) == journaled[(rid, "step")] > 0, rid
    for step in steps:
        assert parent_id(step) == runs[str(step.attributes["brood.run.id"])].context.span_id
    step_ids = {s.context.span_id for s in steps}
    for call in calls:
        a = call.attributes
        assert call.name == "chat scripted"
        assert a["gen_ai.operation.name"] == "chat"
        assert a["gen_ai.provider.name"] == "scripted"
        assert a["gen_ai.request.model"] == "scripted"
        assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == TOKENS
        run_span = runs[str(a["brood.run.id"])].context.span_id
        assert parent_id(call) == run_span or parent_id(call) in step_ids
    # llm_query is made by the mid run's second step: its span is under that step's.
    mid_id = next(rid for rid, r in rows.items() if r["depth"] == 1)
    (query,) = [c for c in calls if c.attributes["brood.call.kind"] == "llm_query"]
    mid_steps = {s.attributes["brood.step"]: s for s in of_run(steps, mid_id)}
    assert parent_id(query) == mid_steps[2].context.span_id

    # The ask, under the step that opened it, answered.
    (ask_span,) = traced.named("brood.ask")
    assert ask_span.attributes["brood.ask.id"] == ask["id"]
    assert ask_span.attributes["brood.ask.state"] == "answered"
    assert parent_id(ask_span) == mid_steps[1].context.span_id

    # One leaf waited for the pool's one place: its wait is a span under its run's.
    (wait,) = traced.named("brood.pool_wait")
    waiter = str(wait.attributes["brood.run.id"])
    assert rows[waiter]["depth"] == 2 and rows[waiter]["pool"] == "p"
    assert wait.attributes["brood.pool"] == "p"
    assert parent_id(wait) == runs[waiter].context.span_id
    assert wait.end_time <= runs[waiter].end_time

    # Each run's span ids are journaled, for a resume to link to.
    trace_events = {e["run_id"]: e["data"] for e in events if e["kind"] == "trace"}
    assert set(trace_events) == set(rows)
    for rid, data in trace_events.items():
        ids = SpanIds.from_journal(data)
        assert ids is not None
        assert (ids.trace_id, ids.span_id) == (
            runs[rid].context.trace_id,
            runs[rid].context.span_id,
        )
        up = rows[rid]["parent_id"]
        want = f"{runs[up].context.span_id:016x}" if up else None
        assert data.get("parent_span_id") == want


# ---- nothing open after a cancel or a close ----------------------------------------------
def test_a_cancel_ends_every_span_of_the_tree_and_close_ends_the_rest(tmp_path, traced):
    in_call = Signal(tmp_path, "in-call")
    gate = Gate(tmp_path, "call")
    held = Signal(tmp_path, "held")
    top = code(
        "a = ask_person('Still there?', blocking=False)\n"
        "h1 = rlm_spawn('SLOW-task one', pool='p')\n"
        "h2 = rlm_spawn('SLOW-task two', pool='p')\n"
        "rlm_wait_all([h1, h2])"
    )
    model = brood.ScriptedModel(
        {
            "T0P-task": [top],
            "SLOW-task": [in_call.notify_then(gate.blocking_reply(final("slow")))],
            "HOLD-task": [code(f"{held.code}\nimport time\ntime.sleep(600)")],
        }
    )
    try:
        with brood.Supervisor(model, limits=fast(pools={"p": 1}), tracing=traced.provider) as sup:
            h = sup.spawn("T0P-task")
            in_call.wait()  # one child is in its model call, the other waits for the pool
            other = sup.spawn("HOLD-task")
            held.wait()
            assert h.cancel() == "cancelled"
            open_now = traced.recorder.still_open()
            # Only the other tree's spans are open: its run's and its step's.
            assert sorted(open_now.values()) == ["brood.run", "brood.step"]
            runs = traced.runs()
            assert other.id not in runs
    finally:
        gate.open()  # the abandoned call's thread returns; its reply is dropped
    assert traced.recorder.still_open() == {}

    runs = traced.runs()
    assert runs[other.id].attributes["brood.state"] == "cancelled"
    assert runs[other.id].attributes["brood.reason"] == "supervisor closed"
    cancelled = [s for rid, s in runs.items() if rid != other.id]
    assert len(cancelled) == 3
    assert {s.attributes["brood.state"] for s in cancelled} == {"cancelled"}
    # The call under way was abandoned, the ask cancelled, the pool wait and the steps
    # under way ended with their runs.
    slow = [rid for rid, s in runs.items() if s.attributes.get("brood.depth") == 1]
    (call,) = [c for rid in slow for c in of_run(traced.calls(), rid)]  # one was in a call
    assert call.status.status_code is StatusCode.ERROR
    assert call.attributes["error.type"] == "abandoned"
    (ask,) = traced.named("brood.ask")
    assert ask.attributes["brood.ask.state"] == "cancelled"
    assert len(traced.named("brood.pool_wait")) == 1
    steps = traced.named("brood.step")
    assert len(steps) == 2  # the cancelled root's, and the other tree's
    for step in steps:
        assert step.attributes["brood.ended_with_run"] is True


# ---- links after a crash and a resume ------------------------------------------------------
def test_a_resumed_tree_has_new_spans_linked_to_those_of_the_crashed_supervisor(tmp_path, traced):
    from tests.test_resume import crash

    url = f"sqlite:///{tmp_path}/j.db"
    in_kid = Signal(tmp_path, "in-kid")
    never = tmp_path / "never"
    os.mkfifo(never)
    top = code("FINAL(rlm_query('KID-task'))")
    script = textwrap.dedent(f"""
        import os, brood
        os.environ["OTEL_TRACES_EXPORTER"] = "none"
        def kid(messages):
            open({in_kid.path!r}, "w").write("1")
            open({str(never)!r}).read()  # blocks until the process is killed
        model = brood.ScriptedModel({{"T0P-task": [{top!r}], "KID-task": [kid]}})
        sup = brood.Supervisor(model, store={url!r}, tracing=True,
                               limits=brood.Limits(shutdown_grace=0.3, term_grace=0.3))
        print(sup.spawn("T0P-task").id, flush=True)
        import signal; signal.pause()
    """)
    root_id = crash(script, in_kid.wait)
    with Journal(url) as journal:
        crashed = {
            e["run_id"]: SpanIds.from_journal(e["data"])
            for e in journal.store.events(kind="trace", root_id=root_id)
        }
    assert len(crashed) == 2 and None not in crashed.values()

    model = brood.ScriptedModel({"T0P-task": [top], "KID-task": [final("kid")]})
    with brood.Supervisor(model, store=url, limits=FAST, tracing=traced.provider) as sup:
        assert sup.resume(root_id).wait(timeout=60) == "kid"
    assert traced.recorder.still_open() == {}

    runs = traced.runs()
    assert set(runs) == set(crashed)
    kid_id = next(rid for rid in runs if rid != root_id)
    assert parent_id(runs[kid_id]) == runs[root_id].context.span_id
    for rid, span in runs.items():
        assert span.attributes["brood.resumed"] is True
        linked = [(link.context.trace_id, link.context.span_id) for link in span.links]
        ids = crashed[rid]
        assert ids is not None
        assert linked == [(ids.trace_id, ids.span_id)], rid
        assert span.context.span_id != ids.span_id


# ---- a span carried with a child placed on another node --------------------------------------
def test_what_a_placed_child_does_on_another_node_goes_under_the_span_sent_with_it(
    tmp_path, traced
):
    """The level of the spread request (no Ray here): node A sends a child's record with
    `guest_data`, and node B hosts it (`host_guest`, what its agent calls)."""
    gate = Gate(tmp_path, "a-holds")
    model = brood.ScriptedModel(
        {
            "T0P-task": [code(gate.wait_code + "\nFINAL('top')")],
            "GUEST-task": [code("print('on node b')"), final("guest")],
        }
    )
    url = f"sqlite:///{tmp_path}/j.db"
    with (
        brood.Supervisor(model, store=url, limits=FAST, tracing=traced.provider) as a,
        brood.Supervisor(model, store=url, limits=FAST, tracing=traced.provider) as b,
    ):
        top = a.spawn("T0P-task")
        engine_a, engine_b = a._engine, b._engine
        run_a = engine_a.core.runs[top.id]

        async def data() -> dict[str, Any]:
            return guest_data(engine_a.core, run_a)

        sent = engine_a.call(data())
        rec = RunRecord(
            id="r-0badc0de",
            root_id=top.id,
            parent_id=top.id,
            depth=1,
            key="1:0",
            prompt="GUEST-task",
            model=None,
        )
        # The parent's node journals the child's row (the cluster's journal is shared).
        assert a.store.insert_run(rec, engine_a.owner, None, None).result() == 1
        guest = engine_b.call(engine_b.core.host_guest(rec, sent, {"node_id": "b"}))

        async def ended() -> None:
            await guest.done.wait()

        engine_b.call(ended())
        assert guest.rec.answer == "guest"
        gate.open()
        assert top.wait(timeout=60) == "top"
    assert traced.recorder.still_open() == {}

    runs = traced.runs()
    header = SpanIds.from_traceparent(sent["traceparent"])
    assert header is not None
    assert (header.trace_id, header.span_id) == (
        runs[top.id].context.trace_id,
        runs[top.id].context.span_id,
    )
    assert rec.id not in runs  # its span is its parent node's
    below = [s for s in traced.spans() if s.attributes.get("brood.run.id") == rec.id]
    assert {s.name for s in below} == {"brood.step", "chat scripted"}
    for span in below:
        assert span.context.trace_id == header.trace_id
        assert parent_id(span) == header.span_id


# ---- a Session's driven steps -----------------------------------------------------------------
def test_a_sessions_driven_steps_are_spans_of_its_episodes_root(traced):
    model = brood.ScriptedModel([final("unused")])
    with brood.Session(model, limits=FAST, tracing=traced.provider) as env:
        env.reset("an episode")
        assert env.step("print(6 * 7)").stdout.strip() == "42"
        obs = env.step("FINAL('done')")
        assert obs.done and obs.answer == "done"
        root = env.run_id
    assert traced.recorder.still_open() == {}
    runs = traced.runs()
    assert set(runs) == {root}
    assert runs[root].attributes["brood.state"] == "completed"
    steps = traced.named("brood.step")
    assert len(steps) == 2
    assert {parent_id(s) for s in steps} == {runs[root].context.span_id}
    assert traced.calls() == []  # a driven root asks the model nothing


# ---- tracing off, and bad input ------------------------------------------------------------
def test_tracing_off_imports_no_opentelemetry_and_holds_the_no_op():
    script = textwrap.dedent(f"""
        import sys, brood
        model = brood.ScriptedModel([{final("x")!r}])
        with brood.Supervisor(model) as sup:
            answer = sup.run("go").answer
            off = sup._engine.tracing
        from brood.supervisor.tracing import NO_TRACING
        loaded = sorted(m for m in sys.modules if m.split(".")[0] == "opentelemetry")
        print(answer, off is NO_TRACING, loaded)
    """)
    env = {k: v for k, v in os.environ.items() if k != "BROOD_OTEL"}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["x", "True", "[]"]


def test_brood_otel_turns_tracing_on_and_false_keeps_it_off(monkeypatch):
    monkeypatch.setenv("BROOD_OTEL", "1")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    model = brood.ScriptedModel([final("x")])
    with brood.Supervisor(model, limits=FAST) as sup:
        assert sup._engine.tracing.enabled
        assert sup.run("go").answer == "x"
    with brood.Supervisor(model, limits=FAST, tracing=False) as sup:
        assert sup._engine.tracing is NO_TRACING


def providers_alive() -> int:
    """TracerProviders this process holds (one not shut down is held by its exit hook)."""
    gc.collect()
    return sum(isinstance(o, TracerProvider) for o in gc.get_objects())


def test_bad_tracing_settings_are_refused_naming_the_fix(monkeypatch):
    model = brood.ScriptedModel([final("x")])
    with pytest.raises(brood.InvalidArgument, match=r"tracing must be True, False or an Open"):
        brood.Supervisor(model, tracing="yes")
    monkeypatch.setenv("BROOD_OTEL", "maybe")
    with pytest.raises(brood.InvalidArgument, match=r"BROOD_OTEL='maybe' is not a switch"):
        brood.Supervisor(model)
    monkeypatch.delenv("BROOD_OTEL")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "zipkin-nope")
    before = providers_alive()
    with pytest.raises(brood.InvalidArgument, match=r"OTEL_TRACES_EXPORTER='zipkin-nope'"):
        brood.Supervisor(model, tracing=True)
    assert providers_alive() == before, "a refused setting left a TracerProvider alive"
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # as if not installed
    with pytest.raises(brood.InvalidArgument, match=r"pip install -e '\.\[otel\]'"):
        brood.Supervisor(model, tracing=True)


def test_a_traceparent_is_read_only_when_it_is_one():
    ids = SpanIds(0xABC, 0xDEF)
    assert SpanIds.from_traceparent(ids.traceparent()) == ids
    for bad in (None, 7, "", "00-0-0-01", ids.traceparent() + " ", "01" + ids.traceparent()[2:]):
        assert SpanIds.from_traceparent(bad) is None
    assert SpanIds.from_journal(ids.journaled()) == (0xABC, 0xDEF, 1, 0)
    assert SpanIds(1, 2, parent=3).journaled()["parent_span_id"] == f"{3:016x}"
    assert SpanIds.from_journal({"trace_id": "zz", "span_id": "1"}) is None
    assert json.loads(json.dumps(ids.journaled())) == ids.journaled()

"""Flow instances whose start or first model call is rate limited: the factory's backoff
(1 s doubling to 60 s, 5 tries in all, then the failure policy), each in the instance's own
task, and nothing after a stop. Waits are shortened; every flow is replay-checked."""

from __future__ import annotations

import threading

import pytest

import brood
from brood.flow import executor as flow_executor
from brood.supervisor import gateway
from tests.test_flow_run import final, kinds, ledger
from tests.util import fast

LIMITS = fast(max_depth=2, max_concurrency=8)
pytestmark = pytest.mark.usefixtures("replay_checked")


@pytest.fixture(autouse=True)
def quick_backoff(monkeypatch):
    """One gateway try per call (so a RateLimited ends the run's call at once), and the
    flow's backoff in hundredths of a second."""
    monkeypatch.setattr(gateway, "RATE_TRIES", 1)
    monkeypatch.setattr(flow_executor, "START_BACKOFF_FIRST_S", 0.01)


def one_state(policy: str = "fail_fast", *others: dict) -> dict:
    return {
        "run": {"failure_policy": policy},
        "states": [
            {"id": "s", "entry": True, "prompt": "Go", "outputs": ["text"]},
            *others,
        ],
        "transitions": [],
    }


def limited_first_calls(times: int | None, reply: str = "done"):
    """A chat_fn whose run of state `s` is refused (RateLimited) at its first model call
    `times` times (None: always); other prompts answer at once."""
    lock = threading.Lock()
    refused = {"n": 0}

    def chat_fn(messages):
        if messages[1]["content"].startswith("Go") and len(messages) == 2:
            with lock:
                if times is None or refused["n"] < times:
                    refused["n"] += 1
                    raise brood.RateLimited("429 Too Many Requests", retry_after=None)
        return final(reply)

    return chat_fn, refused


def child_keys(sup: brood.Supervisor, flow_id: str) -> list[str]:
    return sorted(r["key"] for r in sup.store.runs() if r["parent_id"] == flow_id)


def test_a_rate_limited_first_call_is_deferred_then_succeeds():
    chat_fn, refused = limited_first_calls(2)
    with brood.Supervisor(chat_fn, limits=LIMITS) as sup:
        flow = sup.flow_run(one_state())
        assert flow.wait(timeout=60) == "finished"
        events = ledger(sup, flow.id)
        keys = child_keys(sup, flow.id)
        status = flow.status()
    assert refused["n"] == 2
    deferred = kinds(events, "deferred")
    assert [(d["tries"], d["wait"]) for d in deferred] == [(1, 0.01), (2, 0.02)]
    assert "rate limited" in deferred[0]["reason"]
    # one run per try, each under its own key; the instance is one attempt throughout
    assert keys == ["s#1", "s#1/r1", "s#1/r2"]
    assert kinds(events, "retry") == [] and kinds(events, "state_failed") == []
    (inst,) = status["states"]["s"]["instances"]
    assert inst["attempt"] == 0 and inst["rate_limited_runs"] == 2
    assert inst["state"] == "completed"


def test_a_rate_limit_that_never_lifts_goes_to_the_failure_policy():
    chat_fn, refused = limited_first_calls(None)
    spec = one_state("escalate")
    spec["states"][0]["retries"] = 2  # deferrals are not retries: none is used
    with brood.Supervisor(chat_fn, limits=LIMITS) as sup:
        flow = sup.flow_run(spec)
        assert flow.wait(timeout=60) == "paused"  # escalate
        events = ledger(sup, flow.id)
        report = flow.stop()
    assert refused["n"] == flow_executor.START_TRIES == 5
    assert [d["wait"] for d in kinds(events, "deferred")] == [0.01, 0.02, 0.04, 0.08]
    assert kinds(events, "retry") == []
    (failed,) = kinds(events, "state_failed")
    assert failed["reason"].startswith("rate limited at its first model call, 5 runs in all")
    assert kinds(events, "settled")[-1]["retry"] is False
    assert report["state"] == "stopped"


def test_a_run_rate_limited_after_its_first_call_is_an_ordinary_failure():
    """Only the first call defers: a later rate limit fails the attempt, which is retried."""
    calls = {"n": 0}
    lock = threading.Lock()

    def chat_fn(messages):
        if messages[1]["content"].startswith("Go"):
            with lock:
                calls["n"] += 1
                n = calls["n"]
            if n == 1:
                return "Thinking first.\n```repl\nx = 1\n```"
            if n == 2:
                raise brood.RateLimited("429", retry_after=None)
        return final("done")

    spec = one_state()
    spec["states"][0]["retries"] = 1
    with brood.Supervisor(chat_fn, limits=LIMITS) as sup:
        flow = sup.flow_run(spec)
        assert flow.wait(timeout=60) == "finished"
        events = ledger(sup, flow.id)
    assert kinds(events, "deferred") == []
    (retry,) = kinds(events, "retry")
    assert "rate limited" in retry["reason"]


def test_a_backoff_that_wakes_in_a_stopped_flow_does_nothing(monkeypatch):
    # A backoff far longer than the test: stop() must not wait for it, and nothing may
    # start when it would have woken.
    monkeypatch.setattr(flow_executor, "START_BACKOFF_FIRST_S", 3600.0)
    deferred = threading.Event()
    real_ledger = flow_executor.FlowExecutor.ledger

    def ledger_seen(self, kind, **data):
        real_ledger(self, kind, **data)
        if kind == "deferred":  # its backoff is under way once this returns to the loop
            deferred.set()

    monkeypatch.setattr(flow_executor.FlowExecutor, "ledger", ledger_seen)
    chat_fn, refused = limited_first_calls(None)
    with brood.Supervisor(chat_fn, limits=LIMITS) as sup:
        flow = sup.flow_run(one_state())
        ex = sup._engine.flow(flow.id)
        assert deferred.wait(timeout=60)
        report = flow.stop()
        events = ledger(sup, flow.id)
        keys = child_keys(sup, flow.id)
        assert ex.sleepers == {}
    assert report["state"] == "stopped"
    assert report["cancelled"] == ["s"] and report["instances"][0]["run_id"] is None
    assert refused["n"] == 1 and keys == ["s#1"]
    assert kinds(events, "settled")[-1]["outcome"] == "cancelled"
    assert events[-1]["kind"] == "flow_ended"


def test_a_start_refused_for_a_rate_limit_is_backed_off(monkeypatch):
    from brood.supervisor.core import Core

    real = Core.start_child
    left = {"n": 2}

    async def start_child(self, parent, prompt, **kw):
        if left["n"]:
            left["n"] -= 1
            raise brood.RateLimited("429 at start", retry_after=None)
        return await real(self, parent, prompt, **kw)

    monkeypatch.setattr(Core, "start_child", start_child)
    with brood.Supervisor(brood.ScriptedModel({"Go": [final("ok")]}), limits=LIMITS) as sup:
        flow = sup.flow_run(one_state())
        assert flow.wait(timeout=60) == "finished"
        events = ledger(sup, flow.id)
    assert [e["wait"] for e in kinds(events, "start_retry")] == [0.01, 0.02]

"""The stall alarm: a step's wait on a model call, a child or a task that hears nothing
from below for Limits.stall_timeout raises StallTimeout (the work keeps running); progress
from below (replies, state changes, heartbeats of steps and model calls) keeps it quiet."""

from __future__ import annotations

import json
import threading

import brood
from tests.util import fast

FENCE = "```"


def code(source: str) -> str:
    return f"{FENCE}repl\n{source}\n{FENCE}"


def test_a_model_call_that_never_returns_stalls_while_the_step_clock_stays_paused():
    never = threading.Event()

    def chat_fn(messages):
        if messages[0]["role"] != "system":  # the plain call: it never returns
            never.wait()
            return "too late"
        return code(
            "try:\n    llm_query('plain: never answered')\n"
            "except StallTimeout as e:\n    FINAL(e.waited_on + ' | ' + str(e))"
        )

    # A step clock that ran during the wait would end the step (0.3 s) before the alarm.
    limits = fast(stall_timeout=0.6, step_timeout=0.3)
    try:
        with brood.Supervisor(chat_fn, limits=limits) as sup:
            result = sup.run("root")
    finally:
        never.set()
    waited_on, message = result.answer.split(" | ")
    assert waited_on == "the model call (llm_query: 'plain: never answered')", result
    assert "made no progress for 0.6 s (Limits.stall_timeout)" in message
    assert "It keeps running" in message


def test_a_child_that_keeps_reporting_progress_is_not_stalled():
    child_turns = [code("import time; time.sleep(0.25)")] * 5 + [code("FINAL('steady')")]
    root = code("FINAL(rlm_wait(rlm_spawn('child: steady work')))")
    model = brood.ScriptedModel({"root": [root], "child": child_turns})
    with brood.Supervisor(model, limits=fast(stall_timeout=0.8)) as sup:
        result = sup.run("root")
    assert result.answer == "steady", result


def test_a_silent_child_stalls_the_wait_and_can_be_awaited_again():
    root = code(
        "import json\n"
        "h = rlm_spawn('child: long step')\n"
        "try:\n    rlm_wait(h)\n"
        "except StallTimeout as e:\n    first = [e.waited_on, rlm_status(h)]\n"
        "FINAL(json.dumps(first + [rlm_wait(h)]))"
    )
    child = [code("import time; time.sleep(1.6)"), code("FINAL('done at last')")]
    model = brood.ScriptedModel({"root": [root], "child": child})
    with brood.Supervisor(model, limits=fast(stall_timeout=1.0)) as sup:
        result = sup.run("root")
    waited_on, status, answer = json.loads(result.answer)
    assert waited_on.startswith("child r-") and status == "running"
    assert answer == "done at last"


def test_waiting_on_a_person_never_stalls():
    root = code("FINAL(ask_person('Go?', deadline=1.2, default='went')['answer']['text'])")
    with brood.Supervisor(
        brood.ScriptedModel({"root": [root]}), limits=fast(stall_timeout=0.3)
    ) as sup:
        result = sup.run("root")
    assert result.answer == "went", result


def test_spawned_slow_call_outlives_the_alarm_of_its_waiter_and_gives_its_reply():
    slow = threading.Event()  # the slow call's reply comes once the waiter's alarm rang
    turns = [
        code(
            "t = spawn(llm_query, 'plain: slow')\n"
            "try:\n    rlm_await(t)\n"
            "except StallTimeout as e:\n    print('alarm:', rlm_status(t))"
        ),
        code("FINAL(rlm_await(t))"),
    ]

    def chat_fn(messages):
        if messages[0]["role"] != "system":  # the spawned plain call
            slow.wait()
            return "the slow reply"
        if "alarm: running" in str(messages[-1]["content"]):
            slow.set()  # the step saw the alarm with the work still running
        return turns.pop(0)

    try:
        with brood.Supervisor(chat_fn, limits=fast(stall_timeout=0.4)) as sup:
            result = sup.run("root")
    finally:
        slow.set()
    assert result.state == "completed" and result.answer == "the slow reply", result

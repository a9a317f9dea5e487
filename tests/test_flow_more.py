"""Flows on the supervisor, past the basics of test_flow_run: escalate and resume, budgets,
max_parallel, optional inputs, resident states, the DAG form, mixed foreach outcomes, stop
racing the control loop, scale, and invalid specs at flow_run.

Scripted replies run in worker processes: they are functions of the state's prompt (and of
files the test controls), never of Python state shared with the test. They also refer to no
function of this module: cloudpickle ships such a function by reference, so every worker
would import this module (and pytest) first, about 70 ms a run, which the 1,000-item fan
cannot afford. Module-level strings are fine (they are shipped by value).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import brood
from tests.util import Gate, Signal, fast

FENCE = "```"
LIMITS = fast(max_depth=2, max_concurrency=8)
# Every flow here is also rebuilt from its ledger before its supervisor closes.
pytestmark = pytest.mark.usefixtures("replay_checked")
FOREVER = f"{FENCE}repl\nimport time\nwhile True: time.sleep(1)\n{FENCE}"  # never settles
CRASH = f"{FENCE}repl\nimport os\nos._exit(2)\n{FENCE}"  # fails the run: the worker dies


def final(text: str) -> str:
    """A scripted reply that answers `text` (for replies built in the test)."""
    return f"{FENCE}repl\nFINAL({text!r})\n{FENCE}"


def answer_with(reply):
    """A scripted reply that answers `reply(prompt)`, for the state's rendered prompt: the
    first line of the run's first user message (the worker appends a description of the
    context below it)."""

    def respond(messages):
        task = messages[1]["content"].split("\n", 1)[0]
        return f"{FENCE}repl\nFINAL({reply(task)!r})\n{FENCE}"

    return respond


def ledger(sup: brood.Supervisor, flow_id: str) -> list[dict]:
    sup.store.flush()  # ledger events are queued to the writer, not awaited
    return [e["data"] for e in sup.store.events(flow_id, "flow")]


def kinds(events: list[dict], kind: str) -> list[dict]:
    return [e for e in events if e["kind"] == kind]


def milestones(events: list[dict]) -> list[str]:
    return [e["milestone"] for e in kinds(events, "milestone")]


def children(sup: brood.Supervisor, flow_id: str) -> list[dict]:
    """The flow's state instances (child runs of its controller run), in creation order."""
    return [r for r in sup.store.runs(flow_id) if r["parent_id"] == flow_id]


def controller(sup: brood.Supervisor, flow_id: str) -> dict:
    return sup.store.get_run(flow_id)


def foreach_state(prompt: str, **extra) -> dict:
    """A state that runs once per element of the flow input `item` (a JSON list)."""
    return {
        "id": "each",
        "entry": True,
        "prompt": prompt,
        "inputs": [{"name": "item", "type": "json"}],
        "foreach": {"over": "item"},
        "outputs": ["text"],
        **extra,
    }


def peak_overlap(intervals: list[tuple[float, float]]) -> int:
    """The most intervals open at one time (an end at t closes before a start at t opens)."""
    points = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    peak = open_now = 0
    for _, delta in points:
        open_now += delta
        peak = max(peak, open_now)
    return peak


# ---- (1) escalate ------------------------------------------------------------------------------


def test_escalate_pauses_the_flow_and_resume_runs_the_failed_entry_again(tmp_path):
    switch = tmp_path / "switch"
    switch.write_text("fail")
    spec = {
        "run": {"failure_policy": "escalate"},
        "states": [
            {
                "id": "work",
                "entry": True,
                "prompt": "Work; the switch is at {switch}",
                "inputs": ["switch"],
                "outputs": ["text"],
            },
            {
                "id": "after",
                "prompt": "After {text}",
                "inputs": [{"name": "text", "from": "work.text"}],
                "outputs": ["text"],
            },
        ],
        "transitions": [{"from": "work", "to": "after"}],
    }

    def work(messages):
        # The REPL code reads the switch when it runs, so the test decides each run's
        # outcome by writing the file.
        path = messages[1]["content"].split("\n", 1)[0].rsplit(" ", 1)[1]
        return (
            f"{FENCE}repl\nimport os\nif open({path!r}).read() == 'fail':\n    os._exit(3)\n"
            f"FINAL('worked')\n{FENCE}"
        )

    model = brood.ScriptedModel(
        {"Work;": [work], "After": [answer_with(lambda p: p.split()[1].upper())]}
    )
    with brood.Supervisor(model, limits=LIMITS) as sup:
        flow = sup.flow_run(spec, inputs={"switch": str(switch)})
        assert flow.wait(timeout=60) == "paused"
        paused = flow.status()
        paused_events = ledger(sup, flow.id)
        switch.write_text("ok")
        flow.resume()
        assert flow.wait(timeout=60) == "finished", flow.status()
        outputs = flow.outputs()
        events = ledger(sup, flow.id)
        runs = children(sup, flow.id)
        ctl = controller(sup, flow.id)
    assert paused["status"] == "paused"
    assert paused["milestones"] == ["paused"]
    assert "state work failed" in paused["reason"] and "resume" in paused["reason"]
    assert paused["states"]["after"]["entries"] == 0
    assert milestones(paused_events) == ["paused"]
    assert [e["state"] for e in kinds(paused_events, "state_failed")] == ["work"]

    assert outputs == {"work": {"text": "worked"}, "after": {"text": "WORKED"}}
    assert milestones(events) == ["paused", "finished"]
    assert len(kinds(events, "resumed")) == 1
    work_runs = [r for r in runs if r["prompt"].startswith("Work;")]
    assert [r["state"] for r in work_runs] == ["failed", "completed"]
    assert ctl["state"] == "completed"


# ---- (2) budgets -------------------------------------------------------------------------------


def test_a_state_budget_times_its_instance_out_and_continue_lets_the_rest_finish():
    spec = {
        "run": {"failure_policy": "continue"},
        "states": [
            {
                "id": "slow",
                "entry": True,
                "prompt": "Slow",
                "outputs": ["text"],
                "budget": 0.5,
                "retries": 0,
            },
            {"id": "quick", "entry": True, "prompt": "Quick", "outputs": ["text"]},
        ],
        "transitions": [],
    }
    model = brood.ScriptedModel({"Slow": [FOREVER], "Quick": [final("done")]})
    with brood.Supervisor(model, limits=LIMITS) as sup:
        flow = sup.flow_run(spec)
        assert flow.wait(timeout=60) == "failed", flow.status()
        reason = flow.status()["reason"]
        outputs = flow.outputs()
        events = ledger(sup, flow.id)
        runs = {r["prompt"]: r for r in children(sup, flow.id)}
    assert reason.startswith("states failed (failure_policy continue): slow: timed_out")
    slow = runs["Slow"]
    assert slow["state"] == "timed_out"
    assert slow["ended_at"] - slow["created_at"] >= 0.5
    assert runs["Quick"]["state"] == "completed"
    (failed,) = kinds(events, "state_failed")
    assert failed["state"] == "slow" and failed["reason"].startswith("timed_out")
    assert not kinds(events, "retry")
    assert outputs == {"quick": {"text": "done"}}
    assert milestones(events) == ["failed"]


def test_a_run_budget_pauses_admission_lets_running_work_finish_then_resume_goes_on(tmp_path):
    go = Gate(tmp_path, "go")
    spec = {
        "run": {"budget": 0.5},
        "states": [
            {"id": "slow", "entry": True, "prompt": "Slow", "outputs": ["text"]},
            {
                "id": "later",
                "prompt": "Later {t}",
                "inputs": [{"name": "t", "from": "slow.text"}],
                "outputs": ["text"],
            },
        ],
        "transitions": [{"from": "slow", "to": "later"}],
    }
    model = brood.ScriptedModel(
        {"Slow": [go.blocking_reply(final("slow done"))], "Later": [final("later done")]}
    )
    with brood.Supervisor(model, limits=LIMITS) as sup:
        flow = sup.flow_run(spec)
        assert flow.wait(timeout=60) == "paused"  # the budget ran out while slow ran
        paused = flow.status()
        go.open()
        (slow,) = children(sup, flow.id)
        sup._engine.call(sup._engine.core.runs[slow["id"]].done.wait())  # in flight: it finishes
        assert [r["prompt"] for r in children(sup, flow.id)] == ["Slow"]  # nothing new
        flow.resume()
        assert flow.wait(timeout=60) == "finished", flow.status()
        events = ledger(sup, flow.id)
        runs = {r["prompt"]: r["state"] for r in children(sup, flow.id)}
    assert paused["reason"].startswith("budget: 0.5 s of wall clock used")
    assert runs == {"Slow": "completed", "Later slow done": "completed"}
    assert milestones(events) == ["budget_exceeded", "paused", "finished"]


def test_a_state_budget_ends_its_attempt_timed_out_and_it_is_not_retried():
    spec = {
        "run": {"failure_policy": "fail_fast"},
        "states": [
            {
                "id": "slow",
                "entry": True,
                "prompt": "Slow",
                "outputs": ["text"],
                "budget": 0.5,
                "retries": 3,
            }
        ],
        "transitions": [],
    }
    model = brood.ScriptedModel({"Slow": [FOREVER]})
    with brood.Supervisor(model, limits=LIMITS) as sup:
        flow = sup.flow_run(spec)
        assert flow.wait(timeout=60) == "failed"
        events = ledger(sup, flow.id)
        runs = [r["state"] for r in children(sup, flow.id)]
    assert runs == ["timed_out"]  # one attempt, not four
    assert not kinds(events, "retry")
    (failed,) = kinds(events, "state_failed")
    assert failed["reason"].startswith("timed_out")


# ---- (3) max_parallel ------------------------------------------------------------------------


def test_max_parallel_2_never_runs_more_than_2_instances_at_once(tmp_path):
    marks = str(tmp_path / "marks")
    spec = {"run": {"max_parallel": 2}, "states": [foreach_state("Item {item}")]}

    def item(messages):
        import fcntl
        import time

        n = messages[1]["content"].split()[1]

        def mark(tag: str) -> None:
            with open(marks, "a") as f:
                fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
                f.write(f"{tag} {n}\n")

        mark("start")
        time.sleep(0.2)  # work: long enough that a third instance would overlap
        mark("end")
        return f"{FENCE}repl\nFINAL({n!r})\n{FENCE}"

    model = brood.ScriptedModel({"Item": [item]})
    with brood.Supervisor(model, limits=LIMITS) as sup:
        flow = sup.flow_run(spec, inputs={"item": list(range(6))})
        assert flow.wait(timeout=60) == "finished", flow.status()
        outputs = flow.outputs()
        runs = children(sup, flow.id)
    assert outputs["each"]["text"] == [str(i) for i in range(6)]
    lines = [line.split() for line in Path(marks).read_text().splitlines()]
    assert sorted(n for tag, n in lines if tag == "start") == [str(i) for i in range(6)]
    running = peak = 0
    for tag, _ in lines:  # in the order the children wrote them, under the lock
        running += 1 if tag == "start" else -1
        peak = max(peak, running)
    assert peak == 2
    # The journal agrees: no three child runs were alive at once.
    assert len(runs) == 6
    assert peak_overlap([(r["created_at"], r["ended_at"]) for r in runs]) <= 2


# ---- (4) optional inputs -----------------------------------------------------------------------


def test_optional_inputs_whose_source_never_settled_bind_null():
    spec = {
        "states": [
            {
                "id": "start",
                "entry": True,
                "prompt": "Start",
                "outputs": [{"name": "label", "type": "json"}],
            },
            {"id": "skipped", "prompt": "Skipped", "outputs": ["note"]},
            {
                "id": "use",
                "prompt": "Use {label} with {note} and {extra}",
                "inputs": [
                    {"name": "label", "from": "start.label"},
                    {"name": "note", "from": "skipped.note", "optional": True},
                    {"name": "extra", "optional": True},  # a flow input nobody passed
                ],
                "outputs": ["text"],
            },
        ],
        "transitions": [
            {
                "from": "start",
                "to": "skipped",
                "when": {"output": "label", "op": "eq", "value": "never"},
            },
            {"from": "start", "to": "use"},
        ],
    }
    model = brood.ScriptedModel({"Start": [final('"go"')], "Use": [answer_with(lambda p: p)]})
    with brood.Supervisor(model, limits=LIMITS) as sup:
        flow = sup.flow_run(spec)
        assert flow.wait(timeout=60) == "finished", flow.status()
        outputs = flow.outputs()
        entries = {s: v["entries"] for s, v in flow.status()["states"].items()}
        prompts = [r["prompt"] for r in children(sup, flow.id)]
    assert entries == {"start": 1, "skipped": 0, "use": 1}
    assert prompts == ["Start", "Use go with null and null"]
    assert outputs["use"]["text"] == "Use go with null and null"


# ---- (5) resident states -----------------------------------------------------------------------


def test_residents_do_not_hold_the_flow_open_and_are_stopped_when_it_finishes(tmp_path):
    watching = Signal(tmp_path, "watching")
    go = Gate(tmp_path, "go")
    spec = {
        "states": [
            {"id": "monitor", "entry": True, "prompt": "Monitor", "lifecycle": "resident"},
            {"id": "work", "entry": True, "prompt": "Work", "outputs": ["text"]},
        ],
        "transitions": [],
    }
    model = brood.ScriptedModel(
        {
            "Monitor": [watching.notify_then(FOREVER)],
            "Work": [go.blocking_reply(final("done"))],
        }
    )
    with brood.Supervisor(model, limits=LIMITS) as sup:
        flow = sup.flow_run(spec)
        watching.wait()  # the resident runs while the work is still going
        status = flow.status()
        go.open()
        assert flow.wait(timeout=60) == "finished", flow.status()
        events = ledger(sup, flow.id)
        runs = {r["prompt"]: r["state"] for r in children(sup, flow.id)}
        ctl = controller(sup, flow.id)
    assert status["status"] == "running"
    assert runs == {"Monitor": "cancelled", "Work": "completed"}  # exit confirmed
    assert ctl["state"] == "completed"
    assert milestones(events) == ["finished"]
    assert kinds(events, "flow_ended")[-1]["status"] == "finished"


# ---- (6) the DAG form --------------------------------------------------------------------------


def test_the_dag_form_runs_a_join_after_both_dependencies():
    spec = {
        "name": "diamond",
        "nodes": [
            {"id": "left", "prompt": "Left", "outputs": ["l"]},
            {"id": "right", "prompt": "Right", "outputs": ["r"]},
            {
                "id": "join",
                "prompt": "Join {l} and {r}",
                "depends_on": ["left", "right"],
                "outputs": ["text"],
            },
        ],
    }

    def right(messages):
        import time

        time.sleep(0.3)  # work: right settles well after left, so join must wait for it
        return f"{FENCE}repl\nFINAL('R')\n{FENCE}"

    model = brood.ScriptedModel(
        {"Left": [final("L")], "Right": [right], "Join": [answer_with(lambda p: p)]}
    )
    with brood.Supervisor(model, limits=LIMITS) as sup:
        flow = sup.flow_run(spec)
        assert sorted(flow.started) == ["left", "right"]
        assert flow.wait(timeout=60) == "finished", flow.status()
        outputs = flow.outputs()
        events = ledger(sup, flow.id)
        runs = {r["prompt"]: r for r in children(sup, flow.id)}
    assert outputs == {"left": {"l": "L"}, "right": {"r": "R"}, "join": {"text": "Join L and R"}}
    assert set(runs) == {"Left", "Right", "Join L and R"}
    join = runs["Join L and R"]
    assert join["created_at"] >= max(runs["Left"]["ended_at"], runs["Right"]["ended_at"])
    assert [e["state"] for e in kinds(events, "state_entry")].count("join") == 1
    assert [e["state"] for e in kinds(events, "spawned")].count("join") == 1
    assert milestones(events) == ["finished"]


# ---- (7) mixed foreach outcomes ----------------------------------------------------------------


def test_fail_fast_foreach_one_item_fails_and_the_running_items_are_cancelled(tmp_path):
    go = Gate(tmp_path, "go")
    started = {name: Signal(tmp_path, f"started-{name}") for name in ("a", "c")}
    paths = {name: s.path for name, s in started.items()}
    gate = go.path
    spec = {
        "run": {"failure_policy": "fail_fast"},
        "states": [
            foreach_state("Item {item}"),
            {
                "id": "after",
                "prompt": "After {text}",
                "inputs": [{"name": "text", "from": "each.text"}],
                "outputs": ["text"],
            },
        ],
        "transitions": [{"from": "each", "to": "after"}],
    }

    def item(messages):
        name = messages[1]["content"].split()[1]
        if name == "bad":
            with open(gate) as f:  # fail only once the others are running
                f.read()
            return CRASH
        with open(paths[name], "w") as f:
            f.write("1")
        return FOREVER

    model = brood.ScriptedModel({"Item": [item], "After": [final("no")]})
    with brood.Supervisor(model, limits=LIMITS) as sup:
        flow = sup.flow_run(spec, inputs={"item": ["a", "bad", "c"]})
        for s in started.values():
            s.wait()
        go.open()
        assert flow.wait(timeout=60) == "failed"
        status = flow.status()
        events = ledger(sup, flow.id)
        runs = {r["prompt"]: r for r in children(sup, flow.id)}
    assert set(runs) == {"Item a", "Item bad", "Item c"}
    assert runs["Item bad"]["state"] == "failed"
    for name in ("Item a", "Item c"):
        assert runs[name]["state"] == "cancelled"
        assert runs[name]["reason"].startswith("flow failed: state each failed")
    assert status["reason"].startswith("state each failed")
    assert status["states"]["after"]["entries"] == 0
    (failed,) = kinds(events, "state_failed")
    assert failed["state"] == "each" and failed["item"] == 1
    assert milestones(events) == ["failed"]


def test_continue_foreach_one_item_fails_so_its_data_dependent_fails_at_binding():
    spec = {
        "states": [
            foreach_state("Item {item}", failure_policy="continue"),
            {
                "id": "after",
                "prompt": "After {text}",
                "inputs": [{"name": "text", "from": "each.text"}],
                "outputs": ["text"],
                "failure_policy": "continue",  # its own policy applies to its binding failure
            },
        ],
        "transitions": [{"from": "each", "to": "after"}],
    }

    def item(messages):
        name = messages[1]["content"].split()[1]
        return CRASH if name == "bad" else f"{FENCE}repl\nFINAL({name.upper()!r})\n{FENCE}"

    model = brood.ScriptedModel({"Item": [item], "After": [final("no")]})
    with brood.Supervisor(model, limits=LIMITS) as sup:
        flow = sup.flow_run(spec, inputs={"item": ["a", "bad", "c"]})
        assert flow.wait(timeout=60) == "failed", flow.status()
        status = flow.status()
        outputs = flow.outputs()
        events = ledger(sup, flow.id)
        runs = {r["prompt"]: r["state"] for r in children(sup, flow.id)}
    # `after` reads each.text: it is entered, fails at binding, and never runs.
    assert runs == {"Item a": "completed", "Item bad": "failed", "Item c": "completed"}
    assert status["states"]["after"]["entries"] == 1
    (fired,) = kinds(events, "transition_fired")
    assert (fired["source"], fired["target"], fired["on"]) == ("each", "after", "failed")
    assert "each" not in outputs  # a failed entry never settles
    each, after = kinds(events, "state_failed")
    assert each["state"] == "each" and each["item"] == 1
    assert after["state"] == "after" and after["reason"].startswith(
        "binding failure: input 'text' of state 'after' reads each.text, but state 'each' failed"
    )
    assert milestones(events) == ["failed"]


@pytest.mark.parametrize(
    ("value", "got"), [({"a": 1}, "got dict"), ("abc", "got str"), (None, "got null")]
)
def test_foreach_over_a_value_that_is_no_list_fails_the_entry_naming_it(value, got):
    spec = {"run": {"failure_policy": "fail_fast"}, "states": [foreach_state("Item {item}")]}
    model = brood.ScriptedModel({"Item": [final("never")]})
    with brood.Supervisor(model, limits=LIMITS) as sup:
        flow = sup.flow_run(spec, inputs={"item": value})
        assert flow.wait(timeout=60) == "failed", flow.status()
        reason = flow.status()["reason"]
        events = ledger(sup, flow.id)
        runs = children(sup, flow.id)
    assert "foreach over input 'item' of state 'each' needs a JSON list" in reason, reason
    assert got in reason, reason
    assert runs == []  # nothing started
    (failed,) = kinds(events, "state_failed")
    assert failed["state"] == "each" and failed["item"] is None


def test_an_escalated_foreach_over_no_list_pauses_again_on_resume():
    spec = {"run": {"failure_policy": "escalate"}, "states": [foreach_state("Item {item}")]}
    model = brood.ScriptedModel({"Item": [final("never")]})
    with brood.Supervisor(model, limits=LIMITS) as sup:
        flow = sup.flow_run(spec, inputs={"item": {"not": "a list"}})
        assert flow.wait(timeout=60) == "paused"
        flow.resume()  # the input is read again: the same error, never a hang or a finish
        assert flow.wait(timeout=60) == "paused"
        assert "needs a JSON list, got dict" in flow.status()["reason"]
        assert flow.stop()["state"] == "stopped"
        assert len(kinds(ledger(sup, flow.id), "state_failed")) == 2


def test_foreach_over_an_empty_list_settles_with_empty_lists():
    spec = {"states": [foreach_state("Item {item}")]}
    model = brood.ScriptedModel({"Item": [final("never")]})
    with brood.Supervisor(model, limits=LIMITS) as sup:
        flow = sup.flow_run(spec, inputs={"item": []})
        assert flow.wait(timeout=60) == "finished", flow.status()
        assert flow.outputs() == {"each": {"text": []}}
        assert children(sup, flow.id) == []


def test_a_failed_foreach_entry_starts_none_of_its_queued_items():
    spec = {
        "run": {"max_parallel": 1},
        "states": [foreach_state("Item {item}", failure_policy="continue")],
    }

    def item(messages):
        name = messages[1]["content"].split()[1]
        return CRASH if name == "bad" else f"{FENCE}repl\nFINAL({name!r})\n{FENCE}"

    model = brood.ScriptedModel({"Item": [item]})
    with brood.Supervisor(model, limits=LIMITS) as sup:
        flow = sup.flow_run(spec, inputs={"item": ["a", "bad", "c", "d"]})
        assert flow.wait(timeout=60) == "failed", flow.status()
        events = ledger(sup, flow.id)
        runs = [r["prompt"] for r in children(sup, flow.id)]
    assert runs == ["Item a", "Item bad"]  # c and d never started
    cancelled = kinds(events, "instance_cancelled")
    assert [(e["item"], e["reason"]) for e in cancelled] == [
        (2, "its entry failed"),
        (3, "its entry failed"),
    ]


# ---- (7b) failure_policy continue: dependents, and answers that cannot bind -------------------


def test_continue_runs_control_only_dependents_and_fails_data_dependents_at_binding():
    # `a` fails. `cleanup` depends on it but reads none of its outputs: it runs. `use`
    # reads a.verdict: it fails at binding and does not run, and under `continue` its own
    # control-only dependent `report` runs too (reading use's output only optionally).
    spec = {
        "run": {"failure_policy": "continue"},
        "states": [
            {"id": "a", "entry": True, "prompt": "Check", "outputs": ["verdict"], "retries": 1},
            {"id": "cleanup", "prompt": "Cleanup", "outputs": ["text"]},
            {
                "id": "use",
                "prompt": "Use {verdict}",
                "inputs": [{"name": "verdict", "from": "a.verdict"}],
                "outputs": ["text"],
            },
            {
                "id": "report",
                "prompt": "Report {text}",
                "inputs": [{"name": "text", "from": "use.text", "optional": True}],
                "outputs": ["text"],
            },
        ],
        "transitions": [
            {"from": "a", "to": "cleanup"},
            {"from": "a", "to": "use"},
            {"from": "use", "to": "report"},
            {"from": "a", "to": "report", "when": {"output": "verdict", "op": "exists"}},
        ],
    }
    model = brood.ScriptedModel(
        {
            "Check": [CRASH, CRASH],
            "Cleanup": [final("cleaned")],
            "Use": [final("used")],
            "Report": [answer_with(lambda p: p)],
        }
    )
    with brood.Supervisor(model, limits=LIMITS) as sup:
        flow = sup.flow_run(spec)
        assert flow.wait(timeout=60) == "failed", flow.status()
        status = flow.status()
        outputs = flow.outputs()
        events = ledger(sup, flow.id)
        runs = [(r["prompt"], r["state"]) for r in children(sup, flow.id)]
    assert runs == [
        ("Check", "failed"),
        ("Check", "failed"),  # a child failure is retried (retries: 1)
        ("Cleanup", "completed"),
        ("Report null", "completed"),
    ]
    assert outputs == {"cleanup": {"text": "cleaned"}, "report": {"text": "Report null"}}
    fired = [(e["source"], e["target"], e.get("on")) for e in kinds(events, "transition_fired")]
    # The guarded transition reads a's output, which it has none of: it does not fire.
    on_failed = [("a", "cleanup"), ("a", "use"), ("use", "report")]
    assert fired == [(source, target, "failed") for source, target in on_failed]
    a, use = kinds(events, "state_failed")
    assert a["state"] == "a" and a["reason"].startswith("failed: ")
    assert use["state"] == "use" and use["reason"] == (
        f"binding failure: input 'verdict' of state 'use' reads a.verdict, but state 'a' "
        f"failed ({a['reason']}); 'use' does not run"
    )
    assert status["states"]["use"]["per_entry"] == [
        {"entry": 1, "status": "failed", "instances": 0, "counts": {}}
    ]
    assert status["reason"].startswith("states failed (failure_policy continue): a: failed: ")
    assert "; use: binding failure: input 'verdict'" in status["reason"]
    assert milestones(events) == ["failed"]


def test_the_dag_form_under_continue_fails_a_join_at_binding_when_a_dependency_fails():
    # The DAG form binds every output of a dependency, so its dependents are data
    # dependents: the join fails at binding (no stall), the independent node finishes.
    spec = {
        "run": {"failure_policy": "continue"},
        "nodes": [
            {"id": "left", "prompt": "Left", "outputs": ["l"]},
            {"id": "right", "prompt": "Right", "outputs": ["r"]},
            {"id": "alone", "prompt": "Alone", "outputs": ["text"]},
            {"id": "join", "prompt": "Join {l} and {r}", "depends_on": ["left", "right"]},
        ],
    }
    model = brood.ScriptedModel(
        {"Left": [final("L")], "Right": [CRASH], "Alone": [final("A")], "Join": [final("J")]}
    )
    with brood.Supervisor(model, limits=LIMITS) as sup:
        flow = sup.flow_run(spec)
        assert flow.wait(timeout=60) == "failed", flow.status()
        events = ledger(sup, flow.id)
        runs = {r["prompt"]: r["state"] for r in children(sup, flow.id)}
    assert runs == {"Left": "completed", "Right": "failed", "Alone": "completed"}
    failed = {e["state"]: e["reason"] for e in kinds(events, "state_failed")}
    assert set(failed) == {"right", "join"}
    assert failed["join"].startswith(
        "binding failure: input 'r' of state 'join' reads right.r, but state 'right' failed"
    )


@pytest.mark.parametrize("policy", ["fail_fast", "continue", "escalate"])
def test_an_answer_that_cannot_bind_is_a_binding_failure_never_retried(policy):
    # `review` declares a json output its answer does not give: the instance fails at once
    # (one child, not three) and the failure policy applies, naming the state and output.
    spec = {
        "run": {"failure_policy": policy},
        "states": [
            {
                "id": "review",
                "entry": True,
                "prompt": "Review",
                "outputs": [{"name": "verdict", "type": "json"}],
                "retries": 2,
            }
        ],
        "transitions": [],
    }
    model = brood.ScriptedModel({"Review": [final("looks fine to me")] * 3})
    with brood.Supervisor(model, limits=LIMITS) as sup:
        flow = sup.flow_run(spec)
        assert flow.wait(timeout=60) == ("paused" if policy == "escalate" else "failed")
        reason = flow.status()["reason"]
        runs = [(r["prompt"], r["state"]) for r in children(sup, flow.id)]
        if policy == "escalate":
            flow.stop()
        events = ledger(sup, flow.id)
    assert runs == [("Review", "completed")]  # the child answered; its answer cannot bind
    assert not kinds(events, "retry")
    (settled,) = kinds(events, "settled")
    assert settled["outcome"] == "failed" and settled["retry"] is False
    (failed,) = kinds(events, "state_failed")
    assert failed["state"] == "review"
    assert failed["reason"].startswith(
        "binding failure (not retried): state 'review': output 'verdict' is not valid JSON"
    )
    assert failed["reason"] in reason


# ---- (8) stop racing the control loop ----------------------------------------------------------


def test_stop_right_after_flow_run_ends_stopped_and_admits_nothing_more():
    spec = {"run": {"max_parallel": 2}, "states": [foreach_state("Item {item}")]}
    model = brood.ScriptedModel({"Item": [FOREVER]})
    with brood.Supervisor(model, limits=LIMITS) as sup:
        for _ in range(3):  # where stop lands among the instance starts can vary
            flow = sup.flow_run(spec, inputs={"item": list(range(6))})
            assert flow.stop()["state"] == "stopped"
            assert flow.stop() == {"state": "stopped", "cancelled": [], "instances": []}
            assert flow.wait(timeout=10) == "stopped"
            assert flow.status()["status"] == "stopped"
            events = ledger(sup, flow.id)
            runs = children(sup, flow.id)
            ctl = controller(sup, flow.id)
            assert ctl["state"] == "cancelled"
            # max_parallel 2: only the two first instances were ever admitted
            assert len(runs) <= 2
            assert {r["state"] for r in runs} <= {"cancelled"}
            assert len(kinds(events, "spawned")) <= len(runs)
            assert "finished" not in milestones(events)
            at = next(i for i, e in enumerate(events) if e["kind"] == "stopping")
            after = {e["kind"] for e in events[at:]}
            assert not after & {"state_entry", "transition_fired", "retry"}
            assert kinds(events, "flow_ended")[-1]["status"] == "stopped"
        stats = sup.statistics()
    assert set(stats["runs"]) <= {"cancelled"} and stats["queued"] == 0


# ---- (9) scale ---------------------------------------------------------------------------------

SCALE = fast(max_depth=2, max_concurrency=16)


def test_a_foreach_of_1000_items_completes():
    spec = {"states": [foreach_state("Double {item}", foreach={"over": "item", "max": 1000})]}
    model = brood.ScriptedModel({"Double": [answer_with(lambda p: str(2 * int(p.split()[1])))]})
    with brood.Supervisor(model, limits=SCALE) as sup:
        flow = sup.flow_run(spec, inputs={"item": list(range(1000))})
        assert flow.wait(timeout=120) == "finished", flow.status()["reason"]
        outputs = flow.outputs()
        runs = children(sup, flow.id)
    assert outputs["each"]["text"] == [str(2 * i) for i in range(1000)]
    assert len(runs) == 1000 and {r["state"] for r in runs} == {"completed"}


def test_a_chain_of_100_states_completes():
    n = 100
    states: list[dict] = [
        {"id": "s0", "entry": True, "prompt": "Count 0", "outputs": [{"name": "n", "type": "json"}]}
    ]
    states += [
        {
            "id": f"s{i}",
            "prompt": "Count {n}",
            "inputs": [{"name": "n", "from": f"s{i - 1}.n"}],
            "outputs": [{"name": "n", "type": "json"}],
        }
        for i in range(1, n)
    ]
    spec = {
        "states": states,
        "transitions": [{"from": f"s{i}", "to": f"s{i + 1}"} for i in range(n - 1)],
    }
    model = brood.ScriptedModel({"Count": [answer_with(lambda p: str(int(p.split()[1]) + 1))]})
    with brood.Supervisor(model, limits=SCALE) as sup:
        flow = sup.flow_run(json.dumps(spec))  # as JSON text, the way a file would hold it
        assert flow.wait(timeout=120) == "finished", flow.status()["reason"]
        outputs = flow.outputs()
        status = flow.status()
    assert outputs[f"s{n - 1}"] == {"n": n}
    assert status["transitions_fired"] == n - 1
    assert all(v["entries"] == 1 for v in status["states"].values())


# ---- (10) invalid specs ------------------------------------------------------------------------


def _two_states(**transition) -> dict:
    return {
        "states": [
            {"id": "a", "entry": True, "prompt": "A", "outputs": [{"name": "v", "type": "json"}]},
            {"id": "b", "prompt": "B", "outputs": ["text"]},
        ],
        "transitions": [{"from": "a", "to": "b", **transition}],
    }


def _unknown_state(tmp_path: Path) -> object:
    spec = _two_states()
    spec["transitions"].append({"from": "b", "to": "nowhere"})
    return spec


def _input_cycle(tmp_path: Path) -> object:
    return {
        "states": [
            {
                "id": "a",
                "entry": True,
                "prompt": "A {y}",
                "inputs": [{"name": "y", "from": "b.text"}],
                "outputs": ["text"],
            },
            {
                "id": "b",
                "prompt": "B {x}",
                "inputs": [{"name": "x", "from": "a.text"}],
                "outputs": ["text"],
            },
        ],
        "transitions": [{"from": "a", "to": "b"}],
    }


def _guard_on_missing_output(tmp_path: Path) -> object:
    return _two_states(when={"output": "score", "op": "gt", "value": 3})


def _resident_with_outputs(tmp_path: Path) -> object:
    spec = _two_states()
    spec["states"][1] |= {"lifecycle": "resident"}
    return spec


def _nan_guard_dict(tmp_path: Path) -> object:
    return _two_states(when={"output": "v", "op": "eq", "value": float("nan")})


def _nan_guard_json_text(tmp_path: Path) -> object:
    text = json.dumps(_two_states(when={"output": "v", "op": "eq", "value": 0}))
    return text.replace('"value": 0', '"value": NaN')


def _neither_json_nor_yaml_file(tmp_path: Path) -> object:
    path = tmp_path / "flow.txt"
    path.write_text("states: [a, {b\n")
    return str(path)


def _binary_yaml_file(tmp_path: Path) -> object:
    path = tmp_path / "flow.yaml"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    return path


def _yaml_in_a_json_file(tmp_path: Path) -> object:
    path = tmp_path / "flow.json"
    path.write_text("states:\n  - id: a\n    entry: true\n    prompt: A\n")
    return str(path)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        pytest.param(make, match, id=make.__name__.strip("_"))
        for make, match in [
            (_unknown_state, r"transitions\[1\]\.to: unknown state 'nowhere'"),
            (_input_cycle, r"required inputs form a cycle \(a needs b\.text, b needs a\.text\)"),
            (_guard_on_missing_output, r"state 'a' has no output 'score' \(outputs: v\)"),
            (_resident_with_outputs, r"states\[1\]\.outputs: a resident state may not declare"),
            (_nan_guard_dict, r"transitions\[0\]\.when\.value: nan is not JSON"),
            (_nan_guard_json_text, r"transitions\[0\]\.when\.value: nan is not JSON"),
            (_neither_json_nor_yaml_file, r"flow\.txt: neither JSON .* nor YAML"),
            (_binary_yaml_file, r"flow\.yaml: not UTF-8 text"),
            (_yaml_in_a_json_file, r"flow\.json: not valid JSON"),
        ]
    ],
)
def test_an_invalid_spec_is_refused_at_flow_run_and_starts_nothing(tmp_path, make, match):
    spec = make(tmp_path)
    with brood.Supervisor(brood.ScriptedModel([]), limits=LIMITS) as sup:
        with pytest.raises(brood.InvalidSpec, match=match):
            sup.flow_run(spec)
        assert sup.store.runs() == []
        assert sup.statistics()["runs"] == {}


def test_a_flow_input_that_is_not_json_is_refused_or_fails_the_flow():
    spec = {
        "states": [
            {
                "id": "a",
                "entry": True,
                "prompt": "A {x}",
                "inputs": [{"name": "x", "type": "json"}],
                "outputs": ["text"],
            }
        ],
    }
    with brood.Supervisor(brood.ScriptedModel({"A": [final("x")]}), limits=LIMITS) as sup:
        try:
            flow = sup.flow_run(spec, inputs={"x": float("nan")})
        except brood.InvalidArgument as exc:  # the better fix: refused, nothing started
            assert "'x'" in str(exc)
            assert sup.store.runs() == []
        else:  # also acceptable: the flow fails, naming the input
            assert flow.wait(timeout=3) == "failed"
            assert "'x'" in flow.status()["reason"]


def test_flow_wait_in_the_repl_times_out_without_stopping_the_flow_then_sees_it_stopped():
    spec = {"states": [{"id": "slow", "entry": True, "prompt": "Slow", "outputs": ["text"]}]}
    code = (
        f"fid = flow_run({json.dumps(spec)!r})\n"
        "try:\n    flow_wait(fid, timeout=0.2)\nexcept TimeoutError as e:\n    print(e)\n"
        "print(flow_status(fid)['status'], flow_stop(fid), flow_wait(fid))\nFINAL('done')"
    )
    model = brood.ScriptedModel({"root": [f"{FENCE}repl\n{code}\n{FENCE}"], "Slow": [FOREVER]})
    with brood.Supervisor(model, limits=LIMITS) as sup:
        result = sup.run("root")
        (step,) = [e["data"] for e in sup.store.events(result.run_id, "step")]
    assert result.answer == "done"
    assert "is still running after 0.2 s; it keeps going" in step["stdout"]
    assert step["stdout"].splitlines()[-1] == "running stopped stopped"

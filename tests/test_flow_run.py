"""Flows on the supervisor, with scripted sub-agents and real worker processes."""

from __future__ import annotations

import json
import re

import pytest

import brood
from tests.util import fast

FENCE = "```"
LIMITS = fast(max_depth=2, max_concurrency=8)
# Every flow here is also rebuilt from its ledger before its supervisor closes.
pytestmark = pytest.mark.usefixtures("replay_checked")


def final(text: str) -> str:
    return f"{FENCE}repl\nFINAL({text!r})\n{FENCE}"


def answer_with(reply):
    """A scripted reply computed from the state's prompt (the run's first user message)."""

    def respond(messages):
        return final(reply(messages[1]["content"]))

    return respond


def ledger(sup: brood.Supervisor, flow_id: str) -> list[dict]:
    return [e["data"] for e in sup.store.events(flow_id, "flow")]


def kinds(events: list[dict], kind: str) -> list[dict]:
    return [e for e in events if e["kind"] == kind]


def split_then_each(prompt: str, max_items: int) -> dict:
    """`split` (prompt "Split") answers a JSON list `items`; `each` runs `prompt` once per
    item (at most `max_items`), its output `text` becoming a list."""
    return {
        "states": [
            {
                "id": "split",
                "entry": True,
                "prompt": "Split",
                "outputs": [{"name": "items", "type": "json"}],
            },
            {
                "id": "each",
                "prompt": prompt,
                "inputs": [{"name": "item", "from": "split.items", "type": "json"}],
                "foreach": {"over": "item", "max": max_items},
                "outputs": ["text"],
            },
        ],
        "transitions": [{"from": "split", "to": "each"}],
    }


def test_a_three_round_review_loop_ends_when_approved():
    # Replies run in worker processes, so they are functions of the prompt only: a draft
    # counts the rounds from the notes it gets back; the third draft is approved.
    spec = {
        "name": "review-loop",
        "states": [
            {
                "id": "draft",
                "entry": True,
                "prompt": "Draft about {topic}. {notes}",
                "inputs": ["topic", {"name": "notes", "from": "review.notes", "optional": True}],
                "outputs": ["text"],
                "max_entries": 3,
            },
            {
                "id": "review",
                "prompt": "Review: {text}",
                "inputs": [{"name": "text", "from": "draft.text"}],
                "outputs": [{"name": "verdict", "type": "json"}, "notes"],
                "max_entries": 3,
            },
        ],
        "transitions": [
            {"from": "draft", "to": "review"},
            {
                "from": "review",
                "to": "draft",
                "when": {"output": "verdict", "path": "approved", "op": "eq", "value": False},
            },
        ],
    }

    def draft(prompt: str) -> str:
        found = re.search(r"after round (\d+)", prompt)
        rounds = int(found.group(1)) if found else 0
        return f"draft {rounds + 1}"

    def review(prompt: str) -> str:
        n = int(re.search(r"draft (\d+)", prompt).group(1))
        return (
            f"{FENCE}json verdict\n{json.dumps({'approved': n == 3})}\n{FENCE}\n"
            f"{FENCE}notes\nafter round {n}\n{FENCE}"
        )

    model = brood.ScriptedModel(
        {"Draft about": [answer_with(draft)], "Review:": [answer_with(review)]}
    )
    with brood.Supervisor(model, limits=LIMITS) as sup:
        flow = sup.flow_run(spec, inputs={"topic": "owls"})
        assert flow.started == ["draft"]
        assert flow.wait(timeout=120) == "finished", flow.status()
        events = ledger(sup, flow.id)
        status = flow.status()
        outputs = flow.outputs()
    assert status["states"]["draft"]["entries"] == 3
    assert status["states"]["review"]["entries"] == 3
    assert status["usage"]["model_calls"] == 6  # three drafts, three reviews
    assert outputs["draft"]["text"] == "draft 3"
    assert outputs["review"]["verdict"] == {"approved": True}
    assert [m["milestone"] for m in kinds(events, "milestone")] == ["finished"]
    assert len(kinds(events, "transition_fired")) == 5


def test_a_guard_switch_enters_only_the_matching_branch_and_fan_out_from_one_settle():
    spec = {
        "states": [
            {
                "id": "classify",
                "entry": True,
                "prompt": "Classify",
                "outputs": [{"name": "label", "type": "json"}],
            },
            {"id": "a", "prompt": "Branch a", "outputs": ["text"]},
            {"id": "b", "prompt": "Branch b", "outputs": ["text"]},
            {"id": "c", "prompt": "Branch c", "outputs": ["text"]},
        ],
        "transitions": [
            {"from": "classify", "to": "a", "when": {"output": "label", "op": "eq", "value": "x"}},
            {"from": "classify", "to": "b", "when": {"output": "label", "op": "eq", "value": "y"}},
            {"from": "classify", "to": "c", "when": {"output": "label", "op": "exists"}},
        ],
    }
    model = brood.ScriptedModel(
        {
            "Classify": [final('"x"')],
            "Branch": [answer_with(lambda p: p.split()[1])],
        }
    )
    with brood.Supervisor(model, limits=LIMITS) as sup:
        flow = sup.flow_run(spec)
        assert flow.wait(timeout=120) == "finished"
        entries = {s: v["entries"] for s, v in flow.status()["states"].items()}
    # a and c both entered from classify's one settle; b's guard did not pass.
    assert entries == {"classify": 1, "a": 1, "b": 0, "c": 1}


def test_json_strict_guards_true_is_not_1():
    spec = {
        "states": [
            {
                "id": "s",
                "entry": True,
                "prompt": "Start",
                "outputs": [{"name": "v", "type": "json"}],
            },
            {"id": "t", "prompt": "Then", "outputs": ["text"]},
        ],
        "transitions": [
            {"from": "s", "to": "t", "when": {"output": "v", "op": "eq", "value": True}}
        ],
    }
    model = brood.ScriptedModel({"Start": [final("1")], "Then": [final("no")]})
    with brood.Supervisor(model, limits=LIMITS) as sup:
        flow = sup.flow_run(spec)
        assert flow.wait(timeout=120) == "finished"
        assert flow.status()["states"]["t"]["entries"] == 0


def test_a_max_entries_block_is_journaled_and_the_flow_still_quiesces_to_done():
    spec = {
        "states": [
            {"id": "loop", "entry": True, "prompt": "Again", "outputs": ["text"], "max_entries": 2}
        ],
        "transitions": [{"from": "loop", "to": "loop"}],
    }
    with brood.Supervisor(brood.ScriptedModel({"Again": [final("x")]}), limits=LIMITS) as sup:
        flow = sup.flow_run(spec)
        assert flow.wait(timeout=120) == "finished"
        events = ledger(sup, flow.id)
    assert len(kinds(events, "state_entry")) == 2
    (blocked,) = kinds(events, "transition_blocked")
    assert blocked["state"] == "loop" and "max_entries 2" in blocked["reason"]


def test_foreach_runs_one_child_per_item_clamped_to_max():
    spec = split_then_each("Do {item}", max_items=3)
    model = brood.ScriptedModel(
        {
            "Split": [final('["a", "b", "c", "d"]')],
            "Do": [answer_with(lambda p: p.split()[1].upper())],
        }
    )
    with brood.Supervisor(model, limits=LIMITS) as sup:
        flow = sup.flow_run(spec)
        assert flow.wait(timeout=120) == "finished"
        assert flow.outputs()["each"]["text"] == ["A", "B", "C"]


@pytest.mark.parametrize("policy", ["fail_fast", "continue"])
def test_retries_until_exhausted_then_the_failure_policy(policy):
    spec = {
        "run": {"failure_policy": policy},
        "states": [
            {"id": "bad", "entry": True, "prompt": "Fail", "outputs": ["text"], "retries": 2},
            {"id": "good", "entry": True, "prompt": "Fine", "outputs": ["text"]},
        ],
        "transitions": [],
    }
    model = brood.ScriptedModel(
        {"Fail": [f"{FENCE}repl\nimport os\nos._exit(2)\n{FENCE}"], "Fine": [final("ok")]}
    )
    with brood.Supervisor(model, limits=LIMITS) as sup:
        flow = sup.flow_run(spec)
        result = flow.wait(timeout=120)
        events = ledger(sup, flow.id)
    assert len(kinds(events, "retry")) == 2
    assert kinds(events, "state_failed")[0]["state"] == "bad"
    assert result == "failed"  # continue: the good state ran, but the flow reports the bad
    if policy == "continue":
        assert kinds(events, "settled")[-1]["outcome"] in ("completed", "failed")
        (ended,) = kinds(events, "flow_ended")
        assert ended["reason"].startswith("states failed (failure_policy continue): bad: ")


def test_stop_is_idempotent_cancels_running_children_and_admits_nothing(tmp_path):
    from tests.util import Signal

    started = Signal(tmp_path, "started")
    spec = {
        "states": [{"id": "slow", "entry": True, "prompt": "Slow", "outputs": ["text"]}],
        "transitions": [],
    }
    model = brood.ScriptedModel(
        {
            "Slow": [
                started.notify_then(f"{FENCE}repl\nimport time\nwhile True: time.sleep(1)\n{FENCE}")
            ]
        }
    )
    with brood.Supervisor(model, limits=LIMITS) as sup:
        flow = sup.flow_run(spec)
        started.wait()
        report = flow.stop()
        again = flow.stop()
        runs = sup.store.runs(flow.id)
        events = ledger(sup, flow.id)
    assert {r["state"] for r in runs} == {"cancelled"}
    assert not [m for m in kinds(events, "milestone") if m["milestone"] == "finished"]
    # As the factory reports a stop: the final state and what it cancelled.
    child_ids = {r["id"] for r in runs if r["parent_id"] == flow.id}
    assert report["state"] == "stopped" and report["cancelled"] == ["slow"]
    assert {i["run_id"] for i in report["instances"]} <= child_ids | {None}
    assert again == {"state": "stopped", "cancelled": [], "instances": []}


def test_max_transitions_pauses_once_and_resume_goes_on():
    spec = {
        "run": {"max_transitions": 2},
        "states": [
            {"id": "loop", "entry": True, "prompt": "Again", "outputs": ["text"], "max_entries": 4}
        ],
        "transitions": [{"from": "loop", "to": "loop"}],
    }
    with brood.Supervisor(brood.ScriptedModel({"Again": [final("x")]}), limits=LIMITS) as sup:
        flow = sup.flow_run(spec)
        assert flow.wait(timeout=120) == "paused"
        assert flow.status()["states"]["loop"]["entries"] == 3
        flow.resume()
        assert flow.wait(timeout=120) == "finished"
        events = ledger(sup, flow.id)
        assert flow.status()["states"]["loop"]["entries"] == 4
    ms = [m["milestone"] for m in kinds(events, "milestone")]
    assert ms.count("max_transitions_exceeded") == 1 and ms[-1] == "finished"


def test_a_stalled_machine_fails_naming_the_input_that_never_settled():
    spec = {
        "states": [
            {"id": "a", "entry": True, "prompt": "A", "outputs": ["text"]},
            {
                "id": "b",
                "entry": True,
                "prompt": "B {x}",
                "inputs": [{"name": "x", "from": "c.text"}],
                "outputs": ["text"],
            },
            {"id": "c", "prompt": "C", "outputs": ["text"]},
        ],
        "transitions": [
            {"from": "a", "to": "c", "when": {"output": "text", "op": "eq", "value": "never"}}
        ],
    }
    with brood.Supervisor(brood.ScriptedModel({"A": [final("x")]}), limits=LIMITS) as sup:
        flow = sup.flow_run(spec)
        assert flow.wait(timeout=120) == "failed"
        reason = flow.status()["reason"]
    assert "state b waits for input x (from c.text)" in reason


def test_an_invalid_spec_starts_nothing():
    with brood.Supervisor(brood.ScriptedModel([]), limits=LIMITS) as sup:
        with pytest.raises(brood.InvalidSpec, match="unknown state"):
            sup.flow_run(
                {
                    "states": [{"id": "a", "entry": True, "prompt": "x"}],
                    "transitions": [{"from": "a", "to": "nowhere"}],
                }
            )
        assert sup.store.runs() == []


def test_a_model_runs_a_flow_as_a_child_workflow_and_hears_its_milestones():
    spec = {
        "name": "pair",
        "states": [
            {"id": "one", "entry": True, "prompt": "First", "outputs": ["text"]},
            {
                "id": "two",
                "prompt": "Second {t}",
                "inputs": [{"name": "t", "from": "one.text"}],
                "outputs": ["text"],
            },
        ],
        "transitions": [{"from": "one", "to": "two"}],
    }
    root = [
        f"{FENCE}repl\nfid = flow_run({spec!r})\nprint(fid)\n{FENCE}",
        # The flow runs while the root works; its milestone arrives as a notice.
        f"{FENCE}repl\nimport time\nwhile flow_status(fid)['status'] == 'running':\n"
        f"    time.sleep(0.01)\nst = flow_status(fid)\n"
        f"print(st['status'], st['states']['two']['entries'])\n{FENCE}",
        lambda msgs: final(msgs[-1]["content"]),
    ]
    model = brood.ScriptedModel({"root": root, "First": [final("a")], "Second": [final("b")]})
    with brood.Supervisor(model, limits=fast(max_depth=3)) as sup:
        result = sup.run("root task")
        runs = sup.store.runs(result.run_id)
        (flow_id,) = sup.flows()
        events = sup.flow(flow_id).status()["events"]
    assert result.state == "completed"
    assert "finished 1" in result.answer
    assert "[notice] flow r-" in result.answer and "finished" in result.answer
    assert "collect it with rlm_result" not in result.answer  # no handle collects a flow
    finished = next(e for e in events if e.get("milestone") == "finished")
    assert finished["stage"] == "shown"  # its notice went to the root's next turn
    # The flow is a child of the root, and its states are the flow's children.
    flow_run = next(r for r in runs if r["model"] == "flow")
    assert flow_run["parent_id"] == result.run_id and flow_run["state"] == "completed"
    assert sorted(r["prompt"].split()[0] for r in runs if r["parent_id"] == flow_run["id"]) == [
        "First",
        "Second",
    ]


@pytest.mark.parametrize("refusals", [2, 5])
def test_starts_refused_for_capacity_are_retried_with_backoff(monkeypatch, refusals):
    from brood.flow import executor as flow_executor
    from brood.supervisor.core import Core

    monkeypatch.setattr(flow_executor, "START_BACKOFF_FIRST_S", 0.01)
    real = Core.start_child
    left = {"n": refusals}

    async def start_child(self, parent, prompt, **kw):
        if left["n"]:
            left["n"] -= 1
            raise brood.LimitExceeded("max_concurrency", 9, 8)
        return await real(self, parent, prompt, **kw)

    monkeypatch.setattr(Core, "start_child", start_child)
    spec = {
        "run": {"failure_policy": "fail_fast"},
        "states": [{"id": "s", "entry": True, "prompt": "Go", "outputs": ["text"]}],
        "transitions": [],
    }
    with brood.Supervisor(brood.ScriptedModel({"Go": [final("ok")]}), limits=LIMITS) as sup:
        flow = sup.flow_run(spec)
        result = flow.wait(timeout=60)
        events = ledger(sup, flow.id)
    waits = [e["wait"] for e in kinds(events, "start_retry")]
    if refusals == 2:
        assert result == "finished" and waits == [0.01, 0.02]
    else:  # 5 tries in all, then the instance fails
        assert result == "failed" and waits == [0.01, 0.02, 0.04, 0.08]
        assert "could not start after 5 tries" in kinds(events, "state_failed")[0]["reason"]


def test_status_has_the_factory_shape():
    spec = split_then_each("Item {item}", max_items=3)
    model = brood.ScriptedModel(
        {"Split": [final('["a", "b"]')], "Item": [lambda m: final(m[1]["content"].split()[1])]}
    )
    with brood.Supervisor(model, limits=LIMITS) as sup:
        flow = sup.flow_run(spec)
        assert flow.wait(timeout=60) == "finished"
        status = flow.status()
        later = flow.status()
    assert status["state"] == status["status"] == "finished"
    assert status["states"]["each"]["entries_used"] == 1
    assert status["states"]["each"]["max_entries"] == 1
    usage = status["usage"]
    assert (usage["spawns"], usage["settled"], usage["running"]) == (3, 3, 0)
    assert usage["transitions_fired"] == 1 and usage["model_calls"] == 3
    assert usage["tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert status["states"]["each"]["per_entry"] == [
        {"entry": 1, "status": "settled", "instances": 2, "counts": {"completed": 2}}
    ]
    assert status["states"]["split"]["per_entry"][0]["counts"] == {"completed": 1}
    assert status["elapsed_ms"] >= 0
    assert 0 < len(status["events"]) <= 50
    stages = {e["kind"]: e["stage"] for e in status["events"]}
    assert stages["settled"] == "arrived" and stages["spawned"] == "recorded"
    again = {e["kind"]: e["stage"] for e in later["events"]}  # the first read delivered them
    assert again["settled"] == again["spawned"] == "delivered"

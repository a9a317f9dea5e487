"""Flows survive a crash: a resume rebuilds each flow from its ledger and goes on, adopting
the children the journal holds instead of starting them again.

The crash tests run a flow in another process, SIGKILL it at a chosen point, and resume in
this one. The cut tests rebuild a finished flow from every prefix of its ledger: each prefix
is a point a crash can leave behind (the journal writes in order).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from collections import Counter

import pytest

import brood
from brood.flow.executor import DERIVED
from tests.flowcheck import rebuild
from tests.test_resume import CRASH_TIMEOUT_S, wait_gone
from tests.util import Signal, fast

FENCE = "```"
LIMITS = fast(max_depth=2, max_concurrency=8)

# plan -> work (one child per item, item 2 failing its first attempt) -> review; the third
# transition pauses the flow (max_transitions 2) until it is resumed.
SPEC = {
    "name": "crashable",
    "run": {"max_parallel": 2, "max_transitions": 2},
    "states": [
        {"id": "plan", "entry": True, "prompt": "Plan",
         "outputs": [{"name": "items", "type": "json"}]},
        {
            "id": "work",
            "prompt": "Work on {item}",
            "inputs": [{"name": "item", "from": "plan.items", "type": "json"}],
            "foreach": {"over": "item"},
            "outputs": ["result"],
            "retries": 1,
        },
        {
            "id": "review",
            "prompt": "Review {results}",
            "inputs": [{"name": "results", "from": "work.result"}],
            "outputs": ["verdict"],
        },
        {"id": "publish", "prompt": "Publish {verdict}",
         "inputs": [{"name": "verdict", "from": "review.verdict"}], "outputs": ["url"]},
    ],
    "transitions": [
        {"from": "plan", "to": "work"},
        {"from": "work", "to": "review"},
        {"from": "review", "to": "publish"},
    ],
}  # fmt: skip


def final(text: str) -> str:
    return f"{FENCE}repl\nFINAL({text!r})\n{FENCE}"


def replies(tmp_path) -> dict:
    """The sub-agents' replies; the first attempt at item 2 fails (a marker file tells the
    second attempt apart)."""
    marker = str(tmp_path / "item-2-tried")
    fail_once = (
        f"{FENCE}repl\nimport os\nif not os.path.exists({marker!r}):\n"
        f"    open({marker!r}, 'w').close()\n    os._exit(3)\nFINAL('r2')\n{FENCE}"
    )
    return {
        "Plan": [final("[1, 2, 3]")],
        "Work on 1": [final("r1")],
        "Work on 2": [fail_once],
        "Work on 3": [final("r3")],
        "Review": [final("ok")],
        "Publish": [final("https://example.org/post")],
    }


def derived(events: list[dict]) -> list[tuple]:
    return [(e["kind"], e.get("state"), e.get("target")) for e in events if e["kind"] in DERIVED]


def test_a_flow_rebuilt_from_any_prefix_of_its_ledger_decides_what_the_ledger_holds(tmp_path):
    with brood.Supervisor(brood.ScriptedModel(replies(tmp_path)), limits=LIMITS) as sup:
        flow = sup.flow_run(SPEC)
        assert flow.wait(timeout=120) == "paused"
        flow.resume()
        assert flow.wait(timeout=120) == "finished"
        sup.store.flush()
        full = [e["data"] for e in sup.store.events(flow.id, "flow")]
        kinds = Counter(e["kind"] for e in full)
        assert kinds["retry"] == 1 and kinds["resumed"] == 1 and kinds["settled"] == 7
        with pytest.raises(brood.BroodError, match="holds no spec"):
            rebuild(sup.store, flow.id, 0)
        for cut in range(1, len(full) + 1):
            rebuilt, written = rebuild(sup.store, flow.id, cut)
            # What the prefix holds, plus what the rebuild wrote, is how the flow went on.
            so_far = derived(full[:cut]) + derived(written)
            assert so_far == derived(full)[: len(so_far)], f"cut {cut}"
            assert not [e for e in written if e["kind"] not in DERIVED], f"cut {cut}"
        assert (rebuilt.outputs, rebuilt.ending) == (
            flow.outputs(),
            ("finished", "flow finished", None),
        )


# ---- crashes ---------------------------------------------------------------------------------
def crash_after(tmp_path, body: str, url: str) -> str:
    """Run `body` in another process: it prints an id, then "crash here" once the point to
    crash at is reached, where it is SIGKILLed. Returns the id. The body has `final`,
    `block` (a reply that announces itself on the in-call signal and never returns), SPEC
    and `supervisor(model)`."""
    script = textwrap.dedent(f"""
        import json, os, signal, brood
        FENCE = "```"
        SPEC = json.loads({json.dumps(json.dumps(SPEC))})
        def final(text):
            return f"{{FENCE}}repl\\nFINAL({{text!r}})\\n{{FENCE}}"
        def block(messages):  # the model call the crash interrupts
            open({str(tmp_path / "in-call")!r}, "w").write("1")
            open({str(tmp_path / "never")!r}).read()
        def supervisor(model):
            return brood.Supervisor(
                model,
                store={url!r},
                limits=brood.Limits(
                    shutdown_grace=0.3, term_grace=0.3, fs_write=[{str(tmp_path)!r}]
                ),
            )
    """)
    os.mkfifo(tmp_path / "never")
    proc = subprocess.Popen(
        [sys.executable, "-c", script + textwrap.dedent(body)], stdout=subprocess.PIPE, text=True
    )
    try:
        first = proc.stdout.readline().strip()
        assert first, "the process ended before it started anything"
        assert proc.stdout.readline().strip() == "crash here"
    finally:
        proc.kill()
        proc.wait(CRASH_TIMEOUT_S)
        proc.stdout.close()
    wait_gone(proc.pid)
    return first


def crash_when_paused(tmp_path, url: str) -> str:
    """SPEC run until it pauses at max_transitions (review done, publish held), then
    killed; returns the flow's id."""
    body = f"""
        sup = supervisor(brood.ScriptedModel({replies(tmp_path)!r}))
        flow = sup.flow_run(SPEC)
        print(flow.id, flush=True)
        assert flow.wait() == "paused"
        print("crash here", flush=True)
        signal.pause()
    """
    return crash_after(tmp_path, body, url)


def model_calls(sup: brood.Supervisor, root_id: str) -> Counter:
    """Journaled turns by run id."""
    return Counter(
        e["run_id"]
        for e in sup.store.events(root_id=root_id, kind="model_call")
        if e["data"]["response"] is not None
    )


@pytest.mark.parametrize("journal", ["sqlite", "postgres"])
def test_a_flow_killed_mid_foreach_resumes_and_adopts_its_children(tmp_path, request, journal):
    if journal == "postgres":  # the same, on a real PostgreSQL server
        url = request.getfixturevalue("fresh_pg_url")
    else:
        url = f"sqlite:///{tmp_path}/j.db"
    in_call = Signal(tmp_path, "in-call")
    body = f"""
        sup = supervisor(brood.ScriptedModel({{**{replies(tmp_path)!r}, "Work on 3": [block]}}))
        print(sup.flow_run(SPEC).id, flush=True)
        open({in_call.path!r}).read()
        print("crash here", flush=True)
        signal.pause()
    """
    flow_id = crash_after(tmp_path, body, url)
    with brood.Supervisor(brood.ScriptedModel(replies(tmp_path)), store=url, limits=LIMITS) as sup:
        root = sup.resume(flow_id)
        flow = sup.flow(flow_id)
        assert flow.wait(timeout=120) == "paused"  # at max_transitions, as it would have
        flow.resume()
        assert flow.wait(timeout=120) == "finished"
        outputs = json.loads(root.wait(timeout=120))  # a flow's answer: its outputs
        assert outputs["publish"] == {"url": "https://example.org/post"}
        sup.store.flush()
        ledger = [e["data"] for e in sup.store.events(flow_id, "flow")]
        runs = sup.store.runs(flow_id)
        calls = model_calls(sup, flow_id)
    children = [r for r in runs if r["parent_id"] == flow_id]
    keys = Counter(r["key"] for r in children)
    # Item 2's first attempt fails, unless the crash caught it mid-step: then the resumed
    # run finishes that step (the marker exists by then) and no retry is needed.
    retried = "work#1[1]~1" in keys
    assert set(keys) - {"work#1[1]~1"} == {
        "plan#1", "work#1[0]", "work#1[1]", "work#1[2]", "review#1", "publish#1"
    }  # fmt: skip
    assert set(keys.values()) == {1}
    spawned = Counter(e["run_id"] for e in ledger if e["kind"] == "spawned")
    assert set(spawned.values()) == {1} and len(spawned) == len(children)
    assert Counter(e["kind"] for e in ledger)["state_entry"] == 4
    # One journaled turn per child: nothing recorded was asked again.
    assert set(calls.values()) == {1} and len(calls) == len(children)
    assert Counter(r["state"] for r in children) == {"completed": 6} | (
        {"failed": 1} if retried else {}
    )


def test_a_paused_flow_is_still_paused_after_a_crash_and_resumes_on_request(tmp_path):
    url = f"sqlite:///{tmp_path}/j.db"
    flow_id = crash_when_paused(tmp_path, url)
    with brood.Supervisor(brood.ScriptedModel(replies(tmp_path)), store=url, limits=LIMITS) as sup:
        sup.resume(flow_id)
        flow = sup.flow(flow_id)
        status = flow.status()
        assert status["status"] == "paused"
        assert "max_transitions 2 reached" in status["reason"]
        flow.resume()
        assert flow.wait(timeout=120) == "finished"
        sup.store.flush()
        calls = model_calls(sup, flow_id)
    # plan, work x3 (+1 retry), review before the crash; publish after; none twice.
    assert set(calls.values()) == {1} and len(calls) == 7


def test_a_flow_started_by_a_run_is_adopted_by_the_runs_code_after_a_crash(tmp_path):
    url = f"sqlite:///{tmp_path}/j.db"
    in_call = Signal(tmp_path, "in-call")
    spec = json.dumps(SPEC | {"run": {"max_parallel": 2}})  # no pause
    code = f"fid = flow_run({spec!r})\nFINAL(flow_wait(fid) + ' ' + fid)"
    model = replies(tmp_path) | {"root task": [f"{FENCE}repl\n{code}\n{FENCE}"]}
    body = f"""
        sup = supervisor(brood.ScriptedModel({{**{model!r}, "Work on 3": [block]}}))
        print(sup.spawn("root task").id, flush=True)
        open({in_call.path!r}).read()
        print("crash here", flush=True)
        signal.pause()
    """
    root_id = crash_after(tmp_path, body, url)
    with brood.Supervisor(brood.ScriptedModel(model), store=url, limits=LIMITS) as sup:
        root = sup.resume(root_id)
        status, flow_id = root.wait(timeout=120).split()
        sup.store.flush()
        runs = sup.store.runs(root_id)
        calls = model_calls(sup, root_id)
    assert status == "finished"
    flows = [r for r in runs if r["model"] == "flow"]
    assert [(f["id"], f["key"], f["state"]) for f in flows] == [(flow_id, "flow:0", "completed")]
    instances = [r for r in runs if r["parent_id"] == flow_id]
    # Six, or seven with item 2's retry (see the test above); no key twice.
    assert len({r["key"] for r in instances}) == len(instances) in (6, 7)
    # The root's turn came from the journal; each instance was asked once.
    assert set(calls.values()) == {1} and len(calls) == len(instances) + 1


def test_a_stop_under_way_at_the_crash_is_completed_by_the_resume(tmp_path):
    # The instance's grandchild announces SIGTERM and outlives it; the crashed supervisor
    # waits a long term_grace for it, so the kill lands while the stop escalates.
    url = f"sqlite:///{tmp_path}/j.db"
    ready, got_term = Signal(tmp_path, "ready"), Signal(tmp_path, "got-term")
    grandchild = (
        "import signal, time; "
        f"signal.signal(signal.SIGTERM, lambda *a: open({got_term.path!r}, 'w').write('1')); "
        f"open({ready.path!r}, 'w').write('1'); time.sleep(10**6)"
    )
    stubborn = (
        f"{FENCE}repl\nimport subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', {grandchild!r}])\n"
        f"while True: time.sleep(1)\n{FENCE}"
    )
    spec = {"states": [{"id": "slow", "entry": True, "prompt": "Slow", "outputs": ["text"]}]}
    body = f"""
        import threading
        sup = brood.Supervisor(
            brood.ScriptedModel({{"Slow": [{stubborn!r}]}}), store={url!r},
            limits=brood.Limits(shutdown_grace=0.3, term_grace=600, fs_write=[{str(tmp_path)!r}]),
        )
        flow = sup.flow_run({spec!r})
        print(flow.id, flush=True)
        open({ready.path!r}).read()
        threading.Thread(target=flow.stop, daemon=True).start()
        open({got_term.path!r}).read()
        print("crash here", flush=True)
        signal.pause()
    """
    flow_id = crash_after(tmp_path, body, url)
    with brood.Supervisor(brood.ScriptedModel({}), store=url, limits=LIMITS) as sup:
        root = sup.resume(flow_id)
        flow = sup.flow(flow_id)
        assert flow.wait(timeout=120) == "stopped"
        assert root.status() == "cancelled"
        sup.store.flush()
        ledger = Counter(e["data"]["kind"] for e in sup.store.events(flow_id, "flow"))
        milestones = [e["data"]["milestone"] for e in sup.store.events(flow_id, "flow")
                      if e["data"]["kind"] == "milestone"]  # fmt: skip
        states = {r["state"] for r in sup.store.runs(flow_id)}
    assert ledger["stopping"] == 1 and ledger["flow_ended"] == 1
    assert "finished" not in milestones
    assert states == {"cancelled"}


def test_a_flow_whose_ledger_lost_its_spec_fails_its_resume_with_the_reason(tmp_path):
    import sqlite3

    url = f"sqlite:///{tmp_path}/j.db"
    flow_id = crash_when_paused(tmp_path, url)
    with sqlite3.connect(tmp_path / "j.db") as db:
        db.execute("DELETE FROM events WHERE kind = 'flow' AND data LIKE '{\"kind\": \"spec\"%'")
    with brood.Supervisor(brood.ScriptedModel({}), store=url, limits=LIMITS) as sup:
        root = sup.resume(flow_id)
        with pytest.raises(brood.ReplayDiverged, match="its ledger holds no spec"):
            root.wait(timeout=120)
        with pytest.raises(brood.InvalidArgument, match="not a flow this supervisor runs"):
            sup.flow(flow_id)
        states = {r["parent_id"] is None: r["state"] for r in sup.store.runs(flow_id)}
    assert states[True] == "failed"


def test_brood_resume_finishes_a_killed_flow_run_against_a_model_server(tmp_path):
    from tests.fake_openai import FakeOpenAI
    from tests.test_cli_resume import BROOD, TIMEOUT_S, env_without_model

    store = f"sqlite:///{tmp_path}/j.db"
    spec_path = tmp_path / "flow.json"
    spec_path.write_text(json.dumps({k: v for k, v in SPEC.items() if k != "run"}))
    held, release = threading.Event(), threading.Event()

    def script(body):
        task = next(m["content"] for m in body["messages"] if m["role"] == "user")
        task = task.split("\n", 1)[0]
        if task == "Work on 3" and not release.is_set():  # held until its process is killed
            held.set()
            release.wait(TIMEOUT_S)
        answers = {"Plan": "[1, 2, 3]", "Review": "ok", "Publish": "https://example.org/post"}
        return final(answers.get(task.split(" ", 1)[0], task.replace("Work on ", "r")))

    def brood_cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*BROOD, *args, "--store", store],
            capture_output=True,
            text=True,
            env=env_without_model(),
            timeout=TIMEOUT_S,
        )

    with FakeOpenAI(script) as server:
        model = f"openai:m@{server.base_url}"
        first = subprocess.Popen(
            [*BROOD, "flow", "run", str(spec_path), "--model", model, "--store", store],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env_without_model(),
        )
        try:
            assert held.wait(TIMEOUT_S)
        finally:
            first.kill()
            first.wait(TIMEOUT_S)
        wait_gone(first.pid)
        release.set()
        flow_id = json.loads(brood_cli("ps", "--json").stdout)[0]["run_id"]
        seen = len(server.requests)
        out = brood_cli("resume", flow_id, "--model", model, "--no-live")
        asked = [r.body["messages"][1]["content"] for r in server.requests[seen:]]
        status = json.loads(brood_cli("flow", "status", flow_id, "--json").stdout)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["work"] == {"result": ["r1", "r2", "r3"]}
    assert status["status"] == "finished"
    # Item 3 (held at the kill) is asked again, and any item whose reply was not journaled
    # yet; the plan is not; review and publish once each.
    asked_by = Counter(a.split("\n", 1)[0].split(" ")[0] for a in asked)
    assert (asked_by["Plan"], asked_by["Review"], asked_by["Publish"]) == (0, 1, 1)
    assert any(a.startswith("Work on 3") for a in asked)


def test_brood_resume_of_a_paused_flow_says_so_and_brood_flow_resume_reaches_it(tmp_path):
    from tests.fake_openai import FakeOpenAI
    from tests.test_cli_resume import BROOD, TIMEOUT_S, env_without_model

    url = f"sqlite:///{tmp_path}/j.db"
    flow_id = crash_when_paused(tmp_path, url)
    with FakeOpenAI(lambda body: final("https://example.org/post")) as server:
        resumed = subprocess.Popen(
            [*BROOD, "resume", flow_id, "--model", f"openai:m@{server.base_url}", "--store", url],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env_without_model(),
            text=True,
        )
        try:
            line = resumed.stderr.readline()
            assert line.strip() == (
                f"flow {flow_id} resumed, paused; `brood flow resume {flow_id}` lets it go on"
            )
            go_on = subprocess.run(
                [*BROOD, "flow", "resume", flow_id, "--store", url],
                capture_output=True,
                text=True,
                env=env_without_model(),
                timeout=TIMEOUT_S,
            )
            out, err = resumed.communicate(timeout=TIMEOUT_S)
        finally:
            resumed.kill()
            resumed.wait(TIMEOUT_S)
        asked = [r.body["messages"][1]["content"] for r in server.requests]
    assert go_on.returncode == 0, go_on.stderr
    assert resumed.returncode == 0, err
    assert json.loads(out)["publish"] == {"url": "https://example.org/post"}
    assert [a.split(" ", 1)[0] for a in asked] == ["Publish"]  # nothing before it again

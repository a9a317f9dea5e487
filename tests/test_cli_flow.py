"""`brood flow validate|run|status|stop|resume`, as real processes."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys

from tests.fake_openai import FakeOpenAI

BROOD = [sys.executable, "-m", "brood.cli.main"]
TIMEOUT_S = 90
FINAL_X = "```repl\nFINAL('x')\n```"


def env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if k != "BROOD_MODEL"}
    e["COLUMNS"] = "200"
    return e


def brood(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*BROOD, *args], capture_output=True, text=True, env=env(), timeout=TIMEOUT_S
    )


LOOP = """
name: loop
run: {max_transitions: 2}
states:
  - id: work
    entry: true
    prompt: "Work on {topic}"
    inputs: [topic]
    outputs: [text]
    max_entries: 4
transitions:
  - {from: work, to: work}
"""


def test_validate_reports_every_problem_with_its_path(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text(LOOP)
    out = brood("flow", "validate", str(good))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("valid: 1 states (work), 1 transitions, entry work")
    bad = tmp_path / "bad.yaml"
    bad.write_text(LOOP.replace("to: work", "to: wrok").replace("max_entries: 4", "max_entries: 0"))
    out = brood("flow", "validate", str(bad), "--json")
    assert out.returncode == 2
    problems = json.loads(out.stdout)["problems"]
    assert len(problems) == 2
    assert any(p.startswith("transitions[0].to") and "wrok" in p for p in problems)
    assert any(p.startswith("states[0].max_entries") for p in problems)
    (tmp_path / "x.json").write_text("{not json")
    out = brood("flow", "validate", str(tmp_path / "x.json"))
    assert out.returncode == 2 and "x.json" in out.stderr


def test_run_pauses_at_max_transitions_and_resume_from_another_process_finishes(tmp_path):
    spec = tmp_path / "loop.yaml"
    spec.write_text(LOOP)
    store = f"sqlite:///{tmp_path}/j.db"
    with FakeOpenAI(lambda body: FINAL_X) as server:
        proc = subprocess.Popen(
            [
                *BROOD,
                "flow",
                "run",
                str(spec),
                "--input",
                "topic=owls",
                "--model",
                f"openai:m@{server.base_url}",
                "--store",
                store,
                "--no-live",
                "--json",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env(),
        )
        try:
            assert proc.stderr is not None
            line = ""
            while "paused:" not in line:  # the run process says when the flow pauses
                assert select.select([proc.stderr], [], [], TIMEOUT_S)[0], "no pause"
                line = proc.stderr.readline()
                assert line, "the flow ended without pausing"
            flow_id = line.split("brood flow resume ")[1].split("`")[0]
            status = json.loads(brood("flow", "status", flow_id, "--store", store, "--json").stdout)
            assert status["status"] == "paused"
            assert status["states"]["work"]["entries"] == 3
            resumed = brood("flow", "resume", flow_id, "--store", store)
            assert resumed.returncode == 0, resumed.stderr
            out, err = proc.communicate(timeout=TIMEOUT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert proc.returncode == 0, err
    report = json.loads(out)
    assert report["status"] == "finished"
    assert report["states"]["work"]["entries"] == 4
    # After the run, status is read from the ledger.
    status = json.loads(brood("flow", "status", flow_id, "--store", store, "--json").stdout)
    assert status["status"] == "finished"
    assert status["milestones"] == ["max_transitions_exceeded", "paused", "finished"]


def test_status_of_a_flow_whose_run_was_ended_from_outside_says_stopped(tmp_path):
    from brood import Limits, ScriptedModel, Supervisor

    store = f"sqlite:///{tmp_path}/j.db"
    spec = tmp_path / "loop.yaml"
    spec.write_text(LOOP)
    model = ScriptedModel({"Work on": [FINAL_X]})
    with Supervisor(model, store=store, limits=Limits(shutdown_grace=0.3)) as sup:
        flow = sup.flow_run(str(spec), inputs={"topic": "owls"})
        assert flow.wait(timeout=TIMEOUT_S) == "paused"
    # Closing the supervisor cancelled the flow's run: the flow never ended on its own.
    out = brood("flow", "status", flow.id, "--store", store, "--json")
    assert out.returncode == 0, out.stderr
    status = json.loads(out.stdout)
    assert (status["status"], status["reason"]) == ("stopped", "supervisor closed")
    assert "run_ended" in [e["kind"] for e in status["events"]]

"""Every journey of the command line that the README and the tutorial (docs/tutorial/) show,
tried as a newcomer tries it: with `--model echo`, no model server, real `brood` processes
and a journal of the test's own.

run (with a context file, and without), ps, tree, show, logs, export; flow validate, run
and status; an ask answered from another terminal, across a crash and `brood resume`;
send and cancel; `brood serve` with the OpenAI client."""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
import psutil

from brood.models.echo import CHUNK_TASK, plain_reply
from tests.test_resume import wait_gone
from tests.util import read_until, stop, until

BROOD = [sys.executable, "-m", "brood.cli.main"]
TIMEOUT_S = 120


def env() -> dict[str, str]:
    """The test's environment (its owner registry included, set per test), without the
    user's model or token."""
    found = {k: v for k, v in os.environ.items() if k not in ("BROOD_MODEL", "BROOD_TOKEN")}
    found["COLUMNS"] = "200"  # rich wraps at COLUMNS
    return found


# The README's and the tutorial's first example, as it is printed there.
NOTES = "the owl hunts at dusk\ntwo owls nest in the old oak\nno owls seen today\n"
TASK = "Count the words in the notes"


def brood(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*BROOD, *args], capture_output=True, text=True, timeout=TIMEOUT_S, env=env(), cwd=cwd
    )


def started(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*BROOD, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env()
    )


until = functools.partial(until, every=0.05)


def open_asks(store: str) -> list[dict[str, Any]]:
    out = brood("asks", "--json", "--store", store)
    if out.returncode == 2 and "no journal at" in out.stderr:
        return []  # the run's process has not made its journal yet
    assert out.returncode == 0, out.stderr
    return list(json.loads(out.stdout))


def test_run_with_a_context_file_then_every_read_command(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text(NOTES)
    store = f"sqlite:///{tmp_path}/brood.db"
    out = brood("run", TASK, "--context", str(notes), "--model", "echo", "--store", store)
    assert out.returncode == 0, out.stderr
    lines = NOTES.splitlines()
    words = [len(line.split()) for line in lines]
    assert out.stdout.strip() == (
        f"a str of {len(NOTES)} characters in 3 lines, in 3 chunks: 3 lines, {sum(words)} "
        f"words, {len(NOTES) - 3} characters (the word count agrees with my own count of the "
        f"whole). Per chunk: 1: 1 line, {words[0]} words, {len(lines[0])} chars; 2: 1 line, "
        f"{words[1]} words, {len(lines[1])} chars; 3: 1 line, {words[2]} words, "
        f"{len(lines[2])} chars"
    )

    (root,) = json.loads(brood("ps", "--json", "--store", store).stdout)
    run_id = root["run_id"]
    assert (root["state"], root["prompt"]) == ("completed", TASK)

    tree = brood("tree", run_id, "--store", store).stdout
    assert tree.count("completed") == 4, tree  # the root and one child per line
    for i in (1, 2, 3):
        assert f"{CHUNK_TASK} {i} of 3" in tree
    nested = json.loads(brood("tree", run_id, "--json", "--store", store).stdout)
    assert len(nested["children"]) == 3
    assert nested["subtree_usage"]["model_calls"] == 3 + 3  # three turns, one per child

    show = brood("show", run_id, "--store", store).stdout
    assert f"prompt: {TASK}" in show and '"total": {"lines": 3' in show  # products
    assert "context: a str of" in show and "rlm_spawn(" in show  # its steps, code and output

    logs = brood("logs", run_id, "--store", store)
    assert logs.returncode == 0, logs.stderr
    assert "rlm_wait_all(handles)" in logs.stdout and "started 3 child runs" in logs.stdout
    assert logs.stdout.splitlines()[-1].startswith("ended: completed")

    export = brood("export", run_id, "--format", "jsonl", "--store", store)
    records = [json.loads(line) for line in export.stdout.splitlines()]
    assert len(records) == 6  # one per model call of the tree


def test_run_a_prompt_of_ones_own_with_no_context(tmp_path):
    store = f"sqlite:///{tmp_path}/brood.db"
    prompt = "Plan a birdwatching weekend"
    out = brood("run", prompt, "--model", "echo", "--store", store, "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["state"] == "completed"
    assert json.loads(result["answer"]) == {
        "task": prompt,
        "chars": len(prompt),
        "words": 4,
        "lines": 1,
        "longest_word": "birdwatching",
        "llm_query": plain_reply(prompt),
    }
    assert result["usage"]["model_calls"] == 3  # two turns and the step's llm_query


FLOW = """\
name: write-review
run: {max_parallel: 4, budget: 600, failure_policy: fail_fast, max_transitions: 50}
states:
  - id: draft
    entry: true
    prompt: "Write a paragraph about {topic}."
    inputs: [topic, {name: notes, from: review.notes, optional: true}]
    outputs: [text]
    max_entries: 3
  - id: review
    prompt: "Review this draft:\\n{text}"
    inputs: [{name: text, from: draft.text}]
    outputs: [{name: verdict, type: json}, notes]
    max_entries: 3
transitions:
  - {from: draft, to: review}
  - {from: review, to: draft, when: {output: verdict, path: approved, op: eq, value: false}}
"""


def test_the_readme_flow_validates_runs_and_reports_its_status(tmp_path):
    spec = tmp_path / "review.yaml"
    spec.write_text(FLOW)
    store = f"sqlite:///{tmp_path}/brood.db"
    valid = brood("flow", "validate", str(spec))
    assert valid.returncode == 0, valid.stderr
    assert valid.stdout.strip() == "valid: 2 states (draft, review), 2 transitions, entry draft"

    out = brood(
        "flow", "run", str(spec), "--input", "topic=owls", "--model", "echo", "--store", store
    )
    assert out.returncode == 0, out.stderr
    head, _, body = out.stdout.partition("\n")
    flow_id = re.fullmatch(r"flow (r-\w+) finished", head)[1]  # type: ignore[index]
    outputs = json.loads(body)
    draft = json.loads(outputs["draft"]["text"])  # a text output: the whole answer
    assert draft["task"] == "Write a paragraph about owls."
    verdict = outputs["review"]["verdict"]  # a json output: the answer's object
    assert verdict["task"] == "Review this draft:" and verdict["words"] > 3

    status = json.loads(brood("flow", "status", flow_id, "--json", "--store", store).stdout)
    assert status["status"] == "finished"  # read from the ledger: the flow has ended
    assert status["transitions_fired"] == 1  # the verdict holds no `approved`: no redraft


def test_an_ask_is_answered_from_another_terminal_across_a_crash_and_a_resume(tmp_path):
    store = f"sqlite:///{tmp_path}/brood.db"
    first = started("run", "Ask: deploy to prod?", "--model", "echo", "--store", store)
    try:
        (ask,) = until(lambda: open_asks(store))
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate(timeout=TIMEOUT_S)
    wait_gone(first.pid)
    assert ask["question"] == "deploy to prod?" and ask["default"] == "no"
    (root,) = json.loads(brood("ps", "--json", "--store", store).stdout)
    assert root["stale"] is True and root["state"] == "running"

    resumed = started("resume", root["run_id"], "--store", store)  # the journaled `echo`
    try:
        # The same ask, open again, answerable once the new process has taken the tree.
        answered = until(
            lambda: (
                brood("answer", ask["id"], "yes", "--as", "alice", "--store", store).returncode == 0
            )
        )
        assert answered
        stdout, stderr = resumed.communicate(timeout=TIMEOUT_S)
    finally:
        if resumed.poll() is None:
            resumed.kill()
            resumed.communicate()
    assert resumed.returncode == 0, stderr
    assert stdout.strip() == "alice answered 'deploy to prod?': yes"
    logs = brood("logs", root["run_id"], "--store", store).stdout
    assert "resume" in logs and "alice" in logs


def test_send_and_cancel_reach_a_tree_another_terminal_runs(tmp_path):
    store = f"sqlite:///{tmp_path}/brood.db"
    running = started("run", "Ask: may I go on?", "--model", "echo", "--store", store)
    try:
        (ask,) = until(lambda: open_asks(store))
        run_id = ask["run_id"]
        sent = brood("send", run_id, "hurry up", "--store", store)
        assert (sent.returncode, sent.stdout.strip()) == (0, f"sent to {run_id}")
        cancelled = brood("cancel", run_id, "--store", store)
        assert (cancelled.returncode, cancelled.stdout.strip()) == (0, f"{run_id} cancelled")
        _, stderr = running.communicate(timeout=TIMEOUT_S)
    finally:
        if running.poll() is None:
            running.kill()
            running.communicate()
    assert running.returncode == 1
    assert f"run {run_id} cancelled" in stderr
    logs = brood("logs", run_id, "--store", store).stdout
    assert "hurry up" in logs


# ---- brood serve --------------------------------------------------------------------------
TOKEN = "journey-token"
STARTED = re.compile(r"the dashboard at (http://127\.0\.0\.1:\d+)/")


@contextmanager
def brood_serve(store: str) -> Iterator[str]:
    """`brood serve --model echo` on a free port with a token: its base URL. Stopped
    (SIGTERM) and reaped at the end, and nothing it started is left."""
    proc = subprocess.Popen(
        [*BROOD, "serve", "--port", "0", "--model", "echo", "--token", TOKEN, "--store", store],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env(),
    )
    children: list[psutil.Process] = []
    try:
        yield read_until(proc, STARTED, TIMEOUT_S)[1]
        children = psutil.Process(proc.pid).children(recursive=True)
    finally:
        status = stop(proc, TIMEOUT_S)
    # uvicorn shuts down, then raises the signal it caught again: SIGTERM is how it ends.
    assert status in (0, -signal.SIGTERM), status
    assert not [c for c in children if c.is_running()], "brood serve left processes"


def get(base: str, path: str) -> Any:
    request = urllib.request.Request(base + path, headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
        return json.loads(response.read())


def test_brood_serve_answers_the_openai_client_with_an_echo_tree(tmp_path):
    store = f"sqlite:///{tmp_path}/brood.db"
    with brood_serve(store) as base:
        assert [m["id"] for m in get(base, "/v1/models")["data"]] == ["echo"]
        client = openai.OpenAI(base_url=base + "/v1", api_key=TOKEN, max_retries=0)
        raw = client.chat.completions.with_raw_response.create(
            model="echo",
            messages=[
                {"role": "system", "content": "You count words."},
                {"role": "user", "content": "two owls nest in the oak"},
                {"role": "user", "content": "Count the words of this conversation"},
            ],
        )
        completion = raw.parse()
        run_id = raw.headers["X-Brood-Run-Id"]
        tree = get(base, f"/v1/runs/{run_id}/tree")
    answer = completion.choices[0].message.content
    # The other messages are the root's context: a list of two, one child each.
    assert answer.startswith("a list of 2 items, in 2 chunks: 2 lines"), answer
    assert len(tree["children"]) == 2
    assert completion.usage.total_tokens == sum(
        tree["subtree_usage"][k] for k in ("input_tokens", "output_tokens")
    )
    assert completion.usage.total_tokens > 0

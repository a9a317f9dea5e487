"""`brood resume` picks up a tree whose process was killed, against a real model server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

from tests.fake_openai import FakeOpenAI
from tests.test_resume import wait_gone

BROOD = [sys.executable, "-m", "brood.cli.main"]
TIMEOUT_S = 60


def env_without_model() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "BROOD_MODEL"}
    env["COLUMNS"] = "200"
    return env


def test_brood_resume_finishes_a_killed_tree_without_repeating_recorded_calls(tmp_path):
    store = f"sqlite:///{tmp_path}/j.db"
    child_waiting, release = threading.Event(), threading.Event()

    def script(body):
        task = next(m["content"] for m in body["messages"] if m["role"] == "user")
        turns = sum(1 for m in body["messages"] if m["role"] == "assistant")
        if task.startswith("root"):
            return [
                "```repl\nr = rlm_query('child: the part')\nprint(r)\n```",
                "```repl\nFINAL('root got ' + r)\n```",
            ][turns]
        if not release.is_set():  # the first process's child: held until it is killed
            child_waiting.set()
            release.wait(TIMEOUT_S)
        return "```repl\nFINAL('the part done')\n```"

    with FakeOpenAI(script) as server:
        model = f"openai:m@{server.base_url}"
        first = subprocess.Popen(
            [*BROOD, "run", "root task", "--model", model, "--store", store, "--no-live"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env_without_model(),
            text=True,
        )
        try:
            assert child_waiting.wait(TIMEOUT_S)
        finally:
            first.send_signal(signal.SIGKILL)
            first.communicate(timeout=TIMEOUT_S)
        wait_gone(first.pid)
        release.set()
        seen_before = len(server.requests)
        ps = subprocess.run(
            [*BROOD, "ps", "--json", "--store", store],
            capture_output=True,
            text=True,
            env=env_without_model(),
            timeout=TIMEOUT_S,
        )
        root = __import__("json").loads(ps.stdout)[0]
        assert root["stale"] is True and root["state"] == "running"
        out = subprocess.run(
            [*BROOD, "resume", root["run_id"], "--model", model, "--store", store],
            capture_output=True,
            text=True,
            env=env_without_model(),
            timeout=TIMEOUT_S,
        )
        after = server.requests[seen_before:]
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "root got the part done"
    # Only the child's turn (in flight at the kill) and the root's last turn are new.
    assert len(after) == 2


def test_brood_resume_refuses_what_cannot_be_resumed(tmp_path):
    store = f"sqlite:///{tmp_path}/j.db"
    with FakeOpenAI({"task": ["```repl\nFINAL('x')\n```"]}) as server:
        model = f"openai:m@{server.base_url}"
        done = subprocess.run(
            [*BROOD, "run", "task", "--json", "--model", model, "--store", store],
            capture_output=True,
            text=True,
            env=env_without_model(),
            timeout=TIMEOUT_S,
        )
        run_id = __import__("json").loads(done.stdout)["run_id"]
        before = (tmp_path / "j.db").read_bytes()
        for args, expected in [
            ((run_id,), f"run {run_id} is completed; a tree that has ended"),
            (("r-unknown",), "no run 'r-unknown'"),
        ]:
            out = subprocess.run(
                [*BROOD, "resume", *args, "--model", model, "--store", store],
                capture_output=True,
                text=True,
                env=env_without_model(),
                timeout=TIMEOUT_S,
            )
            assert out.returncode == 2
            assert expected in out.stderr
    # Refusals leave the runs as they were (a resume attempt journals only its supervisor).
    assert len(before) > 0

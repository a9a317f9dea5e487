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
            # no --model: the spec the tree was started with, as journaled
            [*BROOD, "resume", root["run_id"], "--store", store],
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


def test_brood_resume_asks_again_for_a_spec_whose_secret_the_journal_never_held(tmp_path):
    from typer.testing import CliRunner

    import brood
    from brood.cli.main import app
    from tests.util import FAST

    store = f"sqlite:///{tmp_path}/j.db"
    asked, release = threading.Event(), threading.Event()

    def held(body):
        asked.set()
        release.wait(TIMEOUT_S)
        return "```repl\nFINAL('done')\n```"

    with FakeOpenAI(held) as server:
        url = server.base_url.replace("http://", "http://alice:hunter2@")
        with brood.Supervisor(f"openai:m@{url}", store=store, limits=FAST) as sup:
            handle = sup.spawn("a task")
            try:
                assert asked.wait(TIMEOUT_S)
                sup.store.flush()
                out = CliRunner().invoke(
                    app, ["resume", handle.id, "--store", store], env={"BROOD_MODEL": None}
                )
            finally:
                release.set()
            assert handle.wait(timeout=TIMEOUT_S) == "done"
    said = " ".join(out.output.split())
    assert out.exit_code == 2, said
    assert "its spec carried a user or password in its URL" in said
    assert f"it must be given again: brood resume {handle.id} --model SPEC" in said
    assert "hunter2" not in said
    for path in tmp_path.glob("j.db*"):
        assert b"hunter2" not in path.read_bytes(), path


def test_brood_resume_of_a_tree_started_with_a_chat_fn_says_to_pass_a_model(tmp_path):
    from typer.testing import CliRunner

    import brood
    from brood.cli.main import app
    from tests.util import FAST

    store = f"sqlite:///{tmp_path}/j.db"
    asked, release = threading.Event(), threading.Event()

    def chat(messages):
        asked.set()
        release.wait(TIMEOUT_S)
        return "```repl\nFINAL('done')\n```"

    with brood.Supervisor(chat, store=store, limits=FAST) as sup:
        handle = sup.spawn("a task")
        try:
            assert asked.wait(TIMEOUT_S)
            sup.store.flush()
            out = CliRunner().invoke(
                app, ["resume", handle.id, "--store", store], env={"BROOD_MODEL": None}
            )
        finally:
            release.set()
        assert handle.wait(timeout=TIMEOUT_S) == "done"
    said = " ".join(out.output.split())
    assert out.exit_code == 2, said
    assert "it was a chat_fn callable (chat), which has no spec the journal could hold" in said
    assert f"pass one: brood resume {handle.id} --model SPEC (or set BROOD_MODEL)" in said


def test_the_journaled_model_spec_keeps_no_secret():
    from brood.models.base import spec_record

    url = "http://127.0.0.1:8000/v1"
    assert spec_record(f"openai:m@{url}") == {"spec": f"openai:m@{url}"}
    assert spec_record(f"openai:m@{url}?timeout=5&tries=2")["spec"] == (
        f"openai:m@{url}?timeout=5&tries=2"
    )
    assert spec_record("local:smollm2") == {"spec": "local:smollm2"}
    for secret in (
        "openai:m@http://alice:hunter2@host/v1",
        "openai:m@http://hunter2@host/v1",
        "openai:m@http://host/v1?api_key=hunter2",
        "openai:m@http://host/v1?timeout=5&key=hunter2",
        "openai:m@http://host/v1?token=hunter2",
        "openai:m@http://[hunter2/v1",
    ):
        record = spec_record(secret)
        assert record["spec"] is None and record["secret"] is True, secret
        assert "hunter2" not in str(record), record
    record = spec_record(lambda messages: "")
    assert record["spec"] is None and record["secret"] is False

"""The `brood` command, run as a real process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.fake_openai import FakeOpenAI

BROOD = [sys.executable, "-m", "brood.cli.main"]


def brood(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if k != "BROOD_MODEL"}
    full_env.update(COLUMNS="200", **(env or {}))  # rich wraps at COLUMNS
    return subprocess.run(
        [*BROOD, *args], capture_output=True, text=True, timeout=120, env=full_env
    )


def test_demo_fans_out_collects_cancels_and_prints_the_tree(tmp_path):
    out = brood("demo", "--store", f"sqlite:///{tmp_path}/j.db")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "15 sightings at 4 sites; busiest: Oak wood (6)" in text
    assert text.count("completed") == 5  # the root and four site counters
    assert "cancelled" in text and "cancelled by parent" in text
    assert "Watch the notes for late reports" in text


def test_run_prints_the_answer_from_an_openai_compatible_server(tmp_path):
    context = tmp_path / "notes.txt"
    context.write_text("alpha beta gamma")
    script = {"count the words": ["```repl\nFINAL(str(len(context.split())))\n```"]}
    with FakeOpenAI(script) as server:
        out = brood(
            "run",
            "count the words",
            "--context",
            str(context),
            "--model",
            f"openai:tiny@{server.base_url}",
            "--store",
            f"sqlite:///{tmp_path}/j.db",
        )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "3"


def test_run_json_prints_the_run_result(tmp_path):
    script = {"say ok": ["```repl\nFINAL('ok')\n```"]}
    with FakeOpenAI(script) as server:
        out = brood(
            "run",
            "say ok",
            "--json",
            "--store",
            f"sqlite:///{tmp_path}/j.db",
            env={"BROOD_MODEL": f"openai:tiny@{server.base_url}"},
        )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["state"] == "completed" and result["answer"] == "ok"
    assert set(result) == {"run_id", "state", "answer", "error", "usage"}
    assert result["usage"]["model_calls"] == 1


def test_bad_input_gets_a_clear_error_and_exit_code_2(tmp_path):
    store = f"sqlite:///{tmp_path}/j.db"
    out = brood("run", "x", "--model", "nonsense:x", "--store", store)
    assert out.returncode == 2
    assert "unknown model spec 'nonsense:x'" in out.stderr
    out = brood("run", "x", "--model", "openai:m", "--context", str(tmp_path / "missing"))
    assert out.returncode == 2
    assert "--context" in out.stderr and "No such file" in out.stderr
    out = brood("run", "x", "--store", store)
    assert out.returncode == 2 and "no model" in out.stderr
    out = brood("run", "x", "--model", "openai:m", "--max-depth", "0", "--store", store)
    assert out.returncode == 2 and "--max-depth must be >= 1" in out.stderr


def test_a_binary_context_or_a_timeout_that_is_no_duration_is_refused(tmp_path):
    store = f"sqlite:///{tmp_path}/j.db"
    binary = tmp_path / "data.bin"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    out = brood("run", "x", "--model", "scripted:demo", "--context", str(binary))
    assert out.returncode == 2
    assert f"--context {binary}: not UTF-8 text (byte 0)" in out.stderr
    for bad in ("-1", "0", "nan", "inf"):
        out = brood("run", "x", "--model", "scripted:demo", "--timeout", bad, "--store", store)
        assert out.returncode == 2, (bad, out.stderr)
        assert "timeout must be a number of seconds > 0" in out.stderr
    out = brood("run", "--help")  # a root never runs unbounded by mistake
    assert "3600" in out.stdout, out.stdout


def test_model_timeout_bounds_each_try_of_a_call_to_a_server_that_hangs(tmp_path):
    from tests.fake_openai import Reply

    hang = Reply("```repl\nFINAL('late')\n```", delay=60)
    store = f"sqlite:///{tmp_path}/j.db"
    with FakeOpenAI({"slow": [hang] * 3}) as server:
        url = server.base_url
        spec = f"openai:tiny@{url}"
        out = brood("run", "slow", "--model", spec, "--model-timeout", "0.3", "--store", store)
        tries = len(server.requests)
    assert out.returncode == 1, out.stderr
    assert f"model 'tiny' at {url}: APITimeoutError after 3 tries" in out.stderr
    assert tries == 3  # the default: one try and two retries
    out = brood("run", "x", "--model", "scripted:demo", "--model-timeout", "5", "--store", store)
    assert (
        out.returncode == 2
        and "--model-timeout applies to openai:, anthropic: and gemini: models" in out.stderr
    )


def test_a_journal_on_a_read_only_filesystem_is_named_so_not_damaged(tmp_path):
    import shutil

    journal = tmp_path / "ro"
    journal.mkdir()
    store = f"sqlite:///{journal}/j.db"
    assert brood("demo", "--store", store).returncode == 0  # a journal, then made read-only
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        import pytest

        pytest.skip("needs root and unshare to mount a folder read-only in a private namespace")
    cli = " ".join(BROOD)
    script = (
        f"mount --bind {journal} {journal} && mount -o remount,ro,bind {journal} {journal} && "
        f"{cli} run x --model scripted:demo --store {store}; echo exit=$?; "
        f"{cli} run x --model scripted:demo --store sqlite:///{journal}/new.db; echo exit=$?; "
        f"{cli} ps --store {store} --json >/dev/null; echo exit=$?"
    )
    temp = tmp_path / "temp"  # where the supervisors make their scratch and control folders
    temp.mkdir()
    out = subprocess.run(
        ["unshare", "--mount", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TMPDIR": str(temp)},
    )
    assert out.stdout.split() == ["exit=2", "exit=2", "exit=0"], out
    assert out.stderr.count("cannot be written") == 2, out.stderr
    assert "read-only filesystem" in out.stderr and "damaged" not in out.stderr
    assert list(temp.iterdir()) == []  # the supervisors that failed to start left nothing


def test_a_bare_ray_flag_means_a_ray_started_here():
    from brood.cli.main import with_bare_ray

    assert with_bare_ray(["run", "task", "--ray"]) == ["run", "task", "--ray", "local"]
    assert with_bare_ray(["run", "--ray", "task"]) == ["run", "--ray", "local", "task"]
    assert with_bare_ray(["run", "--ray", "--json", "t"]) == [
        "run",
        "--ray",
        "local",
        "--json",
        "t",
    ]
    for address in ("10.0.0.5:6379", "auto", "ray://head:10001", "localhost:6379"):
        assert with_bare_ray(["run", "t", "--ray", address]) == ["run", "t", "--ray", address]
    assert with_bare_ray(["run", "t"]) == ["run", "t"]


def test_a_run_that_ended_at_max_iterations_says_so_and_logs_show_what_it_did(tmp_path):
    store = f"sqlite:///{tmp_path}/j.db"
    script = {"think": ["```repl\nprint('thinking')\n```", "forty-two"]}
    with FakeOpenAI(script) as server:
        model = f"openai:tiny@{server.base_url}"
        out = brood("run", "think", "--model", model, "--max-iterations", "1", "--store", store)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "forty-two"
    run_id = out.stderr.split("note: run ")[1].split()[0]
    assert f"note: run {run_id} completed (answer after max_iterations: no FINAL within " in (
        out.stderr
    )
    assert "(--max-iterations)" in out.stderr
    show = brood("show", run_id, "--store", store).stdout
    assert "reason: answer after max_iterations" in show
    assert "(answer after max_iterations)" in brood("tree", run_id, "--store", store).stdout
    logs = brood("logs", run_id, "--store", store).stdout
    assert "thinking" in logs and "forty-two" in logs
    assert "step_begun" not in logs and "model_spec" not in logs
    assert logs.splitlines()[-1].startswith("ended: completed (answer after max_iterations")
    kinds = [
        json.loads(line)["kind"]
        for line in brood("logs", run_id, "--json", "--store", store).stdout.splitlines()
    ]
    assert kinds == ["cost_unknown", "model_call", "step", "model_call"]  # nobody prices "tiny"
    everything = brood("logs", run_id, "--all", "--store", store).stdout
    assert "step_begun" in everything and "model_spec" in everything

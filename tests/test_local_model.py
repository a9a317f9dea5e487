"""A real model, offline (the `[local]` extra): SmolLM2-135M-Instruct through llama.cpp, in
process (`local:smollm2`) and behind a real OpenAI-compatible server (`llama_cpp.server`)
that the `openai` client talks HTTP to. The runs are bounded (two turns); what matters is
that they end, count tokens and journal the real exchanges, whatever the model's quality."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading

import pytest

import brood

pytestmark = [pytest.mark.local, pytest.mark.timeout(600)]
llama_cpp = pytest.importorskip("llama_cpp", reason="needs the [local] extra (make test-local)")

TASK = "What is 6 times 7? Compute it in the REPL and call FINAL with the number."
LIMITS = brood.Limits(max_iterations=2, max_depth=1, shutdown_grace=0.3, term_grace=0.3)


def check_run(sup: brood.Supervisor, result: brood.RunResult) -> None:
    assert result.state in ("completed", "failed"), result  # it ended; any answer will do
    calls = [e["data"] for e in sup.store.events(result.run_id, "model_call")]
    assert calls and all(c["error"] is None for c in calls), calls
    assert all(c["response"] for c in calls)  # the real model's words are journaled
    usage = sup.store.get_run(result.run_id)["usage"]
    assert usage["input_tokens"] > 1_000 and usage["output_tokens"] > 0, usage


def test_local_smollm2_runs_in_process():
    with brood.Supervisor("local:smollm2", limits=LIMITS) as sup:
        result = sup.run(TASK)
        check_run(sup, result)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_openai_compatible_llama_cpp_server_over_http():
    from brood.models.local import smollm2_path

    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "llama_cpp.server",
            "--model",
            smollm2_path(),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--n_ctx",
            "8192",
            "--model_alias",
            "smollm2",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    ready = threading.Event()

    def watch() -> None:  # uvicorn says when it listens
        assert server.stderr is not None
        for line in server.stderr:
            if "Uvicorn running" in line:
                ready.set()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        assert ready.wait(120), "llama_cpp.server did not start"
        model = brood.OpenAIModel("smollm2", base_url=f"http://127.0.0.1:{port}/v1", timeout=300)
        with brood.Supervisor(model, limits=LIMITS) as sup:
            result = sup.run(TASK)
            check_run(sup, result)
    finally:
        server.terminate()
        server.wait(30)
        watcher.join(10)  # it reads the server's stderr to its end
        assert server.stderr is not None
        server.stderr.close()
    assert not os.path.exists(f"/proc/{server.pid}")

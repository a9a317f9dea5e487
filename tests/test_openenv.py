"""brood as an OpenEnv environment, driven over HTTP by openenv-core's own clients.

The server is `python -m brood.integrations.openenv` in a process of its own (one for the
module: openenv-core takes seconds to import), its children on a scripted model
(tests/openenv_children.py) and its journal in a temporary folder. Eight episodes run at
once, each spawning, waiting for and cancelling children; a reset with a child still
computing confirms its worker's exit before it returns. A server in this process (uvicorn
in a thread) checks the token, and leaves nothing behind (the autouse fixture).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import pytest
import uvicorn
from typer.testing import CliRunner

# Collected everywhere, run where the [openenv] extra is (make test-train).
pytest.importorskip("openenv.core", reason="needs the [openenv] extra (make test-train)")
import httpx2 as httpx
from openenv.core.generic_client import GenericEnvClient
from openenv.core.rubrics import Rubric

import brood
from brood.backends.owners import REGISTRY_ENV, processes_of
from brood.cli.main import app as cli
from brood.integrations.openenv import (
    BroodAction,
    BroodEnv,
    BroodEnvironment,
    BroodEnvironmentFactory,
    load_rubric,
    make_app,
    served_limits,
)
from brood.journal import Journal
from tests.util import FAST, read_until, stop, until

pytestmark = pytest.mark.train

ROOT = Path(__file__).resolve().parent.parent
SERVING = re.compile(r"brood openenv: serving at (http://127\.0\.0\.1:\d+)")
START_S = 120.0  # bound on the server's start-up (openenv-core imports gradio); never a pace
EPISODES = 8


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def runs_of(store: str, root_id: str) -> list[dict[str, Any]]:
    with Journal(store) as journal:
        return journal.store.runs(root_id)


def rewards_of(store: str, run_id: str) -> list[dict[str, Any]]:
    with Journal(store) as journal:
        return [e["data"] for e in journal.store.events(run_id, "reward")]


class Server:
    def __init__(self, proc: subprocess.Popen[bytes], url: str, store: str, registry: str):
        self.proc, self.url, self.store, self.registry = proc, url, store, registry

    def workers(self) -> list[int]:
        """The processes the server's supervisor started (zygote, workers) still there."""
        saved = os.environ.get(REGISTRY_ENV)
        os.environ[REGISTRY_ENV] = self.registry
        try:
            return [p for p in processes_of(self.proc.pid) if alive(p)]
        finally:
            if saved is not None:
                os.environ[REGISTRY_ENV] = saved


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """`python -m brood.integrations.openenv` on a free loopback port; stopped with SIGTERM at
    the end, and then nothing it started is left."""
    folder = tmp_path_factory.mktemp("openenv")
    store = f"sqlite:///{folder / 'journal.db'}"
    env = {k: v for k, v in os.environ.items() if k not in ("BROOD_TOKEN", "BROOD_MODEL")}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "brood.integrations.openenv",
            "--model",
            "python:tests.openenv_children:MODEL",
            "--rubric",
            "tests.openenv_children:reward",
            "--port",
            "0",
            "--store",
            store,
            "--max-envs",
            str(EPISODES + 2),  # max_concurrency: 8 workers for each (the default)
            "--max-depth",
            "2",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
    )
    try:
        found = read_until(proc, SERVING, START_S)
        served = Server(proc, found[1], store, os.environ[REGISTRY_ENV])
        yield served
        # A session still open when the server stops, its episode's child computing.
        loop = asyncio.new_event_loop()
        client = GenericEnvClient(base_url=served.url)
        left_open = loop.run_until_complete(open_episode(client))
        started = served.workers()
        assert started, "the server's zygote is not found: the leftover check would see nothing"
    finally:
        status = stop(proc, START_S)
    # uvicorn shuts down (the supervisor closes, exit confirmed), then re-raises SIGTERM.
    assert status in (0, -signal.SIGTERM), status
    assert not [p for p in started if alive(p)], "the server left processes behind"
    assert {r["state"] for r in runs_of(store, left_open)} == {"cancelled"}
    loop.run_until_complete(client.disconnect())
    loop.close()


async def open_episode(env: GenericEnvClient) -> str:
    await env.connect()
    r = await env.reset(prompt="open when the server stops")
    r = await env.step({"code": "s = rlm_spawn('slow at the end')"})
    assert r.observation["error"] is None
    return str(r.observation["run_id"])


SPAWN = (
    "import os\nprint(os.getpid())\nq = rlm_spawn('quick job')\ns = rlm_spawn('slow job')\n"
    "print(rlm_status(s))"
)


async def whole_episodes(server: Server, i: int) -> dict[str, Any]:
    """Episode A spawns a quick and a slow child, waits for one and cancels the other,
    reads its context and answers; episode B leaves a slow child computing and is reset."""
    seen: dict[str, Any] = {}
    async with GenericEnvClient(base_url=server.url) as env:
        r = await env.reset(prompt=f"episode {i}", context=f"context {i}", expected_answer=f"a{i}")
        assert r.done is False and r.observation["error"] is None
        seen["a"] = r.observation["run_id"]

        r = await env.step({"code": SPAWN})
        obs = r.observation
        assert obs["error"] is None, obs
        assert obs["stdout"].split()[1] in ("queued", "running")
        assert len(obs["children"]) == 2 and obs["iteration"] == 1
        quick, slow = (c["id"] for c in obs["children"])

        r = await env.step({"code": "print(rlm_wait(q, timeout=60))"})
        assert r.observation["stdout"].startswith("quick done by "), r.observation

        r = await env.step({"code": "print(rlm_cancel(s), s.id)"})  # exit confirmed first
        assert r.observation["stdout"].split() == ["cancelled", slow]
        assert r.observation["children"] == [
            {"id": quick, "status": "completed"},
            {"id": slow, "status": "cancelled"},
        ]

        r = await env.step({"code": "print(context, len(rlm_children()))"})
        assert r.observation["stdout"].strip() == f"context {i} 2"

        r = await env.step({"code": f"FINAL('a{i}')"})
        assert r.done is True and r.reward == 1.0
        assert r.observation["answer"] == f"a{i}" and r.observation["iteration"] == 5

        # Episode B: a child still computing when the episode is reset.
        r = await env.reset(prompt=f"left running {i}")
        seen["b"] = r.observation["run_id"]
        r = await env.step({"code": "h = rlm_spawn('slow again')\nprint(h.id)"})
        child = r.observation["stdout"].strip()

        def running_pid() -> int | None:
            row = next(r for r in runs_of(server.store, seen["b"]) if r["id"] == child)
            return row["pid"] if row["state"] == "running" and row["pid"] else None

        pid = await asyncio.to_thread(until, running_pid)
        assert alive(pid)
        r = await env.reset(prompt=f"after {i}")  # returns once the child's exit is confirmed
        assert not alive(pid), f"the reset returned with child {child} (pid {pid}) alive"
        seen["c"] = r.observation["run_id"]
        r = await env.step({"code": "print(len(rlm_children()))"})
        assert r.observation["stdout"].strip() == "0"
    return seen  # leaving closes the session: the server ends episode C


def test_eight_concurrent_episodes_over_http_spawn_wait_cancel_and_leave_nothing(server):
    async def all_of_them() -> list[dict[str, Any]]:
        return await asyncio.gather(*(whole_episodes(server, i) for i in range(EPISODES)))

    episodes = asyncio.run(all_of_them())
    roots = [ep[k] for ep in episodes for k in "abc"]
    assert len(set(roots)) == 3 * EPISODES  # every episode its own tree

    def all_ended() -> bool:
        return all(
            r["state"] in ("completed", "cancelled")
            for t in roots
            for r in runs_of(server.store, t)
        )

    until(all_ended)  # episode C ends when the server sees its session close
    for i, ep in enumerate(episodes):
        a = runs_of(server.store, ep["a"])
        root = next(r for r in a if r["id"] == ep["a"])
        assert (root["state"], root["answer"]) == ("completed", f"a{i}")
        assert sorted(r["state"] for r in a if r["id"] != ep["a"]) == ["cancelled", "completed"]
        assert rewards_of(server.store, ep["a"]) == [
            {"reward": 1.0, "info": {"rubric": "reward", "episode_id": ep["a"]}}
        ]
        b = runs_of(server.store, ep["b"])
        assert {r["state"] for r in b} == {"cancelled"}
        assert next(r for r in b if r["id"] == ep["b"])["reason"] == "session reset"
        assert (
            next(r for r in runs_of(server.store, ep["c"]) if r["id"] == ep["c"])["reason"]
            == "session closed"
        )
    pids = [r["pid"] for t in roots for r in runs_of(server.store, t) if r["pid"]]
    # Every root's worker, and the children's that started (one cancelled early may not have).
    assert len(pids) >= 3 * EPISODES + 2 * EPISODES
    until(lambda: not [p for p in pids if alive(p)])
    assert server.workers(), "the server's own zygote is still there"


def test_bad_input_is_an_error_in_the_observation_and_loses_nothing(server):
    async def episode() -> tuple[str, list[Any]]:
        async with GenericEnvClient(base_url=server.url) as env:
            r = await env.reset(prompt="bad input", expected_answer="raise")
            run_id = r.observation["run_id"]
            got = [
                await env.step(a)
                for a in ({"code": 5}, {"message": "hi"}, {}, {"code": "x = 6 * 7"})
            ]
            got.append(await env.step({"code": "print(x)\n1 / 0"}))
            got.append(await env.step({"is_final": True, "final_answer": str(42)}))
            got.append(await env.step({"code": "print(x)"}))
            got.append(await env.state())
        return run_id, got

    run_id, (not_str, not_field, empty, ok, raised, final, after, state) = asyncio.run(episode())
    assert "code must be a string of Python source, got int" in not_str.observation["error"]
    assert "'message' is not a field of an action" in not_field.observation["error"]
    assert "the action has no code" in empty.observation["error"]
    assert not any(r.done for r in (not_str, not_field, empty))  # the episode goes on
    assert ok.observation["error"] is None and ok.observation["iteration"] == 1
    assert (
        raised.observation["stdout"] == "42\n"
        and "ZeroDivisionError" in raised.observation["error"]
    )
    assert final.done is True and final.reward is None
    assert final.observation["answer"] == "42"
    assert "the rubric reward raised RuntimeError: no score for '42'" in final.observation["error"]
    assert "the episode's answer is kept in the journal" in final.observation["error"]
    assert "has ended" in after.observation["error"] and after.observation["answer"] == "42"
    assert state["answer"] == "42" and state["done"] is True and state["reward"] is None
    root = next(r for r in runs_of(server.store, run_id) if r["id"] == run_id)
    assert (root["state"], root["answer"]) == ("completed", "42")
    assert rewards_of(server.store, run_id) == []


# ---- a server in this process: the token, and nothing left behind --------------------------
@contextmanager
def served_here(app: Any) -> Iterator[str]:
    """uvicorn serving `app` in a thread on a free loopback port; at the end it shuts down
    (its lifespan closes the supervisor, confirming every exit)."""
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    until(lambda: server.started)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(START_S)
        assert not thread.is_alive()


def quick_model(messages: list[dict[str, Any]], model: str | None = None) -> str:
    return "```repl\nFINAL('child says hi')\n```"


def test_a_token_server_takes_brood_s_client_and_refuses_the_rest(tmp_path):
    store = f"sqlite:///{tmp_path / 'j.db'}"
    app = make_app(quick_model, limits=FAST, store=store, token="s3cret", max_concurrent_envs=2)
    with served_here(app) as url:
        with pytest.raises(ConnectionError, match="401"):
            asyncio.run(GenericEnvClient(base_url=url).connect())
        with BroodEnv(url, token="s3cret").sync() as env:
            r = env.reset(prompt="typed")
            r = env.step(BroodAction(code="print(rlm_query('hi'))"))
            assert r.observation.stdout == "child says hi\n"
            r = env.submit_final_answer("done")
            assert r.done and r.observation.answer == "done" and r.reward is None
            run_id = r.observation.run_id
        assert httpx.get(f"{url}/health").status_code == 401
        page = httpx.get(
            f"{url}/health",
            headers={"Authorization": "Bearer s3cret", "Origin": "http://evil.example"},
        )
        assert page.status_code == 403 and "web page" in page.json()["error"]
        assert httpx.get(f"{url}/health", headers={"Authorization": "Bearer s3cret"}).is_success
    assert runs_of(store, run_id)[0]["answer"] == "done"


def test_a_loopback_server_without_a_token_refuses_other_host_names(tmp_path):
    app = make_app(quick_model, limits=FAST, store=f"sqlite:///{tmp_path / 'j.db'}")
    with served_here(app) as url:
        assert httpx.get(f"{url}/health").is_success
        rebound = httpx.get(f"{url}/health", headers={"Host": "attacker.example"})
        assert rebound.status_code == 403 and "loopback" in rebound.json()["error"]


# ---- the environment in this process ---------------------------------------------------------
class LastStepRubric(Rubric):
    """An openenv-core Rubric: called on every step; 0.5 once the episode is done."""

    def __init__(self) -> None:
        super().__init__()
        self.steps = 0

    def forward(self, action: Any, observation: Any) -> float:
        self.steps += 1
        return 0.5 if observation.done else 0.0

    def reset(self) -> None:
        self.steps = 0


def test_an_openenv_rubric_scores_every_step_and_each_environment_has_its_own(tmp_path):
    store = f"sqlite:///{tmp_path / 'j.db'}"
    rubric = LastStepRubric()
    with BroodEnvironmentFactory(quick_model, rubric=rubric, limits=FAST, store=store) as make:
        one, two = make(), make()
        assert one.rubric is not rubric and one.rubric is not two.rubric
        one.reset(prompt="first")
        two.reset(prompt="second")
        assert one.step(BroodAction(code="x = 1")).reward == 0.0
        done = one.step(BroodAction(code="FINAL(str(x))"))
        assert (done.done, done.reward, done.answer) == (True, 0.5, "1")
        assert one.rubric.steps == 2 and two.rubric.steps == 0 and rubric.steps == 0
        assert one.state.reward == 0.5
        two.close()
        one.close()
    assert rewards_of(store, done.run_id)[0]["reward"] == 0.5


class ExpectedAnswerRubric(Rubric):
    """A rubric in the manner of repl_env's ExactMatchRubric: the expected answer comes by
    set_expected() at reset, the answer from the observation's metadata."""

    def __init__(self) -> None:
        super().__init__()
        self.expected: str | None = None

    def set_expected(self, expected: str) -> None:
        self.expected = expected

    def forward(self, action: Any, observation: Any) -> float:
        return float(observation.metadata.get("final_answer") == self.expected)


def test_a_repl_env_style_rubric_gets_the_expected_answer_and_the_final_one(tmp_path):
    env = BroodEnvironment(quick_model, rubric=ExpectedAnswerRubric(), limits=FAST)
    try:
        env.reset(prompt="q", expected_answer="7")
        assert env.step(BroodAction(code="print(3 + 4)")).reward == 0.0
        done = env.step(BroodAction(is_final=True, final_answer="7"))
        assert (done.done, done.answer, done.reward) == (True, "7", 1.0)
        env.reset(prompt="q", expected_answer="8")
        assert env.step(BroodAction(is_final=True, final_answer="7")).reward == 0.0
    finally:
        env.close()


def test_a_rubric_that_returns_no_number_and_a_wrong_reset_are_said_clearly(tmp_path):
    def words(answer: str | None, trajectory: list[Any]) -> Any:
        return "good"

    env = BroodEnvironment(quick_model, rubric=words, limits=FAST)
    try:
        assert "no episode" in (env.step(BroodAction(code="1")).error or "")
        with pytest.raises(brood.InvalidArgument, match=r"does not take: \['hf_token'\]"):
            env.reset(prompt="x", hf_token="t")
        with pytest.raises(brood.InvalidArgument, match="words takes none"):
            env.reset(prompt="x", expected_answer="y")
        env.reset(task_prompt="the task, as repl_env names it")
        assert env.state.prompt == "the task, as repl_env names it"
        obs = env.step(BroodAction(code="FINAL('a')"))
        assert obs.done and obs.answer == "a" and obs.reward is None
        assert "returned 'good' (str); a reward is a finite number" in (obs.error or "")
    finally:
        env.close()
    assert "no episode" in (env.step(BroodAction(code="1")).error or "")


def test_a_full_server_s_sessions_have_a_session_s_worth_of_workers_each():
    assert served_limits(10).max_concurrency == 10 * brood.Limits().max_concurrency
    assert served_limits(10, max_concurrency=3, max_depth=2) == brood.Limits(
        max_concurrency=3, max_depth=2
    )


def test_rubric_specs_and_cli_refusals(tmp_path, monkeypatch):
    assert load_rubric("tests.openenv_children:reward").__name__ == "reward"
    with pytest.raises(brood.InvalidArgument, match="write MODULE:FUNCTION"):
        load_rubric("nothing")
    with pytest.raises(brood.InvalidArgument, match="has no attribute 'nope'"):
        load_rubric("tests.openenv_children:nope")
    with pytest.raises(brood.InvalidArgument, match="cannot be called as reward"):
        BroodEnvironmentFactory(quick_model, rubric=lambda: 1.0)
    monkeypatch.delenv("BROOD_TOKEN", raising=False)
    out = CliRunner().invoke(cli, ["openenv", "serve", "--host", "0.0.0.0", "--model", "echo"])
    assert out.exit_code == 2 and "--token" in out.output

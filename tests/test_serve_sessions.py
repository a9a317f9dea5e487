"""Remote sessions: `reset` / `step` / `close` over `brood serve` (`/v1/sessions`), driven by
`brood.RemoteSession` against a real server (a uvicorn thread, a file journal, a scripted
model for the children, real workers)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

import brood
from brood.journal import Journal
from brood.testing import leftover_processes
from tests.test_serve import SCRIPT, TOKEN, Served, code, error_of, serving, until
from tests.util import Gate, fast

SESSION_SCRIPT = dict(SCRIPT, **{"child: add": [code("FINAL(str(40 + 2))")]})


def remote(s: Served, **kw: Any) -> brood.RemoteSession:
    return brood.RemoteSession(s.base_url, token=TOKEN, **kw)


def test_a_whole_episode_over_http_spawns_waits_cancels_and_answers(tmp_path):
    gate = Gate(tmp_path, "never")  # the slow child blocks on it until it is cancelled
    script = dict(SESSION_SCRIPT, **{"slow child": [code(gate.wait_code + "\nFINAL('late')")]})
    with serving(tmp_path, script=script) as s:
        with remote(s) as env:
            assert env.reset("add numbers", context={"a": 40}) == brood.Observation()
            run_id = env.run_id
            obs = env.step("h = rlm_spawn('child: add')\nprint('spawned', context['a'])")
            assert obs.stdout == "spawned 40\n" and obs.error is None and not obs.done
            assert [c["id"] for c in obs.children] and obs.children[0]["status"] in (
                "queued",
                "running",
                "completed",
            )
            obs = env.step("print(rlm_wait(h, timeout=60))")
            assert obs.stdout == "42\n"
            obs = env.step("g = rlm_spawn('slow child')\nprint(rlm_status(g))")
            assert obs.stdout.strip() in ("queued", "running")
            status = env.status()
            assert status["run_id"] == run_id and status["state"] == "running"
            assert status["busy"] is False and len(status["children"]) == 2
            obs = env.step("print(rlm_cancel(g))")
            assert obs.stdout == "cancelled\n"
            obs = env.step("1 / 0")
            assert "ZeroDivisionError" in (obs.error or "") and not obs.done
            obs = env.step("FINAL('the answer is ' + rlm_wait(h))", timeout=30)
            assert obs.done and obs.answer == "the answer is 42"
            assert {c["status"] for c in obs.children} == {"completed", "cancelled"}
            env.record_reward(1.0, {"rubric": "exact"})
            with pytest.raises(brood.BroodError, match="the episode has ended"):
                env.step("print('more')")
            sid = env.session_id
        # Closed: the tree ended, every exit confirmed; the session answers 409 now.
        assert error_of(s.client.get(f"/v1/sessions/{sid}"), 409)["message"].startswith(
            f"session {sid} is closed"
        )
        assert not leftover_processes()
        run = s.client.get(f"/v1/runs/{run_id}").json()  # in the journal like any run
        assert run["state"] == "completed" and run["answer"] == "the answer is 42"
        with Journal(f"sqlite:///{tmp_path / 'brood.db'}") as journal:
            example, *children = journal.export(run_id, "openai-chat")
        assert example["metadata"]["reward"] == 1.0 and len(children) == 2
        assert example["messages"][1]["content"].startswith("```repl\nh = rlm_spawn")


def test_a_second_episode_starts_fresh_and_a_reset_ends_the_first(tmp_path):
    with serving(tmp_path, script=SESSION_SCRIPT) as s, remote(s) as env:
        env.reset("first")
        env.step("x = 1\nh = rlm_spawn('child: add')")
        first = env.run_id
        env.reset("second")
        assert env.run_id != first
        obs = env.step("print('x' in dir())")
        assert obs.stdout == "False\n"  # a new REPL
        assert s.client.get(f"/v1/runs/{first}").json()["state"] == "cancelled"


def test_bad_calls_are_refused_naming_what_is_wrong(tmp_path):
    with serving(tmp_path, script=SESSION_SCRIPT, limits=fast(max_depth=3)) as s:
        c = s.client
        assert error_of(c.post("/v1/sessions/s-nothere/step", json={"code": "1"}), 404)
        sid = c.post("/v1/sessions", json={}).json()["session_id"]
        # A step before reset: no episode yet.
        err = error_of(c.post(f"/v1/sessions/{sid}/step", json={"code": "1"}), 409)
        assert "no episode: call reset" in err["message"]
        assert error_of(c.post(f"/v1/sessions/{sid}/reset", content=b"{"), 400)
        err = error_of(c.post(f"/v1/sessions/{sid}/reset", json={"prompt": 3}), 422)
        assert err["field"] == "prompt"
        c.post(f"/v1/sessions/{sid}/reset", json={"prompt": "task"}).raise_for_status()
        err = error_of(c.post(f"/v1/sessions/{sid}/step", json={"code": ["x"]}), 422)
        assert err["field"] == "code" and "string" in err["message"]
        err = error_of(c.post(f"/v1/sessions/{sid}/step", json={"code": "1", "tmeout": 1}), 422)
        assert "tmeout" in err["message"]
        err = error_of(c.post(f"/v1/sessions/{sid}/step", json={"code": "1", "timeout": 0}), 422)
        assert err["field"] == "timeout"
        err = error_of(c.post(f"/v1/sessions/{sid}/reward", json={"reward": "high"}), 422)
        assert err["field"] == "reward"
        # Limits may tighten the server's, never loosen them; the model must be the server's.
        err = error_of(c.post("/v1/sessions", json={"limits": {"max_depth": 9}}), 422)
        assert err["field"] == "limits.max_depth" and "never loosen" in err["message"]
        err = error_of(c.post("/v1/sessions", json={"limits": {"network": True}}), 422)
        assert err["field"] == "limits.network"
        err = error_of(c.post("/v1/sessions", json={"model": "openai:gpt-5"}), 422)
        assert err["field"] == "model"
        # Without the token: 401, and nothing done.
        assert c.delete(f"/v1/sessions/{sid}", headers={"Authorization": ""}).status_code == 401
        assert c.get(f"/v1/sessions/{sid}").json()["state"] == "running"
        assert c.delete(f"/v1/sessions/{sid}").json()["closed"] is True
        err = error_of(c.post(f"/v1/sessions/{sid}/step", json={"code": "1"}), 409)
        assert f"session {sid} is closed" in err["message"]
        with pytest.raises(brood.BroodError, match=r"refused \(401\)"):
            brood.RemoteSession(s.base_url, token="wrong")
        with pytest.raises(brood.InvalidArgument, match=r"limits\.max_depth"):
            remote(s, limits={"max_depth": 99})
    assert not leftover_processes()


def test_sessions_are_bounded_per_server_and_per_client_and_idle_ones_close(tmp_path):
    with serving(
        tmp_path,
        script=SESSION_SCRIPT,
        max_sessions=3,
        max_sessions_per_client=2,
        session_idle=3,
    ) as s:
        one, two = remote(s), remote(s)
        with pytest.raises(brood.BroodError, match=r"refused \(429\).*bound of 2 per client"):
            remote(s)
        one.reset("task")
        # Idle past its bound, each is closed by the server (its tree ended, exit confirmed).
        until(lambda: s.client.get(f"/v1/sessions/{one.session_id}").status_code == 409)
        until(lambda: s.client.get(f"/v1/sessions/{two.session_id}").status_code == 409)
        err = error_of(s.client.get(f"/v1/sessions/{one.session_id}"), 409)
        assert "idle for 3 s" in err["message"]
        assert s.client.get(f"/v1/runs/{one.run_id}").json()["state"] == "cancelled"
        one.close()  # closed already: nothing to do
        with remote(s) as three:  # a slot is free again
            assert three.reset("again").done is False


def test_closing_the_server_closes_every_session_with_confirmed_exit(tmp_path):
    with serving(tmp_path, script=SESSION_SCRIPT) as s:
        env = remote(s)
        env.reset("task")
        env.step("h = rlm_spawn('child: add')\nrlm_wait(h)")
        run_id = env.run_id
    assert not leftover_processes()
    with Journal(f"sqlite:///{tmp_path / 'brood.db'}") as journal:
        assert journal.run(run_id)["state"] == "cancelled"


def test_closing_a_session_in_the_middle_of_a_step_ends_the_step(tmp_path):
    gate = Gate(tmp_path, "never")
    with serving(tmp_path, script=SESSION_SCRIPT) as s:
        env = remote(s)
        env.reset("task")
        seen: list[brood.Observation] = []
        stepping = threading.Thread(target=lambda: seen.append(env.step(gate.wait_code)))
        stepping.start()
        until(lambda: s.client.get(f"/v1/sessions/{env.session_id}").json()["busy"])
        err = error_of(
            s.client.post(f"/v1/sessions/{env.session_id}/step", json={"code": "1"}), 409
        )
        assert "busy" in err["message"]
        assert s.client.delete(f"/v1/sessions/{env.session_id}").json()["closed"] is True
        stepping.join(60)
        (obs,) = seen
        assert obs.done and "the episode ended cancelled" in (obs.error or "")
        assert not leftover_processes()


def test_a_server_without_a_model_opens_no_session(tmp_path, monkeypatch):
    monkeypatch.delenv("BROOD_MODEL", raising=False)
    with serving(tmp_path, model=None) as s:
        err = error_of(s.client.post("/v1/sessions", json={}), 503)
        assert "no model" in err["message"] and "--model" in err["fix"]
        assert s.client.get("/v1/runs").json()["runs"] == []

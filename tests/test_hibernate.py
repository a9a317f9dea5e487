"""Hibernation (DESIGN.md section 17): a waiting run gives up its worker and is rebuilt by
replay when its wait is satisfied; Limits.max_workers caps live workers."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
from typing import Any

import pytest
from typer.testing import CliRunner

import brood
from brood.cli.main import app
from brood.journal import Journal
from tests.test_resume import wait_gone
from tests.util import Gate, fast, pid_alive, until

FENCE = "```"


def repl(code: str) -> str:
    return f"{FENCE}repl\n{code}\n{FENCE}"


def row(url: str, run_id: str) -> dict[str, Any]:
    with Journal(url) as journal:
        return journal.run(run_id)


def kinds(url: str, run_id: str) -> list[str]:
    with Journal(url) as journal:
        return [e["kind"] for e in journal.store.events(run_id)]


def hibernated(sup: brood.Supervisor, url: str, run_id: str) -> bool:
    return sup.statistics()["hibernating"] >= 1 and row(url, run_id)["hibernating"]


def test_a_parent_waiting_on_its_child_hibernates_and_wakes_with_its_variables(tmp_path):
    url = f"sqlite:///{tmp_path}/j.db"
    gate = Gate(tmp_path, "child")
    model = brood.ScriptedModel(
        {
            "root": [
                repl("x = 21\nimport os\npid = os.getpid()\nprint(pid)"),
                repl("h = rlm_spawn('child: slow')\nr = rlm_wait(h)\nFINAL(f'{x * 2} {r}')"),
            ],
            "child": [repl(f"{gate.wait_code}\nFINAL('child done')")],
        }
    )
    with brood.Supervisor(model, store=url, limits=fast(hibernate_after=0)) as sup:
        h = sup.spawn("root task")
        until(lambda: hibernated(sup, url, h.id))
        pid = row(url, h.id)["pid"]
        assert not pid_alive(pid)
        assert h.status() == "running"
        assert row(url, h.id)["state"] == "running"
        (ps,) = json.loads(CliRunner().invoke(app, ["ps", "--store", url, "--json"]).output)
        tree = json.loads(CliRunner().invoke(app, ["tree", h.id, "--store", url, "--json"]).output)
        assert ps["hibernating_runs"] == 1 and ps["workers"] == 1  # its child's
        assert tree["hibernating"] and not tree["children"][0]["hibernating"]
        wide = CliRunner().invoke(app, ["tree", h.id, "--store", url], env={"COLUMNS": "200"})
        assert "(hibernating)" in wide.output
        gate.open()
        assert h.wait(timeout=60) == "42 child done"
        assert sup.statistics()["hibernating"] == 0
    events = kinds(url, h.id)
    assert "hibernated" in events and "woken" in events


def test_a_run_waiting_on_a_slow_model_call_hibernates_and_wakes_with_its_reply(tmp_path):
    url = f"sqlite:///{tmp_path}/j.db"
    gate = Gate(tmp_path, "model")
    model = brood.ScriptedModel(
        {
            "root": [
                repl("x = 21"),
                repl("y = llm_query('plain: slow question')\nFINAL(f'{x * 2} {y}')"),
            ],
            "plain:": [gate.blocking_reply("slow answer")],
        }
    )
    with brood.Supervisor(model, store=url, limits=fast(hibernate_after=0)) as sup:
        h = sup.spawn("root task")
        until(lambda: hibernated(sup, url, h.id))
        assert not pid_alive(row(url, h.id)["pid"])
        gate.open()
        assert h.wait(timeout=60) == "42 slow answer"
    assert "woken" in kinds(url, h.id)


def test_a_run_waiting_on_a_person_hibernates_and_wakes_with_the_answer(tmp_path):
    url = f"sqlite:///{tmp_path}/j.db"
    model = brood.ScriptedModel(
        {
            "root": [
                repl("x = 21"),
                repl("a = ask_person('Deploy?', options=['yes', 'no'])\nFINAL(f'{x * 2} {a}')"),
            ]
        }
    )
    with brood.Supervisor(model, store=url, limits=fast(hibernate_after=0)) as sup:
        h = sup.spawn("root task")
        until(lambda: hibernated(sup, url, h.id))
        assert not pid_alive(row(url, h.id)["pid"])
        (ask,) = sup.asks()
        sup.answer(ask["id"], "yes", by="alice")
        answer = h.wait(timeout=60)
    assert answer.startswith("42 ") and "yes" in answer


def test_a_run_waiting_on_its_flow_hibernates_and_wakes_when_the_flow_ends(tmp_path):
    url = f"sqlite:///{tmp_path}/j.db"
    gate = Gate(tmp_path, "state")
    spec = {"states": [{"id": "one", "entry": True, "prompt": "State one", "outputs": ["text"]}]}
    code = f"fid = flow_run({spec!r})\nFINAL(f'{{x * 2}} ' + flow_wait(fid))"
    model = brood.ScriptedModel(
        {
            "root": [repl("x = 21"), repl(code)],
            "State one": [repl(f"{gate.wait_code}\nFINAL('done')")],
        }
    )
    with brood.Supervisor(model, store=url, limits=fast(hibernate_after=0)) as sup:
        h = sup.spawn("root task")
        until(lambda: hibernated(sup, url, h.id))
        assert not pid_alive(row(url, h.id)["pid"])
        gate.open()
        assert h.wait(timeout=60) == "42 finished"


def test_a_parent_waiting_on_a_child_queued_for_its_pool_hibernates_and_wakes(tmp_path):
    url = f"sqlite:///{tmp_path}/j.db"
    gate = Gate(tmp_path, "holder")
    model = brood.ScriptedModel(
        {
            "holder": [repl(f"{gate.wait_code}\nFINAL('held')")],
            "root": [
                repl("x = 21"),
                repl("r = rlm_query('child: pooled', pool='gpu')\nFINAL(f'{x * 2} {r}')"),
            ],
            "child": [repl("FINAL('pooled done')")],
        }
    )
    limits = fast(hibernate_after=0, pools={"gpu": 1})
    with brood.Supervisor(model, store=url, limits=limits) as sup:
        holder = sup.spawn("holder", pool="gpu")
        until(lambda: sup.statistics()["pools"]["gpu"]["holders"] == [holder.id])
        h = sup.spawn("root task")
        until(lambda: sup.statistics()["pools"]["gpu"]["waiting"] and hibernated(sup, url, h.id))
        assert not pid_alive(row(url, h.id)["pid"])
        gate.open()
        assert holder.wait(timeout=60) == "held"
        assert h.wait(timeout=60) == "42 pooled done"


def test_a_run_whose_replay_could_diverge_stays_live_and_says_why_once(tmp_path):
    url = f"sqlite:///{tmp_path}/j.db"
    gate = Gate(tmp_path, "child")
    model = brood.ScriptedModel(
        {
            "root": [
                repl(
                    "import threading\nstop = threading.Event()\n"
                    "t = threading.Thread(target=stop.wait)\nt.start()"
                ),
                repl(
                    "h = rlm_spawn('slow child')\nr = rlm_wait(h)\n"
                    "r2 = rlm_query('quick child')\nstop.set()\nFINAL(r + ' ' + r2)"
                ),
            ],
            "slow child": [repl(f"{gate.wait_code}\nFINAL('one')")],
            "quick child": [repl("FINAL('two')")],
        }
    )
    with brood.Supervisor(model, store=url, limits=fast(hibernate_after=0)) as sup:
        h = sup.spawn("root task")
        until(lambda: "stays_live" in kinds(url, h.id))
        pid = row(url, h.id)["pid"]
        assert pid_alive(pid) and sup.statistics()["hibernating"] == 0
        assert not row(url, h.id)["hibernating"]
        gate.open()
        assert h.wait(timeout=60) == "one two"
        with Journal(url) as journal:
            said = journal.store.events(h.id, "stays_live")
    assert len(said) == 1 and "threads" in said[0]["data"]["reason"]
    assert "hibernated" not in kinds(url, h.id)


def test_three_times_max_workers_parents_each_waiting_on_a_child_all_complete(tmp_path):
    url = f"sqlite:///{tmp_path}/j.db"
    max_workers = 2
    model = brood.ScriptedModel(
        {
            "parent": [
                repl("n = context"),
                repl("r = rlm_query('child of ' + n, context=n)\nFINAL(n + ':' + r)"),
            ],
            "child of": [repl("FINAL('c' + context)")],
        }
    )
    peak = [0]
    done = threading.Event()
    # Default hibernate_after (30 s): the parents hibernate to make room, not by the clock.
    with brood.Supervisor(model, store=url, limits=fast(max_workers=max_workers)) as sup:

        def sample() -> None:  # the live workers, read as often as the test runs
            while not done.wait(0.005):
                peak[0] = max(peak[0], sup.statistics()["workers"]["runs"])

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            handles = [sup.spawn(f"parent {i}", context=str(i)) for i in range(3 * max_workers)]
            answers = [h.wait(timeout=120) for h in handles]
        finally:
            done.set()
            sampler.join()
        stats = sup.statistics()
    assert answers == [f"{i}:c{i}" for i in range(3 * max_workers)]
    assert 1 <= peak[0] <= max_workers
    assert stats["workers"]["max"] == max_workers and stats["hibernating"] == 0
    with Journal(url) as journal:
        slept = journal.store.events(kind="hibernated")
    assert slept and all("max_workers=2" in e["data"]["reason"] for e in slept)


def test_a_supervisor_killed_while_a_run_hibernates_resumes_it_losing_nothing(tmp_path):
    url = f"sqlite:///{tmp_path}/j.db"
    gate = Gate(tmp_path, "child")
    root = [
        repl("x = 21"),
        repl("h = rlm_spawn('child: slow')\nr = rlm_wait(h)\nFINAL(f'{x * 2} {r}')"),
    ]
    child = [repl(f"{gate.wait_code}\nFINAL('child done')")]
    script = textwrap.dedent(f"""
        import brood, signal
        model = brood.ScriptedModel({{"root": {root!r}, "child": {child!r}}})
        sup = brood.Supervisor(model, store={url!r}, limits=brood.Limits(
            shutdown_grace=0.3, term_grace=0.3, fs_write=[{str(tmp_path)!r}],
            hibernate_after=0))
        print(sup.spawn("root task").id, flush=True)
        signal.pause()
    """)
    root_id: list[str] = []

    def asleep() -> None:
        until(lambda: root_id and row(url, root_id[0])["hibernating"])

    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        root_id.append(proc.stdout.readline().strip())
        asleep()
        slept_pid = row(url, root_id[0])["pid"]
    finally:
        proc.kill()
        proc.wait(60)
        if proc.stdout is not None:
            proc.stdout.close()
    wait_gone(proc.pid)
    assert not pid_alive(slept_pid)
    # The resumed root is answered from the journal: a new reply would change its answer.
    again = brood.ScriptedModel({"root": [repl("FINAL('asked again')")], "child": child})
    with brood.Supervisor(again, store=url, limits=fast(hibernate_after=0)) as sup:
        h = sup.resume(root_id[0])
        gate.open()
        assert h.wait(timeout=60) == "42 child done"
    with Journal(url) as journal:
        rows = journal.store.runs(root_id[0])
    assert [r["state"] for r in rows] == ["completed", "completed"]  # no second child


def test_a_follow_up_sent_to_a_hibernating_run_reaches_its_next_turn(tmp_path):
    url = f"sqlite:///{tmp_path}/j.db"
    gate = Gate(tmp_path, "model")

    def child_turn(messages: list[dict[str, Any]]) -> str:
        said = "hello there" in " ".join(str(m["content"]) for m in messages)
        return repl(f"FINAL('heard' if {said} else 'not heard')")

    model = brood.ScriptedModel(
        {
            "child": [repl("y = llm_query('plain: slow')\nprint(y)"), child_turn],
            "plain:": [gate.blocking_reply("slow answer")],
        }
    )
    with brood.Supervisor(model, store=url, limits=fast(hibernate_after=0)) as sup:
        h = sup.spawn("child task")
        until(lambda: hibernated(sup, url, h.id))
        h.send("hello there")
        gate.open()
        assert h.wait(timeout=60) == "heard"


def test_hibernate_after_and_max_workers_are_checked_naming_the_field():
    with pytest.raises(brood.InvalidArgument, match=r"Limits\.hibernate_after"):
        brood.Limits(hibernate_after=-1)
    with pytest.raises(brood.InvalidArgument, match=r"Limits\.max_workers"):
        brood.Limits(max_workers=0)
    assert brood.Limits(hibernate_after=0, max_workers=3).effective_max_workers() == 3
    assert 1 <= brood.Limits().effective_max_workers() <= 4_096


def test_a_session_root_waiting_on_its_child_stays_live_and_says_why(tmp_path):
    url = f"sqlite:///{tmp_path}/j.db"
    gate = Gate(tmp_path, "child")
    model = brood.ScriptedModel({"child": [repl(f"{gate.wait_code}\nFINAL('child done')")]})
    env = brood.Session(model, limits=fast(hibernate_after=0), store=url)

    def said() -> list[dict[str, Any]]:
        with Journal(url) as journal:
            return journal.store.events(run_id, "stays_live")

    def open_once_said() -> None:  # the child ends only once the root said it stays live
        try:
            until(said)
        finally:
            gate.open()  # the child waits for it, whatever the root said

    opener = threading.Thread(target=open_once_said)
    try:
        env.reset("task")
        run_id = env.run_id
        assert run_id is not None
        opener.start()
        obs = env.step("print(rlm_query('child task'))")
        opener.join()
        assert obs.stdout.strip() == "child done"
    finally:
        env.close()
    assert len(said()) == 1 and "Session" in said()[0]["data"]["reason"]


def test_a_run_with_spawned_work_in_flight_stays_live(tmp_path):
    url = f"sqlite:///{tmp_path}/j.db"
    child_gate, model_gate = Gate(tmp_path, "child"), Gate(tmp_path, "model")
    model = brood.ScriptedModel(
        {
            "root": [
                repl(
                    "t = spawn(llm_query, 'plain: slow')\nr = rlm_query('slow child')\n"
                    "FINAL(r + ' ' + rlm_await(t))"
                )
            ],
            "slow child": [repl(f"{child_gate.wait_code}\nFINAL('one')")],
            "plain:": [model_gate.blocking_reply("two")],
        }
    )
    with brood.Supervisor(model, store=url, limits=fast(hibernate_after=0)) as sup:
        h = sup.spawn("root task")
        until(lambda: "stays_live" in kinds(url, h.id))
        assert pid_alive(row(url, h.id)["pid"]) and not row(url, h.id)["hibernating"]
        child_gate.open()
        model_gate.open()
        assert h.wait(timeout=60) == "one two"
        with Journal(url) as journal:
            said = journal.store.events(h.id, "stays_live")
    assert len(said) == 1 and "spawn()" in said[0]["data"]["reason"]

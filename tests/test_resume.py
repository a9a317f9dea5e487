"""Resume after a crash: replay from the journal, adopt children instead of duplicating them."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import textwrap

import pytest

import brood
import brood.journal
from brood.testing import processes_of
from tests.util import FAST, Signal, pid_alive

FENCE = "```"
CRASH_TIMEOUT_S = 60
KILL_ROUNDS = 10  # rounds of kills of what a crashed supervisor left


def repl(code: str) -> str:
    return f"{FENCE}repl\n{code}\n{FENCE}"


ROOT = [
    repl("h = rlm_spawn('child A: count')\nx = llm_query('plain: what is 2+2?')\nprint(x)"),
    repl("r = rlm_query('child B: slow')\nprint(r)"),
    repl("FINAL(rlm_wait(h) + '|' + r + '|' + x)"),
]
CHILD_A = [repl("FINAL('A done')")]
PLAIN = ["4"]


def crashed_tree(tmp_path, root: list[str] = ROOT) -> tuple[str, str]:
    """Run the tree in another process until child B is inside its first model call, then
    SIGKILL that process. Returns (journal URL, root id)."""
    url = f"sqlite:///{tmp_path}/j.db"
    in_b = Signal(tmp_path, "in-b")
    script = textwrap.dedent(f"""
        import os, brood, json
        ROOT, CHILD_A, PLAIN = json.loads({json.dumps(json.dumps([root, CHILD_A, PLAIN]))})
        def child_b(messages):
            open({in_b.path!r}, "w").write("1")
            open({str(tmp_path / "never")!r}).read()  # blocks until the process is killed
        model = brood.ScriptedModel(
            {{"root": ROOT, "child A": CHILD_A, "plain:": PLAIN, "child B": [child_b]}},
            log_path={str(tmp_path / "calls-before.jsonl")!r})
        sup = brood.Supervisor(model, store={url!r},
                               limits=brood.Limits(shutdown_grace=0.3, term_grace=0.3,
                                                   fs_write=[{str(tmp_path)!r}]))
        print(sup.spawn("root task").id, flush=True)
        import signal; signal.pause()
    """)
    os.mkfifo(tmp_path / "never")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        root_id = proc.stdout.readline().strip()
        in_b.wait()
    finally:
        proc.kill()
        proc.wait(CRASH_TIMEOUT_S)
        proc.stdout.close()
    wait_gone(proc.pid)
    return url, root_id


def crash(script: str, ready) -> str:
    """Run `script` (a supervisor that prints its root's id, then waits) in another process
    until `ready()` returns, then SIGKILL that process and what it left. Returns the id."""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        root_id = proc.stdout.readline().strip()
        ready()
    finally:
        proc.kill()
        proc.wait(CRASH_TIMEOUT_S)
        proc.stdout.close()
    wait_gone(proc.pid)
    return root_id


def wait_gone(owner_pid: int) -> None:
    """Kill what the crashed supervisor left (its zygote usually has) and wait until each
    process has died (a pidfd becomes readable when its process exits). A zygote may fork
    one more worker while it is being killed, so this goes round until none is left."""
    for _ in range(KILL_ROUNDS):
        left = [p for p in processes_of(owner_pid) if pid_alive(p)]
        if not left:
            return
        for pid in left:
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                continue
            try:
                os.kill(pid, signal.SIGKILL)
                assert select.select([fd], [], [], CRASH_TIMEOUT_S)[0], f"pid {pid} did not die"
            except ProcessLookupError:
                pass
            finally:
                os.close(fd)
    assert not [p for p in processes_of(owner_pid) if pid_alive(p)]


def journaled_calls(url: str, root_id: str) -> dict[str, int]:
    """Model calls journaled before the resume, by run prompt."""
    from brood.journal import Journal

    with Journal(url) as journal:
        events = journal.store.events(root_id=root_id)
        prompts = {r["id"]: r["prompt"] for r in journal.store.runs(root_id)}
    resume_at = next(e["seq"] for e in events if e["kind"] == "resume")
    counts = dict.fromkeys(prompts.values(), 0)
    for e in events:
        if e["kind"] == "model_call" and e["seq"] < resume_at:
            counts[prompts[e["run_id"]]] += 1
    return counts


def calls(path) -> list[tuple[str, int]]:
    if not path.exists():
        return []
    return [(c["key"], c["turn"]) for c in map(json.loads, path.read_text().splitlines())]


def test_resume_replays_without_new_calls_and_adopts_children(tmp_path):
    url, root_id = crashed_tree(tmp_path)
    before = calls(tmp_path / "calls-before.jsonl")
    # (Child A may not have reached its model call yet: it runs beside the root.)
    assert ("root", 0) in before and ("root", 1) in before
    model = brood.ScriptedModel(
        {"root": ROOT, "child A": CHILD_A, "plain:": PLAIN, "child B": [repl("FINAL('B done')")]},
        log_path=tmp_path / "calls-after.jsonl",
    )
    with brood.Supervisor(model, store=url, limits=FAST) as sup:
        h = sup.resume(root_id)
        assert h.id == root_id
        assert h.wait(timeout=60) == "A done|B done|4"
        runs = sup.store.runs(root_id)
        events = [e["kind"] for e in sup.store.events(root_id)]
        tree_events = sup.store.events(root_id=root_id)
    after = calls(tmp_path / "calls-after.jsonl")
    # A system prompt is journaled once per tree, before and after the resume alike.
    prompts = [e["data"]["ref"] for e in tree_events if e["kind"] == "prompt"]
    assert len(prompts) == len(set(prompts)) >= 1
    # Recorded work is not asked of the model again: the root's first two turns and its
    # plain call are in the journal; its third turn and child B's first (in flight at the
    # crash) are new. Child A's one turn is new only if the crash beat its journaling.
    recorded = journaled_calls(url, root_id)
    assert recorded["root task"] == 3  # two turns and the plain call
    assert sorted(c for c in after if c[0] != "child A") == [("child B", 0), ("root", 2)]
    assert after.count(("child A", 0)) == (0 if recorded["child A: count"] else 1)
    # One child per key: A adopted (finished), B adopted (resumed), nothing started twice.
    assert sorted((r["key"], r["state"]) for r in runs if r["parent_id"]) == [
        ("1:0", "completed"),
        ("2:0", "completed"),
    ]
    assert "resume" in events
    # The scripted model has no price: the root said so once, before the crash, and its
    # live turn after the resume does not say it again.
    unpriced = [e for e in tree_events if e["kind"] == "cost_unknown"]
    assert [e["run_id"] for e in unpriced].count(root_id) == 1


def test_a_finished_tree_is_not_resumed_and_the_journal_is_unchanged(tmp_path):
    url = f"sqlite:///{tmp_path}/j.db"
    with brood.Supervisor(brood.ScriptedModel([repl("FINAL('x')")]), store=url, limits=FAST) as sup:
        root = sup.run("task").run_id
    before = (tmp_path / "j.db").read_bytes()
    with brood.Supervisor(brood.ScriptedModel([]), store=url, limits=FAST) as sup:
        with pytest.raises(brood.BroodError, match=f"run {root} is completed; a tree that has"):
            sup.resume(root)
        with pytest.raises(brood.StoreError, match="no run 'r-nope'"):
            sup.resume("r-nope")
        rows = sup.store.runs(root)
    assert [r["state"] for r in rows] == ["completed"]
    assert before  # the journal file existed and was read


def test_a_live_tree_is_refused_naming_its_pid(tmp_path):
    url = f"sqlite:///{tmp_path}/j.db"
    started = Signal(tmp_path, "started")
    never = tmp_path / "never"
    os.mkfifo(never)

    def block(messages):
        with open(started.path, "w") as f:
            f.write("1")
        with open(never) as f:
            f.read()

    with brood.Supervisor(brood.ScriptedModel([block]), store=url, limits=FAST) as owner:
        h = owner.spawn("task")
        started.wait()
        with (
            brood.Supervisor(brood.ScriptedModel([]), store=url, limits=FAST) as other,
            pytest.raises(brood.BroodError, match=f"pid {os.getpid()}"),
        ):
            other.resume(h.id)
        h.cancel()


def test_a_replay_that_asks_for_another_child_diverges(tmp_path):
    # Code that reads the world outside the REPL is not replay-safe: here the prompt of
    # child A comes from a file that changes between the crash and the resume.
    task = tmp_path / "task.txt"
    task.write_text("child A: count")
    root = [
        repl(f"h = rlm_spawn(open({str(task)!r}).read())\nx = llm_query('plain: q')"),
        *ROOT[1:],
    ]
    url, root_id = crashed_tree(tmp_path, root)
    task.write_text("child A: count differently")
    model = brood.ScriptedModel(
        {"root": root, "child A": CHILD_A, "plain:": PLAIN, "child B": [repl("FINAL('B')")]}
    )
    with brood.Supervisor(model, store=url, limits=FAST) as sup:
        h = sup.resume(root_id)
        with pytest.raises(brood.ReplayDiverged) as info:
            h.wait(timeout=60)
        runs = {r["id"]: r for r in sup.store.runs(root_id)}
    msg = str(info.value)
    assert f"run {root_id} step 1" in msg
    assert "'child A: count'" in msg and "'child A: count differently'" in msg
    assert runs[root_id]["state"] == "failed"
    assert runs[root_id]["reason"].startswith("replay diverged")
    # Nothing was started under the new prompt.
    assert len(runs) == 3


def test_remember_gives_back_the_journaled_value_on_replay(tmp_path):
    root = [
        repl(
            "import random\nv = remember(random.random)\nh = rlm_spawn('child A: count')\n"
            "x = llm_query('plain: q')\nprint(v)"
        ),
        ROOT[1],
        repl("FINAL(repr(v))"),
    ]
    url, root_id = crashed_tree(tmp_path, root)
    model = brood.ScriptedModel(
        {"root": root, "child A": CHILD_A, "plain:": PLAIN, "child B": [repl("FINAL('B')")]}
    )
    with brood.Supervisor(model, store=url, limits=FAST) as sup:
        answer = sup.resume(root_id).wait(timeout=60)
        (first_step,) = [e for e in sup.store.events(root_id, "step") if e["data"]["step"] == 1]
    assert answer == first_step["data"]["stdout"].strip()


def test_a_tree_cancelled_before_the_crash_stays_cancelled(tmp_path):
    """The cancel is journaled (cancelling) before its escalation; the crash lands while the
    escalation waits on a grandchild that ignores SIGTERM. The resume finishes the cancel and
    runs nothing again."""
    url = f"sqlite:///{tmp_path}/j.db"
    blocked, termed = Signal(tmp_path, "blocked"), Signal(tmp_path, "termed")
    # The grandchild says it is ready only once its SIGTERM handler is in place.
    grandchild = (
        "import signal, time\n"
        f"signal.signal(signal.SIGTERM, lambda *a: open({termed.path!r}, 'w').write('1'))\n"
        f"{blocked.code}\n"
        "time.sleep(10**6)"
    )
    child_code = (
        "import subprocess, sys, time\n"
        f"p = subprocess.Popen([sys.executable, '-c', {grandchild!r}])\n"
        "time.sleep(10**6)"
    )
    script = textwrap.dedent(f"""
        import brood, signal
        F = "```"
        model = brood.ScriptedModel({{
            "root": [F + "repl\\nh = rlm_spawn('child: stubborn')\\nrlm_wait(h)\\n" + F],
            "child:": [F + "repl\\n" + {child_code!r} + "\\n" + F],
        }})
        sup = brood.Supervisor(model, store={url!r},
                               limits=brood.Limits(shutdown_grace=0.2, term_grace=600,
                                                   fs_write=[{str(tmp_path)!r}]))
        h = sup.spawn("root task")
        print(h.id, flush=True)
        open({blocked.path!r}).read()  # stands in for the model code's signal: forwarded
        h.cancel()
    """)
    # The test reads `blocked` after the supervisor's script has passed it on.
    relay = Signal(tmp_path, "relay")
    script = script.replace(
        f"open({blocked.path!r}).read()",
        f"open({blocked.path!r}).read(); open({relay.path!r}, 'w').write('1')",
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        root_id = proc.stdout.readline().strip()
        relay.wait()  # the child is running; the supervisor now cancels the root
        termed.wait()  # the escalation reached SIGTERM: both cancels are journaled
    finally:
        proc.kill()
        proc.wait(CRASH_TIMEOUT_S)
        proc.stdout.close()
    wait_gone(proc.pid)
    before = {r["id"]: r["state"] for r in brood.journal.Journal(url).store.runs(root_id)}
    assert set(before.values()) == {"cancelling"}
    model = brood.ScriptedModel({}, log_path=tmp_path / "calls-after.jsonl")
    with brood.Supervisor(model, store=url, limits=FAST) as sup:
        result = sup.resume(root_id).wait_result(timeout=60)
        runs = sup.store.runs(root_id)
    assert result.state == "cancelled"
    assert [r["state"] for r in runs] == ["cancelled", "cancelled"]
    assert calls(tmp_path / "calls-after.jsonl") == []

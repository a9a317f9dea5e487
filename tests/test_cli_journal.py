"""The `brood` read and act commands against trees that ANOTHER process runs (DESIGN.md
sections 6, 7, 10 and 11).

A helper process owns the supervisor and the journal, as a second terminal would. Its tree
is scripted; model replies and model code meet the test through named pipes (tests/util.py),
so each command runs while the tree is held at a known point. The `brood` commands run as
their own processes. The conftest leftover check only sees processes this pytest process
owns, so the `start_tree` fixture checks what each helper's supervisor started.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from brood import Limits, ScriptedModel, Supervisor
from brood.journal import Journal
from brood.testing import processes_of
from tests.util import Gate, Signal, pid_alive

BROOD = [sys.executable, "-m", "brood.cli.main"]
WAIT_S = 30.0  # bound on any wait for another process; a failure, never a pace
FENCE = "```"

# The helper: runs one scripted tree on its own supervisor and prints the root's id, then
# the RunResult as JSON once the root ends. argv: script (JSON), store URL, root prompt.
# Each line "flush" on its stdin commits everything its journal has queued, then it prints
# "flushed" (a worker can run before its `running` is committed: readers wait for this).
# A reply is a string, or {"reply", "signal", "gate", "record"}: a reply that records the
# messages it was given, announces itself on a Signal fifo, then waits for a Gate fifo.
HELPER = """
import json, os, sys, threading
import brood

def held(spec):
    def answer(messages):
        if spec.get("record"):
            with open(spec["record"], "w") as f:
                json.dump(messages, f)
        if spec.get("signal"):
            with open(spec["signal"], "w") as f:
                f.write("1")
        if spec.get("gate"):
            with open(spec["gate"]) as f:
                f.read()
        return spec["reply"]
    return answer

script = {
    key: [r if isinstance(r, str) else held(r) for r in replies]
    for key, replies in json.loads(sys.argv[1]).items()
}
sup = brood.Supervisor(
    brood.ScriptedModel(script, tokens_per_call=(7, 3)),
    store=sys.argv[2],
    # Model code meets the test through files beside the journal (the test's tmp_path).
    limits=brood.Limits(
        shutdown_grace=0.3,
        term_grace=0.3,
        fs_write=[os.path.dirname(sys.argv[2].removeprefix("sqlite:///"))],
    ),
)
def flushes():
    for line in sys.stdin:
        sup.store.flush()
        print("flushed", flush=True)

try:
    handle = sup.spawn(sys.argv[3])
    print(handle.id, flush=True)
    threading.Thread(target=flushes, daemon=True).start()
    print(json.dumps(handle.wait_result()._asdict()), flush=True)
finally:
    sup.close()
"""

# Model code for a child that ignores SIGTERM and starts a grandchild that ignores it too,
# then records both pids in `pidfile` (the pattern of tests/test_cleanup.py).
STUBBORN = """import os, signal, subprocess, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)
gc = subprocess.Popen([sys.executable, '-c',
    'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(10**6)'])
open({pidfile!r}, 'w').write(f'{{os.getpid()}} {{gc.pid}}')"""


def repl(code: str) -> str:
    return f"{FENCE}repl\n{code}\n{FENCE}"


def held(
    reply: str,
    *,
    announce: Signal | None = None,
    gate: Gate | None = None,
    record: Path | None = None,
) -> dict[str, str]:
    """A scripted reply (run by the helper's worker) that records the messages it got,
    announces itself on `announce`, waits for `gate`, then answers `reply`."""
    spec = {"reply": reply}
    if announce is not None:
        spec["signal"] = announce.path
    if gate is not None:
        spec["gate"] = gate.path
    if record is not None:
        spec["record"] = str(record)
    return spec


# ---- meeting other processes, with a deadline ----------------------------------------------
def meet(wait: Callable[[], None], fifo: str, other_end: int, what: str) -> None:
    """Run a blocking fifo rendezvous (Signal.wait, Gate.open) with a deadline. If the other
    process never comes, open the other end ourselves so the thread is released, and fail."""
    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    thread.join(WAIT_S)
    if thread.is_alive():
        fd = os.open(fifo, other_end | os.O_NONBLOCK)
        if other_end == os.O_WRONLY:
            os.close(fd)  # the waiting reader sees end of file
            thread.join()
        else:
            thread.join()  # the waiting writer writes into our end
            os.close(fd)
        raise AssertionError(f"no process came to {what} within {WAIT_S} s")


def wait_for(sig: Signal) -> None:
    meet(sig.wait, sig.path, os.O_WRONLY, f"signal {os.path.basename(sig.path)}")


def open_gate(gate: Gate) -> None:
    meet(gate.open, gate.path, os.O_RDONLY, f"gate {os.path.basename(gate.path)}")


class Reader:
    """Reads a child process's stdout pipe with a deadline, so a process that hangs fails the
    test instead of hanging it."""

    def __init__(self, pipe: Any) -> None:
        self.fd = pipe.fileno()
        self.text = ""
        self.eof = False
        self._decode = codecs.getincrementaldecoder("utf-8")()

    def _read(self, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([self.fd], [], [], left)[0]:
            raise AssertionError(f"nothing more within {WAIT_S} s; so far: {self.text!r}")
        chunk = os.read(self.fd, 65536)
        self.eof = not chunk
        self.text += self._decode.decode(chunk, final=self.eof)

    def until(self, marker: str) -> str:
        deadline = time.monotonic() + WAIT_S
        while marker not in self.text:
            if self.eof:
                raise AssertionError(f"{marker!r} never came; the output was {self.text!r}")
            self._read(deadline)
        return self.text

    def to_end(self) -> str:
        deadline = time.monotonic() + WAIT_S
        while not self.eof:
            self._read(deadline)
        return self.text


def owned_by(owner_pid: int) -> list[int]:
    """Pids of the processes (zygote, workers, their grandchildren) that the supervisor in
    process `owner_pid` started (their owner mark is recorded with that pid)."""
    return processes_of(owner_pid)


def wait_gone(owner_pid: int) -> list[int]:
    """Wait (on pidfds: woken by each exit, no polling) until nothing `owner_pid`'s supervisor
    started is left; returns what is still there after WAIT_S. Scans again after each round:
    a zygote may fork a worker it was asked for just before its supervisor died."""
    deadline = time.monotonic() + WAIT_S
    while pids := owned_by(owner_pid):
        for pid in pids:
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                continue
            try:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([fd], [], [], left)[0]:
                    return owned_by(owner_pid)
            finally:
                os.close(fd)
    return []


class Tree:
    """A helper process that runs one scripted tree on its own supervisor and journal."""

    def __init__(self, tmp_path: Path, script: dict[str, list[Any]], prompt: str) -> None:
        self.store = f"sqlite:///{tmp_path}/j.db"
        self.journal = tmp_path / "j.db"
        self._stderr = tmp_path / "helper.stderr"
        with open(self._stderr, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", HELPER, json.dumps(script), self.store, prompt],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
            )
        self.out = Reader(self.proc.stdout)
        self.root = ""

    def read_root(self) -> str:
        try:
            self.root = self.out.until("\n").split("\n")[0]
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nhelper stderr:\n{self.stderr()}") from None
        return self.root

    def stderr(self) -> str:
        return self._stderr.read_text()

    def flush(self) -> None:
        """Have the helper commit everything its journal has queued so far."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"flush\n")
        self.proc.stdin.flush()
        self.out.until("flushed\n")
        self.out.text = self.out.text.replace("flushed\n", "", 1)

    def finish(self) -> dict[str, Any]:
        """Wait for the root to end and the helper to close its supervisor and exit; returns
        the RunResult it printed."""
        text = self.out.to_end()
        assert self.proc.wait(timeout=WAIT_S) == 0, self.stderr()
        return json.loads(text.splitlines()[-1])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=WAIT_S)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


@pytest.fixture
def start_tree(tmp_path: Path) -> Iterator[Callable[[dict[str, list[Any]]], Tree]]:
    """Starts helper processes; at teardown kills any still running and checks that every
    process their supervisors started is gone."""
    trees: list[Tree] = []

    def start(script: dict[str, list[Any]], prompt: str = "root: the task") -> Tree:
        tree = Tree(tmp_path, script, prompt)
        trees.append(tree)
        tree.read_root()
        return tree

    yield start
    left: dict[int, list[int]] = {}
    for tree in trees:
        tree.close()
        if still := wait_gone(tree.proc.pid):
            left[tree.proc.pid] = still
            for pid in still:  # so one leak does not cascade into the next tests
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
    assert not left, f"processes left behind by the helper's supervisor: {left}"


def cli_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("BROOD_MODEL", "BROOD_STORE")}
    return env | {"COLUMNS": "200"}  # rich wraps at COLUMNS


def brood(
    *args: str, store: str | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """The `brood` command as its own process."""
    store_args = ["--store", store] if store is not None else []
    return subprocess.run(
        [*BROOD, *args, *store_args],
        capture_output=True,
        text=True,
        timeout=WAIT_S,
        env=cli_env() | (env or {}),
    )


def brood_each(calls: list[tuple[tuple[str, ...], str]]) -> list[subprocess.CompletedProcess[str]]:
    """`brood ARGS --store URL` for each (ARGS, URL), a few at a time: each is mostly start-up."""
    with ThreadPoolExecutor(max_workers=4) as pool:
        return list(pool.map(lambda call: brood(*call[0], store=call[1]), calls))


def ok(*args: str, store: str) -> str:
    out = brood(*args, store=store)
    assert out.returncode == 0, f"brood {' '.join(args)}: {out.stderr}"
    return out.stdout


def ok_json(*args: str, store: str) -> Any:
    return json.loads(ok(*args, "--json", store=store))


def children_by_prompt(node: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["prompt"]: c for c in node["children"]}


# ---- a running tree ------------------------------------------------------------------------
def test_ps_tree_show_and_export_see_a_tree_another_process_runs(tmp_path, start_tree):
    a_up, b_up = Signal(tmp_path, "a-up"), Signal(tmp_path, "b-up")
    a_go, b_go, root_go = Gate(tmp_path, "a-go"), Gate(tmp_path, "b-go"), Gate(tmp_path, "r-go")
    a_saw = tmp_path / "a-saw.json"
    tree = start_tree(
        {
            "root:": [
                repl("print('root step ' + 'one')\na = rlm_spawn('child a: wait')"),
                repl(f"b = rlm_spawn('child b: wait')\n{root_go.wait_code}"),
                repl("FINAL(rlm_wait(a) + rlm_wait(b))"),
            ],
            "child a:": [held(repl("FINAL('A')"), announce=a_up, gate=a_go, record=a_saw)],
            "child b:": [held(repl("FINAL('B')"), announce=b_up, gate=b_go)],
        }
    )
    wait_for(a_up)
    wait_for(b_up)
    tree.flush()
    # Child b was spawned after the root's first step and second model call were reported,
    # and its `running` was queued for the journal before its worker started: once what
    # is queued is committed, the journal holds exactly two turns and one step of the root,
    # and both children are running, blocked in their first model call.
    store = tree.store

    (row,) = ok_json("ps", store=store)
    assert row["run_id"] == tree.root and row["state"] == "running"
    assert row["stale"] is False
    assert row["runs"] == 3 and row["open"] == 3
    assert row["subtree_usage"]["model_calls"] == 2
    text = ok("ps", store=store)
    assert tree.root in text and "running" in text and "3 (3 open)" in text
    assert "root: the task" in text and "stale" not in text

    node = ok_json("tree", tree.root, store=store)
    assert node["run_id"] == tree.root and node["state"] == "running"
    kids = children_by_prompt(node)
    assert set(kids) == {"child a: wait", "child b: wait"}
    for kid in kids.values():
        assert kid["state"] == "running" and kid["stale"] is False
        assert kid["parent_id"] == tree.root and kid["depth"] == 1
    a_id, b_id = kids["child a: wait"]["run_id"], kids["child b: wait"]["run_id"]
    text = ok("tree", tree.root, store=store)
    assert all(i in text for i in (tree.root, a_id, b_id))
    assert text.count("running") == 3 and "root step one" in text  # the last line of output

    run = ok_json("show", tree.root, store=store)
    assert run["prompt"] == "root: the task" and run["state"] == "running"
    assert run["usage"]["model_calls"] == 2
    assert run["usage"]["input_tokens"] == 14 and run["usage"]["output_tokens"] == 6
    assert run["children"] == [a_id, b_id]
    (step,) = run["steps"]
    assert "print('root step ' + 'one')" in step["code"] and step["stdout"] == "root step one\n"
    text = ok("show", tree.root, store=store)
    assert "prompt: root: the task" in text and "usage: 2 calls, 20 tok" in text
    assert "step 1" in text and "root step one" in text and "step 2" not in text
    child = ok_json("show", a_id, store=store)
    assert child["parent_id"] == tree.root and child["prompt"] == "child a: wait"
    assert child["state"] == "running" and child["steps"] == []

    for gate in (a_go, b_go, root_go):
        open_gate(gate)
    result = tree.finish()
    assert result["state"] == "completed" and result["answer"] == "AB"
    assert not owned_by(tree.proc.pid)  # the helper's close confirmed every exit

    (row,) = ok_json("ps", store=store)
    assert row["state"] == "completed" and row["open"] == 0 and row["stale"] is False
    lines = ok("export", tree.root, "--format", "jsonl", store=store).splitlines()
    records = [json.loads(line) for line in lines]
    assert len(records) == 5 == row["subtree_usage"]["model_calls"]  # root 3 turns, 1 each
    assert [r["run_id"] for r in records] == [tree.root] * 3 + [a_id, b_id]
    assert [r["turn"] for r in records] == [1, 2, 3, 1, 1]
    for r in records:
        assert r["kind"] == "turn"
        assert r["usage"] == {"input_tokens": 7, "output_tokens": 3, "cost": None}
        assert r["messages"][0]["role"] == "system" and r["messages"][-1]["role"] == "user"
        assert r["response"].startswith(f"{FENCE}repl")
    roles = [m["role"] for m in records[2]["messages"]]  # the whole conversation so far
    assert roles == ["system", "user", "assistant", "user", "assistant", "user"]
    assert records[3]["messages"] == json.loads(a_saw.read_text())  # what the model was given
    # The journal holds each system prompt once per tree; requests refer to it by hash.
    with Journal(store) as journal:
        events = journal.store.events(root_id=tree.root)
    prompts = {e["data"]["ref"]: e["data"]["content"] for e in events if e["kind"] == "prompt"}
    firsts = [e["data"]["request"][0] for e in events if e["kind"] == "model_call"]
    assert len(prompts) == len([e for e in events if e["kind"] == "prompt"])
    assert {m["prompt_ref"] for m in firsts if "prompt_ref" in m} == set(prompts)
    assert all("content" not in m for m in firsts if m["role"] == "system")
    assert records[3]["parent_id"] == tree.root and records[3]["depth"] == 1


def test_logs_follow_sees_a_later_step_and_exits_when_the_run_ends(tmp_path, start_tree):
    up, go = Signal(tmp_path, "up"), Gate(tmp_path, "go")
    tree = start_tree(
        {
            "root:": [
                repl("print('first ' + 'step')"),
                held(repl("print('late ' + 'step')"), announce=up, gate=go),
                repl("FINAL('fol' + 'lowed')"),
            ]
        }
    )
    wait_for(up)  # blocked in its second model call
    follow = subprocess.Popen(
        [*BROOD, "logs", tree.root, "--follow", "--store", tree.store],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=cli_env(),
    )
    try:
        out = Reader(follow.stdout)
        out.until("first step")  # it has read the journal up to the blocked turn
        assert "late step" not in out.text
        open_gate(go)
        text = out.to_end()  # ends by itself once the run has ended
        assert follow.wait(timeout=WAIT_S) == 0, follow.stderr.read() if follow.stderr else ""
    finally:
        if follow.poll() is None:
            follow.kill()
            follow.wait()
        for pipe in (follow.stdout, follow.stderr):
            if pipe is not None:
                pipe.close()
    assert "print('late ' + 'step')" in text and "late step" in text  # its code and stdout
    assert text.index("first step") < text.index("late step")
    assert "FINAL('fol' + 'lowed')" in text  # the last model turn too
    assert tree.finish()["answer"] == "followed"


def test_send_reaches_the_next_model_turn_of_a_run_another_process_runs(tmp_path, start_tree):
    up, go = Signal(tmp_path, "up"), Gate(tmp_path, "go")
    saw = tmp_path / "turn-2.json"
    tree = start_tree(
        {
            "root:": [
                held(repl("print('waiting for word')"), announce=up, gate=go),
                held(repl("FINAL('heard')"), record=saw),
            ]
        }
    )
    wait_for(up)  # blocked in its first model call
    out = brood("send", tree.root, "use the blue key", store=tree.store)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"sent to {tree.root}"
    open_gate(go)
    assert tree.finish()["answer"] == "heard"
    last = json.loads(saw.read_text())[-1]
    assert last["role"] == "user"
    assert "[message from your parent] use the blue key" in last["content"]
    events = [
        json.loads(line)
        for line in ok("logs", tree.root, "--json", store=tree.store).split("\n")
        if line
    ]
    assert [e["data"]["message"] for e in events if e["kind"] == "message"] == ["use the blue key"]


def read_pids(path: Path) -> list[int]:
    return [int(x) for x in path.read_text().split()]


def test_cancel_returns_once_every_process_of_the_subtree_is_gone(tmp_path, start_tree):
    root_up, never = Signal(tmp_path, "root-up"), Gate(tmp_path, "never")
    ups = [Signal(tmp_path, f"up{i}") for i in range(2)]
    pidfiles = [tmp_path / f"pids{i}" for i in range(2)]
    root_pid = tmp_path / "root-pid"
    tree = start_tree(
        {
            "root:": [
                repl(
                    f"import os\nopen({str(root_pid)!r}, 'w').write(str(os.getpid()))\n"
                    "hs = [rlm_spawn(f'stubborn {i}: hold') for i in range(2)]"
                ),
                held("unreachable", announce=root_up, gate=never),
            ],
            **{
                f"stubborn {i}:": [
                    repl(STUBBORN.format(pidfile=str(pidfiles[i]))),
                    held("unreachable", announce=ups[i], gate=never),
                ]
                for i in range(2)
            },
        }
    )
    for s in (root_up, *ups):
        wait_for(s)
    kids = children_by_prompt(ok_json("tree", tree.root, store=tree.store))
    first = kids["stubborn 0: hold"]["run_id"]
    first_pids, second_pids = read_pids(pidfiles[0]), read_pids(pidfiles[1])
    root_worker = int(root_pid.read_text())
    assert all(pid_alive(p) for p in (*first_pids, *second_pids, root_worker))

    out = brood("cancel", first, store=tree.store)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"{first} cancelled"
    # Returned only once the worker and its grandchild, both ignoring SIGTERM, were gone.
    assert not any(pid_alive(p) for p in first_pids)
    assert all(pid_alive(p) for p in (*second_pids, root_worker))

    assert ok_json("cancel", tree.root, store=tree.store) == {
        "run_id": tree.root,
        "state": "cancelled",
    }
    assert not any(pid_alive(p) for p in (*second_pids, root_worker))

    result = tree.finish()
    assert result["state"] == "cancelled"
    assert result["error"] == "cancelled by user (brood cancel)"
    node = ok_json("tree", tree.root, store=tree.store)
    kids = children_by_prompt(node)
    assert kids["stubborn 0: hold"]["reason"] == "cancelled by user (brood cancel)"
    assert kids["stubborn 1: hold"]["reason"] == "parent cancelled"
    assert {k["state"] for k in kids.values()} == {"cancelled"}


# ---- a tree whose supervisor died ----------------------------------------------------------
def test_read_commands_show_the_runs_of_a_dead_supervisor_as_stale(tmp_path, start_tree):
    root_up, child_up, never = Signal(tmp_path, "r"), Signal(tmp_path, "c"), Gate(tmp_path, "n")
    tree = start_tree(
        {
            "root:": [
                repl("print('root step ' + 'one')"),
                repl(f"c = rlm_spawn('child: hold')\n{root_up.code}\n{never.wait_code}"),
            ],
            "child:": [held("unreachable", announce=child_up, gate=never)],
        }
    )
    wait_for(root_up)
    wait_for(child_up)
    tree.flush()  # the root's first step and two turns, and the child's start, are committed
    helper = tree.proc.pid
    assert owned_by(helper)  # its zygote and workers
    os.kill(helper, signal.SIGKILL)
    tree.proc.wait(timeout=WAIT_S)
    # Workers exit on their own when the supervisor is gone; the zygote kills the rest.
    assert wait_gone(helper) == []
    store = tree.store

    (row,) = ok_json("ps", store=store)
    assert row["run_id"] == tree.root and row["state"] == "running"
    assert row["stale"] is True and row["runs"] == 2 and row["open"] == 2
    assert "(stale)" in ok("ps", store=store)

    node = ok_json("tree", tree.root, store=store)
    (child,) = node["children"]
    assert node["stale"] is True and child["stale"] is True
    assert node["state"] == child["state"] == "running"
    assert ok("tree", tree.root, store=store).count("(stale)") == 2

    run = ok_json("show", tree.root, store=store)
    assert run["state"] == "running" and run["stale"] is True and run["duration"] is None
    assert run["usage"]["model_calls"] == 2
    assert [s["stdout"] for s in run["steps"]] == ["root step one\n"]
    assert "(stale)" in ok("show", tree.root, store=store)

    assert "root step one" in ok("logs", tree.root, store=store)
    followed = ok("logs", tree.root, "--follow", store=store)  # a stale run ends the follow
    assert "root step one" in followed

    records = [json.loads(x) for x in ok("export", tree.root, store=store).splitlines()]
    root_records = [r for r in records if r["run_id"] == tree.root]
    assert [r["turn"] for r in root_records] == [1, 2]
    assert all(r["messages"] and r["usage"]["input_tokens"] == 7 for r in records)

    for args in (
        ("cancel", tree.root),
        ("cancel", child["run_id"]),
        ("send", tree.root, "still there?"),
    ):
        out = brood(*args, store=store)
        assert out.returncode == 2, out
        assert f"run {args[1]} is stale" in out.stderr
        assert f"its supervisor (pid {helper}) is gone" in out.stderr


# ---- bad input and a finished journal -------------------------------------------------------
def journal_file(path: Path) -> tuple[str, int]:
    return hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns


def test_read_commands_leave_a_finished_journal_unchanged(tmp_path, start_tree):
    tree = start_tree(
        {
            "root:": [repl("print('root says hi')\nFINAL(rlm_query('child: answer'))")],
            "child:": [repl("print('child says hi')\nFINAL('42')")],
        }
    )
    assert tree.finish()["answer"] == "42"
    assert not (tmp_path / "j.db-wal").exists()  # the writer closed it cleanly
    before = journal_file(tree.journal)
    child = ok_json("tree", tree.root, store=tree.store)["children"][0]["run_id"]
    reads = [
        ("ps",),
        ("ps", "--json"),
        ("tree", tree.root),
        ("tree", tree.root, "--json"),
        ("show", tree.root),
        ("show", child, "--json"),
        ("logs", tree.root),
        ("logs", child, "--json"),
        ("logs", tree.root, "--follow"),
        ("export", tree.root, "--format", "jsonl"),
    ]
    for args, out in zip(reads, brood_each([(a, tree.store) for a in reads]), strict=True):
        assert out.returncode == 0 and out.stdout.strip(), (args, out)
    assert journal_file(tree.journal) == before
    # SQLite does leave an empty j.db-wal and a j.db-shm next to it: reading WAL needs them.
    assert (tmp_path / "j.db-wal").stat().st_size == 0


def test_an_unknown_run_id_is_named_with_exit_code_2(start_tree):
    tree = start_tree({"root:": [repl("FINAL('done')")]})
    tree.finish()
    unknown = [
        ("tree", "r-000000"),
        ("show", "r-000000"),
        ("logs", "r-000000"),
        ("logs", "r-000000", "--follow"),
        ("export", "r-000000"),
        ("cancel", "r-000000"),
        ("send", "r-000000", "hello"),
    ]
    for args, out in zip(unknown, brood_each([(a, tree.store) for a in unknown]), strict=True):
        assert out.returncode == 2, (args, out)
        assert "r-000000" in out.stderr and "Traceback" not in out.stderr, (args, out.stderr)
    out = brood("cancel", tree.root, store=tree.store)
    assert out.returncode == 2
    assert f"run {tree.root} is completed" in out.stderr
    out = brood("export", tree.root, "--format", "csv", store=tree.store)
    assert out.returncode == 2 and "--format 'csv'" in out.stderr


def test_a_store_that_cannot_be_opened_is_named_with_exit_code_2(tmp_path):
    missing = tmp_path / "nowhere" / "j.db"
    garbage = tmp_path / "garbage.db"
    garbage.write_text("not a journal at all\n" * 100)
    commands = [
        ("ps",),
        ("tree", "r-000000"),
        ("show", "r-000000"),
        ("logs", "r-000000"),
        ("export", "r-000000"),
        ("cancel", "r-000000"),
        ("send", "r-000000", "hello"),
    ]
    calls = [(args, f"sqlite:///{missing}") for args in commands]
    named = {f"sqlite:///{missing}": str(missing)}
    for url, name in (
        (f"sqlite:///{garbage}", str(garbage)),
        ("nonsense", "'nonsense'"),
        ("mysql://db/x", "'mysql'"),
        ("postgresql://nobody@127.0.0.1:1/x", "127.0.0.1"),
    ):
        calls.append((("ps",), url))
        named[url] = name
    for (args, url), out in zip(calls, brood_each(calls), strict=True):
        assert out.returncode == 2, (args, url, out)
        assert named[url] in out.stderr, (args, url, out.stderr)
        assert "Traceback" not in out.stderr, (args, url, out.stderr)
    out = brood("ps", env={"BROOD_STORE": f"sqlite:///{missing}"})
    assert out.returncode == 2 and str(missing) in out.stderr
    assert not missing.parent.exists()  # a read command does not create a journal


# ---- known bugs (see the reasons) ----------------------------------------------------------
FOLLOW_END_S = 5.0  # 20 of logs' 0.25 s re-reads: ample to notice a dead supervisor


def test_logs_follow_ends_when_the_supervisor_dies_while_it_follows(tmp_path, start_tree):
    up, go, never = Signal(tmp_path, "up"), Gate(tmp_path, "go"), Gate(tmp_path, "never")
    up_again = Signal(tmp_path, "up-again")
    tree = start_tree(
        {
            "root:": [
                repl("print('first ' + 'step')"),
                held(repl("print('late ' + 'step')"), announce=up, gate=go),
                held("unreachable", announce=up_again, gate=never),
            ]
        }
    )
    wait_for(up)
    follow = subprocess.Popen(
        [*BROOD, "logs", tree.root, "--follow", "--store", tree.store],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=cli_env(),
    )
    try:
        out = Reader(follow.stdout)
        out.until("first step")
        open_gate(go)
        # A second batch of output means it has looked at the run (and its supervisor)
        # at least once between the two.
        out.until("late step")
        wait_for(up_again)
        os.kill(tree.proc.pid, signal.SIGKILL)
        tree.proc.wait(timeout=WAIT_S)
        assert wait_gone(tree.proc.pid) == []
        follow.wait(timeout=FOLLOW_END_S)
    except subprocess.TimeoutExpired:
        raise AssertionError(
            f"logs --follow still running {FOLLOW_END_S} s after its supervisor died"
        ) from None
    finally:
        if follow.poll() is None:
            follow.kill()
            follow.wait()
        if follow.stdout is not None:
            follow.stdout.close()
    assert follow.returncode == 0


def test_a_journal_in_a_folder_the_reader_cannot_write_is_readable():
    # Not under tmp_path, whose parents are private to their owner: as root the reader runs
    # as another user (root ignores folder permissions), via setpriv.
    if os.geteuid() != 0:
        reader: list[str] = []
    elif shutil.which("setpriv"):
        reader = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    else:
        pytest.skip("as root this needs setpriv to read the journal as another user")
    env = cli_env()
    check = subprocess.run(
        [*reader, sys.executable, "-c", "import brood.cli.main"],
        capture_output=True,
        env=env,
        timeout=WAIT_S,
    )
    if check.returncode != 0:
        pytest.skip(f"the reader cannot import brood: {check.stderr[-300:]!r}")
    folder = Path(tempfile.mkdtemp(prefix="brood-ro-"))
    store = f"sqlite:///{folder}/j.db"
    try:
        limits = Limits(shutdown_grace=0.3, term_grace=0.3)
        with Supervisor(ScriptedModel([repl("FINAL('ok')")]), store=store, limits=limits) as sup:
            root = sup.run("root: the task").run_id
        folder.chmod(0o755 if reader else 0o555)  # readable, not writable, by the reader
        out = subprocess.run(
            [*reader, *BROOD, "ps", "--store", store],
            capture_output=True,
            text=True,
            env=env,
            timeout=WAIT_S,
        )
        assert out.returncode == 0, out.stderr
        assert root in out.stdout
    finally:
        folder.chmod(0o700)
        shutil.rmtree(folder)

"""Random spawn / cancel / finish / close sequences against real workers (DESIGN.md 2, 5, 6).

A Hypothesis state machine starts root runs and, from their REPLs, children and
grandchildren; it finishes runs (an answer, a crash, a model error), cancels them (a root
through its handle, a child through its parent's `rlm_cancel`), makes parents wait on
children, lets a child time out, gives runs grandchild processes that ignore SIGTERM, and
closes the supervisor.
After every step it reads the journal and checks the contract:

- every run's journaled transitions are a path of `brood.TRANSITIONS` from `queued`, and the
  run's row agrees with the last one;
- a terminal transition has a reason, a terminal run never changes again, and a terminal
  run has no run below it that is not terminal (no child outlives its parent);
- a run recorded as terminal has no live process in its worker's process group, and no live
  grandchild that its code started;
- each run ended the way the machine made it end, with the reason it should carry;
- after close() every run is terminal, no brood process is left, each run had one on_end
  (and at most one on_start) that agrees with the journal, and the old supervisor and its
  handles refuse further use.

The journal is read with sqlite3 in one read transaction, so that a parent and its children
are seen at one instant (two calls through the Store would race with the supervisor).

How model code and the machine meet, without sleeping: every model turn of run NAME opens
the fifo `NAME.gate` read-write (so it never blocks there and reads wait for data), then
announces itself on the fifo `NAME.sig`, then reads the gate. The machine consumes the
announcement (`ready`), so it knows the run sits in its model call; it then writes the
run's next reply into the gate, which cannot block because a reader is there. A reply is
REPL code; code whose result the machine needs writes it to `NAME.out`, read at the next
announcement.

Not covered here: starts that queue for a slot (max_concurrency is never reached, so every
announcement the machine waits for is sure to come), follow-up messages and budgets.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import select
import shutil
import sqlite3
import tempfile
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import brood
from brood.testing import leftover_processes

MAX_DEPTH = 3  # root, child, grandchild
MAX_OPEN_ROOTS = 2  # Hypothesis favours spawn_root; more roots would crowd out the rest
CLOSE_WITH_LIVE = 2  # close mid-sequence once, with runs going
MAX_LIVE = 4  # runs not yet ended at once; also max_concurrency, so no start ever queues
CHILD_TIMEOUT_S = 0.3  # of the child that child_times_out never answers
WAIT_S = 20.0  # a handshake that takes this long is a hang, reported as a failure
RAISE = "!raise"  # the gate word that makes the model itself raise instead of replying
STUBBORN_SLEEP = "trap '' TERM; exec sleep 1000"  # a grandchild that only SIGKILL ends
# What a parent's open children are cancelled with, by how the parent ended.
CHILD_REASON = {
    "completed": "parent finished",
    "failed": "parent failed",
    "cancelled": "parent cancelled",
}
LIMITS = brood.Limits(
    shutdown_grace=0.2,
    term_grace=0.2,
    max_depth=MAX_DEPTH,
    max_concurrency=MAX_LIVE,
    child_timeout=None,
    step_timeout=None,
)


def make_chat_fn(directory: str):
    """The model of every run. Defined inside a function so that cloudpickle ships it by
    value: a worker then never imports this test module (nor Hypothesis)."""

    def chat_fn(messages: list[dict[str, Any]], model: str | None = None) -> str:
        import os
        import re

        task = next(m["content"] for m in messages if m["role"] == "user")
        name = re.search(r"sm-run (\w+)", task).group(1)
        base = os.path.join(directory, name)
        gate = os.open(base + ".gate", os.O_RDWR)
        try:
            with open(base + ".sig", "w") as f:
                f.write("1")
            reply = os.read(gate, 4096).decode()
        finally:
            os.close(gate)
        if reply == "!raise":
            raise RuntimeError(f"the model of {name} fails on purpose")
        return reply

    return chat_fn


def repl(code: str) -> str:
    return f"```repl\n{code}\n```"


def wait_signal(path: str, what: str) -> None:
    """Consume one announcement on the fifo `path`, failing (not hanging) after WAIT_S.

    Opened non-blocking while no writer has it open, a fifo polls as not ready on Linux
    until a writer comes, so poll() waits for the writer's byte. The writer of the previous
    announcement may not have closed its end yet: then the fifo reports end-of-file when
    it does, with no byte; open it afresh and wait on.
    """
    deadline = time.monotonic() + WAIT_S
    while True:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            left = deadline - time.monotonic()
            if left <= 0 or not poller.poll(left * 1000):
                raise AssertionError(f"{what} did not reach its model call within {WAIT_S} s")
            if os.read(fd, 16):
                return
        finally:
            os.close(fd)


def write_gate(path: str, reply: str, what: str) -> None:
    """Hand a reply to a run that sits in its model call. The reader is there (it announced
    itself after opening the gate), so this never blocks; ENXIO means it is gone."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise AssertionError(f"{what} is no longer waiting on its gate: {exc}") from exc
    try:
        os.write(fd, reply.encode())
    finally:
        os.close(fd)


def live_groups() -> dict[int, list[int]]:
    """{process group id: pids} of every process that has not exited (zombies excluded)."""
    groups: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            groups.setdefault(int(fields[2]), []).append(int(entry))
    return groups


class Phase(enum.Enum):
    ARRIVING = "arriving"  # will announce itself in its next model call
    WAITING = "waiting"  # sits in its model call, reading its gate
    BLOCKED = "blocked"  # in rlm_wait on one of its children
    ENDING = "ending"  # an rlm_cancel of it or of a run above it is in flight
    ENDED = "ended"  # terminal, and the machine knows how it ended


@dataclass(eq=False)
class Node:
    """The machine's model of one run."""

    name: str
    depth: int
    parent: Node | None
    handle: brood.RunHandle | None = None  # roots only
    run_id: str | None = None
    phase: Phase = Phase.ARRIVING
    children: list[Node] = field(default_factory=list)
    # Set while ARRIVING after a command whose result the run writes to NAME.out.
    expect_out: tuple[str, Any] | None = None
    blocked_on: Node | None = None
    confirmed: bool = False  # its start was journaled (seen, or its parent said so)
    arrived: bool = False  # it has been seen in its model call at least once
    # How it may end instead, if a run above it ends first: (state, reason prefix).
    racing: tuple[str, str] | None = None
    # How it ended: (state, reason prefix) pairs, one of which the journal must show.
    end_options: tuple[tuple[str, str], ...] = ()

    def __repr__(self) -> str:
        return f"<run {self.name} {self.phase.value} {self.run_id}>"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # how Hypothesis prints a draw
        p.text(repr(self))

    @property
    def prompt(self) -> str:
        return f"sm-run {self.name}"

    @property
    def open(self) -> bool:
        return self.phase is not Phase.ENDED

    @property
    def end_state(self) -> str:
        (state,) = {s for s, _ in self.end_options}
        return state

    def ended_as(self, row: dict[str, Any]) -> bool:
        return any(
            row["state"] == s and (row["reason"] or "").startswith(r) for s, r in self.end_options
        )

    def subtree(self) -> list[Node]:
        return [self, *(n for c in self.children for n in c.subtree())]


class LifecycleMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="brood-sm-")
        self.db = os.path.join(self.dir, "journal.db")
        self.names = 0
        self.reopened = False  # one close mid-sequence is enough; teardown closes again
        self.nodes: list[Node] = []  # this supervisor's runs
        self.old_handles: list[brood.RunHandle] = []  # roots of supervisors closed since
        self.terminal: dict[str, tuple[str, str]] = {}  # run id -> (state, reason) first seen
        self.verified: set[str] = set()  # terminal runs whose processes were seen gone
        self.sup: brood.Supervisor | None = self.new_supervisor()

    def new_supervisor(self) -> brood.Supervisor:
        self.starts: list[brood.RunInfo] = []
        self.ends: list[brood.RunInfo] = []
        self.earlier = {r["id"] for r in self.journal()[0]} if os.path.exists(self.db) else set()
        # A store URL, not the default temporary journal: that one is removed at close,
        # and the checks after close read the journal.
        return brood.Supervisor(
            make_chat_fn(self.dir),
            # Model code writes what the machine must check into the machine's folder.
            limits=dataclasses.replace(LIMITS, fs_write=(self.dir,)),
            store=f"sqlite:///{self.db}",
            on_start=self.starts.append,
            on_end=self.ends.append,
        )

    # ---- the machine's bookkeeping -----------------------------------------------------
    def new_node(self, parent: Node | None) -> Node:
        name = f"n{self.names}"
        self.names += 1
        for suffix in (".gate", ".sig"):
            os.mkfifo(os.path.join(self.dir, name + suffix))
        node = Node(name, 0 if parent is None else parent.depth + 1, parent)
        if parent is not None:
            parent.children.append(node)
        self.nodes.append(node)
        return node

    def path(self, node: Node, suffix: str) -> str:
        return os.path.join(self.dir, node.name + suffix)

    def journal(self) -> tuple[list[dict[str, Any]], dict[str, list[dict[str, Any]]]]:
        """Every run and every transition, read in one snapshot (WAL readers see one)."""
        conn = sqlite3.connect(self.db, isolation_level=None)
        conn.row_factory = sqlite3.Row
        try:
            conn.execute("BEGIN")
            runs = [dict(r) for r in conn.execute("SELECT * FROM runs ORDER BY created_at")]
            moves: dict[str, list[dict[str, Any]]] = {}
            for r in conn.execute('SELECT run_id, frm, "to", reason FROM transitions ORDER BY seq'):
                moves.setdefault(r["run_id"], []).append(dict(r))
            conn.execute("COMMIT")
        finally:
            conn.close()
        return runs, moves

    def row_of(self, node: Node, runs: list[dict[str, Any]] | None = None) -> dict[str, Any] | None:
        """The node's journal row; None while its start has not been journaled (or never
        will be: a spawn refused because its parent was ending)."""
        if runs is None:
            runs = self.journal()[0]
        rows = [r for r in runs if r["prompt"] == node.prompt]
        assert len(rows) <= 1, f"{node.prompt!r} was started {len(rows)} times"
        if rows and node.run_id is None:
            node.run_id = rows[0]["id"]
        return rows[0] if rows else None

    def handle_of(self, node: Node) -> brood.RunHandle:
        if node.handle is not None:
            return node.handle
        # A child has no public handle outside its parent's REPL; wrap the supervisor's
        # own record of it so the machine can wait for its end without polling.
        assert self.sup is not None and self.row_of(node) is not None
        return brood.RunHandle(self.sup._engine, self.sup._engine.core.runs[node.run_id])

    def open_roots(self) -> list[Node]:
        return [n for n in self.nodes if n.depth == 0 and n.open]

    def live(self) -> int:
        return sum(n.open for n in self.nodes)

    def eligible(self, *phases: Phase) -> list[Node]:
        # Newest first: Hypothesis favours the first choices, and the newest runs are the
        # deepest, whose ends have the most to check.
        return [n for n in reversed(self.nodes) if n.phase in phases]

    def ended(self, node: Node, state: str, reason: str, *also: tuple[str, str]) -> None:
        """`node` ended in `state` with `reason` (a prefix), or one of `also`; its open
        descendants are cancelled on the way."""
        node.phase, node.end_options = Phase.ENDED, ((state, reason), *also)
        node.expect_out = node.blocked_on = None
        for child in node.children:
            if child.open:
                # A cancel or a timeout already under way may win the race with this one.
                racing = () if child.racing is None else (child.racing,)
                self.ended(child, "cancelled", CHILD_REASON[state], *racing)
        # A parent waiting on this run wakes up and writes what rlm_wait gave it.
        for waiter in self.eligible(Phase.BLOCKED):
            if waiter.blocked_on is node:
                waiter.phase, waiter.blocked_on = Phase.ARRIVING, None
                waiter.expect_out = ("text", self.wait_result(node))

    @staticmethod
    def wait_result(child: Node) -> str:
        if child.end_state == "completed":
            return f"answer: answer of {child.name}"
        return f"failed: {child.end_state}"

    def commandable(self) -> list[Node]:
        """Runs that are, or will be, in their model call, waiting for a reply."""
        return self.eligible(Phase.ARRIVING, Phase.WAITING)

    def ready(self, node: Node) -> None:
        """Wait until `node` sits in its model call; check what its last code wrote."""
        if node.phase is Phase.WAITING:
            return
        assert node.phase is Phase.ARRIVING, node
        wait_signal(self.path(node, ".sig"), f"run {node.name}")
        node.phase, node.arrived = Phase.WAITING, True
        expect, node.expect_out = node.expect_out, None
        if expect is None:
            return
        with open(self.path(node, ".out")) as f:
            out = f.read()
        os.unlink(self.path(node, ".out"))
        kind, value = expect
        if kind == "spawned":
            rows = [self.row_of(c) for c in value]
            assert all(rows) and out.split() == [r["id"] for r in rows], (out, rows)
            for c in value:
                c.confirmed = True
        elif kind == "timed_out":
            value.confirmed = True
            assert out == f"failed: timed_out timed out after {CHILD_TIMEOUT_S:g} s", out
            self.ended(value, "timed_out", f"timed out after {CHILD_TIMEOUT_S:g} s")
        elif kind == "pid":
            assert out.isdigit(), out
        elif kind == "cancelled":
            child, state = value
            # rlm_cancel returned `state`, and at that moment the child's worker was gone.
            assert out == f"{state} alive=False", out
            if child.open:
                self.ended(child, "cancelled", "cancelled by parent")
        else:
            assert out == value, (out, value)

    def command(self, node: Node, reply: str, expect: tuple[str, Any] | None) -> None:
        self.ready(node)
        write_gate(self.path(node, ".gate"), reply, f"run {node.name}")
        node.phase, node.expect_out = Phase.ARRIVING, expect

    # ---- rules -------------------------------------------------------------------------
    @initialize(children=st.integers(0, 2), grandchildren=st.integers(0, 2))
    def grow_a_tree(self, children: int, grandchildren: int) -> None:
        """Every example starts from a tree (Hypothesis favours the rules that end trees
        over those that grow them); its newest runs may still be starting."""
        self.spawn_root()
        (root,) = self.nodes
        kids = self.spawn_under(root, children) if children else []
        if kids and grandchildren:
            self.spawn_under(kids[0], min(grandchildren, MAX_LIVE - self.live()))

    # A rule that gives a run its next reply first waits for the run to reach its model
    # call; cancel_root and close do not, so they also hit runs that are starting up or
    # still executing their last reply.
    @precondition(lambda self: self.live() < MAX_LIVE and len(self.open_roots()) < MAX_OPEN_ROOTS)
    @rule()
    def spawn_root(self) -> None:
        node = self.new_node(None)
        assert self.sup is not None
        node.handle = self.sup.spawn(node.prompt)
        node.run_id, node.confirmed = node.handle.id, True

    @precondition(
        lambda self: (
            self.live() < MAX_LIVE and any(n.depth + 1 < MAX_DEPTH for n in self.commandable())
        )
    )
    @rule(data=st.data(), count=st.integers(1, 2))
    def spawn_children(self, data: st.DataObject, count: int) -> None:
        """`rlm_spawn` from the parent's REPL, once or twice in one step."""
        parents = [n for n in self.commandable() if n.depth + 1 < MAX_DEPTH]
        self.spawn_under(data.draw(st.sampled_from(parents), label="parent"), count)

    def spawn_under(self, parent: Node, count: int) -> list[Node]:
        self.ready(parent)  # before the children exist: ready() may end runs it checks on
        children = [self.new_node(parent) for _ in range(min(count, MAX_LIVE - self.live()))]
        out = self.path(parent, ".out")
        code = "".join(f"h_{c.name} = rlm_spawn({c.prompt!r})\n" for c in children)
        ids = " + ' ' + ".join(f"h_{c.name}.id" for c in children)
        code += f"open({out!r}, 'w').write({ids})"
        self.command(parent, repl(code), ("spawned", children))
        return children

    @precondition(
        lambda self: (
            self.live() < MAX_LIVE and any(n.depth + 1 < MAX_DEPTH for n in self.commandable())
        )
    )
    @rule(data=st.data())
    def child_times_out(self, data: st.DataObject) -> None:
        """A child with a timeout of its own that never gets a reply, and its parent waiting
        for it: the timer cancels it (running, cancelling, timed_out) and rlm_wait says so."""
        parents = [n for n in self.commandable() if n.depth + 1 < MAX_DEPTH]
        parent = data.draw(st.sampled_from(parents), label="parent")
        self.ready(parent)
        child = self.new_node(parent)
        child.phase = Phase.ENDING  # it ends by itself; no rule may touch it
        child.racing = ("timed_out", f"timed out after {CHILD_TIMEOUT_S:g} s")
        out = self.path(parent, ".out")
        code = (
            f"h_{child.name} = rlm_spawn({child.prompt!r}, timeout={CHILD_TIMEOUT_S})\n"
            f"try:\n    _r = 'answered: ' + rlm_wait(h_{child.name})\n"
            "except ChildFailed as e:\n    _r = f'failed: {e.status} {e.reason}'\n"
            f"open({out!r}, 'w').write(_r)"
        )
        self.command(parent, repl(code), ("timed_out", child))

    @precondition(lambda self: self.commandable())
    @rule(data=st.data(), how=st.sampled_from(["final", "crash", "raise"]))
    def finish(self, data: st.DataObject, how: str) -> None:
        """Let the run end on its own: an answer, its worker dying, or its model raising."""
        node = data.draw(st.sampled_from(self.commandable()), label="run")
        self.ready(node)
        handle = self.handle_of(node)
        reply = {
            "final": repl(f"FINAL('answer of {node.name}')"),
            "crash": repl("import os\nos._exit(3)"),
            "raise": RAISE,
        }[how]
        write_gate(self.path(node, ".gate"), reply, f"run {node.name}")
        try:
            assert handle.wait(timeout=WAIT_S) == f"answer of {node.name}"
            assert how == "final"
        except brood.ChildFailed as exc:
            assert how != "final", exc
            assert exc.status == "failed", exc
        if how == "final":
            self.ended(node, "completed", "answer")
        elif how == "crash":
            self.ended(node, "failed", "worker exited with status 3")
        else:
            self.ended(node, "failed", "model error: ")

    @precondition(lambda self: self.open_roots())
    @rule(data=st.data())
    def cancel_root(self, data: st.DataObject) -> None:
        """`RunHandle.cancel()`, in whatever phase the root and its tree are."""
        node = data.draw(st.sampled_from(self.open_roots()), label="root")
        assert node.handle is not None
        assert node.handle.cancel() == "cancelled"
        self.ended(node, "cancelled", "cancelled by user")
        # Cancelling an ended run changes nothing and says how it ended.
        for root in self.nodes:
            if root.handle is not None and not root.open:
                assert root.handle.cancel() == root.end_state, root
        # cancel() returns only once every worker of the tree is confirmed gone.
        runs, _ = self.journal()
        groups = live_groups()
        for n in node.subtree():
            row = self.row_of(n, runs)
            if row is not None:
                assert n.ended_as(row), (n.name, row, n.end_options)
                assert row["pid"] is None or row["pid"] not in groups, (n.name, row["pid"])

    @precondition(lambda self: any(n.children for n in self.commandable()))
    @rule(data=st.data())
    def parent_cancels_child(self, data: st.DataObject) -> None:
        """`rlm_cancel` from the parent's REPL; right after it returns, the parent's code
        looks in /proc for the child's worker."""
        parents = [n for n in self.commandable() if n.children]
        parent = data.draw(st.sampled_from(parents), label="parent")
        self.ready(parent)
        child = data.draw(st.sampled_from(parent.children), label="child")
        row = self.row_of(child)
        assert row is not None  # its parent arrived after spawning it, so it was journaled
        pid = row["pid"] or 0  # none while queued: pid 0 has no /proc entry, so not alive
        out = self.path(parent, ".out")
        code = (
            f"_state = rlm_cancel(h_{child.name})\n"
            "try:\n"
            f"    _stat = open('/proc/{pid}/stat').read()\n"
            "    _alive = _stat.rsplit(')', 1)[1].split()[0] != 'Z'\n"
            "except OSError:\n"
            "    _alive = False\n"
            f"open({out!r}, 'w').write(f'{{_state}} alive={{_alive}}')"
        )
        expected = "cancelled" if child.open else child.end_state
        if child.open:
            child.racing = ("cancelled", "cancelled by parent")
            for n in child.subtree():  # no rule may touch what is being cancelled
                if n.open:
                    n.phase = Phase.ENDING
        self.command(parent, repl(code), ("cancelled", (child, expected)))

    @precondition(lambda self: any(n.children for n in self.commandable()))
    @rule(data=st.data())
    def parent_waits_child(self, data: st.DataObject) -> None:
        """`rlm_wait` from the parent's REPL: the parent gives up its slot until the child
        ends (at once if it has already)."""
        parents = [n for n in self.commandable() if n.children]
        parent = data.draw(st.sampled_from(parents), label="parent")
        self.ready(parent)
        child = data.draw(st.sampled_from(parent.children), label="child")
        out = self.path(parent, ".out")
        code = (
            f"try:\n    _r = 'answer: ' + rlm_wait(h_{child.name})\n"
            "except ChildFailed as e:\n    _r = f'failed: {e.status}'\n"
            f"open({out!r}, 'w').write(_r)"
        )
        if child.open:
            self.command(parent, repl(code), None)
            parent.phase, parent.blocked_on = Phase.BLOCKED, child
        else:
            self.command(parent, repl(code), ("text", self.wait_result(child)))

    @precondition(lambda self: self.commandable())
    @rule(data=st.data(), stubborn=st.booleans())
    def start_grandchild_process(self, data: st.DataObject, stubborn: bool) -> None:
        """Model code starts a process of its own (in the worker's process group); a
        stubborn one ignores SIGTERM, so only the SIGKILL step of the escalation ends it."""
        node = data.draw(st.sampled_from(self.commandable()), label="run")
        argv = ["sh", "-c", STUBBORN_SLEEP] if stubborn else ["sleep", "1000"]
        out, pids = self.path(node, ".out"), self.path(node, ".pids")
        code = (
            "import subprocess\n"
            f"_p = subprocess.Popen({argv!r}, stdin=subprocess.DEVNULL,"
            " stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
            f"open({pids!r}, 'a').write(f'{{_p.pid}}\\n')\n"
            f"open({out!r}, 'w').write(str(_p.pid))"
        )
        self.command(node, repl(code), ("pid", None))

    @precondition(lambda self: self.live() >= CLOSE_WITH_LIVE and not self.reopened)
    @rule()
    def close_and_reopen(self) -> None:
        """close() cancels everything and confirms every exit; then a fresh supervisor."""
        assert self.sup is not None
        self.close_and_check()
        for node in self.nodes:
            if node.handle is not None:
                self.old_handles.append(node.handle)
        for h in self.old_handles:
            with pytest.raises(brood.StaleHandle):
                h.status()
        self.nodes = []
        self.reopened = True
        self.sup = self.new_supervisor()

    # ---- the contract ------------------------------------------------------------------
    @invariant()
    def journal_keeps_the_contract(self) -> None:
        self.check_journal()

    def check_journal(self) -> None:
        runs, moves = self.journal()
        by_id = {r["id"]: r for r in runs}
        groups: dict[int, list[int]] | None = None
        for run in runs:
            rid, path = run["id"], moves.get(run["id"], [])
            state = "queued"
            for move in path:
                assert not brood.RunState(state).terminal, (rid, "moved after terminal", path)
                assert move["frm"] == state, (rid, path)
                to = brood.RunState(move["to"])
                assert to in brood.TRANSITIONS[brood.RunState(state)], (rid, path)
                if to.terminal:
                    assert move["reason"], (rid, "terminal move without a reason", path)
                state = to.value
            assert run["state"] == state, (rid, run["state"], path)
            if any(m["to"] == "running" for m in path):
                assert run["pid"] is not None and run["started_at"] is not None, run
            if not brood.RunState(state).terminal:
                continue
            assert run["ended_at"] is not None, run
            first = self.terminal.setdefault(rid, (state, run["reason"]))
            assert first == (state, run["reason"]), (rid, "terminal run changed", first, run)
            if rid in self.verified:
                continue
            groups = live_groups() if groups is None else groups
            if run["pid"] is not None:
                assert run["pid"] not in groups, (rid, "worker group left", groups[run["pid"]])
            for pid in self.grandchild_pids(run["prompt"]):
                assert not any(pid in ps for ps in groups.values()), (rid, "grandchild", pid)
            self.verified.add(rid)
        # No child outlives its parent: below a terminal run everything is terminal.
        for run in runs:
            parent = by_id.get(run["parent_id"] or "")
            if parent is not None and brood.RunState(parent["state"]).terminal:
                assert brood.RunState(run["state"]).terminal, (run["id"], "outlived", parent)
        for node in self.nodes:
            row = self.row_of(node, runs)
            if row is None:
                # Either its spawn is still on its way (its parent has not arrived since),
                # or its parent ended before the spawn was admitted, so it never existed.
                assert not node.confirmed, node
                continue
            node.confirmed = True
            if node.open:
                assert not brood.RunState(row["state"]).terminal or node.phase is Phase.ENDING, (
                    node.name,
                    node.phase,
                    row,
                )
            else:
                assert node.ended_as(row), (node.name, row, node.end_options)
                if row["state"] == "completed":
                    assert row["answer"] == f"answer of {node.name}", row

    def close_and_check(self) -> None:
        assert self.sup is not None
        self.sup.close()
        for node in self.nodes:
            if node.open:
                self.ended(node, "cancelled", "supervisor closed")
        assert leftover_processes() == []
        self.check_journal()
        runs, moves = self.journal()
        assert all(brood.RunState(r["state"]).terminal for r in runs), runs
        # Each observer fired once per run, with what the journal holds: on_start once for
        # every run that moved to running (the test below covers a cancel that lands while
        # that move is being journaled).
        arrived = {n.run_id for n in self.nodes if n.arrived}
        for run in (r for r in runs if r["id"] not in self.earlier):
            ends = [(i.state, i.reason) for i in self.ends if i.run_id == run["id"]]
            assert ends == [(run["state"], run["reason"])], (run, ends)
            ran = any(m["to"] == "running" for m in moves.get(run["id"], []))
            starts = [i for i in self.starts if i.run_id == run["id"]]
            assert len(starts) == ran and (run["id"] not in arrived or starts), (run, starts)
        with pytest.raises(brood.SupervisorClosed):
            self.sup.spawn("sm-run too-late")

    def grandchild_pids(self, prompt: str) -> list[int]:
        name = prompt.removeprefix("sm-run ")
        try:
            with open(os.path.join(self.dir, name + ".pids")) as f:
                lines = f.read().split("\n")
        except FileNotFoundError:
            return []
        return [int(x) for x in lines[:-1] if x.isdigit()]  # the last line may be cut short

    def teardown(self) -> None:
        try:
            if self.sup is not None:
                self.close_and_check()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


def _sequences(examples: int) -> None:
    run_state_machine_as_test(
        LifecycleMachine,
        settings=settings(
            max_examples=examples,
            stateful_step_count=12,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )


def test_random_spawn_cancel_finish_close_sequences_keep_the_contract():
    _sequences(10)


@pytest.mark.scale
def test_many_random_spawn_cancel_finish_close_sequences_keep_the_contract():
    _sequences(60)


def test_a_run_cancelled_while_its_start_is_journaled_still_reports_its_start(
    monkeypatch, tmp_path
):
    from tests.util import Gate

    starts: list[brood.RunInfo] = []
    # The run's model never answers (its gate stays shut): only the cancel ends it.
    model = brood.ScriptedModel([Gate(tmp_path, "never").blocking_reply(repl("FINAL('x')"))])
    sup = brood.Supervisor(model, limits=LIMITS, on_start=starts.append)
    store, original = sup.store, sup.store.transition
    at_running = threading.Event()
    held: list[tuple[Future[Any], Future[Any]]] = []

    def transition(rec: Any, frm: str, to: str) -> Future[Any]:
        committed = original(rec, frm, to)
        if to == "running":
            # Committed, but the supervisor hears so only once the cancel is under way.
            late: Future[Any] = Future()
            held.append((committed, late))
            at_running.set()
            return late
        if to == "cancelling":
            for done, late in held:
                done.add_done_callback(lambda f, late=late: late.set_result(f.result()))
        return committed

    monkeypatch.setattr(store, "transition", transition)
    try:
        h = sup.spawn("root")
        assert at_running.wait(WAIT_S)
        assert h.cancel() == "cancelled"
        moves = [(t["frm"], t["to"]) for t in store.transitions(h.id)]
        assert ("queued", "running") in moves
    finally:
        sup.close()
    assert [i.run_id for i in starts] == [h.id]

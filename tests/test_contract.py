"""The contract every back end keeps: spawn, wait, cancel, send, limits and cleanup.

One set of tests runs against each back end through the `backend` fixture: `supervisor`
(brood.Supervisor, a SQLite journal) and `cluster` (brood.Cluster on the two-node Ray
cluster of tests/ray_util.py, a fresh Postgres journal). The cluster's cases carry the `ray`
mark, so `make test` runs them in the pytest process of its own that Ray needs; Ray is
imported only by that fixture, and this module imports without it.

The model is scripted. Model code and scripted replies meet the test through files in
`tmp_path` (a worker's pid, "I am here", "release"), never through sleeps: a held child
keeps its tree going until the test creates `release`.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cloudpickle
import pytest

import brood
from brood.lifecycle import RunState
from brood.store.base import open_store
from brood.testing import leftover_processes
from tests.ray_util import BOUND_S, agent_pids, assert_nothing_left, pid_gone, poll
from tests.util import FAST, fast, pid_alive

# The scripted replies below are functions of this module, which Ray's workers cannot
# import: pickle them by value (the cluster sends each node agent its own copy).
cloudpickle.register_pickle_by_value(sys.modules[__name__])

FENCE = "```"
STATES = frozenset(s.value for s in RunState)
TERMINAL = frozenset(s.value for s in RunState if s.terminal)
ROOT = "contract root"
TREE = "A done|B done"


def repl(code: str) -> str:
    return f"{FENCE}repl\n{code}\n{FENCE}"


# ---- the back ends ------------------------------------------------------------------------


@dataclass(frozen=True)
class Backend:
    """One back end under the contract: how to start it on its journal, whose processes
    its workers are, and how to check that a closed one left none of them."""

    name: str
    store: str
    make: Callable[..., Any]  # (model, *, store, limits) -> a Supervisor or a Cluster
    owners: Callable[[Any], list[int]]  # the processes that own its workers, while open
    assert_gone: Callable[[list[int]], None]  # after close: nothing of those owners is left

    def start(self, model: brood.ScriptedModel, limits: brood.Limits = FAST) -> Any:
        return self.make(model, store=self.store, limits=limits)

    def journal(self, root_id: str) -> list[dict[str, Any]]:
        """Every run of tree `root_id` as the journal holds it."""
        store = open_store(self.store, readonly=True)
        try:
            return store.runs(root_id)
        finally:
            store.close()


def nothing_left_here(owners: list[int]) -> None:
    """The supervisor's workers are this process's: none may be left after close()."""
    assert owners == [os.getpid()]
    assert not leftover_processes(), "close() returned with workers left"


@pytest.fixture(
    params=[
        pytest.param("supervisor"),
        # Ray's driver threads and processes forked from this one do not mix: the cluster's
        # cases run in a pytest of their own (`pytest -m ray`).
        pytest.param("cluster", marks=pytest.mark.ray),
    ]
)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if request.param == "supervisor":
        return Backend(
            "supervisor",
            f"sqlite:///{tmp_path}/journal.db",
            brood.Supervisor,
            lambda sup: [os.getpid()],
            nothing_left_here,
        )
    pytest.importorskip("ray")
    request.getfixturevalue("ray_cluster")
    return Backend(
        "cluster",
        request.getfixturevalue("fresh_pg_url"),
        brood.Cluster,
        agent_pids,
        assert_nothing_left,
    )


# ---- the scripted tree --------------------------------------------------------------------


def tree_model(folder: Path) -> brood.ScriptedModel:
    """A root that starts child A with rlm_spawn, asks child B with rlm_query, then waits
    for A with rlm_wait and answers "A done|B done". The root's code and child B's code
    write their worker's pid (files `root-pid`, `b-pid`); child B then holds until the test
    creates the file `release`."""
    root_pid, b_pid, release = (str(folder / n) for n in ("root-pid", "b-pid", "release"))
    return brood.ScriptedModel(
        {
            ROOT: [
                repl(
                    f"import os\nopen({root_pid!r}, 'w').write(str(os.getpid()))\n"
                    "h = rlm_spawn('child A: quick')\nb = rlm_query('child B: held')\n"
                    "FINAL(rlm_wait(h) + '|' + b)"
                )
            ],
            "child A": [repl("FINAL('A done')")],
            "child B": [
                repl(
                    f"import os, time\nopen({b_pid!r}, 'w').write(str(os.getpid()))\n"
                    f"while not os.path.exists({release!r}):\n    time.sleep(0.02)\n"
                    "FINAL('B done')"
                )
            ],
        }
    )


def written_pid(path: Path) -> int:
    """The pid model code wrote to `path`, once it has."""

    def read() -> int | None:
        try:
            text = path.read_text()
        except FileNotFoundError:
            return None
        return int(text) if text else None

    return poll(read, f"a pid in {path.name}")


# ---- spawn and wait -----------------------------------------------------------------------


def test_spawn_returns_at_once_and_wait_gives_the_trees_answer(backend, tmp_path):
    with backend.start(tree_model(tmp_path)) as api:
        h = api.spawn(ROOT)
        # Child B holds until `release` exists, so the tree cannot have ended yet: spawn
        # returned without waiting for it.
        assert h.id.startswith("r-")
        assert h.status() in STATES - TERMINAL
        assert not h.done
        written_pid(tmp_path / "b-pid")  # the root's children are running
        (tmp_path / "release").touch()
        assert h.wait(timeout=BOUND_S) == TREE  # rlm_spawn + rlm_wait, rlm_query
        assert h.status() == "completed" and h.done
        result = api.run(ROOT)
        assert (result.state, result.answer, result.error) == ("completed", TREE, None)
    for root_id in (h.id, result.run_id):
        runs = backend.journal(root_id)
        answers = sorted((r["key"] or "root", r["state"], r["answer"]) for r in runs)
        assert answers == [
            ("1:0", "completed", "A done"),
            ("1:1", "completed", "B done"),
            ("root", "completed", TREE),
        ]


def test_wait_with_a_timeout_raises_and_the_tree_keeps_running(backend, tmp_path):
    with backend.start(tree_model(tmp_path)) as api:
        h = api.spawn(ROOT)
        b_pid = written_pid(tmp_path / "b-pid")
        with pytest.raises(TimeoutError, match="keeps running"):
            h.wait(timeout=0.2)
        assert h.status() == "running"
        assert pid_alive(b_pid), "a wait that timed out must not stop the tree"
        with pytest.raises(TimeoutError):
            h.wait_result(timeout=0.2)
        (tmp_path / "release").touch()
        assert h.wait(timeout=BOUND_S) == TREE
        assert h.wait_result(timeout=BOUND_S).state == "completed"


# ---- cancel -------------------------------------------------------------------------------


def test_cancel_returns_once_every_worker_of_the_tree_has_exited(backend, tmp_path):
    with backend.start(tree_model(tmp_path)) as api:
        h = api.spawn(ROOT)
        root_pid = written_pid(tmp_path / "root-pid")
        b_pid = written_pid(tmp_path / "b-pid")
        assert h.cancel() == "cancelled"
        # "cancelled" means the exit was confirmed: no waiting for the workers here.
        assert pid_gone(root_pid) and pid_gone(b_pid)
        with pytest.raises(brood.ChildFailed) as info:
            h.wait(timeout=BOUND_S)
        assert info.value.status == "cancelled"
        assert h.status() == "cancelled" and h.done
        assert h.wait_result(timeout=BOUND_S).state == "cancelled"
        assert h.cancel() == "cancelled"  # a second cancel changes nothing
        owners = backend.owners(api)
    backend.assert_gone(owners)
    states = {r["key"] or "root": r["state"] for r in backend.journal(h.id)}
    assert states["root"] == states["1:1"] == "cancelled"


# ---- send ---------------------------------------------------------------------------------


def follow_up_model(folder: Path) -> brood.ScriptedModel:
    """A root whose first model turn announces itself (file `in-root`) and answers once the
    test creates `release`; its second turn answers "blue" if a follow-up asked for blue
    paint, "red" otherwise."""
    here, release = str(folder / "in-root"), str(folder / "release")

    def first_turn(messages: list[dict[str, Any]]) -> str:
        open(here, "w").close()
        deadline = time.monotonic() + BOUND_S
        while not os.path.exists(release) and time.monotonic() < deadline:
            time.sleep(0.02)
        return repl("print('working')")

    def second_turn(messages: list[dict[str, Any]]) -> str:
        heard = [
            str(m["content"])
            for m in messages
            if m.get("role") == "user" and "use blue paint" in str(m.get("content", ""))
        ]
        return repl(f"FINAL({'blue' if heard else 'red'!r})")

    return brood.ScriptedModel({ROOT: [first_turn, second_turn]})


def test_send_reaches_the_root_before_its_next_model_turn(backend, tmp_path):
    with backend.start(follow_up_model(tmp_path)) as api:
        h = api.spawn(ROOT)
        poll((tmp_path / "in-root").exists, "the root's first model turn")
        h.send("use blue paint")  # while the first turn is in flight
        (tmp_path / "release").touch()
        assert h.wait(timeout=BOUND_S) == "blue"
        unsent = api.run(ROOT)  # the same script without the follow-up
        assert (unsent.state, unsent.answer) == ("completed", "red")
        with pytest.raises(brood.BroodError, match="cannot reach a run that has ended"):
            h.send("too late")


# ---- limits -------------------------------------------------------------------------------


def test_a_child_past_max_children_is_refused_inside_the_model_code(backend, tmp_path):
    model = brood.ScriptedModel(
        {
            ROOT: [
                repl(
                    "answers = [rlm_query('child A: one'), rlm_query('child A: two')]\n"
                    "try:\n    rlm_query('child A: three')\n    refused = 'not refused'\n"
                    "except LimitExceeded as e:\n    refused = f'{e.kind} {e.value} {e.limit}'\n"
                    "FINAL('|'.join(answers) + ' / ' + refused)"
                )
            ],
            "child A": [repl("FINAL('A done')")],
        }
    )
    with backend.start(model, limits=fast(max_children=2)) as api:
        result = api.run(ROOT)
    assert (result.state, result.answer) == ("completed", "A done|A done / max_children 3 2")
    # Refused at admission: the third child was never started.
    runs = backend.journal(result.run_id)
    assert sorted(r["key"] or "root" for r in runs) == ["1:0", "1:1", "root"]
    assert {r["state"] for r in runs} == {"completed"}


# ---- cleanup ------------------------------------------------------------------------------


def test_close_leaves_no_process_stale_handles_and_a_terminal_journal(backend, tmp_path):
    with backend.start(tree_model(tmp_path)) as api:
        h = api.spawn(ROOT)
        pids = [written_pid(tmp_path / "root-pid"), written_pid(tmp_path / "b-pid")]
        owners = backend.owners(api)
    # Closed with the tree still held: close() stopped it and confirmed every exit.
    assert all(pid_gone(p) for p in pids)
    backend.assert_gone(owners)
    for use in (h.status, h.wait, h.wait_result, h.cancel, lambda: h.send("hello")):
        with pytest.raises(brood.StaleHandle, match=h.id):
            use()
    with pytest.raises(brood.SupervisorClosed):
        api.spawn(ROOT)
    runs = backend.journal(h.id)
    assert sorted(r["key"] or "root" for r in runs) == ["1:0", "1:1", "root"]
    assert all(r["state"] in TERMINAL for r in runs), [(r["key"], r["state"]) for r in runs]
    states = {r["key"] or "root": r["state"] for r in runs}
    assert states["root"] == states["1:1"] == "cancelled"

"""Hibernation (DESIGN.md section 17): a waiting run gives up its worker and is rebuilt by
replay when its wait is satisfied; Limits.max_workers caps live workers."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

import brood
from brood.journal import Journal
from tests.util import Gate, fast, pid_alive

FENCE = "```"


def repl(code: str) -> str:
    return f"{FENCE}repl\n{code}\n{FENCE}"


def until(condition: Callable[[], Any], timeout: float = 60.0) -> Any:
    """Poll `condition` until it returns something true, bounded by `timeout`."""
    pause = threading.Event()
    for _ in range(int(timeout / 0.02)):
        if value := condition():
            return value
        pause.wait(0.02)
    raise AssertionError("the condition never held")


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
        gate.open()
        assert h.wait(timeout=60) == "42 child done"
        assert sup.statistics()["hibernating"] == 0
    events = kinds(url, h.id)
    assert "hibernated" in events and "woken" in events

"""Retried attempts: rlm_query(..., retries=N) starts a child that failed or timed out again,
as attempt k+1 under the same key and the same handle, after attempt k's open children
are cancelled. Cancelled children are not retried. Real workers, scripted models."""

from __future__ import annotations

import dataclasses
import threading

import pytest
from typer.testing import CliRunner

import brood
from brood.cli.main import app
from tests.util import FAST

FENCE = "```"


def code(source: str) -> str:
    return f"{FENCE}repl\n{source}\n{FENCE}"


CRASH = code("import os; os._exit(3)")


class Attempts:
    """A chat_fn for children whose k-th start (k = 0, 1, ...) answers replies[k] (the last
    one for every later start); the root's turn is `root`."""

    def __init__(self, root: str, replies: list[str]) -> None:
        self.root, self.replies = root, replies
        self.starts = 0
        self.lock = threading.Lock()

    def __call__(self, messages: list[dict]) -> str:
        prompt = messages[1]["content"]
        if prompt.startswith("grandchild"):
            return code("import time; time.sleep(1000)")
        if not prompt.startswith("child"):
            return self.root
        if len(messages) > 2:  # a later turn of the same attempt
            return code("FINAL('late')")
        with self.lock:
            k, self.starts = self.starts, self.starts + 1
        return self.replies[min(k, len(self.replies) - 1)]


def children_of(sup: brood.Supervisor, root_id: str) -> list[dict]:
    return [r for r in sup.store.runs(root_id) if r["depth"] == 1]


def test_a_child_that_failed_completes_on_attempt_two_and_its_open_children_were_cancelled(
    tmp_path,
):
    url = f"sqlite:///{tmp_path}/j.db"
    first = code("g = rlm_spawn('grandchild: sleeps')\nimport os; os._exit(3)")
    model = Attempts(
        code("FINAL(rlm_query('child: flaky', retries=2))"), [first, code("FINAL('ok')")]
    )
    with brood.Supervisor(model, store=url, limits=FAST) as sup:
        result = sup.run("root")
        runs = sup.store.runs(result.run_id)
        attempt_events = [
            e["data"] for e in sup.store.events(root_id=result.run_id) if e["kind"] == "attempt"
        ]
    assert result.answer == "ok", result
    kids = sorted((r for r in runs if r["depth"] == 1), key=lambda r: r["attempt"])
    assert [(r["key"], r["attempt"], r["state"]) for r in kids] == [
        ("1:0", 0, "failed"),
        ("1:0", 1, "completed"),
    ]
    assert "worker exited with status 3" in kids[0]["reason"]
    (grandchild,) = [r for r in runs if r["depth"] == 2]
    assert grandchild["parent_id"] == kids[0]["id"] and grandchild["state"] == "cancelled"
    assert grandchild["ended_at"] <= kids[1]["created_at"]  # cancelled before attempt 2
    assert attempt_events == [
        {"attempt": 1, "previous": kids[0]["id"], "reason": kids[0]["reason"]}
    ]
    tree = CliRunner().invoke(app, ["tree", result.run_id, "--store", url])
    assert f"{kids[1]['id']} attempt 2" in tree.output, tree.output


def test_a_timed_out_child_is_retried_and_the_handle_follows_the_attempts():
    root = code(
        "h = rlm_spawn('child: slow first', timeout=1, retries=1)\n"
        "FINAL(rlm_wait(h) + '|' + rlm_status(h) + '|' + str(h.id == h.id))"
    )
    model = Attempts(root, [code("import time; time.sleep(60)"), code("FINAL('second')")])
    with brood.Supervisor(model, limits=FAST) as sup:
        result = sup.run("root")
        kids = children_of(sup, result.run_id)
    assert result.answer == "second|completed|True", result
    assert sorted((r["attempt"], r["state"]) for r in kids) == [(0, "timed_out"), (1, "completed")]


def test_retries_run_out_and_the_parent_hears_the_last_failure():
    root = code(
        "try:\n    rlm_query('child: always crashes', retries=2)\n"
        "except ChildFailed as e:\n    FINAL(e.status + ': ' + e.reason)"
    )
    with brood.Supervisor(Attempts(root, [CRASH]), limits=FAST) as sup:
        result = sup.run("root")
        kids = children_of(sup, result.run_id)
    assert result.answer == "failed: worker exited with status 3", result
    assert sorted((r["attempt"], r["state"]) for r in kids) == [
        (0, "failed"),
        (1, "failed"),
        (2, "failed"),
    ]


def test_attempts_count_against_max_children():
    """Each attempt is one more run of the tree: past max_children no attempt starts, and the
    parent hears the last one's failure."""
    root = code(
        "try:\n    rlm_query('child: always crashes', retries=5)\n"
        "except ChildFailed as e:\n    FINAL(e.status + ': ' + e.reason)"
    )
    limits = dataclasses.replace(FAST, max_children=2)
    with brood.Supervisor(Attempts(root, [CRASH]), limits=limits) as sup:
        result = sup.run("root")
        kids = children_of(sup, result.run_id)
        refused = sup.store.events(kids[-1]["id"], "retry_refused")
    assert result.answer == "failed: worker exited with status 3", result
    assert sorted(r["attempt"] for r in kids) == [0, 1]
    assert "limit max_children exceeded" in refused[0]["data"]["error"], refused


def test_a_cancelled_child_is_not_retried():
    root = code(
        "h = rlm_spawn('child: sleeps', retries=3)\nFINAL(rlm_cancel(h) + '|' + rlm_status(h))"
    )
    with brood.Supervisor(
        Attempts(root, [code("import time; time.sleep(60)")]), limits=FAST
    ) as sup:
        result = sup.run("root")
        kids = children_of(sup, result.run_id)
    assert result.answer == "cancelled|cancelled", result
    assert [(r["attempt"], r["state"]) for r in kids] == [(0, "cancelled")]


def test_a_batch_retries_each_failed_child():
    starts: dict[str, int] = {}
    lock = threading.Lock()

    def chat_fn(messages):
        prompt = messages[1]["content"]
        if not prompt.startswith("child"):
            return code("FINAL(','.join(rlm_query_batched(['child a', 'child b'], retries=1)))")
        name = prompt.split()[1]
        with lock:
            starts[name] = starts.get(name, 0) + 1
            first = starts[name] == 1
        return CRASH if name == "a" and first else code(f"FINAL({name!r})")

    with brood.Supervisor(chat_fn, limits=FAST) as sup:
        result = sup.run("root")
        kids = children_of(sup, result.run_id)
    assert result.answer == "a,b", result
    assert sorted((r["prompt"][:7], r["attempt"], r["state"]) for r in kids) == [
        ("child a", 0, "failed"),
        ("child a", 1, "completed"),
        ("child b", 0, "completed"),
    ]


@pytest.mark.parametrize("retries", ["-1", "True", "'2'", "101"])
def test_bad_retries_are_refused_naming_the_value(retries):
    root = code(
        f"try:\n    rlm_spawn('child', retries={retries})\n"
        "except InvalidArgument as e:\n    FINAL(str(e))"
    )
    with brood.Supervisor(Attempts(root, [CRASH]), limits=FAST) as sup:
        result = sup.run("root")
        assert children_of(sup, result.run_id) == []
    assert result.answer.startswith("retries must be a whole number from 0 to 100"), result
    assert result.answer.endswith(f"got {eval(retries)!r}"), result


def test_a_resume_between_attempts_adopts_the_latest_attempt(tmp_path):
    """The supervisor dies while attempt 2 of a child runs (attempt 1 failed): the resume
    adopts attempt 2 (resumed, not started again), starts no attempt 3 and does not run
    attempt 1 again."""
    import json
    import os
    import textwrap

    from tests.test_resume import crash
    from tests.util import Signal

    root = code("FINAL(rlm_query('child: flaky', retries=2))")
    url = f"sqlite:///{tmp_path}/j.db"
    in_second = Signal(tmp_path, "in-second")
    os.mkfifo(tmp_path / "never")
    script = textwrap.dedent(f"""
        import brood, json, signal, threading
        ROOT, CRASH = json.loads({json.dumps(json.dumps([root, CRASH]))})
        starts = []
        lock = threading.Lock()
        def chat_fn(messages):
            if not messages[1]["content"].startswith("child"):
                return ROOT
            with lock:
                starts.append(1)
                k = len(starts)
            if k == 1:
                return CRASH
            open({in_second.path!r}, "w").write("1")
            open({str(tmp_path / "never")!r}).read()  # blocks until the process is killed
        sup = brood.Supervisor(chat_fn, store={url!r}, limits=brood.Limits(
            shutdown_grace=0.3, term_grace=0.3))
        print(sup.spawn("root task").id, flush=True)
        signal.pause()
    """)
    root_id = crash(script, in_second.wait)

    def after(messages):
        if messages[1]["content"].startswith("child"):
            return code("FINAL('ok on resume')")
        return root

    with brood.Supervisor(after, store=url, limits=FAST) as sup:
        h = sup.resume(root_id)
        assert h.wait(timeout=60) == "ok on resume"
        kids = children_of(sup, root_id)
    assert sorted((r["attempt"], r["state"]) for r in kids) == [(0, "failed"), (1, "completed")]

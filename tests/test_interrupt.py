"""Ctrl-C never loses a journal write: a caller that stops waiting leaves the journal's
writer alive and its write committed, and an interrupted `brood run` journals the cancel of
its tree, says so and exits 130, whenever the interrupt comes."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from importlib import resources

from brood.journal import Journal
from brood.models.demo import ROOT_TASK
from brood.store import open_store

BROOD = [sys.executable, "-m", "brood.cli.main"]
OPEN = {"pending", "queued", "running", "cancelling"}


def test_a_write_whose_caller_stopped_waiting_is_committed_and_the_writer_goes_on(tmp_path):
    store = open_store(f"sqlite:///{tmp_path}/j.db")
    gate = threading.Event()
    real = store._write_batch

    def held(batch):
        gate.wait()
        return real(batch)

    store._write_batch = held  # the writer holds its first batch until the caller is gone
    try:
        first = store._submit("INSERT INTO meta VALUES (?, ?)", ("first", "1"))
        assert first.cancel()  # an interrupted caller: its future cancelled while queued
        gate.set()
        second = store._submit("INSERT INTO meta VALUES (?, ?)", ("second", "2"))
        assert second.result(timeout=30) == 1  # the writer lived through the first
        keys = {r["key"] for r in store._rows("SELECT key FROM meta", ())}
        assert {"first", "second"} <= keys  # and committed the write nobody waited for
        assert store.failure is None
    finally:
        store.close()


def test_a_writer_error_fails_the_journal_loudly_and_answers_every_later_write(tmp_path):
    store = open_store(f"sqlite:///{tmp_path}/j.db")
    heard = []
    store.on_failure = heard.append

    def broken(batch):
        raise RuntimeError("the writer tripped")

    real, store._write_batch = store._write_batch, broken
    try:
        first = store._submit("INSERT INTO meta VALUES (?, ?)", ("a", "1"))
        assert "the writer tripped" in str(first.exception(timeout=30))
        store._write_batch = real
        later = store._submit("INSERT INTO meta VALUES (?, ?)", ("b", "2"))
        assert "the writer tripped" in str(later.exception(timeout=30))  # not dropped
        assert len(heard) == 1 and heard[0] is store.failure
    finally:
        store.close()


def _interrupt_one(tmp_path, i: int, rng: random.Random) -> tuple[str, str, int, str]:
    url = f"sqlite:///{tmp_path}/j{i}.db"
    notes = resources.files("brood").joinpath("data/field_notes.md")
    env = {k: v for k, v in os.environ.items() if k != "BROOD_MODEL"} | {"COLUMNS": "200"}
    args = ["--model", "scripted:demo", "--context", str(notes), "--store", url, "--no-live"]
    proc = subprocess.Popen(
        [*BROOD, "run", ROOT_TASK, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    path = url.removeprefix("sqlite:///")
    while not os.path.exists(path) and proc.poll() is None:
        time.sleep(0.005)  # the supervisor is starting once it made its journal
    if i % 5:  # most interrupts land in the tree: wait for its root
        while proc.poll() is None and not _roots(url):
            time.sleep(0.005)
    # The interrupt's moment is the point under test, not a synchronization: anywhere in the
    # supervisor's start or the tree's life, sometimes more than one Ctrl-C.
    time.sleep(rng.uniform(0.0, 0.2))
    for _ in range(rng.choice([1, 1, 2, 3])):
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    return url, out, proc.returncode, err


def test_a_storm_of_interrupts_leaves_no_stale_run_and_no_dead_writer(tmp_path):
    rng = random.Random(23)
    cancelled = 0
    for i in range(20):
        url, out, code, err = _interrupt_one(tmp_path, i, rng)
        assert "Traceback" not in err, err
        assert code in (0, 130, -signal.SIGINT), (i, code, out, err)
        with Journal(url) as journal:
            roots = journal.roots(10)
            for root in roots:
                for run in _runs(journal.tree(root["id"])):
                    assert run["state"] not in OPEN, (i, run["id"], run["state"], err)
        if "15 sightings" in out:
            # The tree ended first and its answer was printed: a late Ctrl-C may still end
            # the exiting process, whose status is then 0, 130 or the signal's.
            continue
        assert code == 130, (i, code, out, err)  # else it said why it stopped early
        if roots:
            root = roots[0]
            assert f"interrupted: {root['id']} {root['state']}" in err, err
            cancelled += root["state"] == "cancelled"
        else:
            assert "interrupted before the run started" in err
    assert cancelled >= 3  # much of the storm landed while the tree ran


def _roots(url: str) -> list[dict]:
    try:
        with Journal(url) as journal:
            return journal.roots(1)
    except Exception:  # the journal is still being made
        return []


def _runs(tree: dict) -> list[dict]:
    return [tree, *(r for child in tree.get("children", []) for r in _runs(child))]

"""Named capacity pools (Limits.pools): a run holds a place from its start to its end; a
start at capacity waits, queued, holding no concurrency slot, and the end of a holder wakes
the oldest waiter. Real workers, scripted models."""

from __future__ import annotations

import itertools

import pytest

import brood
from brood.journal import Journal
from brood.lifecycle import RunState
from tests.util import Gate, fast

FENCE = "```"


def final(text: str) -> str:
    return f"{FENCE}repl\nFINAL({text!r})\n{FENCE}"


def code(source: str) -> str:
    return f"{FENCE}repl\n{source}\n{FENCE}"


def pool_events(sup: brood.Supervisor, run_id: str) -> list[dict]:
    sup.store.flush()
    return [e["data"] for e in sup.store.events(run_id, "pool")]


def assert_never_overlap(rows: list[dict]) -> None:
    """The runs' [started_at, ended_at] spans, from the journal, are disjoint."""
    spans = sorted((r["started_at"], r["ended_at"]) for r in rows)
    assert all(s is not None and e is not None for s, e in spans), spans
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert start >= end, spans


def test_a_start_at_capacity_waits_queued_and_starts_when_the_holder_ends(tmp_path):
    gate = Gate(tmp_path, "holder")

    def chat_fn(messages):
        if messages[1]["content"].startswith("hold"):
            return gate.blocking_reply(final("held"))(messages)
        return final("after")

    limits = fast(pools={"deploy": 1})
    with brood.Supervisor(chat_fn, limits=limits) as sup:
        holder = sup.spawn("hold", pool="deploy")
        waiter = sup.spawn("wait", pool="deploy")
        assert waiter.status() == "queued"
        stats = sup.statistics()["pools"]["deploy"]
        assert stats == {"capacity": 1, "holders": [holder.id], "waiting": [waiter.id]}
        reason = sup._engine.core.runs[waiter.id].rec.reason
        assert reason == f"waiting for pool 'deploy' (1 of 1 held by {holder.id})"
        # Waiting in a pool holds no concurrency slot: only the holder has one.
        assert sup.statistics()["free_slots"] == limits.max_concurrency - 1
        gate.open()
        assert holder.wait(timeout=60) == "held"
        assert waiter.wait(timeout=60) == "after"
        events = pool_events(sup, waiter.id)
        rows = [sup.store.get_run(holder.id), sup.store.get_run(waiter.id)]
    assert events == [
        {"pool": "deploy", "waiting": True, "holders": [holder.id]},
        {"pool": "deploy", "taken": True},
    ]
    assert_never_overlap(rows)


def test_capacity_one_sections_of_fifty_contending_children_never_overlap():
    def chat_fn(messages):
        prompt = messages[1]["content"]
        if prompt.startswith("item"):
            return final(prompt.split("\n")[0].upper())
        return code(
            "answers = rlm_query_batched([f'item {i}' for i in range(50)], pool='deploy')\n"
            "FINAL(str(len(answers)))"
        )

    limits = fast(pools={"deploy": 1}, max_concurrency=4)
    with brood.Supervisor(chat_fn, limits=limits) as sup:
        result = sup.run("root")
        runs = sup.store.runs(result.run_id)
    assert result.answer == "50", result
    children = [r for r in runs if r["parent_id"] == result.run_id]
    assert len(children) == 50 and all(r["pool"] == "deploy" for r in children)
    assert_never_overlap(children)
    # oldest waiter first: they started in the order they were asked for
    by_start = sorted(children, key=lambda r: r["started_at"])
    assert [r["key"] for r in by_start] == [r["key"] for r in children]


def test_a_holder_that_ended_before_the_re_read_still_lets_the_waiter_start():
    """A holder whose end is not yet released (here: forced into the pool's holders after it
    ended) is dropped when the holders are read again after a refused start."""
    limits = fast(pools={"deploy": 1})
    with brood.Supervisor(lambda m: final("done"), limits=limits) as sup:
        first = sup.run("first", pool="deploy")
        ended = sup._engine.core.runs[first.run_id]
        assert ended.rec.state is RunState.COMPLETED
        sup._engine.core.pools["deploy"].holders.append(ended)  # as if its release had not run
        second = sup.spawn("second", pool="deploy")
        assert second.wait(timeout=60) == "done"
        assert sup.statistics()["pools"]["deploy"]["holders"] == []


def test_pools_in_the_repl_and_a_parent_waiting_on_a_pooled_child():
    def chat_fn(messages):
        prompt = messages[1]["content"]
        if prompt.startswith("child"):
            return final(prompt.split("\n")[0])
        return code(
            "hs = [rlm_spawn(f'child {i}', pool='gpu') for i in range(3)]\n"
            "FINAL(','.join(rlm_wait_all(hs)))"
        )

    with brood.Supervisor(chat_fn, limits=fast(pools={"gpu": 2}, max_concurrency=2)) as sup:
        result = sup.run("root")
    assert result.answer == "child 0,child 1,child 2", result


def test_an_unknown_pool_is_refused_listing_the_pools():
    def chat_fn(messages):
        return code(
            "try:\n    rlm_query('x', pool='nope')\nexcept InvalidArgument as e:\n    FINAL(str(e))"
        )

    limits = fast(pools={"deploy": 1, "gpu": 4})
    with brood.Supervisor(chat_fn, limits=limits) as sup:
        with pytest.raises(brood.InvalidArgument, match=r"pools: deploy, gpu"):
            sup.spawn("x", pool="nope")
        result = sup.run("root")
        assert sup.store.runs(result.run_id)[1:] == []  # nothing was started
    assert "pool='nope' is not a pool (pools: deploy, gpu)" in result.answer, result


@pytest.mark.parametrize(
    ("pools", "message"),
    [
        ({"deploy": 0}, "Limits.pools['deploy'] must be a whole number >= 1"),
        ({"gpu": True}, "Limits.pools['gpu'] must be a whole number >= 1"),
        ({"": 1}, "is not a pool name"),
        (["deploy"], "Limits.pools must be a mapping"),
    ],
)
def test_bad_pools_are_refused_naming_the_value(pools, message):
    with pytest.raises(brood.InvalidArgument, match=message.replace("[", r"\[")):
        brood.Limits(pools=pools)


def test_a_flow_state_pool_serializes_its_instances():
    spec = {
        "states": [
            {
                "id": "split",
                "entry": True,
                "prompt": "Split",
                "outputs": [{"name": "items", "type": "json"}],
            },
            {
                "id": "deploy",
                "prompt": "Deploy {item}",
                "inputs": [{"name": "item", "from": "split.items", "type": "json"}],
                "foreach": {"over": "item", "max": 4},
                "outputs": ["text"],
                "pool": "deploy",
            },
        ],
        "transitions": [{"from": "split", "to": "deploy"}],
    }
    model = brood.ScriptedModel({"Split": [final("[1, 2, 3, 4]")], "Deploy": [final("ok")]})
    limits = fast(pools={"deploy": 1}, max_concurrency=4)
    with brood.Supervisor(model, limits=limits) as sup:
        flow = sup.flow_run(spec)
        assert flow.wait(timeout=60) == "finished"
        runs = [r for r in sup.store.runs(flow.id) if r["prompt"].startswith("Deploy")]
        with pytest.raises(brood.InvalidArgument, match=r"flow state 'deploy': pool='gpu'"):
            spec["states"][1]["pool"] = "gpu"
            sup.flow_run(spec)
    assert len(runs) == 4 and all(r["pool"] == "deploy" for r in runs)
    assert_never_overlap(runs)


def test_after_a_crash_pool_waits_are_queued_again_in_order(tmp_path):
    """The supervisor dies while child A holds the pool and B, C wait in it; the resume
    starts A first again (it held the place), then B, then C, never two at once, and
    starts no key twice."""
    import json
    import os
    import textwrap

    from tests.test_resume import crash
    from tests.util import Signal

    root = [
        code(
            "hs = [rlm_spawn(f'child {n}', pool='deploy') for n in 'ABC']\n"
            "FINAL(','.join(rlm_wait_all(hs)))"
        )
    ]
    url = f"sqlite:///{tmp_path}/j.db"
    in_a = Signal(tmp_path, "in-a")
    os.mkfifo(tmp_path / "never")
    script = textwrap.dedent(f"""
        import brood, json, signal
        ROOT = json.loads({json.dumps(json.dumps(root))})
        def child_a(messages):
            open({in_a.path!r}, "w").write("1")
            open({str(tmp_path / "never")!r}).read()  # blocks until the process is killed
        model = brood.ScriptedModel({{"root": ROOT, "child A": [child_a]}})
        sup = brood.Supervisor(model, store={url!r}, limits=brood.Limits(
            shutdown_grace=0.3, term_grace=0.3, pools={{"deploy": 1}}))
        print(sup.spawn("root task").id, flush=True)
        signal.pause()
    """)
    root_id = crash(script, in_a.wait)

    model = brood.ScriptedModel(
        {"root": root, **{f"child {n}": [final(n)] for n in "ABC"}},
    )
    with brood.Supervisor(model, store=url, limits=fast(pools={"deploy": 1})) as sup:
        h = sup.resume(root_id)
        assert h.wait(timeout=60) == "A,B,C"
        children = [r for r in sup.store.runs(root_id) if r["parent_id"] == root_id]
    assert sorted(r["key"] for r in children) == ["1:0", "1:1", "1:2"]  # none twice
    by_start = sorted(children, key=lambda r: r["started_at"])
    assert [r["prompt"][:7] for r in by_start] == ["child A", "child B", "child C"]
    assert_never_overlap(children)


def test_fifty_children_spawned_one_by_one_start_first_come_first_served(tmp_path):
    url = f"sqlite:///{tmp_path}/j.db"

    def chat_fn(messages):
        prompt = messages[1]["content"]
        if prompt.startswith("item"):
            return final(prompt.split("\n")[0])
        return code(
            "import time\n"
            "hs = []\n"
            "for i in range(50):\n"  # spawned while earlier ones start and end
            "    hs.append(rlm_spawn(f'item {i}', pool='deploy'))\n"
            "    time.sleep(0.01)\n"
            "FINAL(str(len(rlm_wait_all(hs))))"
        )

    limits = fast(pools={"deploy": 1}, max_concurrency=2, max_children=60)
    with brood.Supervisor(chat_fn, limits=limits, store=url) as sup:
        result = sup.run("root")
        runs = sup.store.runs(result.run_id)
    assert result.answer == "50", result
    children = [r for r in runs if r["parent_id"] == result.run_id]
    by_start = sorted(children, key=lambda r: r["started_at"])
    assert [r["prompt"] for r in by_start] == [f"item {i}" for i in range(50)]


def test_a_pool_waiter_journals_the_reason_it_waits(tmp_path):
    url = f"sqlite:///{tmp_path}/j.db"
    gate = Gate(tmp_path, "holder")

    def chat_fn(messages):
        if messages[1]["content"].startswith("hold"):
            return gate.blocking_reply(final("held"))(messages)
        return final("after")

    with brood.Supervisor(chat_fn, limits=fast(pools={"deploy": 1}), store=url) as sup:
        holder = sup.spawn("hold", pool="deploy")
        waiter = sup.spawn("wait", pool="deploy")
        sup.store.flush()
        with Journal(url) as journal:
            row = journal.run(waiter.id)
        gate.open()
        assert waiter.wait(timeout=60) == "after"
    assert row["state"] == "queued"
    assert row["reason"] == f"waiting for pool 'deploy' (1 of 1 held by {holder.id})"

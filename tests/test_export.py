"""Training exports (`brood export --format openai-chat|verifiers`, `Journal.export`): real
trees with a scripted model (a child, products, a reward), each format checked against its
schema, a tree still running refused, and the export streamed."""

from __future__ import annotations

import io
import json
import threading
import tracemalloc
from typing import Any

import jsonschema
import pytest
from typer.testing import CliRunner

import brood
from brood.cli.main import app
from brood.exports import write_jsonl
from brood.journal import Journal
from brood.lifecycle import RunRecord, RunState
from brood.store.base import open_store
from tests.util import FAST, Gate

FENCE = "```"


def code(source: str) -> str:
    return f"{FENCE}repl\n{source}\n{FENCE}"


MESSAGE = {
    "type": "object",
    "required": ["role", "content"],
    "additionalProperties": False,
    "properties": {
        "role": {"enum": ["system", "user", "assistant"]},
        "content": {"type": "string"},
    },
}
ABOUT = {
    "run_id": {"type": "string"},
    "root_id": {"type": "string"},
    "parent_id": {"type": ["string", "null"]},
    "depth": {"type": "integer", "minimum": 0},
    "model": {"type": ["string", "null"]},
    "task": {"type": "string"},
    "state": {"type": "string"},
    "stale": {"type": "boolean"},
    "reason": {"type": ["string", "null"]},
    "answer": {"type": ["string", "null"]},
    "error": {"type": ["string", "null"]},
    "products": {"type": ["object", "null"]},
    "usage": {"type": "object"},
    "reward": {"type": ["number", "null"]},
    "reward_info": {"type": ["object", "null"]},
}
# OpenAI's fine-tuning chat format: a `messages` list that starts with the system prompt
# and ends with the assistant's reply; brood's metadata under one more key.
OPENAI_CHAT = {
    "type": "object",
    "required": ["messages", "metadata"],
    "additionalProperties": False,
    "properties": {
        "messages": {
            "type": "array",
            "minItems": 3,
            "items": MESSAGE,
            "prefixItems": [
                {"properties": {"role": {"const": "system"}}},
                {"properties": {"role": {"const": "user"}}},
            ],
        },
        "metadata": {
            "type": "object",
            "required": sorted(ABOUT),
            "additionalProperties": False,
            "properties": ABOUT,
        },
    },
}
SPLIT = {
    "prompt": {"type": "array", "items": MESSAGE, "minItems": 1},
    "completion": {"type": "array", "items": MESSAGE, "minItems": 1},
}
CHILD = {
    "type": "object",
    "required": sorted(SPLIT) + sorted(ABOUT),
    "additionalProperties": False,
    "properties": SPLIT | ABOUT,
}
INFO = {k: v for k, v in ABOUT.items() if k not in ("answer", "reward")}
VERIFIERS = {
    "type": "object",
    "required": ["prompt", "completion", "answer", "reward", "info"],
    "additionalProperties": False,
    "properties": SPLIT
    | {
        "answer": {"type": ["string", "null"]},
        "reward": {"type": ["number", "null"]},
        "info": {
            "type": "object",
            "required": [*sorted(INFO), "children"],
            "additionalProperties": False,
            "properties": INFO | {"children": {"type": "array", "items": CHILD}},
        },
    },
}


class Tree:
    """A finished tree: a root that spawns a child, waits, and answers with products."""

    def __init__(self, tmp_path: Any) -> None:
        self.url = f"sqlite:///{tmp_path / 'j.db'}"
        self.received: dict[str, list[list[dict[str, Any]]]] = {"root": [], "child": []}

        def chat_fn(messages: list[dict[str, Any]]) -> str:
            who = "root" if "root: the task" in messages[1]["content"] else "child"
            self.received[who].append([dict(m) for m in messages])
            turn = len(self.received[who])
            if who == "child":
                return code("print(2 + 2)") if turn == 1 else code("FINAL('4')")
            if turn == 1:
                return code("h = rlm_spawn('child: count')\nprint('spawned')")
            return code("FINAL(rlm_wait(h) + '!', products={'n': 1})")

        with brood.Supervisor(chat_fn, store=self.url, limits=FAST) as sup:
            h = sup.spawn("root: the task")
            assert h.wait(timeout=60) == "4!"
            self.root = h.id
            (child,) = [r for r in sup.store.runs(h.id) if r["parent_id"] == h.id]
            self.child = child["id"]
            h.record_reward(0.5, {"rubric": "first"})
            h.record_reward(1.0, {"rubric": "exact"})  # the latest counts

    def export(self, fmt: str) -> list[dict[str, Any]]:
        out = CliRunner().invoke(app, ["export", self.root, "--format", fmt, "--store", self.url])
        assert out.exit_code == 0, out.output
        return [json.loads(line) for line in out.output.splitlines()]

    def seen(self, who: str) -> list[dict[str, Any]]:
        """What the model saw on its last turn, and its reply to it."""
        last = self.received[who][-1]
        reply = "FINAL('4')" if who == "child" else "FINAL(rlm_wait(h) + '!'"
        return [*last, {"role": "assistant", "content": reply}]


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Tree:
    return Tree(tmp_path_factory.mktemp("export"))


def same_turns(exported: list[dict[str, Any]], seen: list[dict[str, Any]]) -> None:
    assert [m["role"] for m in exported] == [m["role"] for m in seen]
    assert exported[:-1] == seen[:-1]
    assert seen[-1]["content"] in exported[-1]["content"]


def test_openai_chat_gives_one_example_per_run_as_its_model_saw_it(tree: Tree):
    root, child = examples = tree.export("openai-chat")
    for example in examples:
        jsonschema.validate(example, OPENAI_CHAT)
    same_turns(root["messages"], tree.seen("root"))
    same_turns(child["messages"], tree.seen("child"))
    # The system prompt is the one the model received, restored from its reference.
    assert root["messages"][0] == tree.received["root"][0][0]
    assert len(root["messages"][0]["content"]) > 500
    assert "4\n" in child["messages"][3]["content"]  # the REPL's output, a user turn
    assert root["metadata"] | {"usage": None} == {
        "run_id": tree.root,
        "root_id": tree.root,
        "parent_id": None,
        "depth": 0,
        "model": root["metadata"]["model"],
        "task": "root: the task",
        "state": "completed",
        "stale": False,
        "reason": "answer",
        "answer": "4!",
        "error": None,
        "products": {"n": 1},
        "usage": None,
        "reward": 1.0,
        "reward_info": {"rubric": "exact"},
    }
    assert root["metadata"]["usage"]["model_calls"] == 2
    meta = child["metadata"]
    assert (meta["run_id"], meta["parent_id"], meta["depth"]) == (tree.child, tree.root, 1)
    assert (meta["answer"], meta["reward"], meta["products"]) == ("4", None, None)


def test_verifiers_gives_one_rollout_with_the_children_s_turns_as_info(tree: Tree):
    (rollout,) = tree.export("verifiers")
    jsonschema.validate(rollout, VERIFIERS)
    seen = tree.seen("root")
    assert rollout["prompt"] == seen[:2]  # the system prompt and the task
    same_turns(rollout["completion"], seen[2:])
    assert (rollout["answer"], rollout["reward"]) == ("4!", 1.0)
    info = rollout["info"]
    assert info["run_id"] == tree.root and info["reward_info"] == {"rubric": "exact"}
    assert info["products"] == {"n": 1} and info["state"] == "completed"
    (child,) = info["children"]
    assert child["run_id"] == tree.child and child["answer"] == "4"
    same_turns(child["prompt"] + child["completion"], tree.seen("child"))


def test_jsonl_is_unchanged_and_the_python_api_takes_the_format(tree: Tree):
    records = tree.export("jsonl")
    assert [(r["run_id"], r["turn"]) for r in records] == [
        (tree.root, 1),
        (tree.root, 2),
        (tree.child, 1),
        (tree.child, 2),
    ]
    assert records[1]["products"] == {"n": 1}
    with Journal(tree.url) as journal:
        assert list(journal.export(tree.root)) == records
        assert len(list(journal.export(tree.child, "openai-chat"))) == 1
        with pytest.raises(brood.InvalidArgument, match="format 'csv' is not an export"):
            journal.export(tree.root, "csv")
        with pytest.raises(brood.UnknownRun):
            journal.export("r-000000", "verifiers")


@pytest.mark.train
def test_verifiers_rollouts_are_verifiers_own_messages_and_trace(tree: Tree):
    from pydantic import TypeAdapter
    from verifiers.v1.configs.agent import AgentConfig
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.trace import AgentInfo, Reward, Trace, TraceTask
    from verifiers.v1.types import Messages

    (rollout,) = tree.export("verifiers")
    messages = TypeAdapter(Messages)
    prompt = messages.validate_python(rollout["prompt"])
    completion = messages.validate_python(rollout["completion"])
    for child in rollout["info"]["children"]:
        messages.validate_python(child["prompt"] + child["completion"])
    nodes = [
        MessageNode(parent=i - 1 if i else None, message=m, sampled=m.role == "assistant")
        for i, m in enumerate([*prompt, *completion])
    ]
    trace = Trace(
        task=TraceTask(type="brood", data={"prompt": rollout["info"]["task"]}),
        agent=AgentInfo(config=AgentConfig()),
        nodes=nodes,
        rewards={"rubric": Reward(score=rollout["reward"])},
        info=rollout["info"],
        root_reply=rollout["answer"],
        is_completed=True,
    )
    assert trace.reward == 1.0
    (branch,) = trace.branches
    assert [m.role for m in branch.messages] == [m["role"] for m in tree.seen("root")]


# ---- a tree still running -------------------------------------------------------------------
def test_a_tree_still_running_is_refused_with_what_to_do(tmp_path):
    url = f"sqlite:///{tmp_path / 'j.db'}"
    gate = Gate(tmp_path, "go")
    replies = iter([code(gate.wait_code + "\nFINAL('late')")])
    with brood.Supervisor(lambda m: next(replies), store=url, limits=FAST) as sup:
        h = sup.spawn("root: wait")
        started = threading.Event()

        def open_when_asked() -> None:
            started.wait()
            gate.open()

        opener = threading.Thread(target=open_when_asked)
        opener.start()
        try:
            sup.store.flush()
            with Journal(url) as journal:
                for fmt in ("jsonl", "openai-chat", "verifiers"):
                    with pytest.raises(brood.BroodError) as err:
                        journal.export(h.id, fmt)
                    message = str(err.value)
                    assert f"run {h.id} cannot be exported yet" in message
                    assert "still running" in message and f"brood cancel {h.id}" in message
            out = CliRunner().invoke(app, ["export", h.id, "--format", "verifiers", "--store", url])
            assert out.exit_code == 2 and "still running" in out.output
            assert "Traceback" not in out.output
        finally:
            started.set()
            opener.join()
        assert h.wait(timeout=60) == "late"
    with Journal(url) as journal:
        (example,) = journal.export(h.id, "openai-chat")
    assert example["metadata"]["answer"] == "late"


def test_a_stale_tree_is_exported_as_it_was_left(tmp_path):
    """A tree whose supervisor is gone is not running: it is exported, marked stale."""
    url = f"sqlite:///{tmp_path / 'j.db'}"
    store = open_store(url)
    try:
        rec = RunRecord(
            id="r-stale1", root_id="r-stale1", parent_id=None, depth=0, key=None, prompt="p"
        )
        store.insert_supervisor("999999:gone", 999999, "nowhere", None).result()
        store.insert_run(rec, "999999:gone").result()
        store.transition(rec, RunState.QUEUED.value, RunState.RUNNING.value).result()
    finally:
        store.close()
    with Journal(url) as journal:
        (example,) = journal.export("r-stale1", "openai-chat")
    assert example["metadata"]["state"] == "running" and example["metadata"]["stale"] is True
    assert example["messages"] == []


# ---- streaming ------------------------------------------------------------------------------
def _journal_of(url: str, runs: int, turns: int) -> str:
    """A tree of `runs` runs (a root and its children) of `turns` model calls each, written
    straight through the store: what an export reads, without running it."""
    store = open_store(url)
    try:
        root = RunRecord(
            id="r-big", root_id="r-big", parent_id=None, depth=0, key=None, prompt="root"
        )
        recs = [root] + [
            RunRecord(
                id=f"r-c{i}", root_id="r-big", parent_id="r-big", depth=1, key=None, prompt=f"c{i}"
            )
            for i in range(runs - 1)
        ]
        store.insert_supervisor("1:gone", 1, "nowhere", None)
        store.event(root, "prompt", {"ref": "p1", "content": "S" * 4000})
        for rec in recs:
            store.insert_run(rec, "1:gone")
            store.transition(rec, "queued", "completed")
            for t in range(turns):
                head = [{"role": "system", "prompt_ref": "p1", "suffix": "."}] if t == 0 else []
                request = [*head, {"role": "user", "content": f"turn {t} " + "x" * 2000}]
                data = {"kind": "turn", "request": request, "response": code("print(1)")}
                store.event(rec, "model_call", data)
        store.flush()
    finally:
        store.close()
    return "r-big"


def test_an_export_streams_in_memory_that_does_not_grow_with_the_tree(tmp_path):
    peaks = {}
    for runs in (10, 100):
        url = f"sqlite:///{tmp_path / f'j{runs}.db'}"
        root = _journal_of(url, runs, turns=3)
        for fmt in ("jsonl", "openai-chat", "verifiers"):
            out = io.StringIO()
            written = 0

            def count(text: str, out: io.StringIO = out) -> int:
                nonlocal written
                written += len(text)
                out.seek(0)  # the output is thrown away as it comes: only the reader counts
                out.truncate()
                return len(text)

            out.write = count  # type: ignore[method-assign]
            with Journal(url) as journal:
                tracemalloc.start()
                try:
                    write_jsonl(journal.export(root, fmt), out)
                    peaks[runs, fmt] = tracemalloc.get_traced_memory()[1]
                finally:
                    tracemalloc.stop()
            assert written > runs * 3 * 2000
    for fmt in ("jsonl", "openai-chat", "verifiers"):
        # Ten times the runs, ten times the output; the peak stays near one run's worth.
        assert peaks[100, fmt] < peaks[10, fmt] * 2 + 100_000, (fmt, peaks)

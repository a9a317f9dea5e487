"""Exports of a journaled tree for training (`Journal.export`, `brood export --format`).

- `jsonl`: one record per model call (its request messages in full, its response, usage).
- `openai-chat`: one training example per run, in OpenAI's fine-tuning chat format: a
  `messages` list of `{"role", "content"}` as the run's model saw them (the system prompt
  restored, each reply an assistant message with its ```repl code, each REPL output the
  user message that followed it), and everything else under one key, `metadata` (run ids,
  depth, model, state, answer, usage, reward), so a trainer strict about top-level keys
  drops one key.
- `verifiers`: one rollout per tree, in the shape verifiers gives a rollout: `prompt` (the
  messages before the model's first reply), `completion` (the rest of the root's own
  turns), `answer`, `reward` and `info`; the children's turns are metadata, in
  `info["children"]`, each child itself in that shape.

Exports stream: a tree is read as an outline of its runs (ids and states, no text), then
run by run, a page of events at a time, so the memory an export holds is that of its
largest run, not of the tree. `info["children"]` of a verifiers rollout is a lazy
iterator for that reason: `write_jsonl` writes it as it reads it, and a caller who wants
it whole makes a list of it.

A tree still running is refused whole, before the first record: an export is of what
ended. A stale tree (its supervisor gone) is exported as it was left, its open runs
marked `stale`.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TextIO

from brood.errors import BroodError, InvalidArgument
from brood.lifecycle import TERMINAL_VALUES
from brood.store.base import Store

__all__ = ["EXPORT_FORMATS", "export_records", "write_jsonl"]

EXPORT_FORMATS = ("jsonl", "openai-chat", "verifiers")
# Events read per query: a page of model calls holds their requests (a few KB each, a
# system prompt by reference), so 100 of them stay well under a MiB.
EVENT_PAGE = 100


def check_format(fmt: object) -> str:
    if fmt not in EXPORT_FORMATS:
        raise InvalidArgument(
            f"format {fmt!r} is not an export format; use one of {', '.join(EXPORT_FORMATS)}"
        )
    return str(fmt)


def export_records(
    store: Store, run_id: str, fmt: str, alive: Callable[[str | None], bool]
) -> Iterator[dict[str, Any]]:
    """The records of the tree under `run_id` in format `fmt`; refuses (before any record)
    a tree with a run still running under a live supervisor (`alive(token)`)."""
    check_format(fmt)
    top = store.get_run(run_id)  # UnknownRun for an id the journal does not hold
    outline = store.outline(top["root_id"])
    children: dict[str, list[str]] = {}
    open_runs: dict[str, dict[str, Any]] = {}
    for r in outline:
        if r["parent_id"] is not None:
            children.setdefault(r["parent_id"], []).append(r["id"])
        if r["state"] not in TERMINAL_VALUES:
            open_runs[r["id"]] = r
    del outline
    order = _breadth_first(run_id, children)
    stale: set[str] = set()
    for rid in _breadth_first(run_id, children):
        row = open_runs.get(rid)
        if row is None:
            continue
        if alive(row["supervisor"]):
            root = top["root_id"]
            raise BroodError(
                f"run {run_id} cannot be exported yet: its tree is still running (run {rid} "
                f"is {row['state']}); an export holds ended trees only. Wait for it to end "
                f"(`brood tree {root}` shows it) or cancel it (`brood cancel {root}`), then "
                "export again"
            )
        stale.add(rid)
    reader = _Reader(store, top["root_id"], stale)
    if fmt == "jsonl":
        return (rec for rid in order for rec in reader.calls(rid))
    if fmt == "openai-chat":
        return (reader.chat_example(rid) for rid in order)
    return iter([reader.rollout(run_id, _breadth_first(run_id, children, skip_top=True))])


def _breadth_first(
    top: str, children: dict[str, list[str]], *, skip_top: bool = False
) -> Iterator[str]:
    queue = deque([top])
    while queue:
        rid = queue.popleft()
        if not (skip_top and rid == top):
            yield rid
        queue.extend(children.get(rid, ()))


def compacted(conversation: list[dict[str, Any]], call: dict[str, Any]) -> list[dict[str, Any]]:
    """A run's conversation after its compaction `call` (kind "compact"): the system
    prompt and the task, which the next turn's request follows with the summary and its
    new message; unchanged when the summary call failed (nothing was replaced)."""
    return conversation if call.get("response") is None else conversation[:2]


class _Reader:
    """Reads one tree's runs for an export, one run at a time."""

    def __init__(self, store: Store, root_id: str, stale: set[str]) -> None:
        self.store = store
        self.stale = stale
        # The system prompts the tree's requests refer to (a few distinct ones per tree).
        self.prompts = {
            e["data"]["ref"]: e["data"]["content"]
            for e in store.events(kind="prompt", root_id=root_id)
        }

    def events(self, run_id: str, kind: str) -> Iterator[dict[str, Any]]:
        """A run's events of one kind, read a page at a time."""
        after = 0
        while True:
            page = self.store.events(run_id, kind, after=after, limit=EVENT_PAGE)
            yield from page
            if len(page) < EVENT_PAGE:
                return
            after = page[-1]["seq"]

    def resolved(self, request: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [
            {"role": m["role"], "content": self.prompts[m["prompt_ref"]] + m.get("suffix", "")}
            if "prompt_ref" in m
            else m
            for m in request
        ]

    # ---- jsonl: one record per model call -------------------------------------------------
    def calls(self, run_id: str) -> Iterator[dict[str, Any]]:
        run = self.store.get_run(run_id)
        conversation: list[dict[str, Any]] = []
        turn = 0
        last: dict[str, Any] | None = None
        for ev in self.events(run_id, "model_call"):
            if last is not None:
                yield last
            d = ev["data"]
            if d["kind"] == "turn":
                conversation.extend(self.resolved(d.get("request", [])))
                messages = list(conversation)
                turn += 1
            elif d["kind"] == "compact":
                messages = conversation + self.resolved(d.get("request", []))
                conversation = compacted(conversation, d)
            else:
                messages = self.resolved(d.get("request", []))
            last = {
                "run_id": run["id"],
                "root_id": run["root_id"],
                "parent_id": run["parent_id"],
                "depth": run["depth"],
                "kind": d["kind"],
                "turn": turn if d["kind"] == "turn" else None,
                "model": d.get("model"),
                "messages": messages,
                "response": d.get("response"),
                "error": d.get("error"),
                "usage": {
                    "input_tokens": d.get("input_tokens", 0),
                    "output_tokens": d.get("output_tokens", 0),
                    "cost": d.get("cost"),
                },
                "latency": d.get("latency"),
            }
        if last is not None:
            if run.get("products") is not None:
                last["products"] = run["products"]
            yield last

    # ---- a run's conversation ---------------------------------------------------------------
    def messages(self, run: dict[str, Any]) -> list[dict[str, Any]]:
        """What the run's model saw, in order, and its last reply: system, user, then
        assistant and user in turn (after a compaction, the compacted history its later
        turns saw: system, task, summary, then on). A run driven step by step (a
        `Session`'s root) has no model turns: its task, then each step's code as the reply
        and its output."""
        conversation: list[dict[str, Any]] = []
        reply: str | None = None
        for ev in self.events(run["id"], "model_call"):
            d = ev["data"]
            if d["kind"] == "turn":
                conversation.extend(self.resolved(d.get("request", [])))
                reply = d.get("response")
            elif d["kind"] == "compact":
                conversation = compacted(conversation, d)
        if reply is not None:
            conversation.append({"role": "assistant", "content": reply})
        if conversation:
            return conversation
        for ev in self.events(run["id"], "step"):
            d = ev["data"]
            if not conversation:
                conversation.append({"role": "user", "content": run["prompt"]})
            conversation.append({"role": "assistant", "content": f"```repl\n{d['code']}\n```"})
            out = "".join(str(d.get(k) or "") for k in ("stdout", "stderr", "error"))
            conversation.append({"role": "user", "content": out})
        return conversation

    def about(self, run: dict[str, Any]) -> dict[str, Any]:
        """A run's metadata: ids, model, how it ended, usage, and its latest reward."""
        rewards = [e["data"] for e in self.events(run["id"], "reward")]
        reward = rewards[-1] if rewards else {}
        return {
            "run_id": run["id"],
            "root_id": run["root_id"],
            "parent_id": run["parent_id"],
            "depth": run["depth"],
            "model": run["model"],
            "task": run["prompt"],
            "state": run["state"],
            "stale": run["id"] in self.stale,
            "reason": run["reason"],
            "answer": run["answer"],
            "error": run["error"],
            "products": run.get("products"),
            "usage": run["usage"],
            "reward": reward.get("reward"),
            "reward_info": reward.get("info"),
        }

    # ---- openai-chat: one example per run ---------------------------------------------------
    def chat_example(self, run_id: str) -> dict[str, Any]:
        run = self.store.get_run(run_id)
        return {"messages": self.messages(run), "metadata": self.about(run)}

    # ---- verifiers: one rollout per tree ------------------------------------------------------
    def rollout(self, run_id: str, descendants: Iterable[str]) -> dict[str, Any]:
        run = self.store.get_run(run_id)
        about = self.about(run)
        info = {k: v for k, v in about.items() if k not in ("answer", "reward")}
        info["children"] = (self.child_rollout(rid) for rid in descendants)
        return _split(self.messages(run)) | {
            "answer": about["answer"],
            "reward": about["reward"],
            "info": info,
        }

    def child_rollout(self, run_id: str) -> dict[str, Any]:
        run = self.store.get_run(run_id)
        return _split(self.messages(run)) | self.about(run)


def _split(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """verifiers' `prompt` (up to the model's first reply) and `completion` (from it)."""
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    return {"prompt": messages[:first], "completion": messages[first:]}


def write_jsonl(records: Iterable[dict[str, Any]], out: TextIO) -> int:
    """Write each record as one JSON line, a lazy part (an iterator) as it is read; returns
    how many lines were written."""
    n = 0
    for record in records:
        _write(record, out.write)
        out.write("\n")
        n += 1
    return n


def _write(value: Any, write: Callable[[str], object]) -> None:
    if isinstance(value, dict):
        write("{")
        for i, (k, v) in enumerate(value.items()):
            write((", " if i else "") + json.dumps(str(k)) + ": ")
            _write(v, write)
        write("}")
    elif isinstance(value, (list, tuple, Iterator)):
        write("[")
        for i, v in enumerate(value):
            if i:
                write(", ")
            _write(v, write)
        write("]")
    else:
        write(json.dumps(value, default=str))

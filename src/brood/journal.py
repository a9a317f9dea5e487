"""`Journal`: read a journal and act on trees that other processes run (the CLI's view).

Reading never changes the journal: the store is opened read-only. Cancel and send go to the
control socket of the supervisor that owns the tree, found in the journal.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from typing import Any

from brood.backends.local import own_memory
from brood.backends.owners import proc_stat
from brood.errors import BroodError, InvalidArgument
from brood.exports import export_records
from brood.lease import lease_holder_gone
from brood.lifecycle import (
    ASK_OPENED,
    TERMINAL_VALUES,
    USAGE_KEYS,
    FlowStatus,
    add_usage,
    is_hibernating,
)
from brood.models.base import MODEL_SPEC
from brood.protocol import CtlAnswer, CtlCancel, CtlFlow, CtlSend
from brood.store.base import Store, open_store
from brood.supervisor.control import control_request

__all__ = ["USAGE_KEYS", "Journal"]

LIVE_STATES = frozenset({"running", "cancelling"})  # a run that has a worker
CONTROL_TIMEOUT_S = 120.0  # a cancel waits for confirmed exit, which includes grace periods


class Journal:
    """A read-only view of a journal, by store URL."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.store: Store = open_store(url, readonly=True)
        self._dead: set[str] = set()

    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- liveness ------------------------------------------------------------------------
    def supervisor_alive(self, token: str | None) -> bool:
        if not token:
            return False
        if token in self._dead:
            return False
        alive = not lease_holder_gone(self.store.supervisor(token))
        if not alive:
            self._dead.add(token)  # a supervisor that is gone stays gone; a live one may die
        return alive

    def _decorate(self, run: dict[str, Any]) -> dict[str, Any]:
        """Adds `run_id`, `stale` (not ended, but its supervisor is gone) and `duration`."""
        run["run_id"] = run["id"]
        run["stale"] = run["state"] not in TERMINAL_VALUES and not self.supervisor_alive(
            run["supervisor"]
        )
        # Its worker stopped for a long wait, to be rebuilt by replay (it holds none).
        run["hibernating"] = is_hibernating(run["state"], run["reason"])
        start, end = run["started_at"], run["ended_at"]
        if start is None:
            run["duration"] = None
        else:
            # A stale run's clock stopped with its supervisor; its duration is unknown.
            stop = end if end is not None else (None if run["stale"] else time.time())
            run["duration"] = None if stop is None else stop - start
        return run

    # ---- reads ---------------------------------------------------------------------------
    def run(self, run_id: str) -> dict[str, Any]:
        """One run with its own usage and its subtree's (`subtree_usage`)."""
        run = self._decorate(self.store.get_run(run_id))
        tree = self._index(run["root_id"])
        run["subtree_usage"] = tree[run_id]["subtree_usage"]
        run["waiting_for"] = tree[run_id]["waiting_for"]
        run["children"] = [c["id"] for c in tree[run_id]["children"]]
        return run

    def _index(self, root_id: str) -> dict[str, dict[str, Any]]:
        runs = [self._decorate(r) for r in self.store.runs(root_id)]
        by_id = {r["id"]: r for r in runs}
        waiting = self._open_asks(root_id)
        for r in runs:
            r["children"] = []
            # A live run with open asks is waiting for a person (on those asks).
            live = r["state"] not in TERMINAL_VALUES and not r["stale"]
            r["waiting_for"] = waiting.get(r["id"], []) if live else []
        for r in runs:
            parent = by_id.get(r["parent_id"])
            if parent is not None:
                parent["children"].append(r)
        for r in reversed(runs):  # children are created after their parent
            total: dict[str, Any] = {}
            add_usage(total, r["usage"])
            for c in r["children"]:
                add_usage(total, c["subtree_usage"])
            r["subtree_usage"] = total
        return by_id

    def _open_asks(self, root_id: str) -> dict[str, list[str]]:
        """The open asks of a tree's runs, by run, from the journal's ask events."""
        by_run: dict[str, list[str]] = {}
        for ask_id, e in _still_open(self.store.events(root_id=root_id, kind="ask")).items():
            by_run.setdefault(e["run_id"], []).append(ask_id)
        return by_run

    def tree(self, run_id: str) -> dict[str, Any]:
        """The run and its descendants, nested under `children`, each with its usage and
        its subtree's."""
        root_id = self.store.get_run(run_id)["root_id"]
        return self._index(root_id)[run_id]

    def roots(
        self, limit: int = 20, *, offset: int = 0, state: str | None = None
    ) -> list[dict[str, Any]]:
        """The most recent trees, newest first (`limit` from `offset`, in `state` only if
        given), with their size, subtree usage, and the live workers of their open runs
        (`workers`) with the memory those hold alone (`memory_bytes`; read on this host
        only, else None)."""
        out = []
        for root in self.store.roots(limit, offset=offset, state=state):
            index = self._index(root["id"])
            row = index[root["id"]]
            row["runs"] = len(index)
            row["open"] = sum(1 for r in index.values() if r["state"] not in TERMINAL_VALUES)
            row["asks_open"] = sum(len(r["waiting_for"]) for r in index.values())
            row["hibernating_runs"] = sum(r["hibernating"] for r in index.values())
            live = [
                r
                for r in index.values()
                if r["state"] in LIVE_STATES
                and r["pid"]
                and not r["hibernating"]
                and not r["stale"]
                and r["model"] != "flow"
            ]
            row["workers"] = len(live)
            here = all(map(self._on_this_host, {r["supervisor"] for r in live}))
            row["memory_bytes"] = sum(own_memory(r["pid"]) for r in live) if here else None
            row["quarantined"] = sum(
                q["present"] is None or bool(q["present"]) for q in self.quarantined(root["id"])
            )
            out.append(row)
        return out

    def quarantined(self, root_id: str | None = None) -> list[dict[str, Any]]:
        """Worker groups whose exit a supervisor could not confirm, and has not confirmed
        since (a `quarantined` event with no `released` after it), of one tree or of all:
        run_id, root_id, group, pids, at, error, and `present`: those of its processes still
        there now, unreaped ones included (None when its supervisor ran on another host)."""
        released = {e["run_id"] for e in self.store.events(kind="released", root_id=root_id)}
        out = []
        for e in self.store.events(kind="quarantined", root_id=root_id):
            if e["run_id"] in released:
                continue
            group = int(e["data"].get("group", 0))
            here = self._on_this_host(self.store.get_run(e["run_id"])["supervisor"])
            present = [p for p in e["data"].get("pids", []) if _in_group(p, group)]
            out.append(
                {"run_id": e["run_id"], "root_id": e["root_id"], "at": e["at"]}
                | {k: e["data"].get(k) for k in ("group", "pids", "error")}
                | {"present": present if here else None}
            )
        return out

    def _on_this_host(self, token: str | None) -> bool:
        row = self.store.supervisor(token) if token else None
        return row is not None and row["host"] == socket.gethostname()

    def steps(self, run_id: str) -> list[dict[str, Any]]:
        return [e["data"] | {"at": e["at"]} for e in self.store.events(run_id, "step")]

    def events(self, run_id: str, after: int = 0) -> list[dict[str, Any]]:
        """The run's trajectory since event `after`: model calls, steps, messages."""
        self.store.get_run(run_id)  # an unknown id is an error, not an empty log
        return self.store.events(run_id, after=after)

    def model_spec(self, run_id: str) -> dict[str, Any] | None:
        """What the journal holds of the model the tree of `run_id` was last started or
        resumed with: `{"spec": SPEC}`, `{"spec": None, "withheld": WHY}` (a secret, a
        chat_fn), or None (a tree journaled before brood kept it)."""
        root_id = self.store.get_run(run_id)["root_id"]
        found = self.store.events(root_id, MODEL_SPEC)
        return dict(found[-1]["data"]) if found else None

    def export(self, run_id: str, format: str = "jsonl") -> Iterator[dict[str, Any]]:
        """The tree under `run_id` for training, streamed (see `brood.exports`):
        `jsonl`, one record per model call (full request messages, response, usage; a
        run's last one carries its FINAL products); `openai-chat`, one example per run
        (`messages` with the system prompt restored, `metadata` with its ids, state,
        answer, usage and latest reward); `verifiers`, one rollout for the tree (`prompt`,
        `completion`, `answer`, `reward`, `info` with the children's turns, lazily).

        Raises at once (before any record) for an unknown run (UnknownRun), a format not
        among these (InvalidArgument), or a tree still running (BroodError: wait for it or
        cancel it). `brood.exports.write_jsonl` writes the records as JSON lines."""
        return export_records(self.store, run_id, format, self.supervisor_alive)

    # ---- acting on another process's tree ------------------------------------------------
    def _control(self, run_id: str) -> str:
        run = self._decorate(self.store.get_run(run_id))
        if run["state"] in TERMINAL_VALUES:
            raise BroodError(
                f"run {run_id} is {run['state']}; a run that has ended takes no cancel, "
                "message or answer"
            )
        token = run["supervisor"]
        row = self.store.supervisor(token) if token else None
        if row is None or not self.supervisor_alive(token) or not row["control"]:
            pid = token.split(":")[0] if token else "?"
            raise BroodError(
                f"run {run_id} is stale: its supervisor (pid {pid}) is gone; "
                "`brood resume` can pick the tree up"
            )
        return str(row["control"])

    def cancel(self, run_id: str, *, reason: str = "cancelled by user (brood cancel)") -> str:
        """Cancel a run (and its subtree) of a tree another process runs; returns the final
        state once every exit is confirmed. `reason` is journaled as the run's reason (a
        server whose client went away says so)."""
        path = self._control(run_id)
        return str(control_request(path, CtlCancel(1, run_id, reason), CONTROL_TIMEOUT_S))

    # ---- asks to a person ----------------------------------------------------------------
    def asks(self) -> list[dict[str, Any]]:
        """The open asks of every live run in the journal, oldest first: id, run_id,
        question, options, default, deadline (epoch seconds or None), opened_at."""
        opened = {
            ask_id: {
                "id": ask_id,
                "run": e["run_id"],
                "run_id": e["run_id"],
                "question": e["data"]["question"],
                "options": e["data"]["options"],
                "default": e["data"]["default"],
                "deadline": e["data"]["deadline_at"],
                "opened_at": e["data"]["opened_at"],
            }
            for ask_id, e in _still_open(self.store.events(kind="ask")).items()
        }
        states = {r: self.store.get_run(r)["state"] for r in {a["run_id"] for a in opened.values()}}
        live = [a for a in opened.values() if states[a["run_id"]] not in TERMINAL_VALUES]
        return sorted(live, key=lambda a: a["opened_at"])

    def ask_run(self, ask_id: str) -> str | None:
        """The run that opened an ask (None: the journal holds no such ask)."""
        for e in self.store.events(kind="ask"):
            if e["data"].get("op") == ASK_OPENED and e["data"]["ask"] == ask_id:
                return str(e["run_id"])
        return None

    def answer(self, ask_id: str, value: str, by: str) -> dict[str, Any]:
        """Answer an open ask through the control socket of the supervisor that owns its
        run; returns the ask's result."""
        run_id = self.ask_run(ask_id)
        if run_id is None:
            raise InvalidArgument(
                f"no ask {ask_id!r} in the journal {self.store.url}; `brood asks` lists the "
                "open ones"
            )
        run = self.store.get_run(run_id)
        if run["state"] in TERMINAL_VALUES:
            raise InvalidArgument(
                f"ask {ask_id} cannot be answered: run {run_id}, which asked it, has ended "
                f"({run['state']}), and its asks ended with it; `brood asks` lists the open ones"
            )
        try:
            path = self._control(run_id)
        except BroodError as exc:  # a stale run: said of the ask, not only of its run
            raise BroodError(f"ask {ask_id} cannot be answered now: {exc}") from None
        result: dict[str, Any] = control_request(
            path, CtlAnswer(1, ask_id, value, by), CONTROL_TIMEOUT_S
        )
        return result

    def flow(self, run_id: str, op: str) -> Any:
        """stop / resume / status of a flow another process runs (status of an ended or
        stale flow is read from its ledger instead)."""
        if op == "status":
            run = self._decorate(self.store.get_run(run_id))
            if run["state"] in TERMINAL_VALUES or run["stale"]:
                return self.flow_status(run_id)
        path = self._control(run_id)
        return control_request(path, CtlFlow(1, run_id, op), CONTROL_TIMEOUT_S)

    def flow_status(self, run_id: str) -> dict[str, Any]:
        """A flow's status rebuilt from its ledger: per-state entries and instances,
        milestones, the last events."""
        run = self._decorate(self.store.get_run(run_id))
        ledger = [e["data"] for e in self.store.events(run_id, "flow")]
        if not ledger:
            raise BroodError(f"run {run_id} is not a flow (it has no flow ledger)")
        spec: dict[str, Any] = next((e["spec"] for e in ledger if e["kind"] == "spec"), {})
        maxes = {s["id"]: s.get("max_entries", 1) for s in spec.get("states", [])}
        states: dict[str, dict[str, Any]] = {
            sid: {"entries": 0, "max_entries": m, "instances": []} for sid, m in maxes.items()
        }
        for e in ledger:
            st = states.setdefault(str(e.get("state")), {"entries": 0, "instances": []})
            if e["kind"] == "state_entry":
                st["entries"] += 1
            elif e["kind"] == "spawned":
                st["instances"].append(
                    {
                        "entry": e["entry"],
                        "item": e["item"],
                        "attempt": e["attempt"],
                        "run_id": e["run_id"],
                        "state": "running",
                    }
                )
            elif e["kind"] == "settled":
                for inst in st["instances"]:
                    if inst["run_id"] == e["run_id"]:
                        inst["state"] = e["outcome"]
        states.pop("None", None)
        ended = next((e for e in reversed(ledger) if e["kind"] == "flow_ended"), None)
        outside = next((e for e in ledger if e["kind"] == "run_ended"), None)
        if ended is None and (outside or run["state"] in TERMINAL_VALUES):
            # Its run was ended from outside (a cancel, the end of the run that started it).
            ended = {"status": FlowStatus.STOPPED, "reason": (outside or run)["reason"]}
        status = ended["status"] if ended else ("stale" if run["stale"] else FlowStatus.RUNNING)
        return {
            "run_id": run_id,
            "status": status,
            "reason": ended and ended["reason"],
            "transitions_fired": sum(1 for e in ledger if e["kind"] == "transition_fired"),
            "states": states,
            "milestones": [e["milestone"] for e in ledger if e["kind"] == "milestone"],
            "events": ledger[-20:],
        }

    def send(self, run_id: str, message: str) -> None:
        """A follow-up message to a running run of another process's tree."""
        path = self._control(run_id)
        control_request(path, CtlSend(1, run_id, message), CONTROL_TIMEOUT_S)


def default_store_url() -> str:
    return os.environ.get("BROOD_STORE") or "sqlite:///.brood/brood.db"


def _still_open(events: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Of a list of `ask` events in journal order: each ask still open, by id, with the
    event that opened it."""
    opened: dict[str, dict[str, Any]] = {}
    for e in events:
        if e["data"].get("op") == ASK_OPENED:
            opened[e["data"]["ask"]] = e
        else:
            opened.pop(e["data"]["ask"], None)
    return opened


def _in_group(pid: int, group: int) -> bool:
    """Whether process `pid` is there now (a zombie not reaped too) in process group `group`."""
    fields = proc_stat(pid)
    return len(fields) > 2 and fields[2] == str(group)

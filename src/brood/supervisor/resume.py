"""Resuming a tree from the journal: its rows rebuilt into runs, the tree's counters
counted again, and the decision for each run that had not ended (cancelled, failed for a
poison step, replayed in a new worker, or queued again); flows are rebuilt from their
ledgers; a divergence of a replay stops the resume of the whole tree.

It owns `diverged` (root id -> why its resume stopped); flows are rebuilt by the
supervisor's `Flows`, given at construction. It reads the journal; it writes only through
the kernel (events, claims) and ends runs only through the kernel's `finish`.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

from brood.errors import BroodError
from brood.lease import lease_holder_gone
from brood.lifecycle import RunRecord, RunState, is_hibernating
from brood.protocol import Replay
from brood.supervisor.admission import Admission
from brood.supervisor.asks import Asks
from brood.supervisor.conversations import journaled_turns
from brood.supervisor.kernel import Flows, Kernel
from brood.supervisor.runs import (
    CANCELLING,
    COST_UNKNOWN,
    FLOW_MODEL,
    RUN,
    Run,
    Tree,
    graft,
    journaled_kind,
)
from brood.supervisor.spread import Spread
from brood.supervisor.tools import TOOL_EVENT, tool_replay
from brood.supervisor.tracing import SpanIds

HIBERNATED = "hibernated"  # the event of a run whose worker was stopped for a long wait


class Resume:
    def __init__(
        self, kernel: Kernel, admission: Admission, asks: Asks, spread: Spread, flows: Flows
    ) -> None:
        self.kernel = kernel
        self.admission = admission
        self.asks = asks
        self.spread = spread
        self.flows = flows
        self.diverged: dict[str, str] = {}  # root id -> why its resume stopped

    async def resume_tree(self, root_id: str) -> Run:
        """Rebuild the tree under `root_id` from the journal and start its root again.

        Runs that ended keep their journaled outcome. A run cancelled before the crash, or
        under a parent that ended, is cancelled (not resumed). The root replays its journal
        in a new worker; each child waits until its parent's replay asks for it again by
        key (adoption) and is then resumed the same way, or handed its journaled answer.
        """
        self.kernel.check_open()
        return await self._rebuild(root_id, root_id)

    async def resume_subtree(self, root_id: str, top_id: str, top: Run | None = None) -> Run:
        """Resume the subtree of tree `root_id` under run `top_id`, as `resume_tree` resumes
        a tree: a child placed on a node that was lost. `top` is its run here when its
        parent runs here (its own node's run then goes on as a local child); without it the
        subtree is a guest here, as on the node that was lost."""
        self.kernel.check_open()
        return await self._rebuild(root_id, top_id, top)

    async def _rebuild(self, root_id: str, top_id: str, top: Run | None = None) -> Run:
        k = self.kernel
        rows = k.store.runs(root_id)
        counted = len(rows) - 1
        away = self._away(rows) if top_id == root_id else {}
        if away:  # what runs below them is their nodes': not rebuilt here
            below = _below(rows, set(away)) - set(away)
            rows = [r for r in rows if r["id"] not in below]
        if top_id != root_id:  # its subtree
            kept = _below(rows, {top_id})
            rows = [r for r in rows if r["id"] in kept]
        runs = self._runs_of(rows, root_id, top_id, top, away)
        root = runs[top_id]
        # A local child's tree keeps its counters here already (its root runs here).
        if top is None:
            _count_usage(root.tree, [r for i, r in runs.items() if i not in away])
            root.tree.children = counted if top_id == root_id else len(runs) - 1
            root.tree.prompts = {e["data"]["ref"] for e in k.store.events(top_id, "prompt")}
        k.runs.update(runs)
        if k.tracing.enabled:
            self._trace(root_id, runs)
        followed = [runs[i] for i in away]
        runs = {i: r for i, r in runs.items() if i not in away}
        for run in runs.values():  # answered asks replay; open ones are open again
            if not run.rec.state.terminal:
                self.asks.adopt(run, k.store.events(run.id, "ask"))
        if top_id == root_id and not away:
            await asyncio.wrap_future(k.store.claim_tree(root_id, k.owner))
        else:
            for run in runs.values():
                if not run.rec.state.terminal:
                    await asyncio.wrap_future(k.store.claim_run(run.id, k.owner))
        for run in followed:
            if run.remote is not None:
                run.started.set()
                k.task(self.spread.follow(run))
        open_ids = [r.id for r in runs.values() if not r.rec.state.terminal]
        k.event(root, "resume", {"supervisor": k.owner, "open": open_ids})
        ending = self._decide(list(runs.values()))
        # Flows, before any worker starts (a resumed parent's replay asks for its flows):
        # each flow whose run or parent goes on is rebuilt from its ledger.
        for run in runs.values():
            parent = run.parent
            if run.rec.model != FLOW_MODEL or run in ending:
                continue
            if parent is not None and (parent.rec.state.terminal or parent in ending):
                continue
            self._resume_flow(run)
        if root.launchable:
            self.admission.queue(root)
        return root

    def _runs_of(
        self,
        rows: list[dict[str, Any]],
        root_id: str,
        top_id: str,
        top: Run | None,
        away: dict[str, Any],
    ) -> dict[str, Run]:
        """The journal's rows as runs, in creation order (a parent before its children)."""
        k = self.kernel
        extra = k.store.resume_data(root_id)
        runs: dict[str, Run] = {}
        for row in rows:
            rec = _record(row)
            parent = runs.get(row["parent_id"]) if row["parent_id"] else None
            data = extra.get(rec.id, {})
            if rec.id == top_id and top is not None:  # its parent runs here: the same run
                top.rec, top.remote, top.spreading = rec, None, None
                runs[rec.id] = top
                continue
            where = away.get(rec.id)
            if isinstance(where, Run):  # placed here by the lost node: a local child now
                assert parent is not None
                graft(where, parent)
                if rec.key is not None:
                    parent.by_key[rec.key] = where
                runs[rec.id] = where
                continue
            run = Run(
                rec=rec,
                model=k.model,
                context_blob=data.get("context"),
                model_name=data.get("model_name"),
                timeout=k.limits.child_timeout if parent or rec.id != root_id else None,
                parent=parent,
            )
            if rec.id == root_id and not rec.state.terminal:  # a conversation's turns
                run.turns = journaled_turns(k.store, rec.id)
            run.guest = rec.id == top_id != root_id
            run.remote = where  # placed on a node that goes on: followed there
            if parent is not None:
                parent.children.append(run)
                if rec.key is not None:
                    parent.by_key[rec.key] = run
            if rec.state.terminal:
                run.failure_kind = journaled_kind(rec)
                run.started.set()
                run.done.set()
            runs[rec.id] = run
        return runs

    def _trace(self, root_id: str, runs: dict[str, Run]) -> None:
        """A span for each run that goes on, linked to its spans before the crash (the
        ids its `trace` events hold), which ended with the process that held them."""
        k = self.kernel
        crashed: dict[str, list[SpanIds]] = {}
        for e in k.store.events(kind="trace", root_id=root_id):
            ids = SpanIds.from_journal(e["data"])
            if ids is not None and e["run_id"] in runs:
                crashed.setdefault(e["run_id"], []).append(ids)
        for run in runs.values():  # in creation order: a parent's span before its children's
            if not run.rec.state.terminal:
                k.start_trace(run, crashed.get(run.id, ()))

    def _decide(self, runs: list[Run]) -> set[Run]:
        """What becomes of each run that had not ended; the runs this resume cancels."""
        k = self.kernel
        ending: set[Run] = set()  # cancelled by this resume
        # Each running run's journaled steps, read once: for poison steps and its replay.
        steps = {r: k.store.events(r.id, "step") for r in runs if r.rec.state is RUN}
        poisoned = self._poison_steps(steps)
        for run in runs:
            if run.rec.state.terminal or run.ending is not None:
                continue
            parent = run.parent
            if run.rec.state is CANCELLING:  # journaled first, so it stays cancelled
                ending.add(run)
                k.end(run, RunState.CANCELLED, run.rec.reason or "cancelled")
            elif parent is not None and (parent.rec.state.terminal or parent in ending):
                ending.add(run)
                k.end(run, RunState.CANCELLED, "parent ended before the resume")
            elif run.rec.model == FLOW_MODEL:
                pass  # a flow's run has no worker: its ledger rebuilds it, below
            elif run in poisoned:
                ending.add(run)
                why = (
                    f"step {poisoned[run]} was under way each time its host process died, twice; "
                    "it is not replayed a third time (its code may be what kills the host)"
                )
                k.end(run, RunState.FAILED, why)
            elif run.rec.state is RUN:
                self.prepare_replay(run, steps[run])
            else:  # queued: follow-ups held for its start were in memory only
                run.messages = [e["data"]["message"] for e in k.store.events(run.id, "message")]
        return ending

    def _away(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        """The runs of a tree being resumed that head a subtree placed on another node
        (placement="spread") whose supervisor still holds its lease: they go on there, and
        are followed, not resumed; one that supervisor is this one joins the tree here."""
        k = self.kernel
        if k.spreader is None:
            return {}
        owner = {r["id"]: r["supervisor"] for r in rows}
        away: dict[str, Any] = {}
        for row in rows:
            holder = row["supervisor"]
            if row["parent_id"] is None or holder == owner.get(row["parent_id"]):
                continue
            if RunState(row["state"]).terminal:
                continue
            if holder == k.owner:
                guest = k.runs.get(row["id"])
                if guest is not None and guest.guest:
                    away[row["id"]] = guest
            elif not lease_holder_gone(k.store.supervisor(holder)):
                peer = k.spreader.holder(holder)
                if peer is not None:
                    away[row["id"]] = peer
        return away

    def _poison_steps(self, steps: dict[Run, list[dict[str, Any]]]) -> dict[Run, int]:
        """The runs whose step was under way at two host deaths, each with that step. A run
        with such a descendant is not one of them: its step was waiting on that one."""
        found = {}
        for run, done in steps.items():
            if (step := self._poison_step(run, done)) is not None:
                found[run] = step

        def waits_below(run: Run) -> bool:
            return any(c in found or waits_below(c) for c in run.children)

        return {run: step for run, step in found.items() if not waits_below(run)}

    def _poison_step(self, run: Run, steps: list[dict[str, Any]]) -> int | None:
        """The step of `run` that was under way at two host deaths (begun twice in the
        journal, ended never), if there is one."""
        done = {int(e["data"]["step"]) for e in steps}
        begun: dict[int, int] = {}
        for e in self.kernel.store.events(run.id, "step_begun"):
            step = int(e["data"]["step"])
            begun[step] = begun.get(step, 0) + 1
        # A step whose worker was stopped to hibernate begins again when the run wakes:
        # that stop is no host death.
        for e in self.kernel.store.events(run.id, HIBERNATED):
            step = int(e["data"].get("step", 0))
            begun[step] = begun.get(step, 0) - 1
        return next((n for n, c in sorted(begun.items()) if c >= 2 and n not in done), None)

    def prepare_replay(self, run: Run, steps: list[dict[str, Any]] | None = None) -> None:
        """Make `run` (running, its worker gone) ready to be rebuilt in a new worker by
        replaying its journal: after a crash, and when a hibernating run wakes. `steps`:
        its journaled steps, if they have been read already."""
        store = self.kernel.store
        if steps is None:
            steps = store.events(run.id, "step")
        if is_hibernating(run.rec.state.value, run.rec.reason):  # it sleeps no more
            run.rec.reason = None
            store.note_reason(run.id, None)
        run.replay = self._replay_of(run, steps)
        run.tool_replay = tool_replay(store.events(run.id, TOOL_EVENT))

    def _replay_of(self, run: Run, steps: list[dict[str, Any]]) -> Replay:
        """What the journal holds of a run: its turns' replies (and prompt tokens), its
        compactions' summaries, its plain calls' replies by prompt, the number of its last
        journaled step."""
        store = self.kernel.store
        replay = Replay()
        for ev in store.events(run.id, "model_call"):
            d = ev["data"]
            if d.get("response") is None:
                continue
            if d["kind"] == "turn":
                replay.turns.append(d["response"])
                replay.turn_tokens.append(int(d.get("input_tokens") or 0))
            elif d["kind"] == "compact":
                replay.compactions[len(replay.turns)] = d["response"]
            else:
                prompt = str((d.get("request") or [{}])[-1].get("content", ""))
                replay.calls.setdefault(prompt, []).append(d["response"])
        replay.remembered = [
            base64.b64decode(e["data"]["value"]) for e in store.events(run.id, "remember")
        ]
        replay.pending = [p for e in steps for p in e["data"].get("pending", [])]
        replay.steps = max((int(e["data"]["step"]) for e in steps), default=0)
        if run.turns is not None:
            replay.user_turns = list(run.turns.prompts)
        # A model it has already said is unpriced is not said again.
        run.unpriced = {e["data"].get("model") for e in store.events(run.id, COST_UNKNOWN)}
        return replay

    def _resume_flow(self, run: Run) -> None:
        try:
            self.flows.rebuild_flow(run)
        except BroodError as exc:
            why = f"could not resume flow {run.id}: {exc}"
            self.stop_resume(run, why)
            if not run.rec.state.terminal:
                self.kernel.end(run, RunState.FAILED, why)

    def stop_resume(self, run: Run, reason: str) -> None:
        """A replay diverged: the resume of the whole tree stops."""
        k = self.kernel
        root = k.top(run)
        self.diverged.setdefault(root.id, reason)
        if root is not run:
            k.end(root, RunState.CANCELLED, f"resume stopped: {reason}")


def _record(row: dict[str, Any]) -> RunRecord:
    return RunRecord(
        id=row["id"],
        root_id=row["root_id"],
        parent_id=row["parent_id"],
        depth=row["depth"],
        key=row["key"],
        prompt=row["prompt"],
        model=row["model"],
        pool=row["pool"],
        context_ref=row["context_ref"],
        attempt=row["attempt"],
        state=RunState(row["state"]),
        reason=row["reason"],
        answer=row["answer"],
        error=row["error"],
        usage=dict(row["usage"]),
        products=row["products"],
        created_at=row["created_at"],
        started_at=row["started_at"],
        ended_at=row["ended_at"],
    )


def _count_usage(tree: Tree, runs: list[Run]) -> None:
    """The tree's spend so far, from its runs' journaled usage."""
    t = tree.usage
    for run in runs:
        u = run.rec.usage
        t["tokens"] = t.get("tokens", 0) + u.get("input_tokens", 0) + u.get("output_tokens", 0)
        t["cost"] = t.get("cost", 0.0) + (u.get("cost") or 0.0)  # priced calls only


def _below(rows: list[dict[str, Any]], tops: set[str]) -> set[str]:
    """The ids of `tops` and of every run under them, from a tree's rows in creation order
    (a parent's row comes before its children's)."""
    found = set(tops)
    for row in rows:
        if row["parent_id"] in found:
            found.add(row["id"])
    return found


__all__ = ["HIBERNATED", "Resume"]

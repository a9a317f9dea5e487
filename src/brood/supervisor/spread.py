"""Children placed on other nodes (placement="spread", a cluster): starting one there
through the spreader, following its state there (its parent hears of it as of any child's),
taking a child another node placed here (a guest), and adopting the subtree of a child
whose node was lost.

It owns no state of its own (a run's `spreading` and `remote` are its fields). The
`Spreader` itself (the cluster's node agent) is the kernel's; resuming a lost subtree is
resume.py's, bound by the composition root.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from brood.errors import NodeLost
from brood.lifecycle import RunRecord, RunState, move
from brood.supervisor.admission import Admission
from brood.supervisor.ending import Ending
from brood.supervisor.kernel import Kernel, Spreader, unbound
from brood.supervisor.runs import RUN, Q, Run


class Spread:
    def __init__(self, kernel: Kernel, admission: Admission, ending: Ending) -> None:
        self.kernel = kernel
        self.admission = admission
        self.ending = ending
        # Bound by the composition root to resume.py's `Resume.resume_subtree`.
        self.resume_subtree: Callable[[str, str, Run | None], Awaitable[Run]] = unbound

    async def spread(self, run: Run) -> None:
        """Start `run` on another node through the spreader; then follow its state there
        until it ends. With no other node it starts here like any child."""
        k = self.kernel
        assert k.spreader is not None
        try:
            run.remote = await k.spreader.start(run)
        except Exception as exc:
            if not run.rec.state.terminal and run.ending is None:
                k.end(run, RunState.FAILED, f"could not start on another node: {exc}")
            return
        if run.remote is None:
            self.admission.queue(run)
            return
        k.task(self.follow(run))

    async def follow(self, run: Run) -> None:
        """Mirror a spread child's start and end, journaled by the node running it, here:
        its parent hears of them as of any child's."""
        k = self.kernel
        assert k.spreader is not None
        try:
            await k.spreader.started(run)
            if run.rec.state is Q and run.ending is None:
                move(run.rec, RUN)
                k.tell_parent(run)
                run.started.set()
                k.observers.emit("on_start", run.info)
            end = await k.spreader.ended(run)
        except Exception as exc:
            if run.ending is not None or run.rec.state.terminal:
                return
            if isinstance(exc, NodeLost) and await self.adopt_lost(run, exc):
                return
            k.end(run, RunState.FAILED, f"its node was lost: {exc}")
            return
        if run.ending is None:  # else the one ending it mirrors the end
            self.ending.mirror_end(run, end)

    async def adopt_lost(self, run: Run, exc: Exception) -> bool:
        """A spread child's node was lost: resume its subtree here, from the journal, as a
        local child (replayed, its children adopted by key). False if that failed."""
        k = self.kernel
        assert k.spreader is not None
        try:
            await k.spreader.lost(run)
            await self.resume_subtree(run.rec.root_id, run.id, run)
        except Exception as why:
            k.event(run, "adopt_failed", {"lost": str(exc), "error": str(why)})
            return False
        return True

    async def host_guest(
        self, rec: RunRecord, run_data: dict[str, Any], note: dict[str, Any]
    ) -> Run:
        """Take a child placed here by its parent's node (placement="spread"): its record is
        journaled already; this supervisor owns it and its subtree from now on."""
        k = self.kernel
        k.check_open()
        run = Run(
            rec=rec,
            model=k.model,
            context_blob=run_data.get("context"),
            model_name=run_data.get("model_name"),
            timeout=run_data.get("timeout"),
        )
        run.guest = True
        run.messages = list(run_data.get("messages") or [])
        k.runs[run.id] = run
        await asyncio.wrap_future(k.store.claim_run(run.id, k.owner))
        k.event(run, "placed", note | {"supervisor": k.owner})
        # Its span is its parent's node's (the traceparent it sent): what it does here goes
        # under that span; without one (that node traces nothing) its span begins here.
        k.journal_trace(run, k.tracing.guest(run, run_data.get("traceparent")))
        self.admission.admit(run)
        return run

    def admit_remote(self, root_id: str, count: int) -> None:
        """A subtree of `root_id` on another node starts `count` children: the tree-wide
        limits are this node's to keep (the root runs here)."""
        k = self.kernel
        root = k.tree_root(root_id)
        k.limits.admit_children(tree_total=root.tree.children, run_total=0, count=count)
        root.tree.children += count


__all__ = ["Spread", "Spreader"]

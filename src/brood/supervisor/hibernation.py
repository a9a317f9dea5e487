"""Hibernation (DESIGN.md section 17): a run that has waited longer than
`Limits.hibernate_after` (on children, an ask, a flow, a pool, a slow model call) gives up
its worker, and is rebuilt in a fresh worker by replaying its journal (resume.py's
machinery) once something it waits on has changed; it then goes on with its wait.

Its state stays `running` throughout (its parent's `rlm_status` does not change); its
journal row's reason says `hibernating: ...` while its worker is gone, and `hibernated` /
`woken` events mark each sleep. Its handles, children, asks and budgets stay as they are:
the rebuilt worker's replay adopts its children by key, its asks by key, and its model
calls and tool results come from the journal.

Whether a run may hibernate is decided before, not discovered after: its worker says what
it can see that a replay would not reproduce (`Blocked.hazard`: threads, open files,
spawned work, a wait with a timeout), the supervisor what it knows (a Session's root, a
conversation's). Such a run stays live, and its journal says why (once per run).

Under `Limits.max_workers` (admission.py counts live workers), the runs that have waited
longest hibernate first to make room for starts that queue.

It owns the order of the runs waiting with a worker (`waiters`) and the hibernations under
way; it stops workers only through ending's `release_worker` and starts them again only
through admission's queue.
"""

from __future__ import annotations

import asyncio
from typing import Any

from brood.lifecycle import HIBERNATING
from brood.supervisor.admission import Admission
from brood.supervisor.asks import Asks
from brood.supervisor.ending import Ending
from brood.supervisor.kernel import Kernel
from brood.supervisor.resume import HIBERNATED, Resume
from brood.supervisor.runs import RUN, Run

WOKEN = "woken"  # the event of a hibernating run rebuilt in a new worker
STAYS_LIVE = "stays_live"  # why a waiting run keeps its worker (once per run)


class Hibernation:
    def __init__(
        self, kernel: Kernel, admission: Admission, ending: Ending, asks: Asks, resume: Resume
    ) -> None:
        self.kernel = kernel
        self.admission = admission
        self.ending = ending
        self.asks = asks
        self.resume = resume
        self.after = kernel.limits.hibernate_after
        # Runs waiting with a live worker that may hibernate, longest waiting first.
        self.waiters: dict[Run, None] = {}
        self.stopping = 0  # hibernations whose worker is being stopped
        admission.make_room = self.make_room

    # ---- a run waits, and computes again ----------------------------------------------------
    def waiting(self, run: Run, hazard: str) -> None:
        """`run`'s worker says it waits, on something the supervisor holds; `hazard` is
        what its worker says a replay would not reproduce ("" if nothing)."""
        k = self.kernel
        if self.after is None or run.hibernating:
            return
        why = hazard or self._hazard(run)
        if why:
            self._stays_live(run, why)
            return
        self.waiters[run] = None
        self._cancel_timer(run)
        if self.after == 0:
            k.task(self.hibernate(run, "it waits (Limits.hibernate_after=0)"))
        else:
            run.hibernate_timer = asyncio.get_running_loop().call_later(self.after, self._due, run)

    def computing(self, run: Run) -> None:
        """`run`'s worker computes again (or its run ends): it is no candidate any more."""
        self._cancel_timer(run)
        self.waiters.pop(run, None)

    def _due(self, run: Run) -> None:
        run.hibernate_timer = None
        why = f"it waited {self.after:g} s (Limits.hibernate_after)"
        self.kernel.task(self.hibernate(run, why))

    def _cancel_timer(self, run: Run) -> None:
        if run.hibernate_timer is not None:
            run.hibernate_timer.cancel()
            run.hibernate_timer = None

    def _hazard(self, run: Run) -> str:
        """Why the supervisor keeps `run` live, from what it knows itself ("" if nothing)."""
        if run.driven:
            return "a Session's root: its steps come from its trainer, not from the journal"
        if run.turns is not None:
            return "a conversation's root: it is suspended between turns instead"
        if run.guest or run.remote is not None or run.spreading is not None:
            return "its tree spans nodes: it is not rebuilt away from its parent's node"
        return ""

    def _stays_live(self, run: Run, why: str) -> None:
        if run.stays_live is None:
            run.stays_live = why
            self.kernel.event(run, STAYS_LIVE, {"reason": why})

    def _can_sleep(self, run: Run) -> bool:
        return (
            run.blocked
            and not run.hibernating
            and run.conn is not None
            and run.ending is None
            and run.rec.state is RUN
            and not self.kernel.closing
        )

    # ---- to sleep ------------------------------------------------------------------------
    async def hibernate(self, run: Run, why: str) -> None:
        """Stop `run`'s worker (exit confirmed) while it waits; it stays `running`."""
        self.computing(run)
        if not self._can_sleep(run):
            return
        k = self.kernel
        run.hibernating, run.wake_due = True, False
        step = run.steps.last
        self.stopping += 1
        try:
            await self.ending.release_worker(run)
        finally:
            self.stopping -= 1
        run.conn = None
        if run.ending is not None or run.rec.state.terminal:
            return
        what = self._waits_on(run)
        run.rec.reason = f"{HIBERNATING}: waiting on {what}"
        k.store.note_reason(run.id, run.rec.reason)
        k.event(run, HIBERNATED, {"step": step, "reason": why, "waiting_on": what})
        self._try_wake(run)

    def _waits_on(self, run: Run) -> str:
        parts = []
        children = [c.id for c in run.children if not c.rec.state.terminal]
        if children:
            parts.append("children " + ", ".join(children[:5]) + "..." * (len(children) > 5))
        asks = list(self.asks.open_by_run.get(run.id, {}))
        if asks:
            parts.append("asks " + ", ".join(asks[:5]))
        if run.model_requests:
            parts.append(f"{run.model_requests} model call{'s' * (run.model_requests > 1)}")
        return "; ".join(parts) or "its wait"

    def make_room(self) -> None:
        """Starts wait for a worker under Limits.max_workers: the runs that have waited
        longest hibernate (before hibernate_after) until the hibernations under way make
        room for one more."""
        if self.after is None:
            return
        adm = self.admission
        need = adm.workers - self.stopping - adm.max_workers + 1
        for run in list(self.waiters):
            if need <= 0:
                break
            if self._can_sleep(run):
                why = f"room for a start (Limits.max_workers={adm.max_workers})"
                self.kernel.task(self.hibernate(run, why))
                need -= 1
            else:
                self.waiters.pop(run, None)

    # ---- to wake -------------------------------------------------------------------------
    def changed(self, run: Run, *, wake: bool = True) -> None:
        """Something `run` may wait on changed (`wake`: a child ended, an ask settled, a
        model call answered), or a request of its worker was answered."""
        if not run.hibernating:
            return
        if wake:
            run.wake_due = True
        self._try_wake(run)

    def _try_wake(self, run: Run) -> None:
        # Once its worker is gone, and every request its worker made is answered and
        # journaled (its replay then reads them, and no answer reaches the new worker).
        if not (run.hibernating and run.wake_due and run.conn is None):
            return
        if run.requests or run.model_requests or self.kernel.closing:
            return
        if run.ending is not None or run.rec.state.terminal:
            return
        run.wake_due = False
        self.kernel.task(self._wake(run))

    async def _wake(self, run: Run) -> None:
        k = self.kernel
        await asyncio.wrap_future(k.store.committed())  # its model calls and steps, read below
        if not run.hibernating or run.ending is not None or run.rec.state.terminal:
            return
        self.resume.prepare_replay(run)
        run.by_key = {c.rec.key: c for c in run.children if c.rec.key is not None}
        run.seq, run.flows_started = {}, 0
        self.asks.restart(run)
        run.blocked, run.holds = False, 0
        run.hibernating = False
        k.event(run, WOKEN, {})
        self.admission.queue(run)

    def statistics(self) -> dict[str, Any]:
        runs = self.kernel.runs.values()
        return {"hibernating": sum(r.hibernating and not r.rec.state.terminal for r in runs)}


__all__ = ["STAYS_LIVE", "WOKEN", "Hibernation"]

"""Ending runs: `finish` (the first caller decides how a run ends, later callers wait for
that ending), the one escalation that stops a worker, the quarantine of a worker group
whose exit cannot be confirmed, attempts (a failed child's retry), and the reason a worker
died.

It owns `cleanup_failures` and `quarantined`. It changes a run's state only through the
kernel's `move`, gives slots and pool places back only through admission, and reaches
another node only through the spreader and the two calls the composition root binds
(`spread`, `adopt_lost`: spread.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable
from typing import Any

from brood.backends.base import STATUS_UNKNOWN, WorkerConn
from brood.errors import BroodError, ChildCleanupError, NodeLost, StoreError
from brood.lifecycle import FailureKind, RunState, move
from brood.limits import Limits
from brood.protocol import Stop
from brood.supervisor.admission import Admission
from brood.supervisor.asks import Asks
from brood.supervisor.kernel import Kernel, unbound
from brood.supervisor.runs import CANCELLING, RUN, Q, Run

KILL_CONFIRM_S = 5.0  # after SIGKILL, a group still present this long is reported, not awaited
QUARANTINE_RETRY_S = 5.0  # how often a quarantined worker group is sent SIGKILL again
DRAIN_ON_EXIT_S = 1.0  # read what a dead worker sent last before calling its exit a crash
CPU_SLACK_S = 0.05  # rusage of a worker killed at its CPU limit can read just under it
log = logging.getLogger("brood")

_STOP = Stop()
_WHY_CHILDREN_END = {
    RunState.COMPLETED: "parent finished",
    RunState.FAILED: "parent failed",
    RunState.TIMED_OUT: "parent timed out",
}


class Ending:
    def __init__(self, kernel: Kernel, admission: Admission, asks: Asks) -> None:
        self.kernel = kernel
        self.admission = admission
        self.asks = asks
        # Cleanup failures, in order (close() raises the first), and the worker groups whose
        # exit is still unconfirmed, by run id: quarantined, killed again until they are gone.
        self.cleanup_failures: list[ChildCleanupError] = []
        self.quarantined: dict[str, list[int]] = {}
        # Bound by the composition root to spread.py: start an attempt on another node, and
        # rebuild here the subtree of a child whose node was lost.
        self.spread: Callable[[Run], Awaitable[None]] = unbound
        self.adopt_lost: Callable[[Run, Exception], Awaitable[bool]] = unbound
        # Bound by the composition root to hibernation.py: a run that ends waits no more.
        self.forget: Callable[[Run], None] = unbound

    async def finish(
        self,
        run: Run,
        state: RunState,
        reason: str,
        *,
        answer: str | None = None,
        error: str | None = None,
        kind: FailureKind = FailureKind.ERROR,
    ) -> RunState:
        """End `run` (and its subtree) in `state`; returns the state it really ended in.
        `kind` says why a run ending `failed` failed (Run.failure_kind).

        The first caller decides how a run ends; later callers wait for that ending. The
        work is shielded: a caller that is cancelled does not interrupt cleanup.
        """
        if run.rec.state.terminal:
            return run.rec.state
        self.end(run, state, reason, answer=answer, error=error, kind=kind)
        assert run.ending is not None
        return await asyncio.shield(run.ending)

    def end(
        self,
        run: Run,
        state: RunState,
        reason: str,
        *,
        answer: str | None = None,
        error: str | None = None,
        kind: FailureKind = FailureKind.ERROR,
    ) -> None:
        """Begin ending `run` as `finish` does, for a caller that does not wait for it (a
        frame's handler, a timer): nothing if its ending has begun already."""
        if run.ending is None and not run.rec.state.terminal:
            run.ending = self.kernel.task(self._end(run, state, reason, answer, error, kind))

    async def _end(
        self,
        run: Run,
        state: RunState,
        reason: str,
        answer: str | None,
        error: str | None,
        kind: FailureKind,
    ) -> RunState:
        k = self.kernel
        if run.spreading is not None and await self._ended_on_its_node(run, state, reason):
            return run.rec.state
        rec = run.rec
        run.retrying = self.retries(run, state)
        if run.timer is not None:
            run.timer.cancel()
        self.forget(run)
        k.stop_watch(run)
        for call in list(run.calls):  # abandoned: nobody will read their replies
            call.cancel()
        if answer is not None:
            rec.answer = answer
        if error is not None:
            rec.error = error
        if state in (RunState.CANCELLED, RunState.TIMED_OUT) and rec.state is RUN:
            await k.move(run, CANCELLING, reason)
        why = _WHY_CHILDREN_END.get(state, "parent cancelled")
        open_children = [c for c in run.children if not c.rec.state.terminal]
        await asyncio.gather(*(self.finish(c, RunState.CANCELLED, why) for c in open_children))
        confirmed = await self.stop_worker(run)
        # Its scratch is gone before its end is journaled: removed meanwhile, off the loop.
        discarded = None
        if confirmed and run.conn is not None:
            discarded = k.backend.discard_scratch(run.conn)
        with contextlib.suppress(StoreError):  # a failed journal fails every tree anyway
            await self.asks.end_of(run, f"its run ended ({state.value}: {reason})")
        self.admission.release(run)
        if not confirmed and run.conn is not None:
            self.quarantine(run, run.conn)
        if state is RunState.FAILED:
            run.failure_kind = kind
        if discarded is not None:
            await discarded
        await k.move(run, state, reason)  # a journal that fails it makes it kind store
        k.tracing.run_ended(run)
        # Its pool place is given up once its end is journaled, so a pool's sections never
        # overlap in the journal's times.
        self.admission.pool_release(run)
        if run.retrying:  # its children were cancelled above, before its end
            k.task(self.next_attempt(run))
        for fut in run.pending.values():
            if not fut.done():
                fut.set_exception(BroodError(f"run {run.id} ended ({state.value}: {reason})"))
        run.done.set()
        k.observers.emit("on_end", run.info)
        return state

    async def suspend(self, run: Run, reason: str) -> RunState:
        """Stop `run`'s worker (the one escalation, exit confirmed; its open children are
        cancelled first) and leave its state as the journal holds it, with a `suspended`
        event saying why: a conversation between turns when its supervisor closes, which
        a later supervisor resumes from the journal. Returns its state (still running)."""
        if run.rec.state.terminal:
            return run.rec.state
        if run.ending is None:
            run.ending = self.kernel.task(self._suspend(run, reason))
        return await asyncio.shield(run.ending)

    async def _suspend(self, run: Run, reason: str) -> RunState:
        k = self.kernel
        open_children = [c for c in run.children if not c.rec.state.terminal]
        await asyncio.gather(*(self.finish(c, RunState.CANCELLED, reason) for c in open_children))
        await self.release_worker(run)
        k.event(run, "suspended", {"reason": reason})
        k.tracing.run_ended(run)
        run.done.set()
        # Its worker is gone, so nothing of it is heard any more: it may still be ended
        # (a conversation closed while suspended), through `finish` as any run is.
        run.ending = None
        return run.rec.state

    async def release_worker(self, run: Run) -> bool:
        """Stop `run`'s worker (the one escalation) and give back its slot, leaving the run
        as it is: a conversation suspended between turns, a run hibernating. Its scratch
        goes once the exit is confirmed; a group that outlives the escalation is
        quarantined. True if the exit was confirmed."""
        k = self.kernel
        k.stop_watch(run)
        confirmed = await self.stop_worker(run)
        if confirmed and run.conn is not None:
            await k.backend.discard_scratch(run.conn)
        self.admission.release(run)
        if not confirmed and run.conn is not None:
            self.quarantine(run, run.conn)
        return confirmed

    async def _ended_on_its_node(self, run: Run, state: RunState, reason: str) -> bool:
        """A child placed on another node (placement="spread") is ended there, which
        confirms every exit there: True once its end is mirrored here. False when it
        started here after all, or its node was lost (then it is ended here)."""
        assert run.spreading is not None
        await asyncio.shield(run.spreading)  # its start, one way or the other
        if run.rec.state.terminal:
            return True
        if run.remote is None:
            return False
        assert self.kernel.spreader is not None
        try:  # on its node, which confirms every exit there
            self.mirror_end(run, await self.kernel.spreader.cancel(run, state, reason))
            return True
        except Exception as exc:  # its node is gone, its processes with it
            # Its subtree is rebuilt here from the journal, to be ended here.
            if not (isinstance(exc, NodeLost) and await self.adopt_lost(run, exc)):
                run.remote, run.spreading = None, None
        return False

    def mirror_end(self, run: Run, end: dict[str, Any]) -> None:
        """A spread child ended on its node (which journaled it): end it here too."""
        if run.rec.state.terminal:
            return
        k = self.kernel
        rec = run.rec
        rec.answer, rec.error, rec.products = end["answer"], end["error"], end["products"]
        rec.usage = dict(end["usage"])
        to = RunState(end["state"])
        if rec.state is Q and to is not RunState.CANCELLED:
            move(rec, RUN)
        if rec.state is RUN and to is RunState.CANCELLED:
            move(rec, CANCELLING)
        move(rec, to, end["reason"] or "ended on its node")
        if to is RunState.FAILED:  # as the supervisor of its node decided it
            run.failure_kind = FailureKind(end.get("failure_kind") or FailureKind.ERROR)
        run.retrying = self.retries(run, to)
        if not run.retrying:  # else its parent hears of the next attempt instead
            k.tell_parent(run)
        run.started.set()
        run.done.set()
        k.tracing.run_ended(run)
        k.observers.emit("on_end", run.info)
        if run.retrying:
            k.task(self.next_attempt(run))

    # ---- a worker's exit -----------------------------------------------------------------
    async def stop_worker(self, run: Run) -> bool:
        """The one escalation: Stop → grace → SIGTERM group → term_grace → SIGKILL group.

        Returns True once no process of the worker's group is left.
        """
        conn = run.conn
        if conn is None or conn.gone.is_set():
            return True
        lim = self.kernel.limits
        conn.send(_STOP)
        # The zygote reports the exit and whether the group emptied with it, in one message;
        # processes the run left behind (grandchildren) get the signals below at once.
        if await _wait(conn.exited, lim.shutdown_grace) and conn.gone.is_set():
            return True
        for sig, grace in ((signal.SIGTERM, lim.term_grace), (signal.SIGKILL, KILL_CONFIRM_S)):
            self.kernel.backend.signal_group(conn, sig)
            if await _wait_event(conn.gone, grace):
                return True
        return False

    def quarantine(self, run: Run, conn: WorkerConn) -> None:
        """`run`'s worker group outlived the whole escalation: its cleanup failed. That is
        said loudly (the log, the journal's `quarantined` event, which `brood ps` and `brood
        doctor` show, and close()), the group is killed again until its exit is confirmed
        (then `released`), and the supervisor goes on serving the other trees."""
        k = self.kernel
        pids = k.backend.group_pids(conn)
        err = ChildCleanupError(
            f"exit of run {run.id}'s worker group {conn.pid} could not be confirmed; "
            f"processes {pids} may still be alive; the group is quarantined (killed again "
            f"every {QUARANTINE_RETRY_S:g} s until it is gone; `brood doctor` lists it) and "
            "the supervisor goes on serving other trees",
            pids=pids,
            answer=run.rec.answer,
        )
        log.error("brood: %s", err)
        self.cleanup_failures.append(err)
        self.quarantined[run.id] = pids
        k.event(run, "quarantined", {"group": conn.pid, "pids": pids, "error": str(err)})
        k.task(self._kill_quarantined(run, conn))

    async def _kill_quarantined(self, run: Run, conn: WorkerConn) -> None:
        k = self.kernel
        while not await _wait_event(conn.gone, QUARANTINE_RETRY_S):
            k.backend.signal_group(conn, signal.SIGKILL)
        del self.quarantined[run.id]
        k.event(run, "released", {"group": conn.pid})
        if not k.closing:
            await k.backend.discard_scratch(conn)

    def exited(self, run: Run, status: int, conn: WorkerConn) -> None:
        """`run`'s worker `conn` died. Unless its run is already ending, or the worker was
        stopped for the run to hibernate (or is not the run's any more), that is a crash
        (`on_exit`); the common case, a run that ended, costs no task."""
        ending = run.ending is not None or run.rec.state.terminal or run.hibernating
        if not ending and run.conn is conn:
            self.kernel.task(self.on_exit(run, status))

    async def on_exit(self, run: Run, status: int) -> None:
        """`run`'s worker crashed: its run fails with how it died, once what it sent last
        was read (a Final may still be queued)."""
        if run.conn is not None:
            await _wait_event(run.conn.closed, DRAIN_ON_EXIT_S)  # a Final may still be queued
            await asyncio.sleep(0)
        if run.ending is not None or run.rec.state.terminal:
            return
        conn = run.conn
        used, oom = (conn.cpu, conn.oom_kills) if conn is not None else (0.0, 0)
        reason = exit_reason(self.kernel.limits, status, used, oom)
        await self.finish(run, RunState.FAILED, reason)

    def zygote_lost(self, pid: int, status: int) -> None:
        """The backend lost its zygote and is starting another: said in every live tree.
        Runs whose workers it forked go on; their exits are confirmed without it."""
        how = f"signal {-status}" if status < 0 else f"status {status}"
        data = {"pid": pid, "exit": how, "replaced": True}
        for root in self.kernel.live_roots():
            self.kernel.event(root, "zygote_lost", data)

    # ---- attempts ------------------------------------------------------------------------
    def retries(self, run: Run, state: RunState) -> bool:
        """Whether ending `run` in `state` starts its next attempt."""
        parent = run.parent
        return (
            run.retries_left > 0
            and state in (RunState.FAILED, RunState.TIMED_OUT)
            and parent is not None
            and parent.ending is None
            and parent.rec.state is RUN
            and not self.kernel.closing
            and self.kernel.store_error is None
        )

    async def next_attempt(self, old: Run) -> None:
        """Start attempt k+1 of a child that ended failed or timed out: same parent, key,
        prompt, context, model, timeout and pool; journaled under (parent, key, attempt).
        If it cannot start, the parent hears how attempt k ended."""
        k = self.kernel
        parent = old.parent
        assert parent is not None
        rec = k.child_record(parent, old.rec.key or "", old.rec.prompt, old.rec.model)
        rec.attempt, rec.pool = old.rec.attempt + 1, old.rec.pool
        new = Run(
            rec=rec,
            model=old.model,
            context_blob=old.context_blob,
            model_name=old.model_name,
            timeout=old.timeout,
            parent=parent,
        )
        new.retries_left = old.retries_left - 1
        new.handle_id = old.handle_id or old.id
        if not self.retries(old, old.rec.state):  # its parent ended, or it was cancelled
            old.retrying = False
            k.tell_parent(old)
            return
        try:  # an attempt is one more run of the tree: it counts against max_children
            await k.admit_to_tree(parent, 1)
        except Exception as exc:
            old.retrying = False
            k.event(old, "retry_refused", {"error": str(exc)})
            k.tell_parent(old)
            return
        parent.tree.children += 1
        parent.children.append(new)
        old.next_attempt = new  # from now on its parent's handle stands for this attempt
        try:
            await k.journal_or_forget([new], parent, 1)
        except Exception:
            old.next_attempt, old.retrying = None, False
            k.tell_parent(old)
            return
        k.event(
            new,
            "attempt",
            {"attempt": rec.attempt, "previous": old.id, "reason": old.rec.reason},
        )
        k.tell_parent(new)  # queued again
        if old.spreading is not None:  # placed as it was: on another node
            new.spreading = k.task(self.spread(new))
            return
        self.admission.queue(new)


def exit_reason(limits: Limits, status: int, cpu_used: float, oom_kills: int = 0) -> str:
    """Why a worker died, naming the limit when a limit killed it."""
    if status == STATUS_UNKNOWN:
        return "worker exited; its status is unknown (the zygote that forked it was lost)"
    how = f"signal {-status}" if status < 0 else f"status {status}"
    if status == -signal.SIGKILL and oom_kills:
        return (
            f"worker exited with {how}: the kernel killed it at its memory limit, "
            f"Limits.worker_memory={limits.worker_memory}"
        )
    cpu = limits.worker_cpu_seconds
    # RLIMIT_CPU sends SIGXCPU at the limit (nothing else sends it to a worker) and
    # SIGKILL a second later if that was ignored; for SIGKILL, the CPU time the zygote
    # read at the reap tells whether the limit did it (rusage rounds: a little slack).
    if cpu is not None and (
        status == -signal.SIGXCPU or (status == -signal.SIGKILL and cpu_used >= cpu - CPU_SLACK_S)
    ):
        return (
            f"worker exited with {how}: it used its CPU time limit, "
            f"Limits.worker_cpu_seconds={cpu:g} ({cpu_used:.1f} s used)"
        )
    return f"worker exited with {how}"


async def _wait(fut: asyncio.Future[Any], timeout: float) -> bool:
    """Whether `fut` is done within `timeout` seconds; it is never cancelled. (Every run's
    end waits so for its worker's exit: a callback and a timer, not wait_for and shield.)"""
    if not fut.done():
        loop = asyncio.get_running_loop()
        woken: asyncio.Future[None] = loop.create_future()

        def wake(_: object = None) -> None:
            if not woken.done():
                woken.set_result(None)

        fut.add_done_callback(wake)
        timer = loop.call_later(timeout, wake)
        try:
            await woken
        finally:
            timer.cancel()
            fut.remove_done_callback(wake)
    return fut.done()


async def _wait_event(event: asyncio.Event, timeout: float) -> bool:
    if event.is_set():
        return True
    try:
        await asyncio.wait_for(event.wait(), timeout)
        return True
    except TimeoutError:
        return False


__all__ = ["Ending", "exit_reason"]

"""Admission: the concurrency slots, the named pools, and the queues of runs waiting for
them (runs to start, and parents that gave up their slot while they waited on the
supervisor and now want to compute again).

It owns `free_slots`, `pools`, `start_queue` and `resume_queue`, and the blocking rule
(a slot is given up only while the supervisor holds something the run can wait on). It
starts a worker only through the `launch` it is given, and ends a run only through the
kernel's `finish`; it never journals a state change itself.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable

from brood.lifecycle import RunState
from brood.supervisor.asks import Asks
from brood.supervisor.kernel import Kernel
from brood.supervisor.runs import RUN, Pool, Run


class Admission:
    def __init__(
        self, kernel: Kernel, asks: Asks, launch: Callable[[Run], Awaitable[None]]
    ) -> None:
        self.kernel = kernel
        self.asks = asks
        self.launch = launch
        self.free_slots = kernel.limits.max_concurrency
        self.pools = {name: Pool(name, cap) for name, cap in kernel.limits.pools.items()}
        self.start_queue: deque[Run] = deque()
        self.resume_queue: deque[tuple[Run, asyncio.Future[None]]] = deque()
        # Live workers of runs (warm-pool workers are not counted), from the grant of a start
        # to its worker's exit, under Limits.max_workers; past it starts wait in the queue
        # while `make_room` (hibernation.py, bound there) stops waiting runs' workers.
        self.workers = 0
        self.max_workers = kernel.limits.effective_max_workers()
        self.make_room: Callable[[], None] = _nothing
        self.changed: Callable[[Run], None] = _ignore

    def admit(self, run: Run) -> None:
        """A new root, or a guest from another node: started in turn."""
        if run.driven:
            # A Session's root is driven by the trainer between steps; it holds no slot,
            # and does not queue for max_workers (its trainer waits on its reset).
            self.workers += 1
            self.kernel.task(self.launch(run))
        else:
            self.start_queue.append(run)
            self.grant()

    def queue(self, *runs: Run) -> None:
        """Start `runs` in turn, after those queued already."""
        self.start_queue.extend(runs)
        self.grant()

    def grant(self) -> None:
        """Hand free slots out: parents resuming after a wait first, then queued starts."""
        while self.free_slots > 0:
            if self.resume_queue:
                run, fut = self.resume_queue.popleft()
                if fut.done():
                    continue
                # Asked twice (a worker's frames are not trusted), or ended while it
                # waited: it takes no slot, or the slot would never come back.
                if run.holds_slot or run.ending is not None or run.rec.state.terminal:
                    fut.set_result(None)
                    continue
                run.holds_slot = True
                self.free_slots -= 1
                fut.set_result(None)
            elif self.start_queue:
                if self.workers >= self.max_workers:
                    self.make_room()  # the queue waits for a worker to exit
                    break
                run = self.start_queue.popleft()
                # Queued twice (a woken parent's replay adopts a child queued already): once.
                if run.holds_slot or not run.launchable or not self.pool_admits(run):
                    continue  # a run its pool refused waits there, holding no slot
                run.holds_slot = True
                self.free_slots -= 1
                self.workers += 1
                self.kernel.task(self.launch(run))
            else:
                break

    def pool_admits(self, run: Run) -> bool:
        """Whether `run` may start as far as its pool goes: it takes a place, or waits in
        the pool's queue (journaled, with the reason naming the pool and its holders)."""
        if run.rec.pool is None or run.holds_pool:
            return True
        k = self.kernel
        pool = self.pools.get(run.rec.pool)
        if pool is None:  # journaled under a pool this supervisor's limits do not have
            k.end(
                run,
                RunState.FAILED,
                f"pool {run.rec.pool!r} is not one of this supervisor's pools "
                f"({', '.join(sorted(self.pools)) or 'none'}); resume it with "
                "Limits(pools=...) naming it",
            )
            return False
        # Holders are read again here, after any refusal: one that ended meanwhile is gone.
        pool.holders = [r for r in pool.holders if not r.rec.state.terminal]
        free = len(pool.holders) < pool.capacity
        if free and (first := pool.take_waiter(ahead_of=run)) is not None:
            # A place is free but an older run waits for it: that one starts first.
            self.start_queue.appendleft(first)
        elif free:
            pool.holders.append(run)
            run.holds_pool = True
            if run in pool.waiters:
                pool.waiters.remove(run)
            k.event(run, "pool", {"pool": pool.name, "taken": True})
            k.tracing.pool_admitted(run)
            return True
        if run not in pool.waiters:
            pool.wait(run)
            k.tracing.pool_waiting(run, pool.name)
            run.rec.reason = f"waiting for pool {pool.name!r} ({pool.describe()})"
            k.store.note_reason(run.id, run.rec.reason)
            k.event(
                run,
                "pool",
                {"pool": pool.name, "waiting": True, "holders": [r.id for r in pool.holders]},
            )
        return False

    def pool_release(self, run: Run) -> None:
        """`run` ended: its place goes to the oldest waiter still waiting, which starts
        through the start queue (the supervisor's own event, no polling)."""
        pool = self.pools.get(run.rec.pool or "")
        if pool is None:
            return
        if run in pool.waiters:
            pool.waiters.remove(run)
        if not run.holds_pool:
            return
        run.holds_pool = False
        pool.holders = [r for r in pool.holders if r is not run and not r.rec.state.terminal]
        if len(pool.holders) < pool.capacity and (first := pool.take_waiter()) is not None:
            self.start_queue.appendleft(first)
        self.grant()

    def worker_gone(self) -> None:
        """A run's worker exited (or was never started): one more may start."""
        self.workers -= 1
        self.grant()

    def release(self, run: Run) -> None:
        """`run` gives its slot back (it ended, or waits on the supervisor)."""
        if run.holds_slot:
            run.holds_slot = False
            self.free_slots += 1
            self.grant()

    # ---- blocking: the concurrency slot -------------------------------------------------
    def block(self, run: Run) -> None:
        """The worker says it waits. A slot is given up only while the supervisor itself
        holds something the run can wait on (a child, an ask, a model call): the worker's
        word alone frees nothing."""
        if not run.blocked and self.waits_on_something(run):
            run.blocked = True
            self.kernel.hold(run)
            self.release(run)

    def unblocked(self, run: Run) -> None:
        """The worker wants to compute again (it asked for a slot with `unblock`)."""
        if run.blocked:
            run.blocked = False
            self.kernel.unhold(run)

    def waits_on_something(self, run: Run) -> bool:
        if run.model_requests or self.asks.open_by_run.get(run.id):
            return True
        # Newest first: the children most likely still going. An attempt that ended and
        # will be followed by another is still going for its parent.
        return any(not c.rec.state.terminal or c.retrying for c in reversed(run.children))

    def waits_changed(self, run: Run) -> None:
        """Something `run` could wait on ended. If nothing is left, a run that said it was
        blocked is not any more: its step clock goes on, and it takes a slot again (its
        worker, if it truly waited, is about to ask for one). A hibernating run is woken
        instead (hibernation.py)."""
        if run.hibernating:
            self.changed(run)
            return
        if not run.blocked or self.waits_on_something(run):
            return
        run.blocked = False
        self.kernel.unhold(run)
        if not run.holds_slot:
            self.kernel.task(self.unblock(run))

    async def unblock(self, run: Run) -> None:
        """Wait until `run` holds a slot again (parents waiting to resume go first)."""
        if run.holds_slot or run.driven or run.rec.state is not RUN:
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.resume_queue.append((run, fut))
        self.grant()
        await fut


def _nothing() -> None:
    pass


def _ignore(_run: Run) -> None:
    pass


__all__ = ["Admission"]

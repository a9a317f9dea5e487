"""The supervisor core: the composition root of the rooms that own every run of every tree,
on one asyncio loop.

`Core` builds the kernel (kernel.py: the registry of runs and the one place a run changes
state, `Kernel.move`) and hands it to each room: admission (slots, pools, queues), ending
(finish, the one escalation, attempts), budget (a model call's budget and accounting),
spread (other nodes), resume (the journal back into runs), starts (new runs), requests
(a worker's frames, one handler each) and asks. It binds the few calls that go up from one
room to another, wires each new worker to its rooms (`_launch`), and is what the engine
(engine.py, which `Supervisor`, `Session` and a cluster's node agent wrap), the flow
executor and the flow service call. What it needs of the flows (brood.flow) and of other
nodes comes in at construction, as `Flows` and `Spreader`.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

from brood.backends.base import Backend
from brood.errors import BroodError, ChildCleanupError, NodeLost, StoreError
from brood.lifecycle import RunRecord, RunState
from brood.limits import Limits
from brood.models.base import Model
from brood.models.prices import Pricing
from brood.protocol import (
    Exec,
    Notice,
    SpawnReq,
    Start,
    StepResult,
    user_message_cap,
)
from brood.store.base import Store
from brood.supervisor.admission import Admission
from brood.supervisor.asks import Asks
from brood.supervisor.budget import Budget
from brood.supervisor.conversations import Conversations
from brood.supervisor.ending import Ending, exit_reason
from brood.supervisor.frames import Conversation, Steps
from brood.supervisor.gateway import ModelGateway
from brood.supervisor.hibernation import Hibernation
from brood.supervisor.kernel import Flows, Kernel, Spreader
from brood.supervisor.observers import Observers
from brood.supervisor.requests import Requests
from brood.supervisor.resume import Resume
from brood.supervisor.runs import FLOW_MODEL, RUN, Pool, Run, RunInfo, new_run_id
from brood.supervisor.spread import Spread
from brood.supervisor.starts import Starts
from brood.supervisor.tools import ToolBox
from brood.supervisor.tracing import NO_TRACING, Tracing
from brood.tools import Tool


class Core:
    def __init__(
        self,
        *,
        model: Model,
        model_name: str | None,
        limits: Limits,
        store: Store,
        backend: Backend,
        observers: Observers,
        owner: str,
        flows: Flows,
        unenforced: list[str],
        keep_scratch: bool = False,
        spreader: Spreader | None = None,
        pricing: Pricing | None = None,
        tools: tuple[Tool, ...] = (),
        tracing: Tracing = NO_TRACING,
    ) -> None:
        k = self.kernel = Kernel(
            model=model,
            model_name=model_name,
            limits=limits,
            store=store,
            backend=backend,
            observers=observers,
            owner=owner,
            unenforced=unenforced,
            keep_scratch=keep_scratch,
            spreader=spreader,
            tracing=tracing,
        )
        self.flows = flows
        self.asks = Asks(k)
        self.admission = Admission(k, self.asks, self._launch)
        self.ending = Ending(k, self.admission, self.asks)
        self.budget = Budget(k, pricing)
        self.spread = Spread(k, self.admission, self.ending)
        self.resume = Resume(k, self.admission, self.asks, self.spread, flows)
        self.starts = Starts(k, self.admission, self.budget, self.ending, self.spread)
        self.tools = ToolBox(k, tools)
        self.conversations = Conversations(k, self.admission, self.asks, self.ending)
        self.hibernation = Hibernation(k, self.admission, self.ending, self.asks, self.resume)
        self.requests = Requests(
            k,
            self.admission,
            self.budget,
            self.asks,
            self.resume,
            self.starts,
            flows,
            self.tools,
            self.conversations,
            self.hibernation,
        )
        # The calls that go up from a room to one built on it, bound once here.
        k.finish = self.ending.finish
        k.end = self.ending.end
        k.waits_changed = self.admission.waits_changed
        self.ending.spread = self.spread.spread
        self.ending.adopt_lost = self.spread.adopt_lost
        self.ending.forget = self.hibernation.computing
        self.admission.changed = self.hibernation.changed
        self.spread.resume_subtree = self.resume.resume_subtree
        backend.on_lost = self.ending.zygote_lost

    # ---- a worker, wired to the rooms ------------------------------------------------------
    async def _launch(self, run: Run) -> None:
        """Give `run` a worker (admission granted it a slot): its frames go to requests,
        its exit to ending, and it starts once `running` is journaled."""
        k = self.kernel
        try:
            conn = await k.backend.acquire()
        except Exception as exc:
            self.admission.worker_gone()
            await k.finish(run, RunState.FAILED, f"backend error: {exc}")
            return
        if not run.launchable:
            k.backend.release_unused(conn)
            self.admission.worker_gone()
            return
        # Counted under Limits.max_workers until it exits (a callback, not a task).
        conn.exited.add_done_callback(lambda _: self.admission.worker_gone())
        resumed = run.rec.state is RUN
        run.conn = conn
        on_msg = self.requests.on_msg
        conn.attach(lambda msg: on_msg(run, msg))
        conn.on_exit = lambda status: self.ending.exited(run, status, conn)
        run.rec.pid = conn.pid
        if k.keep_scratch:  # the user keeps it: say where it is
            k.event(run, "scratch", {"path": conn.scratch, "pid": conn.pid})

        def send_start() -> None:
            r = run.rec
            if run.replay is not None:  # its worker replays these without asking
                run.convo = Conversation.resumed(run.replay)
                run.steps = Steps(replayed=run.replay.steps)
            run.first_cap = user_message_cap(k.limits.max_prompt_chars, r.prompt, run.messages)
            self.conversations.starting(run)
            conn.send(
                Start(
                    run_id=r.id,
                    depth=r.depth,
                    prompt=r.prompt,
                    context=run.context_blob,
                    limits=k.worker_limits,
                    driven=run.driven,
                    messages=run.messages,
                    model_name=run.model_name,
                    replay=run.replay,
                    budget=self.budget.budget_of(run),
                    tools=self.tools.infos,
                    conversation=run.turns is not None,
                )
            )
            run.messages = []
            run.replay = None

        if resumed:
            # Still `running` in the journal: a new worker picks it up by replaying it.
            k.event(
                run,
                "resumed",
                {"pid": conn.pid, "turns": len(run.replay.turns) if run.replay else 0},
            )
            send_start()
        else:
            # The worker may start while `running` is committed; the parent hears of it after.
            await k.move(run, RUN, meanwhile=send_start)
        # The run has started (journaled, with a worker) even if a cancel landed while the
        # start was being journaled: observers and waiters hear of it either way.
        run.started.set()
        self.conversations.started(run)
        k.observers.emit("on_start", run.info)
        if run.rec.state is not RUN or run.ending is not None:
            return  # that cancel stops the worker
        if run.timeout is not None and run.timer is None:  # a woken run keeps its clock
            run.timer = asyncio.get_running_loop().call_later(
                run.timeout,
                lambda: k.end(run, RunState.TIMED_OUT, f"timed out after {run.timeout:g} s"),
            )

    # ---- driving a Session root --------------------------------------------------------
    async def exec_step(
        self, run: Run, code: str, req_id: int, timeout: float | None = None
    ) -> StepResult:
        if run.conn is None or run.rec.state is not RUN:
            raise BroodError(f"run {run.id} is {run.rec.state.value}; it takes no more steps")
        fut: asyncio.Future[StepResult] = asyncio.get_running_loop().create_future()
        run.pending[req_id] = fut
        run.exec_timeout = timeout
        run.conn.send(Exec(req_id, code, timeout))
        return await fut

    # ---- shutting down -----------------------------------------------------------------
    async def close(self, reason: str = "supervisor closed") -> None:
        k = self.kernel
        k.closing = True
        roots = k.live_roots()
        # A conversation between turns computes nothing: it is left resumable, not ended.
        idle = [r for r in roots if r.turns is not None and r.turns.between and r.ending is None]
        why = f"{reason} between turns; resume it with Supervisor.resume_conversation"
        await asyncio.gather(
            *(self.conversations.suspend_now(r, why) for r in idle),
            *(k.finish(r, RunState.CANCELLED, reason) for r in roots if r not in idle),
        )
        await self.tools.aclose()
        await self.budget.gateway.aclose()
        await k.backend.close()
        k.tracing.end_all()  # none should be open: every run has ended

    def snapshot(self, run: Run) -> dict[str, Any]:
        r = run.rec
        return {
            "run_id": r.id,
            "parent_id": r.parent_id,
            "depth": r.depth,
            "key": r.key,
            "prompt": r.prompt,
            "state": r.state.value,
            "reason": r.reason,
            "answer": r.answer,
            "duration": r.duration,
            "usage": dict(r.usage),
            "last_line": run.last_line,
            "started_at": r.started_at,
            "children": [self.snapshot(c) for c in run.children],
        }

    # ---- what the facade, a node agent and the flow executor call (flow.host.FlowHost) -----
    async def finish(
        self,
        run: Run,
        state: RunState,
        reason: str,
        *,
        answer: str | None = None,
        error: str | None = None,
    ) -> RunState:
        """End `run` (and its subtree) in `state` (ending.py); the state it really ended in."""
        return await self.ending.finish(run, state, reason, answer=answer, error=error)

    async def create_root(
        self,
        prompt: str,
        *,
        context_blob: bytes | None,
        model: Model | None = None,
        sub_model: Model | None = None,
        model_name: str | None = None,
        timeout: float | None = None,
        driven: bool = False,
        pool: str | None = None,
        run_id: str | None = None,
        conversation: bool = False,
    ) -> Run:
        """A new root run (starts.py)."""
        return await self.starts.create_root(
            prompt,
            context_blob=context_blob,
            model=model,
            sub_model=sub_model,
            model_name=model_name,
            timeout=timeout,
            driven=driven,
            pool=pool,
            run_id=run_id,
            conversation=conversation,
        )

    async def spawn_children(self, parent: Run, msg: SpawnReq) -> list[str]:
        return await self.starts.spawn_children(parent, msg)

    async def create_controller(
        self, prompt: str, parent: Run | None = None, run_id: str | None = None
    ) -> Run:
        """A flow's run, driven by the supervisor's own code (starts.py)."""
        return await self.starts.create_controller(prompt, parent, run_id)

    async def start_child(
        self,
        parent: Run,
        prompt: str,
        *,
        key: str,
        context_blob: bytes | None = None,
        model: Model | None = None,
        model_name: str | None = None,
        timeout: float | None = None,
        pool: str | None = None,
    ) -> Run:
        """Start a child of a controller run (starts.py)."""
        return await self.starts.start_child(
            parent,
            prompt,
            key=key,
            context_blob=context_blob,
            model=model,
            model_name=model_name,
            timeout=timeout,
            pool=pool,
        )

    def adopt_child(
        self, parent: Run, key: str, timeout: float | None = None, *, launch: bool = True
    ) -> Run | None:
        return self.starts.adopt_child(parent, key, timeout, launch=launch)

    def adopt_flow(self, parent: Run) -> Run | None:
        return self.starts.adopt_flow(parent)

    def children_left(self, flow: Run) -> int | None:
        return self.starts.children_left(flow)

    def children_of(self, run: Run) -> int:
        return self.kernel.children_of(run)

    def event(self, run: Run, kind: str, data: dict[str, Any]) -> None:
        """Journal an event of a run (a flow's ledger)."""
        self.kernel.event(run, kind, data)

    def run_of(self, run_id: str) -> Run | None:
        return self.kernel.runs.get(run_id)

    def top(self, run: Run) -> Run:
        """The top of `run`'s tree here (its root, or the guest its subtree hangs from)."""
        return self.kernel.top(run)

    def notice(self, run: Run, line: str) -> None:
        """Tell `run`'s code `line` before its next turn (a flow's milestone), while its
        worker is live."""
        if run.conn is not None and not run.rec.state.terminal:
            run.conn.send(Notice(line))

    async def send_message(self, run: Run, message: str) -> None:
        await self.kernel.send_message(run, message)

    def store_failed(self, exc: StoreError) -> None:
        self.kernel.store_failed(exc)

    def traceparent(self, run: Run) -> str | None:
        """`run`'s span as a W3C traceparent (tracing on), for the node it is placed on."""
        return self.kernel.tracing.traceparent(run)

    def check_open(self) -> None:
        self.kernel.check_open()

    def waits_changed(self, run: Run) -> None:
        self.admission.waits_changed(run)

    def budget_of(self, run: Run) -> dict[str, Any]:
        return self.budget.budget_of(run)

    def check_model(self, run: Run, name: str | None) -> None:
        self.budget.check_model(run, name)

    def allowed_models(self, run: Run) -> list[str]:
        return self.budget.allowed_models(run)

    async def budget_enter(self, root_id: str) -> None:
        await self.budget.budget_enter(root_id)

    def budget_leave(self, root_id: str, tokens: int, cost: float, answered: bool) -> None:
        self.budget.budget_leave(root_id, tokens, cost, answered)

    async def host_guest(
        self, rec: RunRecord, run_data: dict[str, Any], note: dict[str, Any]
    ) -> Run:
        return await self.spread.host_guest(rec, run_data, note)

    def admit_remote(self, root_id: str, count: int) -> None:
        self.spread.admit_remote(root_id, count)

    async def resume_tree(self, root_id: str) -> Run:
        return await self.resume.resume_tree(root_id)

    async def resume_subtree(self, root_id: str, top_id: str, top: Run | None = None) -> Run:
        return await self.resume.resume_subtree(root_id, top_id, top)

    def _exit_reason(self, status: int, cpu_used: float, oom_kills: int = 0) -> str:
        return exit_reason(self.limits, status, cpu_used, oom_kills)

    # ---- the rooms' state, as the engine and a node agent read it --------------------------
    @property
    def model(self) -> Model:
        return self.kernel.model

    @property
    def model_name(self) -> str | None:
        return self.kernel.model_name

    @property
    def limits(self) -> Limits:
        return self.kernel.limits

    @property
    def store(self) -> Store:
        return self.kernel.store

    @property
    def backend(self) -> Backend:
        return self.kernel.backend

    @property
    def observers(self) -> Observers:
        return self.kernel.observers

    @property
    def owner(self) -> str:
        return self.kernel.owner

    @property
    def runs(self) -> dict[str, Run]:
        return self.kernel.runs

    @property
    def gateway(self) -> ModelGateway:
        return self.budget.gateway

    @property
    def closing(self) -> bool:
        return self.kernel.closing

    @property
    def store_error(self) -> StoreError | None:
        return self.kernel.store_error

    @property
    def unenforced(self) -> list[str]:
        return self.kernel.unenforced

    @property
    def keep_scratch(self) -> bool:
        return self.kernel.keep_scratch

    @property
    def spreader(self) -> Spreader | None:
        return self.kernel.spreader

    @property
    def diverged(self) -> dict[str, str]:
        return self.resume.diverged

    @property
    def cleanup_failures(self) -> list[ChildCleanupError]:
        return self.ending.cleanup_failures

    @property
    def quarantined(self) -> dict[str, list[int]]:
        return self.ending.quarantined

    @property
    def free_slots(self) -> int:
        return self.admission.free_slots

    @property
    def pools(self) -> dict[str, Pool]:
        return self.admission.pools

    @property
    def start_queue(self) -> deque[Run]:
        return self.admission.start_queue


# Names other modules import from here.
__all__ = [
    "FLOW_MODEL",
    "Core",
    "NodeLost",
    "Run",
    "RunInfo",
    "new_run_id",
]

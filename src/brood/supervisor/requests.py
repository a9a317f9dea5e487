"""A worker's frames: hostile input, each checked against the protocol and its run's limits
before anything is done for it (frames.py), then handled once, by the one handler its type
has in `HANDLERS`. A frame no worker keeping the protocol sends ends its run with
`protocol violation: ...`. A request is answered by a `Reply` when its work is done; the
run's step clock stands still meanwhile.

It owns a run's requests in flight and the supervisor's clock of each step. It starts,
ends and budgets nothing itself: it hands each request to the room that owns the work.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Awaitable, Callable
from typing import Any

from brood.backends.base import WorkerConn
from brood.errors import BroodError, InvalidArgument, LimitExceeded
from brood.lifecycle import FailureKind, RunState
from brood.protocol import (
    FAILURE_TEXT_CAP,
    MAX_REMEMBER_BYTES,
    AskCancelReq,
    AskReq,
    Blocked,
    BudgetReq,
    CancelReq,
    Failed,
    Final,
    FlowReq,
    ModelReq,
    Msg,
    Remember,
    Reply,
    SendReq,
    SpawnReq,
    StepBegan,
    StepDone,
    StepResult,
    ToolReq,
    clip,
    error_info,
)
from brood.supervisor import frames
from brood.supervisor.admission import Admission
from brood.supervisor.asks import Asks
from brood.supervisor.budget import Budget
from brood.supervisor.conversations import Conversations
from brood.supervisor.frames import Violation
from brood.supervisor.hibernation import Hibernation
from brood.supervisor.kernel import Flows, Kernel
from brood.supervisor.resume import Resume
from brood.supervisor.runs import STORE_FAILED, Run, StepWatch, last_line
from brood.supervisor.starts import Starts
from brood.supervisor.tools import ToolBox


class Requests:
    def __init__(
        self,
        kernel: Kernel,
        admission: Admission,
        budget: Budget,
        asks: Asks,
        resume: Resume,
        starts: Starts,
        flows: Flows,
        tools: ToolBox,
        conversations: Conversations,
        hibernation: Hibernation,
    ) -> None:
        self.kernel = kernel
        self.hibernation = hibernation
        self.admission = admission
        self.budget = budget
        self.asks = asks
        self.resume = resume
        self.starts = starts
        self.flows = flows
        self.tools = tools
        self.conversations = conversations

    def on_msg(self, run: Run, msg: Msg) -> None:
        """A frame from `run`'s worker, handled by the one handler of its type."""
        if run.ending is not None or run.rec.state.terminal or run.hibernating:
            if isinstance(msg, Reply | StepResult):
                self._settle_pending(run, msg)
            return  # an ending (or hibernating) run's worker is heard no more
        handler = HANDLERS.get(type(msg))
        if handler is None:
            return  # not a worker's frame: the connection's decoder lets none through
        try:
            handler(self, run, msg)
        except Violation as exc:
            k = self.kernel
            k.end(run, RunState.FAILED, f"protocol violation: {exc}")

    # ---- answering a request ----------------------------------------------------------------
    def _ask(self, run: Run, req_id: int, work: Awaitable[Any]) -> None:
        """Answer a worker's request; the run's step clock stands still meanwhile."""
        if run.requests >= frames.MAX_REQUESTS_IN_FLIGHT:
            if asyncio.iscoroutine(work):
                work.close()  # never started
            raise Violation(f"more than {frames.MAX_REQUESTS_IN_FLIGHT} requests at once (a flood)")
        run.requests += 1
        self.kernel.hold(run)
        self.kernel.task(self._answer(run, req_id, work, run.conn))

    async def _answer(
        self, run: Run, req_id: int, work: Awaitable[Any], conn: WorkerConn | None
    ) -> None:
        try:
            value = await work
            # A reply built by the work itself carries more than a value (a model turn's).
            reply = value if isinstance(value, Reply) else Reply(req_id, value=value)
        except Exception as exc:
            reply = Reply(req_id, error=error_info(exc))
        finally:
            run.requests -= 1
            self.kernel.unhold(run)
            if run.hibernating:  # its worker waited for this answer (a flow's end, say)
                self.hibernation.changed(run)
        # Only to the worker that asked: a run rebuilt meanwhile (hibernation) asks again.
        if conn is not None and run.conn is conn:
            conn.send(reply)

    def _settle_pending(self, run: Run, msg: Reply | StepResult) -> None:
        """A worker confirms a delivery (Reply), or ends a driven step (StepResult): only a
        request the supervisor made of it is settled, whatever id the frame names."""
        fut = run.pending.pop(msg.req_id, None)
        if fut is not None and not fut.done():
            fut.set_result(msg if isinstance(msg, StepResult) else None)

    # ---- one handler per frame type ----------------------------------------------------------
    def _spawn(self, run: Run, msg: SpawnReq) -> None:
        if msg.step > run.steps.last:
            raise Violation(f"a child was asked for by step {msg.step}, before it began")
        frames.check_prompts(msg.prompts, self.kernel.limits)
        self._ask(run, msg.req_id, self.starts.spawn_children(run, msg))

    def _cancel(self, run: Run, msg: CancelReq) -> None:
        self._ask(run, msg.req_id, self._cancel_child(run, msg))

    def _send(self, run: Run, msg: SendReq) -> None:
        cap = self.kernel.limits.max_prompt_chars
        if len(msg.message) > cap:
            raise Violation(
                f"a follow-up of {len(msg.message):,} characters, over "
                f"Limits.max_prompt_chars={cap:,}"
            )
        self._ask(run, msg.req_id, self._send_child(run, msg))

    def _budget(self, run: Run, msg: BudgetReq) -> None:
        self._ask(run, msg.req_id, _now(self.budget.budget_of(run)))

    def _open_ask(self, run: Run, msg: AskReq) -> None:
        if msg.step > run.steps.last:
            raise Violation(f"an ask was opened by step {msg.step}, before it began")
        self._ask(run, msg.req_id, self._opened_ask(run, msg))

    def _withdraw_ask(self, run: Run, msg: AskCancelReq) -> None:
        self._ask(run, msg.req_id, self.asks.withdraw(run, msg))

    def _flow(self, run: Run, msg: FlowReq) -> None:
        # A flow's spec and inputs are journaled (on its own run) for its starter.
        if msg.op == "run" and not self.kernel.charge(run, frames.weight([msg.spec, msg.inputs])):
            return  # the run fails naming its journal bytes
        self._ask(run, msg.req_id, self._flow_request(run, msg))

    def _tool(self, run: Run, msg: ToolReq) -> None:
        self.tools.check(run, msg)
        self._ask(run, msg.req_id, self.tools.call(run, msg))

    def _blocked(self, run: Run, msg: Blocked) -> None:
        if msg.blocked:
            self.admission.block(run)
            if run.blocked:
                self.hibernation.waiting(run, clip(msg.hazard, FAILURE_TEXT_CAP))
            return
        self.hibernation.computing(run)
        self._ask(run, msg.req_id, self.admission.unblock(run))
        self.admission.unblocked(run)

    def _model(self, run: Run, msg: ModelReq) -> None:
        limits = self.kernel.limits
        if msg.kind == "llm_query":
            frames.check_call(msg, limits)
            self._ask(run, msg.req_id, self.budget.model_call(run, msg))
            run.model_requests += 1  # held from now on: a wait on it may give up the slot
            return
        # A call of the run's own conversation: a turn, or its compaction.
        if run.driven:
            raise Violation(f"a Session's root asked for a model {msg.kind}; its steps are driven")
        if msg.model != run.model_name:
            raise Violation(f"a model {msg.kind} named model {msg.model!r}, not its run's")
        self.conversations.check_in_turn(run, f"a model {msg.kind}")
        if msg.kind == "turn":
            run.convo.check(
                msg,
                max_iterations=limits.max_iterations,
                first_cap=run.first_cap,
                cap=limits.max_prompt_chars,
            )
        else:
            run.convo.check_compact(
                msg,
                compact_at=limits.compact_at,
                first_cap=run.first_cap,
                cap=limits.max_prompt_chars,
            )
        self._ask(run, msg.req_id, self._conversation_call(run, msg))
        run.model_requests += 1

    async def _conversation_call(self, run: Run, msg: ModelReq) -> Reply:
        """A turn (or compaction) of the run's conversation; a turn's reply carries the
        prompt tokens its model reported, which Limits.compact_at is measured by."""
        text = await self.budget.model_call(run, msg)
        tokens = run.convo.prompt_tokens if msg.kind == "turn" else 0
        return Reply(msg.req_id, value=text, prompt_tokens=tokens)

    def _remember(self, run: Run, msg: Remember) -> None:
        if len(msg.value) > MAX_REMEMBER_BYTES:
            raise Violation(
                f"a remembered value of {len(msg.value):,} bytes, over the "
                f"{MAX_REMEMBER_BYTES:,} one may hold"
            )
        if self.kernel.charge(run, len(msg.value) * 4 // 3):  # journaled as base64
            self.kernel.event(run, "remember", {"value": base64.b64encode(msg.value).decode()})

    def _reply(self, run: Run, msg: Reply) -> None:
        self._settle_pending(run, msg)

    def _step_result(self, run: Run, msg: StepResult) -> None:
        limits = self.kernel.limits
        cap = frames.output_cap(limits.output_limit)
        msg.stdout, msg.stderr = clip(msg.stdout, cap), clip(msg.stderr, cap)
        if msg.answer is not None and len(msg.answer) > limits.answer_limit:
            raise Violation(
                f"a step's answer of {len(msg.answer):,} characters, over "
                f"Limits.answer_limit={limits.answer_limit:,}"
            )
        self._settle_pending(run, msg)

    def _final(self, run: Run, msg: Final) -> None:
        """The run's answer, checked whole before any state changes for it."""
        cap = self.kernel.limits.answer_limit
        if len(msg.answer) > cap:
            raise Violation(
                f"a FINAL answer of {len(msg.answer):,} characters, over "
                f"Limits.answer_limit={cap:,}"
            )
        products = frames.checked_products(msg.products, cap)
        if msg.reason not in ("answer", "answer after max_iterations"):
            raise Violation(f"FINAL with the reason {clip(msg.reason, 80)!r}")
        if run.steps.open:
            raise Violation(f"FINAL came while step {run.steps.last} was under way")
        if run.turns is not None:  # a conversation's turn ended; the root goes on
            self.conversations.turn_ended(run, msg.answer, msg.reason, products)
            return
        run.rec.answer = msg.answer
        run.rec.products = products
        k = self.kernel
        k.end(run, RunState.COMPLETED, msg.reason, answer=msg.answer)

    def _failed(self, run: Run, msg: Failed) -> None:
        """The worker says its run cannot go on. What it says is data: kept (capped) as the
        reason, never a decision; the failure's kind is the supervisor's (`_failure_kind`)."""
        reason, error = clip(msg.reason, FAILURE_TEXT_CAP), clip(msg.error, FAILURE_TEXT_CAP)
        if reason.startswith(STORE_FAILED):  # that reason is the journal's, said only here
            reason = f"worker error: {reason}"
        kind = _failure_kind(run, msg)
        k = self.kernel
        k.end(run, RunState.FAILED, reason, error=error, kind=kind)
        if kind is FailureKind.DIVERGED:
            self.resume.stop_resume(run, reason)

    # ---- the supervisor's clock of each step ---------------------------------------------
    def _step_began(self, run: Run, msg: StepBegan) -> None:
        """Start the supervisor's own clock of a step, and let the step run once its start
        is journaled (a step during which the host dies is then known to a resume). On
        the hot path of every step: no task, one callback from the journal's writer."""
        if run.turns is not None:
            self.conversations.check_in_turn(run, f"step {msg.step}")
        run.steps.begin(msg)
        k = self.kernel
        k.stop_watch(run)
        k.tracing.step_began(run, msg.step, msg.replaying)
        limit = run.exec_timeout if run.exec_timeout is not None else k.limits.step_timeout
        if limit is not None and run.ending is None:
            step = msg.step
            run.watch = StepWatch(
                limit + k.limits.step_grace,
                lambda: self._step_ignored(run, step, limit),
                running=False,
            )
        k.hold(run)  # until the reply is on its way
        if msg.replaying:  # journaled before the crash
            self._step_go(run, msg.req_id)
            return
        req_id = msg.req_id

        def written(fut: asyncio.Future[Any]) -> None:
            # A failed write needs no word here: the journal's failure ends the run.
            if not fut.cancelled():
                fut.exception()
            self._step_go(run, req_id)

        written_at = k.store.event(run.rec, "step_begun", {"step": msg.step})
        asyncio.wrap_future(written_at).add_done_callback(written)

    def _step_go(self, run: Run, req_id: int) -> None:
        self.kernel.unhold(run)
        if run.conn is not None:
            run.conn.send(Reply(req_id))

    def _step_ignored(self, run: Run, step: int, limit: float) -> None:
        run.watch = None
        if run.ending is not None or run.rec.state.terminal:
            return
        k = self.kernel
        reason = (
            f"step timeout ignored: step {step} computed past its limit of {limit:g} s and "
            f"{k.limits.step_grace:g} s of grace (Limits.step_grace) without ending (its "
            "StepTimeout was swallowed, disarmed or lost, e.g. in a fork loop), so its "
            "worker was stopped"
        )
        k.end(run, RunState.FAILED, reason)

    def _step_done(self, run: Run, msg: StepDone) -> None:
        run.steps.end(msg)
        k = self.kernel
        k.stop_watch(run)
        k.tracing.step_done(run, msg.step, msg.error)
        k.progress(run)
        if msg.replayed:
            return
        msg = frames.clipped_step(msg, frames.output_cap(k.limits.output_limit))
        data = {
            "step": msg.step,
            "code": msg.code,
            "stdout": msg.stdout,
            "stderr": msg.stderr,
            "error": msg.error,
            "duration": msg.duration,
            "pending": msg.pending,
        }
        if not k.charge(run, frames.weight(data)):
            return
        run.last_line = last_line(msg.stdout) or run.last_line
        k.event(run, "step", data, progress=run.last_line)

    # ---- the work of requests --------------------------------------------------------------
    async def _opened_ask(self, run: Run, msg: AskReq) -> str:
        """ask_person: within Limits.max_asks_per_run, and counted as journal bytes."""
        k = self.kernel
        most = k.limits.max_asks_per_run
        if run.asks_opened >= most:
            raise LimitExceeded(
                "max_asks_per_run",
                run.asks_opened + 1,
                most,
                hint=f"run {run.id} has opened {run.asks_opened} asks; ask fewer (one ask can "
                "hold several questions: ask_user_question), or raise Limits(max_asks_per_run=...)",
            )
        if not k.charge(run, frames.weight(msg.question) + frames.weight(msg.options)):
            raise BroodError(f"run {run.id} is over its journal bytes; it opens no asks")
        run.asks_opened += 1
        return await self.asks.open(run, msg)

    def _child(self, run: Run, child_id: str) -> Run:
        """The latest attempt of `run`'s child `child_id` (its handle stands for that)."""
        child = self.kernel.runs.get(child_id)
        if child is None or child.parent is not run:
            raise InvalidArgument(f"{child_id} is not a child of run {run.id}")
        while child.next_attempt is not None:
            child = child.next_attempt
        return child

    async def _cancel_child(self, run: Run, msg: CancelReq) -> Any:
        child = self._child(run, msg.child_id)
        child.retries_left = 0  # a cancelled child is not retried (nor a retry started)
        state = await self.kernel.finish(child, RunState.CANCELLED, "cancelled by parent")
        return state.value

    async def _send_child(self, run: Run, msg: SendReq) -> None:
        child = self._child(run, msg.child_id)
        if msg.replaying:
            return  # delivered (and journaled) before the crash
        if not self.kernel.charge(run, len(msg.message)):
            raise BroodError(f"run {run.id} is over its journal bytes; it sends nothing more")
        await self.kernel.send_message(child, msg.message)

    async def _flow_request(self, run: Run, msg: FlowReq) -> Any:
        return await self.flows.answer_flow(run, msg)


async def _now(value: Any) -> Any:
    return value


def _failure_kind(run: Run, msg: Failed) -> FailureKind:
    """Why the run whose worker sent `msg` failed, from what the supervisor knows: diverged
    only while it replays the run, rate limited only when its gateway refused the run's
    last model call for a rate limit. The worker's words decide neither."""
    if msg.kind == "diverged" and run.steps.replaying:
        return FailureKind.DIVERGED
    return FailureKind.RATE_LIMITED if run.rate_limited else FailureKind.ERROR


# Each frame a worker may send (protocol.WorkerMsg), and the one handler it has.
HANDLERS: dict[type[Msg], Callable[[Requests, Run, Any], None]] = {
    SpawnReq: Requests._spawn,
    CancelReq: Requests._cancel,
    SendReq: Requests._send,
    BudgetReq: Requests._budget,
    AskReq: Requests._open_ask,
    AskCancelReq: Requests._withdraw_ask,
    FlowReq: Requests._flow,
    ToolReq: Requests._tool,
    Blocked: Requests._blocked,
    ModelReq: Requests._model,
    StepBegan: Requests._step_began,
    StepDone: Requests._step_done,
    Remember: Requests._remember,
    Final: Requests._final,
    Failed: Requests._failed,
    Reply: Requests._reply,
    StepResult: Requests._step_result,
}

__all__ = ["HANDLERS", "Requests"]

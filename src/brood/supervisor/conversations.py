"""Conversations (`Supervisor.conversation`): a root run that keeps its REPL and its model's
history across user turns.

Each turn is journaled (`user_turn`, committed before the worker sees it) and handed to the
root's worker as a `Turn`; the root works as any run does until FINAL, whose answer is the
turn's (`turn_answer`, committed before the caller hears it). The root then does not end:
its state stays `running`, it gives its slot back, and its children still running are
cancelled with exit confirmed and its open asks withdrawn (as a FINAL ends them), so
nothing computes or waits between turns; their handles stay in the REPL, reporting
`cancelled`. Between turns the supervisor takes
no step and no model turn from it. A resumed conversation's worker replays every journaled
turn (`Replay.user_turns`) and then waits for the next.

It owns each conversation root's `Turns`; it ends runs only through the kernel's `finish`
and gives slots only through admission.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from brood.errors import BroodError, ConversationClosed
from brood.lifecycle import COUNT_KEYS, RunState
from brood.protocol import Turn, user_message_cap
from brood.store.base import Store
from brood.supervisor.admission import Admission
from brood.supervisor.asks import Asks
from brood.supervisor.ending import Ending
from brood.supervisor.frames import Violation
from brood.supervisor.kernel import Kernel
from brood.supervisor.runs import RUN, Run, Turns

CONVERSATION = "conversation"  # the event that marks a root as a conversation's
USER_TURN = "user_turn"  # a turn handed: its number, prompt and the replies before it
TURN_ANSWER = "turn_answer"  # a turn's answer: its number, answer, reason, products, usage
CONVERSATION_PROMPT = "(conversation)"  # the root's prompt: its turns are its user_turns
CHILDREN_END = "its conversation turn ended"  # why its open children and asks end


def journaled_turns(store: Store, run_id: str) -> Turns | None:
    """The user turns the journal holds of root `run_id`, or None if it is not a
    conversation's."""
    if not store.events(run_id, CONVERSATION):
        return None
    handed = [e["data"] for e in store.events(run_id, USER_TURN)]
    answers = store.events(run_id, TURN_ANSWER)
    return Turns(
        prompts=[str(d["prompt"]) for d in handed],
        at=[int(d["at"]) for d in handed],
        answered=len(answers),
        answer=answers[-1]["data"]["answer"] if answers else None,
    )


def usage_since(now: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    """A run's usage since `then` (a copy of it taken earlier): counts subtracted, and the
    cost too where both are known (None where the cost since is unknown)."""
    out: dict[str, Any] = {k: now.get(k, 0) - then.get(k, 0) for k in COUNT_KEYS}
    cost, before = now.get("cost"), then.get("cost")
    out["cost"] = None if cost is None else cost - (before or 0.0)
    return out


class Conversations:
    def __init__(self, kernel: Kernel, admission: Admission, asks: Asks, ending: Ending) -> None:
        self.kernel = kernel
        self.admission = admission
        self.asks = asks
        self.ending = ending

    # ---- a turn, from the API --------------------------------------------------------------
    async def send(self, run: Run, prompt: str, timeout: float | None) -> dict[str, Any]:
        """Run one user turn of conversation `run` to its end: {"state", "answer", "error",
        "usage"}, `state` being the turn's (`completed`) or, if the root ended during it,
        the root's. One turn at a time: a send waits for the turn under way (one a resume
        goes on with) to end first. ConversationClosed when the root has ended."""
        turns = run.turns
        assert turns is not None
        async with turns.lock:
            if not turns.between:  # a resumed turn under way
                await self._turn_end(run, turns)
            self.check_open(run)
            await _unless_ended(run, asyncio.ensure_future(run.started.wait()))
            self.check_open(run)
            k = self.kernel
            if not k.charge(run, len(prompt)):
                raise ConversationClosed(
                    f"conversation {run.id} is over Limits.journal_bytes_per_run and has "
                    "ended; start a new one with Supervisor.conversation()"
                )
            n, at = len(turns.prompts) + 1, run.convo.turns
            data = {"turn": n, "prompt": prompt, "at": at}
            await asyncio.wrap_future(k.store.event(run.rec, USER_TURN, data))
            self._hand(run, turns, prompt, at)
            turns.usage_at = dict(run.rec.usage)
            loop = asyncio.get_running_loop()
            turns.waiter = loop.create_future()
            # A slot, as a parent whose wait ended gets one (unless the root ends first).
            await _unless_ended(run, asyncio.ensure_future(self.admission.unblock(run)))
            if run.conn is not None and run.ending is None and not run.rec.state.terminal:
                if timeout is not None:
                    run.timer = loop.call_later(timeout, self._timed_out, run, n, timeout)
                run.conn.send(Turn(prompt))
            await self._turn_end(run, turns)
            return self._outcome(run, turns)

    def _hand(self, run: Run, turns: Turns, prompt: str, at: int) -> None:
        """Turn `prompt` is handed after `at` answered model turns: the model-turn check
        learns its message's cap (the first turn's also holds the context's description and
        early follow-ups, as a run's first message does) and counts max_iterations from it."""
        turns.prompts.append(prompt)
        turns.at.append(at)
        run.convo.user_turn(at, self._cap(run, prompt, first=len(turns.prompts) == 1))

    def _cap(self, run: Run, prompt: str, *, first: bool) -> int:
        if first:  # run.first_cap is that of the root's label and its early follow-ups
            return run.first_cap - len(run.rec.prompt) + len(prompt)
        return user_message_cap(self.kernel.limits.max_prompt_chars, prompt)

    async def _turn_end(self, run: Run, turns: Turns) -> None:
        """Until the turn under way has ended (its answer journaled, its children's exit
        confirmed) or the root has ended."""
        if turns.waiter is None:
            turns.waiter = asyncio.get_running_loop().create_future()
        waiter = turns.waiter
        try:
            await _unless_ended(run, waiter)
        finally:
            if turns.waiter is waiter:
                turns.waiter = None
            if run.timer is not None:
                run.timer.cancel()
                run.timer = None

    def _outcome(self, run: Run, turns: Turns) -> dict[str, Any]:
        usage = usage_since(run.rec.usage, turns.usage_at)
        rec = run.rec
        if rec.state is RUN and run.ending is None and turns.between:
            return {"state": "completed", "answer": turns.answer, "error": None, "usage": usage}
        state = rec.state.value if rec.state.terminal else "cancelling"
        return {"state": state, "answer": None, "error": rec.reason, "usage": usage}

    def _timed_out(self, run: Run, n: int, timeout: float) -> None:
        run.timer = None
        k = self.kernel
        why = f"conversation turn {n} timed out after {timeout:g} s"
        k.end(run, RunState.TIMED_OUT, why)

    def check_open(self, run: Run) -> None:
        """ConversationClosed once the root has ended (or is ending); BroodError for one
        suspended here (its next turn is sent once it is resumed)."""
        rec = run.rec
        if run.turns is not None and run.turns.suspended and not rec.state.terminal:
            raise BroodError(
                f"conversation {run.id} is suspended; resume it first "
                "(Conversation.send does, as Supervisor.resume_conversation does)"
            )
        if rec.state.terminal or run.ending is not None:
            how = rec.state.value if rec.state.terminal else "ending"
            raise ConversationClosed(
                f"conversation {run.id} is closed ({how}: {rec.reason or 'closing'}); it "
                "takes no more turns. Start another with Supervisor.conversation()"
            )

    async def close(self, run: Run) -> RunState:
        """End the conversation: `completed` with the last turn's answer between turns,
        `cancelled` during one; every exit confirmed. Closing a closed one does nothing."""
        turns = run.turns
        assert turns is not None
        k = self.kernel
        if turns.between:
            n = turns.answered
            why = f"conversation closed after {n} turn{'s' * (n != 1)}"
            return await k.finish(run, RunState.COMPLETED, why, answer=turns.answer)
        why = f"conversation closed during turn {len(turns.prompts)}"
        return await k.finish(run, RunState.CANCELLED, why)

    async def suspend(self, run: Run, why: str) -> bool:
        """Stop the worker of conversation `run` between turns, its exit confirmed, and
        leave it resumable from the journal (Ending.suspend); a turn under way is waited
        for first. False if it has ended (nothing to suspend)."""
        turns = run.turns
        assert turns is not None
        async with turns.lock:
            if not turns.between:  # a resumed turn under way
                await self._turn_end(run, turns)
            return await self.suspend_now(run, why)

    async def suspend_now(self, run: Run, why: str) -> bool:
        """`suspend` without waiting for a turn or a send (the supervisor is closing)."""
        assert run.turns is not None
        if run.ending is not None or run.rec.state.terminal or run.turns.suspended:
            return False
        run.turns.suspended = True
        await self.ending.suspend(run, why)
        return True

    # ---- the worker's side of a turn --------------------------------------------------------
    def check_in_turn(self, run: Run, what: str) -> None:
        """Between turns a conversation root takes no step, model turn or FINAL."""
        turns = run.turns
        if turns is not None and turns.between:
            raise Violation(f"{what} came while no user turn of the conversation was under way")

    def turn_ended(
        self, run: Run, answer: str, reason: str, products: dict[str, Any] | None
    ) -> None:
        """The worker's FINAL ended the turn under way: a live one's answer is journaled
        (a replayed one's is there already). Once no turn is under way, the turn's
        children are cancelled, the root's slot given back and the send answered."""
        turns = run.turns
        assert turns is not None
        self.check_in_turn(run, "FINAL")
        turns.ended += 1
        k = self.kernel
        written = None
        if turns.ended > turns.answered:
            turns.answered = turns.ended
            turns.answer = answer
            run.rec.answer, run.rec.products = answer, products
            data = {
                "turn": turns.ended,
                "answer": answer,
                "reason": reason,
                "products": products,
                "usage": usage_since(run.rec.usage, turns.usage_at),
            }
            written = k.store.event(run.rec, TURN_ANSWER, data)
        if turns.between:
            k.task(self._between(run, turns, written))

    async def _between(self, run: Run, turns: Turns, written: Any) -> None:
        k = self.kernel
        if run.timer is not None:
            run.timer.cancel()
            run.timer = None
        open_children = [c for c in run.children if not c.rec.state.terminal]
        await asyncio.gather(
            *(k.finish(c, RunState.CANCELLED, CHILDREN_END) for c in open_children)
        )
        with contextlib.suppress(BroodError):  # a failed journal ends the run anyway
            await self.asks.end_of(run, CHILDREN_END)
        if turns.between:  # no turn was handed meanwhile
            self.admission.release(run)
        if written is not None:
            with contextlib.suppress(BroodError):  # a failed journal ends the run anyway
                await asyncio.wrap_future(written)
        if turns.waiter is not None and not turns.waiter.done():
            turns.waiter.set_result(None)

    def starting(self, run: Run) -> None:
        """`run`'s worker is being started: it ends each journaled turn again (replayed),
        and the model-turn check learns each turn's cap as it was handed."""
        turns = run.turns
        if turns is None:
            return
        turns.ended = 0
        turns.usage_at = dict(run.rec.usage)  # a turn it goes on with counts from here
        for i, (prompt, at) in enumerate(zip(turns.prompts, turns.at, strict=True)):
            run.convo.user_turn(at, self._cap(run, prompt, first=i == 0))

    def started(self, run: Run) -> None:
        """`run`'s worker has started: between turns it holds no slot."""
        if run.turns is not None and run.turns.between:
            self.admission.release(run)


async def _unless_ended(run: Run, fut: asyncio.Future[Any]) -> None:
    """Until `fut` is done or `run` has ended; `fut` is cancelled if it is not done then."""
    ended = asyncio.ensure_future(run.done.wait())
    try:
        await asyncio.wait({fut, ended}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        ended.cancel()
        if not fut.done():
            fut.cancel()


__all__ = [
    "CONVERSATION",
    "CONVERSATION_PROMPT",
    "TURN_ANSWER",
    "USER_TURN",
    "Conversations",
    "journaled_turns",
    "usage_since",
]

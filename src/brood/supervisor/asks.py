"""Asks to a person (DESIGN.md section 9): a run opens an ask with `ask_person`, someone
answers it (`brood answer`, `sup.answer`, `Session.answer`), a deadline applies its default
or ends it, the run withdraws it, or the run's end cancels it.

Every move is a journal event of the run (kind `ask`: `opened`, `answered`, `cancelled`),
committed before anyone hears of it, so a resumed tree knows each ask: an answered one is
given back to the replay without asking again, an open one is adopted (answerable to the
new process, its deadline still counted from when it was first opened). A run's asks are
keyed `STEP:SEQ` like its children, which is how a replay asks for the same one again.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from brood.errors import BroodError, InvalidArgument, ReplayDiverged
from brood.lifecycle import ASK_OPENED, AskState
from brood.protocol import AskCancelReq, AskReq, AskUpdate
from brood.supervisor.kernel import Kernel
from brood.supervisor.runs import Run


@dataclass(eq=False)
class Ask:
    id: str
    run: Run
    key: str
    question: str
    options: list[dict[str, str]]
    default: str | None
    deadline_at: float | None  # epoch seconds
    opened_at: float
    state: AskState = AskState.OPEN
    result: dict[str, Any] | None = None
    reason: str | None = None
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)

    def info(self) -> dict[str, Any]:
        """The ask as `brood asks` and `sup.asks()` list it."""
        return {
            "id": self.id,
            "run": self.run.id,
            "run_id": self.run.id,
            "question": self.question,
            "options": [dict(o) for o in self.options],
            "default": self.default,
            "deadline": self.deadline_at,
            "opened_at": self.opened_at,
            "state": self.state,
        }

    def update(self) -> AskUpdate:
        return AskUpdate(self.id, self.state, self.result, self.reason)


class Asks:
    """Every ask of the supervisor's runs, by id; the runs' open asks by run."""

    def __init__(self, kernel: Kernel) -> None:
        self.kernel = kernel
        self.by_id: dict[str, Ask] = {}
        self.by_key: dict[tuple[str, str], Ask] = {}  # (run id, STEP:SEQ)
        self.open_by_run: dict[str, dict[str, Ask]] = {}  # run id -> its open asks
        self.seq: dict[tuple[str, int], int] = {}  # (run id, step) -> asks opened in it

    def open_of(self, run: Run) -> list[Ask]:
        return list(self.open_by_run.get(run.id, {}).values())

    def waiting(self) -> dict[str, list[str]]:
        """The runs waiting for a person: blocked in a wait while asks of theirs are open
        (run id -> those asks)."""
        return {
            run_id: list(asks)
            for run_id, asks in self.open_by_run.items()
            if asks and next(iter(asks.values())).run.blocked
        }

    def listing(self) -> list[dict[str, Any]]:
        """The open asks, oldest first."""
        opened = [a for asks in self.open_by_run.values() for a in asks.values()]
        return [a.info() for a in sorted(opened, key=lambda a: a.opened_at)]

    # ---- a run opens and withdraws asks ------------------------------------------------
    async def open(self, run: Run, msg: AskReq) -> str:
        n = self.seq.get((run.id, msg.step), 0)
        self.seq[(run.id, msg.step)] = n + 1
        key = f"{msg.step}:{n}"
        known = self.by_key.get((run.id, key))
        if known is not None:  # a replayed step asks again: the journal's ask, as it stands
            if known.question != msg.question:
                raise ReplayDiverged(
                    f"run {run.id} step {msg.step}: the journal holds ask {known.id} under "
                    f"key {key} with question {known.question[:80]!r}; the replay asked "
                    f"{msg.question[:80]!r}"
                )
            if known.state is not AskState.OPEN:
                asyncio.get_running_loop().call_soon(self._tell, known)
            return known.id
        if msg.replaying:
            raise ReplayDiverged(
                f"run {run.id} step {msg.step}: the replay opened an ask under key {key} "
                f"({msg.question[:80]!r}), but the journal holds none there"
            )
        if run.ending is not None or run.rec.state.terminal:
            raise BroodError(f"run {run.id} is ending; it opens no asks")
        options = _options(msg)
        default = msg.default
        if default is not None and options and _choice(options, default) is None:
            raise InvalidArgument(
                f"ask_person(default={default!r}) is none of the options "
                f"({', '.join(o['id'] for o in options)}); give an option id or label"
            )
        now = time.time()
        ask = Ask(
            id=self._new_id(),
            run=run,
            key=key,
            question=msg.question,
            options=options,
            default=default,
            deadline_at=None if msg.deadline is None else now + msg.deadline,
            opened_at=now,
        )
        await self._journal(ask, ASK_OPENED, _opened(ask))
        self._keep(ask)
        self.kernel.tracing.ask_opened(run, ask.id)
        return ask.id

    async def withdraw(self, run: Run, msg: AskCancelReq) -> AskState:
        ask = self.by_id.get(msg.ask_id)
        if ask is None or ask.run is not run:
            raise InvalidArgument(f"{msg.ask_id} is not an ask of run {run.id}")
        if ask.state is AskState.OPEN:
            await self.cancel(ask, f"withdrawn by run {run.id}")
        return ask.state

    # ---- answers, deadlines, ends ------------------------------------------------------
    async def answer(self, ask_id: str, value: str, by: str) -> dict[str, Any]:
        """Answer an open ask with an option id or label (or free text when it has no
        options); returns the ask's result."""
        ask = self.by_id.get(ask_id)
        if ask is None:
            raise InvalidArgument(
                f"no ask {ask_id!r} in this supervisor; `brood asks` lists the open ones"
            )
        if ask.state is not AskState.OPEN:
            why = f" ({ask.reason})" if ask.reason else ""
            raise InvalidArgument(f"ask {ask_id} is {ask.state}{why}; only an open ask is answered")
        if not isinstance(value, str) or not value.strip():
            raise InvalidArgument(f"an answer to ask {ask_id} must be non-empty text")
        if not isinstance(by, str) or not by.strip():
            raise InvalidArgument("an answer needs who gives it: by=NAME")
        result = _result(ask, value, by)
        if result is None:
            labels = ", ".join(f"{o['id']} ({o['label']})" for o in ask.options)
            raise InvalidArgument(
                f"{value!r} is none of the options of ask {ask_id}: {labels}; answer with an "
                "option id or label"
            )
        await self._settle(ask, AskState.ANSWERED, result=result)
        return result

    async def cancel(self, ask: Ask, reason: str) -> None:
        await self._settle(ask, AskState.CANCELLED, reason=reason)

    async def end_of(self, run: Run, why: str) -> None:
        """The run ends: its open asks are cancelled (journaled)."""
        for ask in self.open_of(run):
            await self.cancel(ask, why)

    def _deadline(self, ask: Ask) -> None:
        ask.timer = None
        if ask.state is not AskState.OPEN:
            return
        if ask.default is not None:
            work = self._settle(
                ask, AskState.ANSWERED, result=_result(ask, ask.default, "deadline")
            )
        else:
            passed = (ask.deadline_at or ask.opened_at) - ask.opened_at
            work = self.cancel(
                ask, f"its deadline ({passed:g} s) passed with no answer and no default"
            )
        self.kernel.task(_quietly(work))

    async def _settle(
        self,
        ask: Ask,
        state: AskState,
        *,
        result: dict[str, Any] | None = None,
        reason: str | None = None,
    ) -> None:
        if ask.state is not AskState.OPEN:
            return
        data: dict[str, Any] = {"result": result} if result is not None else {"reason": reason}
        ask.state = state  # at once: a second answer meanwhile is refused
        ask.result, ask.reason = result, reason
        self.open_by_run.get(ask.run.id, {}).pop(ask.id, None)
        self.kernel.tracing.ask_settled(ask.run, ask.id, state.value, reason)
        if ask.timer is not None:
            ask.timer.cancel()
            ask.timer = None
        await self._journal(ask, state, data)
        self._tell(ask)
        self.kernel.waits_changed(ask.run)  # it may have been all the run waited on

    def _tell(self, ask: Ask) -> None:
        conn = ask.run.conn
        if conn is not None and not ask.run.rec.state.terminal:
            conn.send(ask.update())

    # ---- the journal -------------------------------------------------------------------
    async def _journal(self, ask: Ask, op: str, data: dict[str, Any]) -> None:
        """An ask event, committed before anyone hears of the move."""
        fut = self.kernel.store.event(ask.run.rec, "ask", {"op": op, "ask": ask.id, **data})
        await asyncio.wrap_future(fut)

    def _keep(self, ask: Ask) -> None:
        self.by_id[ask.id] = ask
        self.by_key[(ask.run.id, ask.key)] = ask
        if ask.state is AskState.OPEN:
            self.open_by_run.setdefault(ask.run.id, {})[ask.id] = ask
        if ask.state is AskState.OPEN and ask.deadline_at is not None:
            left = max(0.0, ask.deadline_at - time.time())
            ask.timer = asyncio.get_running_loop().call_later(left, self._deadline, ask)

    def _new_id(self) -> str:
        while (aid := f"a-{secrets.token_hex(4)}") in self.by_id:
            pass
        return aid

    def restart(self, run: Run) -> None:
        """`run` is rebuilt in a new worker (a hibernating run wakes): its replay opens its
        asks again from the first of each step, finding them by key."""
        self.seq = {key: n for key, n in self.seq.items() if key[0] != run.id}

    def adopt(self, run: Run, events: list[dict[str, Any]]) -> None:
        """After a crash: the run's asks as its journal holds them. Open ones are open again
        (their deadlines from when they were first opened); the others replay."""
        asks: dict[str, Ask] = {}
        for e in events:
            d = e["data"]
            if d.get("op") == ASK_OPENED:
                asks[d["ask"]] = Ask(
                    id=d["ask"],
                    run=run,
                    key=d["key"],
                    question=d["question"],
                    options=d["options"],
                    default=d["default"],
                    deadline_at=d["deadline_at"],
                    opened_at=d["opened_at"],
                )
            elif d["ask"] in asks:
                ask = asks[d["ask"]]
                ask.state = AskState(d["op"])
                ask.result, ask.reason = d.get("result"), d.get("reason")
        for ask in asks.values():
            self._keep(ask)
            if ask.state is AskState.OPEN:  # its span before the crash is lost with it
                self.kernel.tracing.ask_opened(run, ask.id)


async def _quietly(work: Any) -> None:
    """A deadline's move: a journal failure is the supervisor's (it fails every tree)."""
    try:
        await work
    except BroodError:
        pass


def _opened(ask: Ask) -> dict[str, Any]:
    return {
        "key": ask.key,
        "question": ask.question,
        "options": ask.options,
        "default": ask.default,
        "deadline_at": ask.deadline_at,
        "opened_at": ask.opened_at,
    }


def _options(msg: AskReq) -> list[dict[str, str]]:
    options = [{"id": o.id, "label": o.label} for o in msg.options]
    ids = [o["id"] for o in options]
    if len(set(ids)) != len(ids):
        raise InvalidArgument(f"ask_person(options=...): option ids must differ, got {ids}")
    return options


def _choice(options: list[dict[str, str]], value: str) -> dict[str, str] | None:
    """The option `value` names: by id, else by label (case and outer spaces aside)."""
    for o in options:
        if o["id"] == value:
            return o
    folded = value.strip().casefold()
    return next((o for o in options if o["label"].strip().casefold() == folded), None)


def _result(ask: Ask, value: str, by: str) -> dict[str, Any] | None:
    """The ask's result for an answer `value` by `by` (None: not one of its options)."""
    answer: dict[str, str | None]
    if ask.options:
        o = _choice(ask.options, value)
        if o is None:
            return None
        answer = {"type": "choice", "id": o["id"], "label": o["label"], "text": o["label"]}
        summary = f"{o['label']} (chosen by {by})"
    else:
        answer = {"type": "text", "id": None, "label": None, "text": value}
        summary = f"{value if len(value) <= 80 else value[:77] + '...'} (answered by {by})"
    return {"answer": answer, "summary": summary, "resolved_by": by}

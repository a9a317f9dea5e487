"""What a server holds: the journal it reads, and the one supervisor it hosts for the runs
started through it.

Every read goes to the journal, and every action (cancel, send, answer, flow stop/resume)
goes through the control socket of the supervisor that owns the run, found in the
journal: the hosted supervisor's own runs take the same path as another process's. All of
this blocks, so endpoints call it from a worker thread.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import brood
from brood.journal import Journal
from brood.lifecycle import TERMINAL_VALUES
from brood.models import resolve_model
from brood.models.prices import price_table
from brood.serve.caps import Queued
from brood.serve.errors import ApiError
from brood.store.base import open_store

log = logging.getLogger("brood.serve")

RUN_TIMEOUT_S = 3600.0  # a tree started over HTTP is never unbounded by mistake
NEW_CONVERSATION = "new"  # the conversation_id of a chat completion that starts one
# Conversations a server keeps a worker for: past this, the least recently used that no
# request is using are suspended (worker stopped; the next turn resumes it from the journal).
LIVE_CONVERSATIONS = 64
START_ANOTHER = f'pass "conversation_id": "{NEW_CONVERSATION}" to start another conversation'
STATES = frozenset(s.value for s in brood.RunState)


def open_journal(store_url: str) -> Journal:
    """The journal at `store_url`, read-only; one that does not exist yet is made first
    (empty), as the hosted supervisor would at its first run, so that reads before then
    answer with no runs rather than an error."""
    if not isinstance(store_url, str) or store_url.partition("://")[2] in ("", "/", "/:memory:"):
        raise brood.InvalidArgument(
            f"store {store_url!r}: brood serve reads the journal its supervisor writes, so it "
            "needs one both can open: sqlite:///PATH or postgresql://..."
        )
    try:
        return Journal(store_url)
    except brood.StoreError:
        open_store(store_url).close()  # raises the store's own error if it cannot be made
        return Journal(store_url)


def _state(handle: brood.RunHandle) -> str:
    """A hosted run's state; "closed" once its supervisor is (nothing of it waits then)."""
    try:
        return handle.status()
    except brood.BroodError:
        return "closed"


class Host:
    """The journal and the hosted supervisor (made at the first run started here)."""

    def __init__(
        self,
        store_url: str,
        model: Any,
        limits: brood.Limits | None,
        *,
        max_queued: int,
        prices: Mapping[str, Any] | None = None,
    ) -> None:
        model = model if model is not None else os.environ.get("BROOD_MODEL")
        # Resolved here so that a bad spec stops the server at its start, not its first run.
        self.model = None if model is None else resolve_model(model)
        # A spec is handed on as such, so the trees started here journal it for a resume.
        self.spec = model if isinstance(model, str) else self.model
        self.model_name = None if self.model is None else self.model.describe()
        self.store_url = store_url
        self.limits = limits
        self.prices = price_table(prices)  # checked here: a bad price stops the server at once
        self.journal = open_journal(store_url)
        self.queued = Queued(max_queued)
        self._supervisor: brood.Supervisor | None = None
        self._lock = threading.Lock()
        self._closed = False
        # The conversations this server holds live, by id, least recently used first, and
        # how many requests use each now.
        self._conversations: dict[str, brood.Conversation] = {}
        self._using: dict[str, int] = {}
        self._conversations_lock = threading.Lock()

    # ---- the hosted supervisor -----------------------------------------------------------
    def supervisor(self) -> brood.Supervisor:
        """The hosted supervisor, made on first use."""
        with self._lock:
            if self._closed:
                raise ApiError(503, "the server is shutting down; it starts no more runs")
            if self._supervisor is None:
                if self.model is None:
                    raise ApiError(
                        503,
                        "this server has no model, so it starts no runs",
                        fix="start it with brood serve --model SPEC (or set BROOD_MODEL)",
                    )
                self._supervisor = brood.Supervisor(
                    self.spec, store=self.store_url, limits=self.limits, prices=self.prices
                )
            return self._supervisor

    def start(
        self, prompt: str, context: Any = None, timeout: float = RUN_TIMEOUT_S, *, client: str
    ) -> str:
        """Start a root run in the hosted supervisor for `client` (its address); returns its
        id at once. Refused (429) while the client has `max_queued` runs not started yet."""

        def spawn() -> tuple[str, Callable[[], str]]:
            handle = self.supervisor().spawn(prompt, context=context, timeout=timeout)
            return handle.id, partial(_state, handle)

        return self.queued.admit(client, spawn)

    def conversation_turn(
        self, conversation_id: str, prompt: str, context: Any = None
    ) -> tuple[str, brood.RunResult]:
        """One turn of conversation `conversation_id` (see `conversation`), run to its
        end: (its id, the turn's result). Past LIVE_CONVERSATIONS, the least recently used
        conversations no request is using are suspended after it."""
        conv = self.conversation(conversation_id, context)
        try:
            return conv.id, conv.send(prompt)
        finally:
            with self._conversations_lock:
                self._using[conv.id] -= 1
                if not self._using[conv.id]:
                    del self._using[conv.id]
            self._suspend_beyond(LIVE_CONVERSATIONS)

    def conversation(self, conversation_id: str, context: Any = None) -> brood.Conversation:
        """Conversation `conversation_id`, counted as used by one more request: one this
        server holds, else resumed from the journal (left by a server that stopped or
        crashed between turns); NEW_CONVERSATION starts one with `context`. 404 for an id
        the journal does not hold, 409 for one that has ended or that a live supervisor
        elsewhere runs, 422 for a run that is not a conversation."""
        supervisor = self.supervisor()
        with self._conversations_lock:
            conv = self._held(supervisor, conversation_id, context)
            self._conversations[conv.id] = conv  # the most recently used, last
            self._using[conv.id] = self._using.get(conv.id, 0) + 1
            return conv

    def _held(
        self, supervisor: brood.Supervisor, conversation_id: str, context: Any
    ) -> brood.Conversation:
        if conversation_id == NEW_CONVERSATION:
            return supervisor.conversation(context)
        held = self._conversations.pop(conversation_id, None)
        if held is not None and not held.closed:
            return held
        self.run_row(conversation_id)  # 404 for an unknown id
        try:
            return supervisor.resume_conversation(conversation_id)
        except brood.ConversationClosed as exc:
            raise ApiError(409, str(exc), field="conversation_id", fix=START_ANOTHER) from None
        except brood.InvalidArgument as exc:
            raise ApiError(422, str(exc), field="conversation_id") from None
        except brood.BroodError as exc:  # a live supervisor elsewhere runs it
            raise ApiError(409, str(exc), field="conversation_id") from None

    def _suspend_beyond(self, most: int) -> None:
        """Suspend the least recently used conversations no request uses, down to `most`
        held; they stay held, and their next turn resumes them from the journal."""
        with self._conversations_lock:
            live = [c for c in self._conversations.values() if not c.closed and not c.suspended]
            idle = [c for c in live if c.id not in self._using][: max(0, len(live) - most)]
        for conv in idle:
            conv.suspend()

    def session(self, limits: brood.Limits | None) -> brood.Session:
        """A new `brood.Session` of the hosted model and journal (a remote session's)."""
        if self.model is None:
            raise ApiError(
                503,
                "this server has no model, so it opens no sessions",
                fix="start it with brood serve --model SPEC (or set BROOD_MODEL)",
            )
        return brood.Session(self.spec, limits=limits, store=self.store_url, prices=self.prices)

    def close(self) -> None:
        """Cancel the hosted supervisor's runs, confirm every exit, close the journal
        (conversations between turns are left resumable: see `Supervisor.close`)."""
        with self._lock:
            self._closed = True
            supervisor, self._supervisor = self._supervisor, None
        try:
            if supervisor is not None:
                supervisor.close()
        except brood.BroodError:
            log.exception("the hosted supervisor did not close cleanly")
        finally:
            self.journal.close()

    # ---- reads -----------------------------------------------------------------------------
    def run_row(self, run_id: str) -> dict[str, Any]:
        """A run's journal row; 404 (UnknownRun) for an id the journal does not hold."""
        return self.journal.store.get_run(run_id)

    def live_row(self, run_id: str) -> dict[str, Any]:
        """A run's row, refused with 409 once it has ended (nothing acts on it then)."""
        row = self.run_row(run_id)
        if row["state"] in TERMINAL_VALUES:
            raise ApiError(
                409,
                f"run {run_id} is {row['state']}; a run that has ended takes no cancel, "
                "message or answer",
            )
        return row

    def tree_done(self, root_id: str) -> bool:
        """Whether a tree's root has ended, or its supervisor is gone (a stale tree writes
        no more events until something resumes it)."""
        row = self.run_row(root_id)
        if row["state"] in TERMINAL_VALUES:
            return True
        return not self.journal.supervisor_alive(row["supervisor"])

    def roots_page(self, state: str | None, limit: int, offset: int) -> list[dict[str, Any]]:
        """Roots newest first, those in `state` only when given, `limit` from `offset`."""
        return self.journal.roots(limit, offset=offset, state=state)

    def open_ask(self, ask_id: str) -> dict[str, Any]:
        """An open ask; 404 for an ask the journal does not hold, 409 for one that ended."""
        for ask in self.journal.asks():
            if ask["id"] == ask_id:
                return ask
        if self.journal.ask_run(ask_id) is None:
            raise ApiError(
                404,
                f"no ask {ask_id!r} in this server's journal",
                fix="GET /v1/asks lists the open ones",
            )
        raise ApiError(409, f"ask {ask_id} has ended (answered, withdrawn, or its run ended)")

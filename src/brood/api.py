"""The Python API: `Supervisor` and the `RunHandle` it returns (DESIGN.md section 4).

`Supervisor` is a thin facade over the supervisor's engine (brood.supervisor.engine), and
the handles wrap that engine: what is here is the API users call, its checks and words.
"""

from __future__ import annotations

import asyncio
import getpass
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from brood.errors import (
    ChildFailed,
    ChildNotReady,
    ConversationClosed,
    InvalidArgument,
    ReplayDiverged,
    StaleHandle,
    StoreError,
)
from brood.lifecycle import TERMINAL_VALUES, FailureKind, RunState
from brood.limits import Limits, check_timeout
from brood.models.base import Model
from brood.models.prices import Price
from brood.store.base import Store
from brood.supervisor.conversations import (
    CONVERSATION,
    CONVERSATION_PROMPT,
    TURN_ANSWER,
    USER_TURN,
)
from brood.supervisor.core import Run, RunInfo
from brood.supervisor.engine import Engine
from brood.tools import Tool

# brood.flow (pydantic, PyYAML) is imported where a flow is first used: every process that
# imports brood (each supervisor's zygote, every CLI command) would pay about 0.2 s for it.
if TYPE_CHECKING:
    from brood.flow.executor import FlowExecutor

__all__ = ["Conversation", "FlowHandle", "RunHandle", "RunInfo", "RunResult", "Supervisor"]


class RunResult(NamedTuple):
    """How a run ended: `error` is the reason when it did not complete."""

    run_id: str
    state: str
    answer: str | None
    error: str | None
    usage: dict[str, Any]


def os_user() -> str:
    """Who answers an ask when no name is given: the OS user."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container, say)
        return f"uid {os.getuid()}"


class Supervisor:
    """Owns every run started through it and all their children, on one asyncio loop.

    `model` is a chat_fn callable, a spec string (`openai:MODEL@URL`) or a `brood.Model`;
    without one, BROOD_MODEL is used. The model stays here: workers ask the supervisor's
    model gateway for every call. `store` is a journal URL (default: a temporary SQLite
    file removed at close). Leaving the `with` block, or `close()`, cancels what is still
    running and confirms every worker's exit. A worker whose exit cannot be confirmed fails
    its run's cleanup loudly (logged, journaled as `quarantined`, listed by `brood doctor`
    and `brood ps`); its group is killed again until it is gone, and the supervisor goes on
    serving other trees; `close()` then raises `ChildCleanupError` for the first such
    failure.

    Model code is confined (see `Limits`): workers get only PATH, LANG, LC_ALL, LC_CTYPE,
    TZ and TERM of this process's environment, plus `worker_env` (a dict of names to
    values, or a list of names to copy); HOME, TMPDIR and the working directory are the
    run's scratch directory, removed when the run ends unless `keep_scratch=True`.

    Each model call's cost is journaled and counted against `Limits.cost_budget`: the
    price the user gives in `prices` (model name -> `brood.Price(input, output)` or an
    `(input, output)` pair, dollars per million tokens), else the cost the model reported,
    else the price `genai-prices` knows for the model's provider and name; else it is
    unknown (None, said once per run and model by a `cost_unknown` event), and a
    cost_budget cannot count it.

    `tools` puts the user's functions (each a function, a `brood.Tool`, or "module:function")
    into every run's REPL, described to the model from their signatures and docstrings. A
    call's arguments are checked against the signature, the function runs here (in a
    thread, with its `Tool.timeout`), and its result (JSON) is journaled; a resumed run gets
    journaled results back without calling it again. A tool that raises or times out raises
    ToolError in the REPL, and the run goes on. `Tool(fn, in_worker=True)` runs in the
    worker instead, confined.

    `mcp_servers` connects to MCP servers through the official `mcp` SDK (the `[mcp]`
    extra), here: each a command ("python server.py", started here and stopped at close)
    or a streamable-HTTP URL, either after "NAME=". Each server's tools join the REPL as
    `NAME_TOOL` (NAME: the server's own name by default), described from their JSON
    schemas, checked, journaled and replayed like `tools`. A server found gone at a call
    is started again and the call sent once more. A server that does not start fails this
    constructor, naming it.

    `tracing=True` (or BROOD_OTEL=1 when `tracing` is not given) emits OpenTelemetry spans
    (the `[otel]` extra): one per run, under its parent's; one per
    model call (GenAI conventions: provider, model, tokens, cost); one per REPL step, ask
    and wait for a pool. They go to the application's TracerProvider if it set one up, else
    to the exporters the OTEL_* environment variables name (OTEL_TRACES_EXPORTER, `otlp` by
    default); `tracing=` also takes a TracerProvider. Every span has ended by `close()`.
    """

    def __init__(
        self,
        model: str | Callable[..., Any] | Model | None = None,
        *,
        limits: Limits | None = None,
        store: str | None = None,
        on_start: Callable[[RunInfo], Any] | None = None,
        on_end: Callable[[RunInfo], Any] | None = None,
        backend: str = "local",
        worker_env: Mapping[str, str] | Iterable[str] | None = None,
        keep_scratch: bool = False,
        prices: Mapping[str, Price | tuple[float, float]] | None = None,
        tools: Iterable[Tool | Callable[..., Any] | str] | None = None,
        mcp_servers: Iterable[str] | str | None = None,
        tracing: bool | Any | None = None,
    ) -> None:
        self._engine = Engine(
            model,
            limits=limits,
            store=store,
            on_start=on_start,
            on_end=on_end,
            backend=backend,
            worker_env=worker_env,
            keep_scratch=keep_scratch,
            prices=prices,
            tools=tools,
            mcp_servers=mcp_servers,
            tracing=tracing,
        )
        self.limits = self._engine.limits

    # ---- starting runs -----------------------------------------------------------------
    def spawn(
        self,
        prompt: str,
        *,
        context: Any = None,
        timeout: float | None = None,
        model: str | Callable[..., Any] | Model | None = None,
        pool: str | None = None,
        sub_model: str | Callable[..., Any] | Model | None = None,
    ) -> RunHandle:
        """Start a root run and return its handle at once. `timeout` is the root's
        wall-clock seconds (a number > 0, or None for no limit); `pool` names a pool of
        Limits.pools the run holds a place in from its start to its end.

        `model` is the root's model (default: the supervisor's). `sub_model` is the model
        of everything below the root's own turns when model code names none: its plain
        calls (llm_query and its kin) and its children's turns and calls, all the way
        down; by default the root's model. A trainer gives the policy as `model` and a
        fixed model as `sub_model`, so that only the root's turns are the policy's. A
        resumed tree runs on the resuming supervisor's model."""
        engine = self._engine
        engine.check_open()
        check_timeout(timeout)
        run = engine.call(
            engine.create_root(
                prompt, context, timeout, model, driven=False, pool=pool, sub_model=sub_model
            )
        )
        return RunHandle(engine, run)

    def run(
        self,
        prompt: str,
        *,
        context: Any = None,
        timeout: float | None = None,
        model: str | Callable[..., Any] | Model | None = None,
        pool: str | None = None,
        sub_model: str | Callable[..., Any] | Model | None = None,
    ) -> RunResult:
        """Run a root run to its end and return how it ended (never raises for a failed run)."""
        handle = self.spawn(
            prompt, context=context, timeout=timeout, model=model, pool=pool, sub_model=sub_model
        )
        return handle.wait_result()

    def resume(self, run_id: str) -> RunHandle:
        """Resume the crashed tree that `run_id` belongs to, from this supervisor's journal,
        and return a handle on its root at once.

        Every unfinished run replays its journaled steps in a new worker, with journaled
        model replies (no new model call for recorded work) and journaled children adopted
        by key instead of started again; then it goes on live. A replay that asks for a call
        the journal does not hold stops the resume: `wait()` then raises ReplayDiverged.
        Refused (nothing changes) for an unknown id, a tree that has ended, and a tree whose
        supervisor is still alive, and a conversation's tree (`resume_conversation`).
        """
        engine = self._engine
        root_id = engine.store.get_run(run_id)["root_id"]
        if engine.store.events(root_id, CONVERSATION):
            raise InvalidArgument(
                f"run {run_id} belongs to conversation {root_id}, whose root waits for user "
                f"turns; resume it with Supervisor.resume_conversation({root_id!r})"
            )
        return RunHandle(engine, engine.resume(run_id))

    # ---- conversations -----------------------------------------------------------------
    def conversation(
        self, context: Any = None, model: str | Callable[..., Any] | Model | None = None
    ) -> Conversation:
        """Start a conversation: one root run whose REPL namespace and model history persist
        across user turns (`Conversation.send`). `context` is its REPL's `context`; `model`
        its model (default: the supervisor's). Its id is the root's, the same for every
        turn; it is journaled and resumable like any tree (`resume_conversation`)."""
        engine = self._engine
        engine.check_open()
        run = engine.call(
            engine.create_root(
                CONVERSATION_PROMPT, context, None, model, driven=False, conversation=True
            )
        )
        return Conversation(engine, run)

    def resume_conversation(self, run_id: str) -> Conversation:
        """Resume the conversation `run_id` (its id) from this supervisor's journal after a
        crash of the process that ran it: its worker replays every journaled turn (no new
        model call for recorded work), so the REPL holds what it held, and the next `send`
        goes on from there. A turn the crash interrupted goes on first; `send` waits for it.
        Refused: an id that is not a conversation's (InvalidArgument), a conversation that
        has ended (ConversationClosed), one a live supervisor still runs (BroodError)."""
        engine = self._engine
        engine.check_open()
        row = engine.store.get_run(run_id)
        if row["root_id"] != run_id or not engine.store.events(run_id, CONVERSATION):
            raise InvalidArgument(
                f"run {run_id} is not a conversation (Supervisor.conversation() starts one); "
                "resume any other tree with Supervisor.resume(run_id)"
            )
        if RunState(row["state"]).terminal:
            raise ConversationClosed(
                f"conversation {run_id} is closed ({row['state']}: {row['reason']}); it takes "
                "no more turns. Start another with Supervisor.conversation()"
            )
        return Conversation(engine, engine.resume(run_id))

    def flow_run(self, spec: Any, *, inputs: dict[str, Any] | None = None) -> FlowHandle:
        """Validate a flow spec (a path, YAML/JSON text, a dict, or a `FlowSpec` that
        `load_spec_text` made) and start it; returns at once, with the states it started on
        `handle.started`. An invalid spec raises InvalidSpec listing every problem, and
        nothing starts (nothing is journaled). A flow started here is trusted: its own
        settings bound it, not the tree limits of `Limits`."""
        self._engine.check_open()
        from brood.flow.load import load_spec
        from brood.flow.schema import FlowSpec

        loaded = spec if isinstance(spec, FlowSpec) else load_spec(spec)
        executor = self._engine.start_flow(loaded, inputs)
        return FlowHandle(self._engine, executor, executor.started)

    def flows(self) -> list[str]:
        """The ids of the flows this supervisor runs (started or resumed), oldest first."""
        return self._engine.flow_ids()

    def flow(self, run_id: str) -> FlowHandle:
        """A handle on a flow this supervisor runs: one it started, or one a `resume`
        rebuilt from its ledger (a flow's run id is its tree's root id when it was started
        by `flow_run` or `brood flow run`)."""
        executor = self._engine.flow(run_id)
        return FlowHandle(self._engine, executor, executor.started)

    # ---- asks to a person --------------------------------------------------------------
    def asks(self) -> list[dict[str, Any]]:
        """The open asks of this supervisor's runs, oldest first: id, run_id, question,
        options, default, deadline (epoch seconds, or None), opened_at, state."""
        return self._engine.asks()

    def answer(self, ask_id: str, value: str, *, by: str | None = None) -> dict[str, Any]:
        """Answer an open ask: an option id or label, or free text when it has no options;
        `by` names who answers (default: the OS user). Returns the ask's result. Refused
        with InvalidArgument: an unknown ask, an ended one, a value none of its options."""
        return self._engine.answer(ask_id, value, by or os_user())

    # ---- introspection -----------------------------------------------------------------
    @property
    def store(self) -> Store:
        """The journal this supervisor writes (its `runs(root_id)` lists a tree's runs)."""
        return self._engine.store

    def statistics(self) -> dict[str, Any]:
        """A snapshot: runs by state, free slots, queued starts, each pool's capacity,
        holders and waiting runs (oldest first), `hibernating` (running runs whose worker
        was stopped for a long wait: Limits.hibernate_after), and the live workers:
        `workers` = {"runs": workers serving a run (a parent waiting on its children
        included, unless it hibernates), "warm": ready in the pool, "memory_bytes": their
        own memory (USS, what is not shared with the template they were forked from),
        "max": Limits.max_workers as this supervisor applies it}."""
        return self._engine.statistics()

    # ---- closing -----------------------------------------------------------------------
    def close(self) -> None:
        """Cancel every run still going, confirm every worker's exit, close the journal. A
        conversation between turns is not cancelled: its worker is stopped and it stays
        resumable (`resume_conversation`).

        Raises ChildCleanupError (answer preserved on it) if some run's worker exit could not
        be confirmed (the first such cleanup failure, whether or not the group went later).
        """
        self._engine.close()

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RunHandle:
    """A root run started by `Supervisor.spawn`. Used after close it raises StaleHandle."""

    def __init__(
        self, engine: Engine, run: Run, stale_reason: Callable[[], str | None] | None = None
    ) -> None:
        self._engine = engine
        self._run = run
        self._stale_reason = stale_reason
        self.id = run.id

    def __repr__(self) -> str:
        return f"<RunHandle {self.id} {self._run.rec.state.value}>"

    def _check(self) -> None:
        why = self._stale_reason() if self._stale_reason else None
        if why:
            raise StaleHandle(f"handle {self.id} is stale: {why}")
        self._engine.check_live(f"handle {self.id}")

    def status(self) -> str:
        """The run's state; never blocks."""
        self._check()
        return self._run.rec.state.value

    @property
    def done(self) -> bool:
        """Whether the run has ended (a terminal state; its workers' exit confirmed)."""
        return self.status() in TERMINAL_VALUES

    def wait(self, timeout: float | None = None) -> str:
        """Block until the run ends and return its answer; raises ChildFailed if it did not
        complete. On timeout raises TimeoutError and the run keeps running."""
        self._wait(timeout)
        return self.result()

    def _wait(self, timeout: float | None) -> None:
        self._check()

        async def wait() -> None:
            try:
                await asyncio.wait_for(self._run.done.wait(), timeout)
            except TimeoutError:
                raise TimeoutError(
                    f"run {self.id} is still {self._run.rec.state.value} after {timeout} s; "
                    "it keeps running: wait again, or cancel() it"
                ) from None

        self._engine.call(wait())

    def result(self) -> str:
        """The answer if completed; ChildNotReady while going; ChildFailed otherwise."""
        self._check()
        rec = self._run.rec
        if not rec.state.terminal:
            raise ChildNotReady(f"run {self.id} is {rec.state.value}; use wait() to block")
        diverged = self._engine.core.diverged.get(self.id)
        if diverged is not None:
            raise ReplayDiverged(f"the resume of tree {self.id} stopped: {diverged}")
        if rec.state is RunState.FAILED and self._run.failure_kind is FailureKind.STORE:
            raise StoreError(f"run {self.id} failed: {rec.reason}")
        if rec.state is RunState.COMPLETED:
            return rec.answer or ""
        raise ChildFailed(
            f"run {self.id} {rec.state.value}: {rec.reason}",
            run_id=self.id,
            status=rec.state.value,
            reason=rec.reason,
        )

    def products(self) -> dict[str, Any] | None:
        """The JSON object the run gave with FINAL(answer, products=...), None if none;
        raises as result() does while it is going or if it did not complete."""
        self.result()
        return self._run.rec.products

    def wait_result(self, timeout: float | None = None) -> RunResult:
        """Block until the run ends and return how it ended (never raises for a run that
        did not complete). On timeout raises TimeoutError and the run keeps running."""
        self._wait(timeout)
        return self.outcome()

    def outcome(self) -> RunResult:
        """How the run ended so far (state may still be non-terminal)."""
        rec = self._run.rec
        error = None if rec.state is RunState.COMPLETED else rec.reason
        return RunResult(rec.id, rec.state.value, rec.answer, error, dict(rec.usage))

    def cancel(self) -> str:
        """Cancel the run and its whole subtree; returns once every exit is confirmed."""
        self._check()
        state = self._engine.call(
            self._engine.core.finish(self._run, RunState.CANCELLED, "cancelled by user")
        )
        return state.value

    def send(self, message: str) -> None:
        """A follow-up instruction the run sees before its next model turn."""
        self._check()
        if not isinstance(message, str):
            raise InvalidArgument("send(message): message must be str")
        self._engine.call(self._engine.core.send_message(self._run, message))

    def record_reward(self, reward: float, info: Mapping[str, Any] | None = None) -> None:
        """Journal a reward of this run (a rubric's score of its answer, with optional JSON
        `info`); `brood export --format openai-chat|verifiers` carries the latest one."""
        self._check()
        self._engine.record_reward(self._run, reward, info)

    def tree(self) -> dict[str, Any]:
        """The run and its descendants: id, state, reason, answer, duration, usage, children."""
        self._check()

        async def snap() -> dict[str, Any]:
            return self._engine.core.snapshot(self._run)

        return self._engine.call(snap())


class Conversation:
    """A conversation (`Supervisor.conversation`): one root run that keeps its REPL
    namespace and its model's history (system prompt, every earlier turn) across user
    turns. `id` is the root's run id, the same for every turn.

    Between turns the root stays `running` in the journal, holds no max_concurrency slot
    and computes nothing: children still running when a turn answers are cancelled (exit
    confirmed), as a FINAL ends them; their handles stay in the REPL. Each turn is
    journaled (`user_turn`, then `turn_answer`), so a crash between turns loses nothing:
    `Supervisor.resume_conversation(id)` rebuilds the REPL by replaying them. A
    supervisor that closes while the conversation is between turns leaves it so too
    (its worker stopped, its state `running`, a `suspended` event), to be resumed the
    same way; one closed during a turn cancels it.
    `close()` (or leaving a `with` block) ends it for good; a send after that raises
    ConversationClosed."""

    def __init__(self, engine: Engine, run: Run) -> None:
        self._engine = engine
        self._run = run
        self._resuming = threading.Lock()
        self.id = run.id

    def __repr__(self) -> str:
        return f"<Conversation {self.id} {self._run.rec.state.value}>"

    def send(self, prompt: str, *, timeout: float | None = None) -> RunResult:
        """Run one user turn: `prompt` joins the history and the root works on it (model
        turns, REPL steps, children as usual; Limits.max_iterations counts per turn) until
        FINAL. Returns the turn's RunResult: `run_id` is the conversation's id, `state` is
        `completed` when the turn answered (the root goes on `running`), `answer` its
        answer, `usage` the root's own model usage during this turn. A turn during which
        the root ended (its worker died, a budget ran out, `timeout` passed) returns the
        root's final state with `error` saying why, and the conversation is closed.

        `timeout` bounds this turn's wall-clock seconds: past it the conversation ends
        `timed_out` (its subtree cancelled), as a run's timeout ends that run. One turn at
        a time: a send from another thread waits for the turn under way. Raises
        ConversationClosed once the conversation has ended."""
        if not isinstance(prompt, str) or not prompt.strip():
            raise InvalidArgument(
                f"send(prompt): prompt must be a non-empty str, got {prompt!r:.60}; pass the "
                "user's message"
            )
        check_timeout(timeout)
        engine = self._engine
        if engine.closed:
            rec = self._run.rec
            fix = (
                "Start another with Supervisor.conversation()"
                if rec.state.terminal
                else "It was left resumable between turns: go on with "
                f"Supervisor.resume_conversation({self.id!r}) in a new supervisor"
            )
            raise ConversationClosed(
                f"conversation {self.id} is closed here: its supervisor was closed "
                f"({rec.state.value}: {rec.reason}). {fix}"
            )
        run = self._run
        if run.turns is not None and run.turns.suspended:
            with self._resuming:  # one thread rebuilds it
                live = engine.core.run_of(self.id)
                if live is not run and live is not None and not _suspended(live):
                    self._run = live  # rebuilt meanwhile (resume_conversation)
                elif self._run is run:
                    self._run = engine.resume(self.id)
        out = engine.call(engine.core.conversations.send(self._run, prompt, timeout))
        return RunResult(self.id, out["state"], out["answer"], out["error"], out["usage"])

    def turns(self) -> list[dict[str, Any]]:
        """The user turns so far, oldest first, from the journal: `turn` (from 1),
        `prompt`, and `answer` (None while it goes on, or if the root ended during it)."""
        store = self._engine.store
        self._engine.store.flush()
        answers = {
            e["data"]["turn"]: e["data"]["answer"] for e in store.events(self.id, TURN_ANSWER)
        }
        return [
            {
                "turn": e["data"]["turn"],
                "prompt": e["data"]["prompt"],
                "answer": answers.get(e["data"]["turn"]),
            }
            for e in store.events(self.id, USER_TURN)
        ]

    def suspend(self) -> bool:
        """Stop its worker between turns (a turn under way is waited for), exit confirmed,
        freeing the process and its memory while it is kept resumable: the next `send`
        rebuilds its REPL from the journal first, as `resume_conversation` does (no new
        model call for recorded work). What a server holding many conversations does with
        the ones not used for a while. False if it has ended."""
        engine = self._engine
        if engine.closed or self._run.rec.state.terminal:
            return False
        why = "suspended between turns; the next turn resumes it from the journal"
        return engine.call(engine.core.conversations.suspend(self._run, why))

    @property
    def suspended(self) -> bool:
        """Whether its worker is stopped between turns (`suspend`, or its supervisor
        closed): its next turn resumes it from the journal."""
        return _suspended(self._run)

    @property
    def closed(self) -> bool:
        """Whether it has ended (it takes no more turns)."""
        return self._engine.closed or self._run.rec.state.terminal

    def status(self) -> str:
        """The root's state: `running` until the conversation ends; never blocks."""
        return self._run.rec.state.value

    def close(self) -> RunResult:
        """End the conversation and its root, exit confirmed: `completed` (reason
        "conversation closed after N turns", answer the last turn's) between turns,
        `cancelled` during one. Returns how the root ended; closing again does nothing."""
        engine = self._engine
        run = self._run
        if not engine.closed and not run.rec.state.terminal:
            engine.call(engine.core.conversations.close(run))
        rec = run.rec
        error = None if rec.state is RunState.COMPLETED else rec.reason
        return RunResult(rec.id, rec.state.value, rec.answer, error, dict(rec.usage))

    def __enter__(self) -> Conversation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _suspended(run: Run) -> bool:
    return run.turns is not None and run.turns.suspended


class FlowHandle:
    """A running flow: `id` (its run in the journal), `started` (the states it entered
    first), `status()`, `wait()`, `stop()`, `resume()`."""

    def __init__(self, engine: Engine, executor: FlowExecutor[Run], started: list[str]) -> None:
        self._engine = engine
        self._ex = executor
        self.id = executor.run.id
        self.started = started

    def __repr__(self) -> str:
        return f"<FlowHandle {self.id} {self._ex.status_value}>"

    def status(self) -> dict[str, Any]:
        """Per-state entries used / max and instances, milestones, recent ledger events."""
        self._engine.check_live(f"flow {self.id}")

        async def snap() -> dict[str, Any]:
            return self._ex.status()

        return self._engine.call(snap())

    def wait(self, timeout: float | None = None) -> str:
        """Block until the flow ends (finished, failed, stopped) or pauses; returns that
        status. On timeout raises TimeoutError and the flow keeps going. The flow's ledger
        up to that point is committed: the journal's reads see it."""
        self._engine.check_live(f"flow {self.id}")
        status = self._engine.call(self._ex.wait(timeout))
        self._engine.store.flush()
        return status

    def wait_change(self) -> None:
        """Block until the flow's status changes (e.g. a paused flow is resumed)."""
        self._engine.check_live(f"flow {self.id}")
        ex = self._ex

        async def wait() -> None:
            status = ex.status_value
            while ex.status_value == status:  # check and clear in one step of the loop
                ex.changed.clear()
                await ex.changed.wait()

        self._engine.call(wait())

    def outputs(self) -> dict[str, dict[str, Any]]:
        """Each state's latest settled outputs."""
        return dict(self._ex.outputs)

    def stop(self) -> dict[str, Any]:
        """Stop: admit nothing more, cancel every running instance (exit confirmed).
        Returns {"state": the final state, "cancelled": the states whose instances it
        cancelled, "instances": those instances}, as the factory executor does."""
        self._engine.check_live(f"flow {self.id}")
        return self._engine.call(self._ex.stop_report())

    def resume(self) -> None:
        """Go on after a pause (escalate, max_transitions)."""
        self._engine.check_live(f"flow {self.id}")
        self._engine.call(self._ex.resume())

"""The Python API: `Supervisor` and the `RunHandle` it returns (DESIGN.md section 4)."""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import json
import os
import socket
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import cloudpickle

from brood import lease
from brood.backends.base import make_backend
from brood.backends.confinement import announce, unenforced, worker_settings
from brood.backends.local import own_memory
from brood.backends.owners import owner_token
from brood.errors import (
    BroodError,
    ChildFailed,
    ChildNotReady,
    InvalidArgument,
    LimitExceeded,
    ReplayDiverged,
    StaleHandle,
    StoreError,
    SupervisorClosed,
)
from brood.lifecycle import TERMINAL_VALUES, RunState
from brood.limits import Limits, is_duration
from brood.models.base import MODEL_SPEC, Model, resolve_model, spec_record
from brood.protocol import FlowReq, Notice
from brood.store.base import Store, open_store
from brood.supervisor.control import ControlServer
from brood.supervisor.core import STORE_FAILED, Core, Run, RunInfo
from brood.supervisor.loop import LoopThread
from brood.supervisor.observers import Observers

# brood.flow (pydantic, PyYAML) is imported where a flow is first used: every process that
# imports brood (each supervisor's zygote, every CLI command) would pay about 0.2 s for it.
if TYPE_CHECKING:
    from brood.flow.executor import FlowExecutor
    from brood.flow.schema import FlowSpec

__all__ = ["FlowHandle", "RunHandle", "RunInfo", "RunResult", "Supervisor"]

# A spec as journaled (and as a resumed run's replay compares it).
SPEC_DUMP: dict[str, Any] = {"mode": "json", "exclude_unset": True, "by_alias": True}


def _flow_title(executor: FlowExecutor) -> str:
    return f"flow {executor.m.name or '(unnamed)'}"


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


def _check_timeout(timeout: object) -> None:
    if timeout is not None and not is_duration(timeout):
        raise InvalidArgument(
            f"timeout must be a number of seconds > 0, or None for no limit; got {timeout!r}"
        )


def _context_blob(context: object) -> bytes | None:
    if context is None:
        return None
    try:
        return cloudpickle.dumps(context)
    except Exception as exc:
        raise InvalidArgument(f"context cannot be pickled: {exc}") from exc


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
    ) -> None:
        if limits is not None and not isinstance(limits, Limits):
            raise InvalidArgument(f"limits must be brood.Limits(...), got {type(limits).__name__}")
        self.limits = limits or Limits()
        model = model if model is not None else os.environ.get("BROOD_MODEL")
        if model is None:
            raise InvalidArgument(
                "no model: pass Supervisor(model=chat_fn or 'openai:MODEL@URL'), or set BROOD_MODEL"
            )
        resolved = resolve_model(model)
        self._model_record = spec_record(model)  # journaled with each tree, for a resume
        settings = worker_settings(self.limits, worker_env, keep_scratch)
        self._store: Store = open_store(store)
        self._observers = Observers(on_start, on_end)
        self._loop = LoopThread()
        self._lease: asyncio.Future[None] | None = None
        owner = owner_token()
        try:
            self._backend = make_backend(backend, settings)
            self._core = Core(
                model=resolved,
                model_name=resolved.name,
                limits=self.limits,
                store=self._store,
                backend=self._backend,
                observers=self._observers,
                owner=owner,
            )
            self._control = ControlServer(self._core)
            self._store.on_failure = self._store_failed
            self._spec_turn = asyncio.Lock()  # specs from model code, parsed one at a time
            self._core.flow_handler = self._flow_request
            self._core.flow_resumer = self._resume_flow
            self._core.unenforced = unenforced(settings)
            self._core.keep_scratch = settings.keep_scratch
            announce(self._core.unenforced)
            self._loop.call(self._start())
        except BaseException:
            with contextlib.suppress(Exception):
                self._loop.call(self._backend.close())
            self._shutdown()
            raise
        self._closed = False

    def _store_failed(self, exc: StoreError) -> None:
        """From the journal's writer thread: the supervisor's loop ends the runs."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: nothing runs any more
            self._loop.loop.call_soon_threadsafe(self._core.store_failed, exc)

    async def _start(self) -> None:
        await self._backend.start()
        await self._control.start()
        await asyncio.wrap_future(
            self._store.insert_supervisor(
                self._core.owner,
                os.getpid(),
                socket.gethostname(),
                self._control.path,
                lease_until=time.time() + lease.LEASE_S,
            )
        )
        self._lease = asyncio.ensure_future(self._keep_lease())

    async def _keep_lease(self) -> None:
        """Renew this supervisor's lease on its trees; one found lapsed or revoked fences
        it: the journal takes no more of its writes, and its runs end here."""
        while True:
            await asyncio.sleep(lease.RENEW_S)
            until = time.time() + lease.LEASE_S
            try:
                renewed = await asyncio.wrap_future(
                    self._store.renew_lease(self._core.owner, until)
                )
            except StoreError:
                return  # the journal failed; the store has said so to the core
            if not renewed:
                self._store.fence(
                    "this supervisor's lease on its trees lapsed or was revoked, so another "
                    "supervisor may be resuming them; it writes nothing more (fenced)"
                )
                return

    # ---- starting runs -----------------------------------------------------------------
    def spawn(
        self,
        prompt: str,
        *,
        context: Any = None,
        timeout: float | None = None,
        model: str | Callable[..., Any] | Model | None = None,
        pool: str | None = None,
    ) -> RunHandle:
        """Start a root run and return its handle at once. `timeout` is the root's
        wall-clock seconds (a number > 0, or None for no limit); `pool` names a pool of
        Limits.pools the run holds a place in from its start to its end."""
        if self._closed:
            raise SupervisorClosed("the supervisor is closed; make a new one")
        _check_timeout(timeout)
        run = self._loop.call(
            self._create(prompt, context, timeout, model, driven=False, pool=pool)
        )
        return RunHandle(self, run)

    def run(
        self,
        prompt: str,
        *,
        context: Any = None,
        timeout: float | None = None,
        model: str | Callable[..., Any] | Model | None = None,
        pool: str | None = None,
    ) -> RunResult:
        """Run a root run to its end and return how it ended (never raises for a failed run)."""
        handle = self.spawn(prompt, context=context, timeout=timeout, model=model, pool=pool)
        return handle.wait_result()

    def resume(self, run_id: str) -> RunHandle:
        """Resume the crashed tree that `run_id` belongs to, from this supervisor's journal,
        and return a handle on its root at once.

        Every unfinished run replays its journaled steps in a new worker, with journaled
        model replies (no new model call for recorded work) and journaled children adopted
        by key instead of started again; then it goes on live. A replay that asks for a call
        the journal does not hold stops the resume: `wait()` then raises ReplayDiverged.
        Refused (nothing changes) for an unknown id, a tree that has ended, and a tree whose
        supervisor is still alive.
        """
        if self._closed:
            raise SupervisorClosed("the supervisor is closed; make a new one")
        root_id = self._store.get_run(run_id)["root_id"]
        runs = self._store.runs(root_id)
        root = next(r for r in runs if r["id"] == root_id)
        if RunState(root["state"]).terminal:
            raise BroodError(
                f"run {root_id} is {root['state']}; a tree that has ended has nothing to resume"
            )
        for token in {r["supervisor"] for r in runs if not RunState(r["state"]).terminal}:
            row = self._store.supervisor(token) if token else None
            if row is not None and not lease.lease_holder_gone(row):
                if token != root["supervisor"] and self._core.spreader is not None:
                    continue  # a child placed on another node, which runs it still: followed
                raise BroodError(
                    f"tree {root_id} is still run by a live supervisor (pid {row['pid']} on "
                    f"{row['host']}, its lease runs to {time.ctime(row['lease_until'] or 0)}); "
                    "it can be resumed once that supervisor is gone or its lease has lapsed "
                    "(brood cancel stops it)"
                )
        run = self._loop.call(self._resume_tree(root_id))
        return RunHandle(self, run)

    async def _resume_tree(self, root_id: str) -> Run:
        run = await self._core.resume_tree(root_id)
        self._core.event(run, MODEL_SPEC, self._model_record)  # the model it goes on with
        return run

    def flow_run(self, spec: Any, *, inputs: dict[str, Any] | None = None) -> FlowHandle:
        """Validate a flow spec (a path, YAML/JSON text, a dict, or a `FlowSpec` that
        `load_spec_text` made) and start it; returns at once, with the states it started on
        `handle.started`. An invalid spec raises InvalidSpec listing every problem, and
        nothing starts (nothing is journaled). A flow started here is trusted: its own
        settings bound it, not the tree limits of `Limits`."""
        if self._closed:
            raise SupervisorClosed("the supervisor is closed; make a new one")
        from brood.flow.load import load_spec
        from brood.flow.schema import FlowSpec

        loaded = spec if isinstance(spec, FlowSpec) else load_spec(spec)
        executor = self._loop.call(self._start_flow(loaded, inputs))
        return FlowHandle(self, executor, executor.started)

    async def _start_flow(
        self,
        loaded: FlowSpec,
        inputs: dict[str, Any] | None,
        parent: Run | None = None,
        run_id: str | None = None,
    ) -> FlowExecutor:
        """Start a validated flow (a child of `parent` when a run's code starts it, whose
        next turns then hear its milestones), and keep it by its run id."""
        from brood.flow.compile import compile_spec
        from brood.flow.executor import FlowExecutor

        machine = compile_spec(loaded)
        for st in machine.states.values():
            self._core.limits.check_pool(st.pool, where=f"flow state {st.id!r}: pool")
        executor = FlowExecutor(self._core, machine, inputs)
        if parent is not None:
            executor.on_milestone = self._notifier(parent)
        spec = loaded.model_dump(**SPEC_DUMP)
        await executor.start(_flow_title(executor), parent, spec=spec, run_id=run_id)
        if parent is None:
            self._core.event(executor.run, MODEL_SPEC, self._model_record)
        self._core.flows[executor.run.id] = executor
        # Its ledger's head (spec and inputs) is what a resume rebuilds it from: the start
        # is answered once that is committed, so a host lost right after still has it.
        await asyncio.wrap_future(self._store.committed())
        return executor

    def flows(self) -> list[str]:
        """The ids of the flows this supervisor runs (started or resumed), oldest first."""
        return list(self._core.flows)

    def flow(self, run_id: str) -> FlowHandle:
        """A handle on a flow this supervisor runs: one it started, or one a `resume`
        rebuilt from its ledger (a flow's run id is its tree's root id when it was started
        by `flow_run` or `brood flow run`)."""
        executor = self._core.flows.get(run_id)
        if executor is None:
            raise InvalidArgument(
                f"{run_id!r} is not a flow this supervisor runs; start one with flow_run, "
                "or resume its tree with resume(run_id) first"
            )
        return FlowHandle(self, executor, executor.started)

    def _notifier(self, run: Run) -> Callable[[str], None]:
        """Milestones of a flow `run`'s code started, as notices for its next turn."""

        def notify(line: str) -> None:
            if run.conn is not None and not run.rec.state.terminal:
                run.conn.send(Notice(line))

        return notify

    def _resume_flow(self, run: Run) -> None:
        """Rebuild a flow from its ledger while its tree is resumed, and let it go on."""
        from brood.flow.executor import FlowExecutor

        executor = FlowExecutor.from_ledger(self._core, run, self._store.events(run.id, "flow"))
        if run.parent is not None:
            executor.on_milestone = self._notifier(run.parent)
        self._core.flows[run.id] = executor
        executor.go_live()

    async def _flow_request(self, run: Run, msg: FlowReq) -> Any:
        """A run's code starts or steers a flow (the REPL's flow_* helpers)."""
        if msg.op == "run":
            from brood.flow.load import load_spec_text

            if not msg.replaying and not self._core.limits.can_start_child(run.rec.depth):
                # refused before the spec is read; the flow's start checks every limit
                raise LimitExceeded("max_depth", run.rec.depth + 2, self._core.limits.max_depth)
            # Text only: the supervisor never opens a path model code named (the worker
            # read the file, under its own confinement), and problems are told in the
            # schema's own words. Parsed off the loop, one spec at a time: YAML of a
            # megabyte takes seconds of pure Python, which every other tree would wait for.
            async with self._spec_turn:
                loaded = await asyncio.to_thread(load_spec_text, msg.spec or "")
            try:
                inputs = json.loads(msg.inputs or "{}")
            except (ValueError, RecursionError) as exc:
                raise InvalidArgument(
                    f"flow_run: inputs are not JSON that can be read ({type(exc).__name__}: "
                    "nested too deep, or not JSON); pass a dict of JSON values"
                ) from None
            adopted = self._core.adopt_flow(run)
            if adopted is not None:  # a resumed run's replay starts its flow again
                executor = self._core.flows.get(adopted.id)
                asked = (loaded.model_dump(**SPEC_DUMP), inputs)
                if executor is None or (executor.spec, executor.params) != asked:
                    raise ReplayDiverged(
                        f"run {run.id}: the replay started a flow that differs from flow "
                        f"{adopted.id} of the journal (another spec or other inputs)"
                    )
                return {"id": adopted.id, "started": executor.started}
            if msg.replaying:
                raise ReplayDiverged(
                    f"run {run.id}: the replay started a flow, but the journal holds none there"
                )
            executor = await self._start_flow(loaded, inputs, parent=run)
            return {"id": executor.run.id, "started": executor.started}
        found: FlowExecutor | None = self._core.flows.get(msg.ref or "")
        if found is None or found.run.parent is not run:
            raise InvalidArgument(f"{msg.ref!r} is not a flow this run started")
        if msg.op == "status":
            return found.status()
        if msg.op == "wait":
            return await found.wait(msg.timeout)
        if msg.replaying and msg.op in ("stop", "resume"):
            return found.status_value  # done (and journaled) before the crash
        if msg.op == "stop":
            return await found.stop()
        if msg.op == "resume":
            await found.resume()
            return found.status_value
        raise InvalidArgument(f"flow op must be run, status, wait, stop or resume, not {msg.op!r}")

    async def _create(
        self,
        prompt: str,
        context: Any,
        timeout: float | None,
        model: Any,
        driven: bool,
        pool: str | None = None,
        run_id: str | None = None,
    ) -> Run:
        resolved = None if model is None else resolve_model(model)
        run = await self._core.create_root(
            prompt,
            context_blob=_context_blob(context),
            model=resolved,
            model_name=resolved.name if resolved is not None else None,
            timeout=timeout,
            driven=driven,
            pool=pool,
            run_id=run_id,
        )
        record = self._model_record if model is None else spec_record(model)
        self._core.event(run, MODEL_SPEC, record)
        return run

    # ---- asks to a person --------------------------------------------------------------
    def asks(self) -> list[dict[str, Any]]:
        """The open asks of this supervisor's runs, oldest first: id, run_id, question,
        options, default, deadline (epoch seconds, or None), opened_at, state."""
        if self._closed:
            raise SupervisorClosed("the supervisor is closed; make a new one")

        async def listing() -> list[dict[str, Any]]:
            return self._core.asks.listing()

        return self._loop.call(listing())

    def answer(self, ask_id: str, value: str, *, by: str | None = None) -> dict[str, Any]:
        """Answer an open ask: an option id or label, or free text when it has no options;
        `by` names who answers (default: the OS user). Returns the ask's result. Refused
        with InvalidArgument: an unknown ask, an ended one, a value none of its options."""
        if self._closed:
            raise SupervisorClosed("the supervisor is closed; make a new one")
        return self._loop.call(self._core.asks.answer(ask_id, value, by or os_user()))

    # ---- introspection -----------------------------------------------------------------
    @property
    def store(self) -> Store:
        return self._store

    def statistics(self) -> dict[str, Any]:
        """A snapshot: runs by state, free slots, queued starts, each pool's capacity,
        holders and waiting runs (oldest first), and the live workers:
        `workers` = {"runs": workers serving a run (a parent waiting on its children
        included), "warm": ready in the pool, "memory_bytes": their own memory (USS, what
        is not shared with the template they were forked from)}."""

        async def snap() -> tuple[dict[str, Any], list[int], list[int]]:
            states: dict[str, int] = {}
            serving: list[int] = []
            for r in self._core.runs.values():
                states[r.rec.state.value] = states.get(r.rec.state.value, 0) + 1
                if r.conn is not None and not r.conn.exited.done():
                    serving.append(r.conn.pid)
            core = self._core
            counts = {
                "runs": states,
                "free_slots": core.free_slots,
                "queued": len(core.start_queue),
                "pools": {
                    name: {
                        "capacity": p.capacity,
                        "holders": [r.id for r in p.holders],
                        "waiting": [r.id for r in p.waiters],
                    }
                    for name, p in core.pools.items()
                },
                "waiting_for_person": core.asks.waiting(),
            }
            return counts, serving, self._backend.idle_pids()

        counts, serving, warm = self._loop.call(snap())
        # Read here, not on the supervisor's loop: /proc of a busy worker can be slow.
        memory = sum(map(own_memory, serving + warm))
        return counts | {
            "workers": {"runs": len(serving), "warm": len(warm), "memory_bytes": memory}
        }

    # ---- closing -----------------------------------------------------------------------
    def close(self) -> None:
        """Cancel every run still going, confirm every worker's exit, close the journal.

        Raises ChildCleanupError (answer preserved on it) if some run's worker exit could not
        be confirmed (the first such cleanup failure, whether or not the group went later).
        """
        if self._closed:
            return
        self._closed = True
        try:
            self._loop.call(self._close())
        finally:
            self._shutdown()
        if self._core.cleanup_failures:
            raise self._core.cleanup_failures[0]
        if self._store.failure is not None:
            raise self._store.failure

    async def _close(self) -> None:
        """Every worker and the zygote are stopped even when the journal has failed; the
        journal's error is raised once, by close(), after that."""
        if self._lease is not None:
            self._lease.cancel()
        await self._core.close()
        await self._control.close()
        with contextlib.suppress(StoreError):  # kept on the store: close() raises it
            await asyncio.wrap_future(self._store.close_supervisor(self._core.owner))

    def _shutdown(self) -> None:
        self._loop.stop()
        self._observers.drain()
        self._store.close()

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_live(self, what: str) -> None:
        if self._closed:
            raise StaleHandle(f"{what} belongs to a supervisor that was closed")


class RunHandle:
    """A root run started by `Supervisor.spawn`. Used after close it raises StaleHandle."""

    def __init__(
        self, sup: Supervisor, run: Run, stale_reason: Callable[[], str | None] | None = None
    ) -> None:
        self._sup = sup
        self._run = run
        self._stale_reason = stale_reason
        self.id = run.id

    def __repr__(self) -> str:
        return f"<RunHandle {self.id} {self._run.rec.state.value}>"

    def _check(self) -> None:
        why = self._stale_reason() if self._stale_reason else None
        if why:
            raise StaleHandle(f"handle {self.id} is stale: {why}")
        self._sup._check_live(f"handle {self.id}")

    def status(self) -> str:
        """The run's state; never blocks."""
        self._check()
        return self._run.rec.state.value

    @property
    def done(self) -> bool:
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

        self._sup._loop.call(wait())

    def result(self) -> str:
        """The answer if completed; ChildNotReady while going; ChildFailed otherwise."""
        self._check()
        rec = self._run.rec
        if not rec.state.terminal:
            raise ChildNotReady(f"run {self.id} is {rec.state.value}; use wait() to block")
        diverged = self._sup._core.diverged.get(self.id)
        if diverged is not None:
            raise ReplayDiverged(f"the resume of tree {self.id} stopped: {diverged}")
        if rec.state is RunState.FAILED and (rec.reason or "").startswith(STORE_FAILED):
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
        state = self._sup._loop.call(
            self._sup._core.finish(self._run, RunState.CANCELLED, "cancelled by user")
        )
        return state.value

    def send(self, message: str) -> None:
        """A follow-up instruction the run sees before its next model turn."""
        self._check()
        if not isinstance(message, str):
            raise InvalidArgument("send(message): message must be str")
        self._sup._loop.call(self._sup._core.send_message(self._run, message))

    def tree(self) -> dict[str, Any]:
        """The run and its descendants: id, state, reason, answer, duration, usage, children."""
        self._check()

        async def snap() -> dict[str, Any]:
            return self._sup._core.snapshot(self._run)

        return self._sup._loop.call(snap())


class FlowHandle:
    """A running flow: `id` (its run in the journal), `started` (the states it entered
    first), `status()`, `wait()`, `stop()`, `resume()`."""

    def __init__(self, sup: Supervisor, executor: FlowExecutor, started: list[str]) -> None:
        self._sup = sup
        self._ex = executor
        self.id = executor.run.id
        self.started = started

    def __repr__(self) -> str:
        return f"<FlowHandle {self.id} {self._ex.status_value}>"

    def status(self) -> dict[str, Any]:
        """Per-state entries used / max and instances, milestones, recent ledger events."""
        self._sup._check_live(f"flow {self.id}")

        async def snap() -> dict[str, Any]:
            return self._ex.status()

        return self._sup._loop.call(snap())

    def wait(self, timeout: float | None = None) -> str:
        """Block until the flow ends (finished, failed, stopped) or pauses; returns that
        status. On timeout raises TimeoutError and the flow keeps going. The flow's ledger
        up to that point is committed: the journal's reads see it."""
        self._sup._check_live(f"flow {self.id}")
        status = self._sup._loop.call(self._ex.wait(timeout))
        self._sup._store.flush()
        return status

    def wait_change(self) -> None:
        """Block until the flow's status changes (e.g. a paused flow is resumed)."""
        self._sup._check_live(f"flow {self.id}")
        ex = self._ex

        async def wait() -> None:
            status = ex.status_value
            while ex.status_value == status:  # check and clear in one step of the loop
                ex.changed.clear()
                await ex.changed.wait()

        self._sup._loop.call(wait())

    def outputs(self) -> dict[str, dict[str, Any]]:
        """Each state's latest settled outputs."""
        return dict(self._ex.outputs)

    def stop(self) -> dict[str, Any]:
        """Stop: admit nothing more, cancel every running instance (exit confirmed).
        Returns {"state": the final state, "cancelled": the states whose instances it
        cancelled, "instances": those instances}, as the factory executor does."""
        self._sup._check_live(f"flow {self.id}")
        return self._sup._loop.call(self._ex.stop_report())

    def resume(self) -> None:
        """Go on after a pause (escalate, max_transitions)."""
        self._sup._check_live(f"flow {self.id}")
        self._sup._loop.call(self._ex.resume())

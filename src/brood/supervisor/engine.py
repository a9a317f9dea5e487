"""The engine: one supervisor's machinery, which `Supervisor`, `Session` and a cluster's node
agent each wrap.

It owns the loop thread, the journal, the backend, the `Core` and its rooms, the control
socket, the lease on its trees, the observers, the model record journaled with each tree,
the flows (brood.flow's `FlowService`, built on a flow's first use) and closing, with its
own lifecycle (`EngineState`). The wrappers hold an engine and use only its public methods
and attributes (`core`, `store`, `backend`, `control`, `limits`); what they add is their
own API (handles, steps, a node's calls).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import socket
import time
from collections.abc import Callable, Coroutine, Iterable, Mapping
from enum import Enum
from typing import TYPE_CHECKING, Any, TypeVar

import cloudpickle

from brood import lease
from brood.backends.base import make_backend
from brood.backends.confinement import announce, unenforced, worker_settings
from brood.backends.local import own_memory
from brood.backends.owners import OWNER_ENV, owner_token
from brood.errors import (
    BroodError,
    InvalidArgument,
    StaleHandle,
    StoreError,
    SupervisorClosed,
)
from brood.lifecycle import RunState
from brood.limits import Limits
from brood.models.base import MODEL_SPEC, Model, resolve_model, spec_record
from brood.models.prices import Pricing
from brood.protocol import FlowReq
from brood.store.base import open_store
from brood.supervisor.control import ControlServer
from brood.supervisor.core import Core, Run, RunInfo
from brood.supervisor.kernel import Spreader
from brood.supervisor.loop import LoopThread
from brood.supervisor.observers import Observers
from brood.supervisor.tracing import make_tracing
from brood.tools import Tool, as_tools

# brood.flow (pydantic, PyYAML) is imported where a flow is first used: every process that
# imports brood (each supervisor's zygote, every CLI command) would pay about 0.2 s for it.
if TYPE_CHECKING:
    from brood.flow.executor import FlowExecutor
    from brood.flow.schema import FlowSpec
    from brood.flow.service import FlowService

T = TypeVar("T")


class EngineState(Enum):
    """The engine's own lifecycle: closing from the first `close()`, closed once every
    worker's exit is confirmed and the journal is shut."""

    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


def context_blob(context: object) -> bytes | None:
    """A run's context, pickled for its worker (None for none)."""
    if context is None:
        return None
    try:
        return cloudpickle.dumps(context)
    except Exception as exc:
        raise InvalidArgument(f"context cannot be pickled: {exc}") from exc


def repl_names() -> frozenset[str]:
    """The names a REPL holds before any tool: its helpers, errors and `context`."""
    from brood.worker.verbs import ERRORS, HELPER_NAMES  # the zygote imports them anyway

    return HELPER_NAMES | ERRORS.keys() | {"context"}


class Engine:
    """One supervisor: its arguments are `Supervisor`'s (DESIGN.md section 4); `spreader` is
    a cluster node agent's, which places children on other nodes; `tracing` is
    `tracing.make_tracing`'s (False, True, a TracerProvider, or None for BROOD_OTEL)."""

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
        spreader: Spreader | None = None,
        prices: Mapping[str, Any] | None = None,
        tools: Iterable[Tool | Callable[..., Any] | str] | None = None,
        mcp_servers: Iterable[str] | str | None = None,
        tracing: object = None,
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
        toolset = as_tools(tools, reserved=repl_names())
        self._mcp = [mcp_servers] if isinstance(mcp_servers, str) else list(mcp_servers or ())
        self._model_record = spec_record(model)  # journaled with each tree, for a resume
        self.pricing = Pricing(prices)
        self.pricing.warm(resolved.provider, resolved.name)  # here, not on the loop
        settings = worker_settings(self.limits, worker_env, keep_scratch)
        self.tracing = make_tracing(tracing)  # opentelemetry is imported only when on
        self.store = open_store(store)
        self._observers = Observers(on_start, on_end)
        self._loop = LoopThread()
        self.state = EngineState.OPEN
        self._lease: asyncio.Future[None] | None = None
        self._flows: FlowService[Run] | None = None  # built on a flow's first use
        try:
            self.backend = make_backend(backend, settings)
            self.core = Core(
                model=resolved,
                model_name=resolved.name,
                limits=self.limits,
                store=self.store,
                backend=self.backend,
                observers=self._observers,
                owner=owner_token(),
                flows=self,
                unenforced=unenforced(settings),
                keep_scratch=settings.keep_scratch,
                spreader=spreader,
                pricing=self.pricing,
                tools=toolset,
                tracing=self.tracing,
            )
            self.control = ControlServer(self.core)
            self.store.on_failure = self._store_failed
            announce(self.core.unenforced)
            self._loop.call(self._start())
        except BaseException:
            if hasattr(self, "core"):  # MCP servers it connected to are stopped too
                with contextlib.suppress(Exception):
                    self._loop.call(self.core.tools.aclose())
            if hasattr(self, "control"):  # its socket's folder, made before the journal failed
                with contextlib.suppress(Exception):
                    self._loop.call(self.control.close())
            with contextlib.suppress(Exception):
                self._loop.call(self.backend.close())
            self._shutdown()
            raise

    def _store_failed(self, exc: StoreError) -> None:
        """From the journal's writer thread: the supervisor's loop ends the runs."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: nothing runs any more
            self._loop.loop.call_soon_threadsafe(self.core.store_failed, exc)

    async def _start(self) -> None:
        self.store.bind_loop()  # its writes from the loop are settled on it, a batch at once
        await self.backend.start()
        # Its processes carry the workers' owner mark, and its control folder is recorded
        # under it: a sweep finds them if we crash.
        mark = getattr(self.backend, "owner", None)
        if self._mcp:
            from brood.supervisor.mcp import McpServers  # the [mcp] extra, when asked for

            servers = McpServers(self._mcp, env={OWNER_ENV: mark} if mark else None)
            tools = self.core.tools
            await servers.start(repl_names() | tools.tools.keys())
            tools.add_remote(servers)
        await self.control.start(mark)
        await asyncio.wrap_future(
            self.store.insert_supervisor(
                self.core.owner,
                os.getpid(),
                socket.gethostname(),
                self.control.path,
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
                renewed = await asyncio.wrap_future(self.store.renew_lease(self.core.owner, until))
            except StoreError:
                return  # the journal failed; the store has said so to the core
            if not renewed:
                self.store.fence(
                    "this supervisor's lease on its trees lapsed or was revoked, so another "
                    "supervisor may be resuming them; it writes nothing more (fenced)"
                )
                return

    # ---- its state ---------------------------------------------------------------------
    @property
    def owner(self) -> str:
        """This supervisor's owner token in the journal (its lease, its trees)."""
        return self.core.owner

    @property
    def closed(self) -> bool:
        """Closing or closed: it starts nothing more."""
        return self.state is not EngineState.OPEN

    def check_open(self) -> None:
        """Refuse new work once closing: SupervisorClosed."""
        if self.closed:
            raise SupervisorClosed("the supervisor is closed; make a new one")

    def check_live(self, what: str) -> None:
        """Refuse the use of `what` (a handle, a call on a tree) once closing: StaleHandle."""
        if self.closed:
            raise StaleHandle(f"{what} belongs to a supervisor that was closed")

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the supervisor's loop and return its value (from another thread)."""
        return self._loop.call(coro)

    # ---- trees -------------------------------------------------------------------------
    async def create_root(
        self,
        prompt: str,
        context: Any,
        timeout: float | None,
        model: Any,
        *,
        driven: bool,
        pool: str | None = None,
        run_id: str | None = None,
        sub_model: Any = None,
        conversation: bool = False,
    ) -> Run:
        """A new root run (`driven`: its code comes step by step from a Session;
        `conversation`: its user turns come one by one, conversations.py), journaled with
        the model it runs on; `sub_model` is its tree's model below it."""
        resolved = None if model is None else resolve_model(model)
        below = None if sub_model is None else resolve_model(sub_model)
        for m in (resolved, below):
            if m is not None and self.pricing.cold(m.provider, m.name):
                await asyncio.to_thread(self.pricing.warm, m.provider, m.name)
        run = await self.core.create_root(
            prompt,
            context_blob=context_blob(context),
            model=resolved,
            sub_model=below,
            model_name=resolved.name if resolved is not None else None,
            timeout=timeout,
            driven=driven,
            pool=pool,
            run_id=run_id,
            conversation=conversation,
        )
        record = self._model_record if model is None else spec_record(model)
        self.core.event(run, MODEL_SPEC, record)
        return run

    def forget_tree(self, root: Run) -> None:
        """Drop the ended tree of `root` from this supervisor's memory; the journal keeps
        it. A server that runs episode after episode on one supervisor (Session.on_engine)
        would otherwise hold every run it ever ran. A tree still going is kept."""

        async def drop() -> None:
            tree, todo = [], [root]
            while todo:
                run = todo.pop()
                tree.append(run)
                todo.extend(run.children)
            if all(r.rec.state.terminal for r in tree):
                for run in tree:
                    self.core.runs.pop(run.id, None)

        self.call(drop())

    def resume(self, run_id: str) -> Run:
        """Resume the crashed tree `run_id` belongs to (see `Supervisor.resume`); refused
        for an unknown id, a tree that has ended, and one a live supervisor still runs."""
        self.check_open()
        root_id = self.store.get_run(run_id)["root_id"]
        runs = self.store.runs(root_id)
        root = next(r for r in runs if r["id"] == root_id)
        if RunState(root["state"]).terminal:
            raise BroodError(
                f"run {root_id} is {root['state']}; a tree that has ended has nothing to resume"
            )
        here = self.core.run_of(root_id)  # a conversation suspended here, say
        suspended = here is not None and here.turns is not None and here.turns.suspended
        for token in {r["supervisor"] for r in runs if not RunState(r["state"]).terminal}:
            if suspended and token == self.core.owner:
                continue  # its worker is stopped: its runs here are rebuilt from the journal
            row = self.store.supervisor(token) if token else None
            if row is not None and not lease.lease_holder_gone(row):
                if token != root["supervisor"] and self.core.spreader is not None:
                    continue  # a child placed on another node, which runs it still: followed
                raise BroodError(
                    f"tree {root_id} is still run by a live supervisor (pid {row['pid']} on "
                    f"{row['host']}, its lease runs to {time.ctime(row['lease_until'] or 0)}); "
                    "it can be resumed once that supervisor is gone or its lease has lapsed "
                    "(brood cancel stops it)"
                )
        return self.call(self._resume_tree(root_id, here if suspended else None))

    async def _resume_tree(self, root_id: str, suspended: Run | None = None) -> Run:
        run = await self.core.resume_tree(root_id)
        if suspended is not None:  # suspended here: it goes on with the model it had
            run.model, run.model_name = suspended.model, suspended.model_name
            return run
        self.core.event(run, MODEL_SPEC, self._model_record)  # the model it goes on with
        return run

    # ---- flows -------------------------------------------------------------------------
    def _flow_service(self) -> FlowService[Run]:
        """The flows this supervisor runs; brood.flow is imported on the first call, which
        is made on the loop (so one service is ever built)."""
        if self._flows is None:
            from brood.flow.service import FlowService

            self._flows = FlowService(self.core, (MODEL_SPEC, self._model_record))
        return self._flows

    def start_flow(
        self, loaded: FlowSpec, inputs: dict[str, Any] | None, run_id: str | None = None
    ) -> FlowExecutor[Run]:
        """Start a validated flow from the API (trusted: its own settings bound it)."""
        return self.call(self._start_flow(loaded, inputs, run_id))

    async def _start_flow(
        self, loaded: FlowSpec, inputs: dict[str, Any] | None, run_id: str | None
    ) -> FlowExecutor[Run]:
        return await self._flow_service().start(loaded, inputs, run_id=run_id)

    def flow_ids(self) -> list[str]:
        """The ids of the flows this supervisor runs (started or resumed), oldest first."""
        return [] if self._flows is None else list(self._flows.executors)

    def flow(self, run_id: str) -> FlowExecutor[Run]:
        """The executor of flow `run_id`; InvalidArgument when this supervisor runs none."""
        executor = self.flow_executor(run_id)
        if executor is None:
            raise InvalidArgument(
                f"{run_id!r} is not a flow this supervisor runs; start one with flow_run, "
                "or resume its tree with resume(run_id) first"
            )
        return executor

    def flow_executor(self, run_id: str) -> FlowExecutor[Run] | None:
        """The executor of flow `run_id`, or None when this supervisor runs no such flow."""
        return None if self._flows is None else self._flows.executors.get(run_id)

    async def answer_flow(self, run: Run, msg: FlowReq) -> Any:
        """A run's code starts or steers a flow (its FlowReq, from the core's requests)."""
        return await self._flow_service().request(run, msg)

    def rebuild_flow(self, run: Run) -> None:
        """Rebuild flow `run` from its ledger (the core's resume of its tree)."""
        self._flow_service().rebuild(run)

    # ---- asks to a person --------------------------------------------------------------
    def record_reward(self, run: Run, reward: float, info: Mapping[str, Any] | None) -> None:
        """Journal a reward of `run` (a rubric's score of its answer): a `reward` event whose
        latest one the training exports carry. A later reward of the same run replaces it."""
        if isinstance(reward, bool) or not isinstance(reward, int | float):
            raise InvalidArgument(f"reward: must be a number, got {type(reward).__name__}")
        if not math.isfinite(reward):
            raise InvalidArgument(f"reward: must be a finite number, got {reward!r}")
        data: dict[str, Any] = {"reward": float(reward)}
        if info is not None:
            if not isinstance(info, Mapping):
                raise InvalidArgument(f"reward info: must be a mapping, got {type(info).__name__}")
            try:
                data["info"] = json.loads(json.dumps(dict(info)))
            except (TypeError, ValueError) as exc:
                raise InvalidArgument(
                    f"reward info: must be JSON-serializable ({exc}); pass numbers, strings, "
                    "lists and mappings"
                ) from None

        async def journal() -> None:
            self.core.event(run, "reward", data)

        self.call(journal())

    def asks(self) -> list[dict[str, Any]]:
        """The open asks of this supervisor's runs, oldest first."""
        self.check_open()

        async def listing() -> list[dict[str, Any]]:
            return self.core.asks.listing()

        return self.call(listing())

    def answer(self, ask_id: str, value: str, by: str) -> dict[str, Any]:
        """Answer an open ask as `by`; returns the ask's result."""
        self.check_open()
        return self.call(self.core.asks.answer(ask_id, value, by))

    # ---- introspection -----------------------------------------------------------------
    def statistics(self) -> dict[str, Any]:
        """See `Supervisor.statistics`."""

        async def snap() -> tuple[dict[str, Any], list[int], list[int]]:
            states: dict[str, int] = {}
            serving: list[int] = []
            for r in self.core.runs.values():
                states[r.rec.state.value] = states.get(r.rec.state.value, 0) + 1
                if r.conn is not None and not r.conn.exited.done():
                    serving.append(r.conn.pid)
            core = self.core
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
                "hibernating": core.hibernation.statistics()["hibernating"],
            }
            return counts, serving, self.backend.idle_pids()

        counts, serving, warm = self.call(snap())
        # Read here, not on the supervisor's loop: /proc of a busy worker can be slow.
        memory = sum(map(own_memory, serving + warm))
        return counts | {
            "workers": {
                "runs": len(serving),
                "warm": len(warm),
                "memory_bytes": memory,
                "max": self.core.admission.max_workers,
            }
        }

    # ---- closing -----------------------------------------------------------------------
    def close(self) -> None:
        """Cancel every run still going, confirm every worker's exit, close the journal;
        raises the first cleanup failure, then the journal's failure (see
        `Supervisor.close`). Only the first call does anything."""
        if self.closed:
            return
        self.state = EngineState.CLOSING
        try:
            self.call(self._close())
        finally:
            self._shutdown()
            self.state = EngineState.CLOSED
        if self.core.cleanup_failures:
            raise self.core.cleanup_failures[0]
        if self.store.failure is not None:
            raise self.store.failure

    async def _close(self) -> None:
        """Every worker and the zygote are stopped even when the journal has failed; the
        journal's error is raised once, by close(), after that."""
        if self._lease is not None:
            self._lease.cancel()
        await self.core.close()
        await self.control.close()
        with contextlib.suppress(StoreError):  # kept on the store: close() raises it
            await asyncio.wrap_future(self.store.close_supervisor(self.core.owner))

    def _shutdown(self) -> None:
        self._loop.stop()
        self._observers.drain()
        self.store.close()
        self.tracing.shutdown()  # the spans still queued go to the exporters

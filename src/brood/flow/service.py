"""The flows one supervisor runs: started from the API (trusted) or by a run's code (a child
of that run), steered by a worker's FlowReq, rebuilt from their ledgers when a tree is
resumed, their milestones told to the run that started them.

`FlowService` is built by the supervisor's engine on a flow's first use (this package
imports pydantic and PyYAML, which a supervisor that runs no flow never pays for). It
reaches the supervisor only through `ServiceHost`, and a worker's request only through
`FlowRequest`: like the rest of the package, it imports nothing of the supervisor, the
journal or the protocol.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Generic, Protocol

from brood.errors import InvalidArgument, LimitExceeded, ReplayDiverged
from brood.flow.compile import compile_spec
from brood.flow.executor import FlowExecutor
from brood.flow.host import FlowHost, R
from brood.flow.load import load_spec_text
from brood.flow.schema import FlowSpec
from brood.limits import Limits

# A spec as journaled (and as a resumed run's replay compares it).
SPEC_DUMP: dict[str, Any] = {"mode": "json", "exclude_unset": True, "by_alias": True}


class Ledgers(Protocol):
    """The journal, as the service reads it: a flow's ledger, and the commit of what is
    queued."""

    def events(self, run_id: str | None = None, kind: str | None = None) -> list[dict[str, Any]]:
        """The events of `run_id` of that kind, oldest first."""

    def committed(self) -> Future[Any] | asyncio.Future[Any]:
        """Done once everything written so far is committed."""


class ServiceHost(FlowHost[R], Protocol[R]):
    """The supervisor's core as the service uses it: the executor's calls, and the limits,
    the journal, the adoption of a flow a resumed run's replay starts again and a notice to
    a run's code (`Core` is one)."""

    @property
    def limits(self) -> Limits: ...

    @property
    def store(self) -> Ledgers: ...

    def adopt_flow(self, parent: R) -> R | None:
        """The journaled flow run a resumed `parent`'s replay starts again (its next flow),
        or None."""

    def notice(self, run: R, line: str) -> None:
        """Tell `run`'s code `line` before its next turn, while its worker is live."""


class FlowRequest(Protocol):
    """A worker's request about a flow (brood.protocol's FlowReq), as the service reads it."""

    @property
    def op(self) -> str: ...

    @property
    def ref(self) -> str | None: ...

    @property
    def spec(self) -> str | None: ...

    @property
    def inputs(self) -> str | None: ...

    @property
    def timeout(self) -> float | None: ...

    @property
    def replaying(self) -> bool: ...


def flow_title(executor: FlowExecutor[R]) -> str:
    """The prompt of a flow's controller run, as `brood ps` shows it."""
    return f"flow {executor.m.name or '(unnamed)'}"


class FlowService(Generic[R]):
    """Every flow of one supervisor by its run id. `model_event` (kind, data) is journaled
    with a flow started from the API: the model its tree goes on with when resumed."""

    def __init__(self, host: ServiceHost[R], model_event: tuple[str, dict[str, Any]]) -> None:
        self.host = host
        self.model_event = model_event
        self.executors: dict[str, FlowExecutor[R]] = {}  # flow run id -> its executor
        self.spec_turn = asyncio.Lock()  # specs from model code, parsed one at a time

    async def start(
        self,
        loaded: FlowSpec,
        inputs: dict[str, Any] | None,
        parent: R | None = None,
        run_id: str | None = None,
    ) -> FlowExecutor[R]:
        """Start a validated flow (a child of `parent` when a run's code starts it, whose
        next turns then hear its milestones), and keep it by its run id."""
        machine = compile_spec(loaded)
        for st in machine.states.values():
            self.host.limits.check_pool(st.pool, where=f"flow state {st.id!r}: pool")
        executor = FlowExecutor(self.host, machine, inputs)
        if parent is not None:
            executor.on_milestone = self.notifier(parent)
        spec = loaded.model_dump(**SPEC_DUMP)
        await executor.start(flow_title(executor), parent, spec=spec, run_id=run_id)
        if parent is None:
            self.host.event(executor.run, *self.model_event)
        self.executors[executor.run.id] = executor
        # Its ledger's head (spec and inputs) is what a resume rebuilds it from: the start
        # is answered once that is committed, so a host lost right after still has it.
        await asyncio.wrap_future(self.host.store.committed())
        return executor

    def rebuild(self, run: R) -> None:
        """Rebuild a flow from its ledger while its tree is resumed, and let it go on."""
        events = self.host.store.events(run.id, "flow")
        executor = FlowExecutor.from_ledger(self.host, run, events)
        if run.parent is not None:
            executor.on_milestone = self.notifier(run.parent)
        self.executors[run.id] = executor
        executor.go_live()

    async def request(self, run: R, msg: FlowRequest) -> Any:
        """A run's code starts or steers a flow (the REPL's flow_* helpers)."""
        if msg.op == "run":
            return await self._run(run, msg)
        found = self.executors.get(msg.ref or "")
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

    async def _run(self, run: R, msg: FlowRequest) -> dict[str, Any]:
        """A flow started by `run`'s code, or (in a resumed run's replay) adopted again."""
        limits = self.host.limits
        if not msg.replaying and not limits.can_start_child(run.rec.depth):
            # refused before the spec is read; the flow's start checks every limit
            raise LimitExceeded("max_depth", run.rec.depth + 2, limits.max_depth)
        # Text only: the supervisor never opens a path model code named (the worker read
        # the file, under its own confinement), and problems are told in the schema's own
        # words. Parsed off the loop, one spec at a time: YAML of a megabyte takes seconds
        # of pure Python, which every other tree would wait for.
        async with self.spec_turn:
            loaded = await asyncio.to_thread(load_spec_text, msg.spec or "")
        try:
            inputs = json.loads(msg.inputs or "{}")
        except (ValueError, RecursionError) as exc:
            raise InvalidArgument(
                f"flow_run: inputs are not JSON that can be read ({type(exc).__name__}: "
                "nested too deep, or not JSON); pass a dict of JSON values"
            ) from None
        adopted = self.host.adopt_flow(run)
        if adopted is not None:  # a resumed run's replay starts its flow again
            executor = self.executors.get(adopted.id)
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
        executor = await self.start(loaded, inputs, parent=run)
        return {"id": executor.run.id, "started": executor.started}

    def notifier(self, run: R) -> Callable[[str], None]:
        """Milestones of a flow `run`'s code started, as notices for its next turn."""

        def notify(line: str) -> None:
            self.host.notice(run, line)

        return notify

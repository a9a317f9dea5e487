"""The flows one supervisor runs: started from the API (trusted) or by a run's code (a child
of that run), steered by a worker's FlowReq, rebuilt from their ledgers when a tree is
resumed, their milestones told to the run that started them.

`FlowService` is built by the supervisor's engine on a flow's first use (this package
imports pydantic and PyYAML, which a supervisor that runs no flow never pays for). It
reaches the supervisor only through `ServiceHost`, so it depends on no supervisor type.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from brood.errors import InvalidArgument, LimitExceeded, ReplayDiverged
from brood.flow.compile import compile_spec
from brood.flow.executor import FlowExecutor
from brood.flow.host import FlowHost
from brood.flow.load import load_spec_text
from brood.flow.schema import FlowSpec
from brood.limits import Limits
from brood.models.base import MODEL_SPEC
from brood.protocol import FlowReq, Notice
from brood.store.base import Store

if TYPE_CHECKING:
    from brood.supervisor.runs import Run

# A spec as journaled (and as a resumed run's replay compares it).
SPEC_DUMP: dict[str, Any] = {"mode": "json", "exclude_unset": True, "by_alias": True}


class ServiceHost(FlowHost, Protocol):
    """The supervisor's core as the service uses it: the executor's calls, and the limits,
    the journal and the adoption of a flow a resumed run's replay starts again."""

    @property
    def limits(self) -> Limits: ...

    @property
    def store(self) -> Store: ...

    def adopt_flow(self, parent: Any) -> Any: ...


def flow_title(executor: FlowExecutor) -> str:
    """The prompt of a flow's controller run, as `brood ps` shows it."""
    return f"flow {executor.m.name or '(unnamed)'}"


class FlowService:
    """Every flow of one supervisor by its run id; `model_record` is the model a flow
    started from the API is journaled with (for a resume)."""

    def __init__(self, host: ServiceHost, model_record: dict[str, Any]) -> None:
        self.host = host
        self.model_record = model_record
        self.executors: dict[str, FlowExecutor] = {}  # flow run id -> its executor
        self.spec_turn = asyncio.Lock()  # specs from model code, parsed one at a time

    async def start(
        self,
        loaded: FlowSpec,
        inputs: dict[str, Any] | None,
        parent: Run | None = None,
        run_id: str | None = None,
    ) -> FlowExecutor:
        """Start a validated flow (a child of `parent` when a run's code starts it, whose
        next turns then hear its milestones), and keep it by its run id."""
        machine = compile_spec(loaded)
        for st in machine.states.values():
            self.host.limits.check_pool(st.pool, where=f"flow state {st.id!r}: pool")
        executor = FlowExecutor(self.host, machine, inputs)
        if parent is not None:
            executor.on_milestone = notifier(parent)
        spec = loaded.model_dump(**SPEC_DUMP)
        await executor.start(flow_title(executor), parent, spec=spec, run_id=run_id)
        if parent is None:
            self.host.event(executor.run, MODEL_SPEC, self.model_record)
        self.executors[executor.run.id] = executor
        # Its ledger's head (spec and inputs) is what a resume rebuilds it from: the start
        # is answered once that is committed, so a host lost right after still has it.
        await asyncio.wrap_future(self.host.store.committed())
        return executor

    def rebuild(self, run: Run) -> None:
        """Rebuild a flow from its ledger while its tree is resumed, and let it go on."""
        events = self.host.store.events(run.id, "flow")
        executor = FlowExecutor.from_ledger(self.host, run, events)
        if run.parent is not None:
            executor.on_milestone = notifier(run.parent)
        self.executors[run.id] = executor
        executor.go_live()

    async def request(self, run: Run, msg: FlowReq) -> Any:
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

    async def _run(self, run: Run, msg: FlowReq) -> dict[str, Any]:
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


def notifier(run: Run) -> Callable[[str], None]:
    """Milestones of a flow `run`'s code started, as notices for its next turn."""

    def notify(line: str) -> None:
        if run.conn is not None and not run.rec.state.terminal:
            run.conn.send(Notice(line))

    return notify

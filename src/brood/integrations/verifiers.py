"""brood trees as the rollouts of a verifiers environment (verifiers >= 0.4, `verifiers.v1`).

verifiers plays a task with a harness: the program that answers the task, whose every call
to the policy goes through the rollout's interception endpoint, which records it in the
rollout's trace. `BroodHarness` is that program: each rollout is one brood tree, run in
this process (confined by brood, each run in its own worker), whose root's model is the
policy reached through the endpoint. So the trace, what the trainer learns from, holds the
root's own turns. Its children and plain calls (`llm_query` and its kin) run on
`sub_model`, the model the user configures; their turns go to the trace's `info["brood"]`
as metadata, with the tree's state. The root's FINAL answer is the trace's `root_reply`
(so `trace.last_reply`, which rubrics read, is the answer, not the REPL code of the last
turn), and the task's rubric scores it. A tree that times out or is cancelled still ends
its rollout with a trace, scored (its answer is empty); the reward is journaled on the
root (`RunHandle.record_reward`) once scoring is done.

verifiers finds a harness by the id of the package that exports it: an environment
package re-exports `BroodHarness` beside its taskset, and brood is then its default
harness (`vf-eval my-env`, or prime-rl with `taskset.id = "my-env"`):

    # my_env/__init__.py
    from brood.integrations.verifiers import BroodHarness
    from my_env.taskset import MyTaskset
    __all__ = ["BroodHarness", "MyTaskset"]

Its knobs are `BroodHarnessConfig`'s fields; on the command line they are read once the
seat names its harness: `--env.agent.harness.id my-env --env.agent.harness.sub-model
openai:gpt-4.1-mini --env.agent.harness.limits.max_depth 2` (in TOML,
`[env.agent.harness]` and `[env.agent.harness.limits]`). brood confines the tree itself,
on the host that runs the environment: run the seat on the subprocess runtime
(`--env.agent.runtime.type subprocess`); a container or sandbox runtime would be started
and left unused. `load_environment(package, ...)` builds the same from Python.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import difflib
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from pydantic import Field, field_validator

from brood.api import RunHandle, RunResult, Supervisor
from brood.errors import InvalidArgument, install_hint
from brood.journal import Journal
from brood.limits import Limits
from brood.models.base import BARE, is_spec, resolve_model
from brood.models.openai import OpenAIModel

try:
    import verifiers.v1 as vf
except ImportError as exc:  # the extra is not installed
    raise ImportError(
        f"brood.integrations.verifiers needs verifiers >= 0.4: {install_hint('verifiers')}"
    ) from exc

__all__ = ["METADATA_KEY", "BroodHarness", "BroodHarnessConfig", "load_environment"]

METADATA_KEY = "brood"  # the trace's `info` key of a rollout's tree
T = TypeVar("T")


class BroodHarnessConfig(vf.HarnessConfig):
    """How each rollout's brood tree runs (the seat's `--env.agent.harness.*`).

    sub_model: the model spec of the root's children and plain calls (`openai:MODEL@URL`,
        `anthropic:MODEL`, `echo`, `python:MODULE:FUNCTION`...). None: the policy, through
        the rollout's endpoint, whose calls verifiers then records in the trace beside the
        root's (as other branches).
    limits: `brood.Limits` fields by name (`{"max_depth": 2, "max_iterations": 10}`); an
        unknown name or a bad value fails the harness's construction, naming it.
    timeout: the tree's wall-clock seconds (None: none but the seat's own rollout timeout);
        a tree past it ends `timed_out` and its rollout stops as `agent_timeout`, scored.
    store: the journal URL every rollout's tree is written to (`sqlite:///rollouts.db`,
        `postgresql://...`); None: a temporary journal per rollout, removed when the
        rollout is done (the trace's metadata keeps what the trainer needs).
    """

    sub_model: str | None = None
    limits: dict[str, Any] = Field(default_factory=dict)
    timeout: float | None = Field(None, gt=0)
    store: str | None = None

    @field_validator("sub_model")
    @classmethod
    def _a_model_spec(cls, spec: str | None) -> str | None:
        # Only the form is checked here: building the model (a local one loads its weights)
        # is each rollout's supervisor's work.
        if spec is not None and spec not in BARE and not is_spec(spec):
            try:
                resolve_model(spec)
            except InvalidArgument as exc:
                raise ValueError(f"sub_model: {exc}") from None
        return spec

    @field_validator("limits")
    @classmethod
    def _brood_limits(cls, given: dict[str, Any]) -> dict[str, Any]:
        _limits_of(given)
        return given


def _limits_of(given: dict[str, Any]) -> Limits:
    """`brood.Limits` of a config's `limits`; ValueError naming a field Limits does not have
    (with the nearest one) or a bad value."""
    names = [f.name for f in dataclasses.fields(Limits)]
    for name in given:
        if name not in names:
            near = difflib.get_close_matches(name, names, n=1)
            hint = f"did you mean {near[0]!r}?" if near else f"the fields are {', '.join(names)}"
            raise ValueError(f"limits: brood.Limits has no field {name!r}; {hint}")
    try:
        return Limits(**given)
    except InvalidArgument as exc:
        raise ValueError(f"limits: {exc}") from None


class BroodHarness(vf.Harness[BroodHarnessConfig]):
    """Runs each rollout as a brood tree whose root's model is the policy (see the module's
    docstring). The tree runs in this process's host, not in the rollout's runtime box.
    A task's data field `context`, when it has one, is the root's `context` variable.
    MCP tool servers of a task are not wired into the REPL (SUPPORTS_MCP is off, so
    verifiers refuses such tasks at the start rather than running them without tools)."""

    APPENDS_SYSTEM_PROMPT = True  # the task's system prompt opens the root's task text
    NEEDS_CONTAINER = False  # brood confines model code itself

    def __init__(self, config: BroodHarnessConfig) -> None:
        super().__init__(config)
        self.limits = _limits_of(config.limits)
        # Each rollout's tree, by trace id, from launch to cleanup: its supervisor stays
        # open through scoring, so that the reward can be journaled on its root.
        self._trees: dict[str, _Tree] = {}

    async def launch(
        self,
        ctx: Any,
        trace: Any,
        runtime: Any,
        endpoint: str,
        secret: str,
        mcp_urls: dict[str, str],
        data: Any,
    ) -> Any:
        """Run the rollout's tree to its end; its answer becomes `trace.root_reply` and its
        state `trace.info["brood"]`. A tree that ended otherwise than completed is scored
        like any other: `timed_out` stops the trace as `agent_timeout`, `failed` and
        `cancelled` as `brood_failed` / `brood_cancelled`. A root that failed because a
        call to the policy failed raises HarnessError instead: the trainer's endpoint
        failed, not the model, and verifiers records the call's error (and retries the
        rollout as configured). Cancelled (the seat's rollout timeout), it cancels the
        tree, confirms its workers' exit and records the tree's state on the trace
        before the cancellation goes on."""
        system, prompt = self.resolve_text_prompt(data)
        if not prompt:
            raise vf.HarnessError(
                "the brood harness runs a task's prompt; this task has none (task.prompt)"
            )
        task_text = f"{system}\n\n{prompt}" if system else prompt
        policy = OpenAIModel(ctx.model, base_url=endpoint, api_key=secret)
        tree = _Tree(self.config, self.limits)
        self._trees[trace.id] = tree
        try:
            result = await tree.run(task_text, getattr(data, "context", None), policy)
        except asyncio.CancelledError:
            await _shielded(tree.describe(trace))
            raise
        await tree.describe(trace)
        if result.state == "failed" and any(call.error is not None for call in trace.calls):
            # The policy's endpoint failed the root (the trainer's server, not the model's
            # doing): an error of the rollout, which verifiers records and may retry.
            raise vf.HarnessError(
                f"brood run {result.run_id} failed on a call to the policy: {result.error}"
            )
        if result.state == "timed_out":
            trace.record_timeout("agent")
        elif result.state != "completed":
            trace.stop(f"brood_{result.state}")
        return vf.ProgramResult(exit_code=0, stdout=result.answer or "", stderr="")

    async def cleanup(self, trace: Any, runtime: Any) -> None:
        """After scoring: journal the trace's reward on the tree's root (when scoring ran),
        then close the tree's supervisor, which confirms every worker's exit."""
        tree = self._trees.pop(trace.id, None)
        if tree is not None:
            await _shielded(tree.close(trace))


def load_environment(
    taskset: str,
    *,
    sub_model: str | None = None,
    limits: dict[str, Any] | None = None,
    timeout: float | None = None,
    store: str | None = None,
) -> Any:
    """The verifiers environment (a `vf.Env`, single-agent) that plays the taskset of the
    installed package `taskset` with brood trees, its seat on the subprocess runtime. The
    package must export `BroodHarness` beside its taskset (its id is the harness's id);
    the keywords are `BroodHarnessConfig`'s fields. The policy is the model and client a
    rollout is run with (`vf.ModelContext`, as `vf-eval` and prime-rl give them)."""
    if not _exports_brood_harness(taskset):
        raise vf.EnvError(
            f"the package {taskset!r} does not export brood's harness; add "
            "`from brood.integrations.verifiers import BroodHarness` to it and 'BroodHarness' "
            "to its __all__, beside its taskset"
        )
    knobs = {"sub_model": sub_model, "limits": limits or {}, "timeout": timeout, "store": store}
    config = vf.SingleAgentEnvConfig(
        taskset={"id": taskset},
        agent={"runtime": {"type": "subprocess"}, "harness": {"id": taskset, **knobs}},
    )
    return vf.load_environment(config)


def _exports_brood_harness(package: str) -> bool:
    """Whether the package (which verifiers imports by its id) exports BroodHarness or a
    subclass of it; a package not installed raises verifiers' ModuleNotFoundError."""
    module = vf.import_taskset(package)
    exported = (getattr(module, name, None) for name in getattr(module, "__all__", ()))
    return any(isinstance(c, type) and issubclass(c, BroodHarness) for c in exported)


class _Tree:
    """One rollout's tree: its supervisor, its root's handle, how it ended. Every brood
    call blocks, so each runs in a thread of its own (a rollout never waits for a place in
    a pool that other rollouts' waits fill)."""

    def __init__(self, config: BroodHarnessConfig, limits: Limits) -> None:
        self.config = config
        self.limits = limits
        self.sup: Supervisor | None = None
        self.handle: RunHandle | None = None

    async def run(self, task: str, context: Any, policy: OpenAIModel) -> RunResult:
        config = self.config
        below = config.sub_model

        def start() -> RunHandle:
            self.sup = Supervisor(below or policy, limits=self.limits, store=config.store)
            self.handle = self.sup.spawn(
                task, context=context, timeout=config.timeout, model=policy, sub_model=below
            )
            return self.handle

        try:
            # Shielded: a cancellation while the tree starts waits for its handle, which
            # then cancels it (else the tree would go on alone until cleanup).
            handle = await _shielded(_in_thread(start))
            return await _in_thread(handle.wait_result)
        except asyncio.CancelledError:
            if self.handle is not None:
                await _shielded(_in_thread(self.handle.cancel))
            raise

    async def describe(self, trace: Any) -> None:
        """Put the tree's answer and state on the trace (its root's turns are there
        already: the endpoint recorded them)."""
        if self.handle is None or self.sup is None:
            return
        handle, sup = self.handle, self.sup
        result = handle.outcome()
        info = await _in_thread(lambda: _tree_info(sup, handle, result))
        trace.info[METADATA_KEY] = info
        trace.root_reply = result.answer or ""
        trace.record_metric("brood_runs", 1 + len(info["children"]))

    async def close(self, trace: Any) -> None:
        sup, handle = self.sup, self.handle
        if sup is None:
            return
        rewards = {k: r.value for k, r in trace.rewards.items() if r is not None}

        def close() -> None:
            try:
                if handle is not None and rewards and handle.done:
                    handle.record_reward(float(trace.reward), {"rewards": rewards})
            finally:
                sup.close()

        await _in_thread(close)


def _tree_info(sup: Supervisor, handle: RunHandle, result: RunResult) -> dict[str, Any]:
    """What the trace keeps of a tree besides the root's turns: the root's id, state,
    answer, error and usage; its plain calls (`calls`); and each run below it
    (`children`, in the journal's order: a run's children after it), with its place in
    the tree, how it ended, its conversation (the messages of its last turn and that
    turn's reply, the system prompt included) and its plain calls. A call is the journal's
    record of it: kind, model, messages, response, error, usage."""
    sup.store.flush()
    with Journal(sup.store.url) as journal:
        records = list(journal.export(result.run_id))
    ended = {run["run_id"]: run for run in _runs_of(handle.tree())}
    calls: list[dict[str, Any]] = []
    children: dict[str, dict[str, Any]] = {}
    for record in records:
        run_id = record["run_id"]
        if run_id == result.run_id:
            if record["kind"] != "turn":  # the root's turns are the trace's own
                calls.append(_call(record))
            continue
        run = ended.get(run_id, {})
        child = children.setdefault(
            run_id,
            {
                "run_id": run_id,
                "parent_id": record["parent_id"],
                "depth": record["depth"],
                "prompt": run.get("prompt"),
                "state": run.get("state"),
                "answer": run.get("answer"),
                "error": run.get("reason"),
                "usage": run.get("usage"),
                "messages": [],
                "calls": [],
            },
        )
        if record["kind"] == "turn":
            reply = record["response"]
            said = [] if reply is None else [{"role": "assistant", "content": reply}]
            child["messages"] = [*record["messages"], *said]
        else:
            child["calls"].append(_call(record))
    return {
        "run_id": result.run_id,
        "state": result.state,
        "answer": result.answer,
        "error": result.error,
        "usage": result.usage,
        "calls": calls,
        "children": list(children.values()),
    }


def _runs_of(node: dict[str, Any]) -> list[dict[str, Any]]:
    """A tree snapshot's runs (`RunHandle.tree()`), the node first."""
    return [node, *(run for child in node["children"] for run in _runs_of(child))]


def _call(record: dict[str, Any]) -> dict[str, Any]:
    return {k: record[k] for k in ("kind", "model", "messages", "response", "error", "usage")}


async def _in_thread(fn: Callable[[], T]) -> T:
    """`fn()` in a thread of its own; awaiting it can be cancelled, the call goes on."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(value: T | None, error: BaseException | None) -> None:
        if done.cancelled():
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(value)  # type: ignore[arg-type]

    def call() -> None:
        try:
            value, error = fn(), None
        except BaseException as exc:  # handed to the awaiting task
            value, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(settle, value, error)

    threading.Thread(target=call, name="brood-verifiers", daemon=True).start()
    return await done


async def _shielded(work: Awaitable[T]) -> T:
    """Run `work` to its end even if the awaiting task is cancelled meanwhile (cleanup
    must finish: a tree cancelled is a tree whose workers are gone); a cancellation that
    came meanwhile is raised once it is done."""
    task = asyncio.ensure_future(work)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(task)
            break
        except asyncio.CancelledError:
            if task.done():
                raise
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return result

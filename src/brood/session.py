"""`Session`: a step-driven root run, for RL environments (DESIGN.md section 4).

The trainer supplies the root's code step by step; children the code starts run on their
own model. A Session's root does not hold a `max_concurrency` slot: between steps it is the
trainer, not the root, that computes.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from brood.api import RunHandle
from brood.errors import BroodError, InvalidArgument
from brood.lifecycle import RunState
from brood.limits import Limits, is_duration
from brood.models.base import Model
from brood.models.prices import Price
from brood.supervisor.core import Run
from brood.supervisor.engine import Engine
from brood.tools import Tool

__all__ = ["Observation", "Session"]


@dataclass
class Observation:
    stdout: str = ""
    stderr: str = ""
    error: str | None = None
    done: bool = False
    answer: str | None = None
    children: list[dict[str, str]] = field(default_factory=list)


class Session:
    """An environment: `reset(prompt, context)` starts an episode, `step(code)` runs code in
    the root's REPL, `close()` ends it. Handles from an earlier episode raise StaleHandle.
    `worker_env`, `keep_scratch`, `prices`, `tools`, `mcp_servers` and `tracing` are those
    of `Supervisor`."""

    def __init__(
        self,
        model: str | Callable[..., Any] | Model | None = None,
        *,
        limits: Limits | None = None,
        store: str | None = None,
        worker_env: Mapping[str, str] | Iterable[str] | None = None,
        keep_scratch: bool = False,
        prices: Mapping[str, Price | tuple[float, float]] | None = None,
        tools: Iterable[Tool | Callable[..., Any] | str] | None = None,
        mcp_servers: Iterable[str] | str | None = None,
        tracing: bool | Any | None = None,
    ) -> None:
        engine = Engine(
            model,
            limits=limits,
            store=store,
            worker_env=worker_env,
            keep_scratch=keep_scratch,
            prices=prices,
            tools=tools,
            mcp_servers=mcp_servers,
            tracing=tracing,
        )
        self._attach(engine, owns_engine=True)

    @classmethod
    def on_engine(cls, engine: Engine) -> Session:
        """A session whose episodes are trees of `engine`, an engine its caller owns and
        closes: a server that drives many sessions at once from one supervisor (brood's
        OpenEnv server) pays for one zygote, one journal and one loop, not one per session.
        Each episode is still a tree of its own, with its own workers. `close()` ends this
        session's episode (exit confirmed) and leaves the engine open."""
        return _EngineSession(engine)

    def _attach(self, engine: Engine, *, owns_engine: bool) -> None:
        self._engine = engine
        self._owns_engine = owns_engine
        self._root: Run | None = None
        self._episode = 0
        self._req = itertools.count(1)
        self._closed = False

    @property
    def run_id(self) -> str | None:
        """The id of the current episode's root run (None before the first reset)."""
        return self._root.id if self._root else None

    def reset(self, prompt: str, context: Any = None) -> Observation:
        """End the current episode (its children are cancelled, exit confirmed) and start a
        new one whose root waits for `step`."""
        self._check_open()
        self._end_episode("session reset")
        self._episode += 1
        self._root = self._engine.call(self._start(prompt, context))
        return Observation()

    async def _start(self, prompt: str, context: Any) -> Run:
        run = await self._engine.create_root(prompt, context, None, None, driven=True)
        await run.started.wait()
        return run

    def step(self, code: str, *, timeout: float | None = None) -> Observation:
        """Run `code` in the root's REPL and return what it printed. When the code calls
        FINAL, `done` is True, `answer` is set and the root's children are cancelled.

        `timeout` bounds this step's compute seconds instead of Limits.step_timeout. A step
        that ignores its timeout is ended from outside: the episode ends, `done` is True
        and `error` says why (as for any step whose worker dies)."""
        self._check_open()
        if not isinstance(code, str):
            raise InvalidArgument(f"step(code): code must be str, got {type(code).__name__}")
        if timeout is not None and not is_duration(timeout):
            raise InvalidArgument(
                f"step(timeout=): must be a number of seconds > 0 or None, got {timeout!r}"
            )
        root = self._root
        if root is None:
            raise BroodError("no episode: call reset(prompt) before step()")
        if root.rec.state.terminal:
            raise BroodError(
                f"the episode has ended ({root.rec.state.value}: {root.rec.reason}); call reset()"
            )
        core = self._engine.core

        async def step() -> Any:
            try:
                res = await core.exec_step(root, code, next(self._req), timeout)
            except BroodError:
                if not root.rec.state.terminal and root.ending is None:
                    raise
                await root.done.wait()  # ended during the step: say how, as an observation
                return None
            if res.done:
                await root.done.wait()
            return res

        res = self._engine.call(step())
        if res is None:
            r = root.rec
            why = f"the episode ended {r.state.value}: {r.reason}"
            return Observation("", "", why, True, None, self.children())
        return Observation(res.stdout, res.stderr, res.error, res.done, res.answer, self.children())

    def children(self) -> list[dict[str, str]]:
        """The root's children, each `{"id", "status"}`, in the order they started."""
        root = self._root
        if root is None:
            return []
        return [{"id": c.id, "status": c.rec.state.value} for c in root.children]

    def asks(self) -> list[dict[str, Any]]:
        """The open asks of the session's runs (a trainer that plays the person reads
        them here; callable from another thread while a step waits on an ask)."""
        self._check_open()
        return self._engine.asks()

    def answer(self, ask_id: str, value: str, *, by: str = "trainer") -> dict[str, Any]:
        """Answer an open ask (an option id or label, or text); returns its result."""
        self._check_open()
        return self._engine.answer(ask_id, value, by)

    def record_reward(self, reward: float, info: Mapping[str, Any] | None = None) -> None:
        """Journal the episode's reward (a rubric's score), carried by the training exports."""
        self._check_open()
        if self._root is None:
            raise BroodError("no episode: call reset(prompt) first")
        self._engine.record_reward(self._root, reward, info)

    def handle(self) -> RunHandle:
        """A handle on this episode's root; stale after the next reset or close."""
        self._check_open()
        if self._root is None:
            raise BroodError("no episode: call reset(prompt) first")
        episode = self._episode
        return RunHandle(
            self._engine,
            self._root,
            lambda: (
                "its session was reset"
                if self._episode != episode
                else "its session was closed"
                if self._closed
                else None
            ),
        )

    def _end_episode(self, reason: str) -> None:
        root = self._root
        if root is None:
            return
        if not root.rec.state.terminal:
            self._engine.call(self._engine.core.finish(root, RunState.CANCELLED, reason))
        self._engine.forget_tree(root)  # the journal keeps it; memory stays flat per episode

    def _check_open(self) -> None:
        if self._closed:
            raise BroodError("the session is closed; make a new Session")
        self._engine.check_open()

    def close(self) -> None:
        """End the episode and stop every worker, confirming exit (a session made with
        `on_engine` ends its episode's workers, not the engine's)."""
        if self._closed:
            return
        self._closed = True
        if self._owns_engine:
            self._engine.close()
        elif not self._engine.closed:  # a closing engine ends every episode itself
            self._end_episode("session closed")

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _EngineSession(Session):
    """A Session on an engine its caller owns and closes (`Session.on_engine`)."""

    def __init__(self, engine: Engine) -> None:  # no engine of its own: Session's is not made
        self._attach(engine, owns_engine=False)

"""The environment: each `reset` starts a brood episode (a driven root run: its own tree,
workers and journal entries), each `step` runs an action's code in the root's REPL.

Actions and observations follow OpenEnv's repl_env where brood has the same thing: code in
(`code`, or `is_final` with `final_answer`); `stdout`, `stderr`, `error`, `done`, `answer`
and `reward` out, plus the root's child runs (`children`, whose handles live in the REPL
across steps), the episode's run id and its step count (`iteration`). Where brood differs:
the answer is a field (openenv-core's server leaves `metadata` out of what it sends; in the
process, a done observation's `metadata["final_answer"]` holds it too, where repl_env's
rubrics look for it); stdout, stderr and the error are fields of the
observation itself, not of a nested `result`; FINAL is a call that ends the episode, not
text printed to stdout.
"""

from __future__ import annotations

import asyncio
import copy
import importlib
import inspect
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, EnvironmentMetadata, Observation, State
from openenv.core.rubrics import Rubric
from pydantic import Field, PrivateAttr, ValidationError, model_validator

from brood.errors import BroodError, InvalidArgument
from brood.session import Session
from brood.store.base import redact
from brood.supervisor.engine import Engine

__all__ = [
    "BroodAction",
    "BroodEnvironment",
    "BroodEnvironmentFactory",
    "BroodObservation",
    "BroodState",
    "RewardFn",
    "load_rubric",
]

RewardFn = Callable[..., float]
"""A user's reward: `reward(answer, trajectory) -> float`, called once when an episode ends.
`answer` is the episode's answer (None when it ended without one); `trajectory` is the list
of `(BroodAction, BroodObservation)` pairs of its steps. One that also takes an
`expected_answer` parameter gets the value `reset(expected_answer=...)` was given."""

# The options of brood.Supervisor a factory or an environment passes on to its supervisor.
SUPERVISOR_OPTIONS = frozenset(
    {"worker_env", "keep_scratch", "prices", "tools", "mcp_servers", "tracing"}
)
ACTION_FORM = (
    'send {"code": "<Python source>"}, or {"is_final": true, "final_answer": "<answer>"} '
    "to submit an answer"
)


class BroodAction(Action):
    """Code for the episode's root REPL (repl_env's REPLAction): `code` is run as one step;
    `is_final` with `final_answer` submits that answer instead (as `FINAL(final_answer)`).

    An action that is not code (`code` not a string, an unknown field, no code at all) is
    still taken in: its step answers with an observation whose `error` says what is wrong,
    and the episode goes on."""

    code: str = Field(default="", description="Python source run in the episode's root REPL")
    is_final: bool = Field(
        default=False,
        description="submit final_answer as the episode's answer instead of running code",
    )
    final_answer: str | None = Field(default=None, description="the answer is_final submits")

    _refused: str | None = PrivateAttr(default=None)

    @model_validator(mode="wrap")
    @classmethod
    def _take_in_and_refuse_at_step(cls, data: Any, handler: Any) -> Any:
        # openenv-core answers an action that fails validation with a protocol error (the
        # client raises, the episode's observation never says why); kept as an empty action
        # that remembers the problem, it is refused by step() in an observation instead.
        try:
            return handler(data)
        except ValidationError as exc:
            action: BroodAction = handler({})
            action.refuse(_not_code(exc))
            return action

    def refuse(self, why: str) -> None:
        """Have step() refuse this action, saying `why` in the observation's error (the
        validator does so for input that is not code)."""
        self._refused = why

    @property
    def refused(self) -> str | None:
        """Why this action cannot be taken, or None when it can."""
        if self._refused is not None:
            return self._refused
        if self.is_final and self.code.strip():
            return (
                "the action has both code and is_final; send the code in one step and "
                "is_final with final_answer in the next"
            )
        if not self.is_final and "code" not in self.model_fields_set:
            return f"the action has no code; {ACTION_FORM}"
        return None


def _not_code(exc: ValidationError) -> str:
    """The words of a refused action: each field that is wrong, and the form to send."""
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"])
        given = err.get("input")
        if err["type"] == "extra_forbidden":
            parts.append(f"{where!r} is not a field of an action")
        elif not where:
            parts.append(f"the action must be an object, got {type(given).__name__}")
        elif where == "code":
            parts.append(f"code must be a string of Python source, got {type(given).__name__}")
        else:
            parts.append(f"{where}: {err['msg']} (got {given!r:.40})")
    return f"the action is not code: {'; '.join(parts)}; {ACTION_FORM}"


class BroodObservation(Observation):
    """What a step did. `done`, `reward` and `metadata` are openenv-core's own fields."""

    stdout: str = Field(default="", description="what the step printed (capped, with a note)")
    stderr: str = Field(default="", description="what the step wrote to stderr")
    error: str | None = Field(
        default=None,
        description="the step's exception, a refused action, or a rubric that failed",
    )
    answer: str | None = Field(default=None, description="the episode's answer once done")
    children: list[dict[str, str]] = Field(
        default_factory=list, description="the root's child runs: [{id, status}], oldest first"
    )
    run_id: str | None = Field(default=None, description="the episode's root run in the journal")
    iteration: int = Field(default=0, ge=0, description="steps taken in this episode")


class BroodState(State):
    """The episode: openenv-core's `episode_id` and `step_count`, and brood's view of it."""

    run_id: str | None = Field(default=None, description="the episode's root run in the journal")
    prompt: str | None = Field(default=None, description="the episode's task")
    done: bool = Field(default=False, description="whether the episode has ended")
    answer: str | None = Field(default=None, description="the episode's answer once done")
    reward: float | None = Field(default=None, description="the episode's reward once scored")
    children: list[dict[str, str]] = Field(
        default_factory=list, description="the root's child runs: [{id, status}]"
    )


# ---- rubrics -------------------------------------------------------------------------------


def check_rubric(rubric: Any) -> Rubric | RewardFn | None:
    """`rubric` if it is one (an openenv-core Rubric, or a callable taking the answer and
    the trajectory), else InvalidArgument naming what it is."""
    if rubric is None or isinstance(rubric, Rubric):
        return rubric
    if isinstance(rubric, type) and issubclass(rubric, Rubric):
        raise InvalidArgument(
            f"rubric: {rubric.__name__} is a Rubric class; pass an instance, {rubric.__name__}()"
        )
    if not callable(rubric):
        raise InvalidArgument(
            f"rubric: must be a function reward(answer, trajectory) -> float or an openenv-core "
            f"Rubric, got {type(rubric).__name__}"
        )
    try:
        inspect.signature(rubric).bind(None, [])
    except TypeError:
        raise InvalidArgument(
            f"rubric: {_name(rubric)} cannot be called as reward(answer, trajectory); give it "
            "those two parameters"
        ) from None
    except ValueError:  # a builtin without a signature: it is tried when called
        pass
    return rubric


def load_rubric(spec: str) -> Rubric | RewardFn:
    """The rubric `module:name` names: a function `reward(answer, trajectory)`, an
    openenv-core Rubric instance, or a Rubric class that takes no arguments (made here).
    The module is imported from sys.path or the current directory."""
    module_name, _, attr = spec.partition(":")
    if not module_name.strip() or not attr.strip():
        raise InvalidArgument(
            f"rubric {spec!r}: write MODULE:FUNCTION, e.g. myrewards:exact for "
            "`def exact(answer, trajectory)` in myrewards.py"
        )
    here = os.getcwd()  # searched after sys.path, as for a python:MODULE:FUNCTION model
    if here not in sys.path and "" not in sys.path:
        sys.path.append(here)
    try:
        found: Any = importlib.import_module(module_name.strip())
    except Exception as exc:
        raise InvalidArgument(
            f"rubric {spec!r}: importing {module_name.strip()!r} failed ({type(exc).__name__}: "
            f"{exc}); run from the folder that holds it, or put that folder on PYTHONPATH"
        ) from None
    for part in attr.strip().split("."):
        if not hasattr(found, part):
            raise InvalidArgument(f"rubric {spec!r}: {module_name} has no attribute {part!r}")
        found = getattr(found, part)
    if isinstance(found, type) and issubclass(found, Rubric):
        found = found()
    rubric = check_rubric(found)
    assert rubric is not None
    return rubric


def _name(rubric: Any) -> str:
    return str(getattr(rubric, "__qualname__", None) or type(rubric).__name__)


def _takes_expected(fn: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except ValueError:
        return False
    return any(p.name == "expected_answer" or p.kind is p.VAR_KEYWORD for p in params)


class NotAReward(ValueError):
    """A rubric returned something that is not a finite number."""


def _reward(value: Any, rubric: Any) -> float:
    """A rubric's score as a reward, or NotAReward saying what it returned instead."""
    if inspect.iscoroutine(value):  # an openenv-core Rubric whose forward() is async
        value = asyncio.run(value)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise NotAReward(
            f"the rubric {_name(rubric)} returned {value!r:.60} ({type(value).__name__}); "
            "a reward is a finite number"
        )
    return float(value)


@dataclass
class Scorer:
    """How an environment scores its episodes: a user's `reward(answer, trajectory)` once,
    when the episode ends; or an openenv-core Rubric on every step (as openenv environments
    apply theirs), whose score at the end is the episode's reward."""

    rubric: Rubric | RewardFn | None
    expected: Any = None

    def reset(self, expected_answer: Any) -> None:
        rubric = self.rubric
        if isinstance(rubric, Rubric):
            rubric.reset()
            setter = getattr(rubric, "set_expected", None)  # repl_env's rubrics take it so
            if expected_answer is not None:
                if not callable(setter):
                    raise InvalidArgument(
                        f"reset(expected_answer=...): the rubric {_name(rubric)} has no "
                        "set_expected() to take it; give it one, or leave expected_answer out"
                    )
                setter(expected_answer)
        elif expected_answer is not None and (rubric is None or not _takes_expected(rubric)):
            what = "there is no rubric" if rubric is None else f"{_name(rubric)} takes none"
            raise InvalidArgument(
                f"reset(expected_answer=...): {what}; give the reward function an "
                "expected_answer parameter, or leave expected_answer out"
            )
        self.expected = expected_answer

    def score(
        self,
        action: BroodAction,
        obs: BroodObservation,
        trajectory: list[tuple[BroodAction, BroodObservation]],
    ) -> float | None:
        """The step's reward (None for none); raises what the rubric raised, or NotAReward
        when it returned something that is not a reward."""
        rubric = self.rubric
        if isinstance(rubric, Rubric):
            return _reward(rubric(action, obs), rubric)
        if rubric is None or not obs.done:
            return None
        if self.expected is not None:
            return _reward(
                rubric(obs.answer, list(trajectory), expected_answer=self.expected), rubric
            )
        return _reward(rubric(obs.answer, list(trajectory)), rubric)


# ---- the environment -----------------------------------------------------------------------


@dataclass
class Episode:
    """One episode as the environment sees it (the journal holds the rest)."""

    episode_id: str
    run_id: str | None
    prompt: str
    trajectory: list[tuple[BroodAction, BroodObservation]] = field(default_factory=list)
    done: bool = False
    answer: str | None = None
    reward: float | None = None


class BroodEnvironment(Environment[BroodAction, BroodObservation, BroodState]):
    """brood on openenv-core's Environment API: `reset(prompt=..., context=...)` starts an
    episode, `step(BroodAction(code=...))` runs code in its root's REPL, `close()` ends it.

    `model` runs the children and plain calls that the episode's code starts; `limits`,
    `store` and the other options of `brood.Supervisor` (worker_env, keep_scratch, prices,
    tools, mcp_servers, tracing) are the supervisor's. `session` runs the episodes on a
    `brood.Session` given instead (`BroodEnvironmentFactory` gives each environment one on
    its shared supervisor); the environment closes it.

    `rubric` scores episodes: a function `reward(answer, trajectory) -> float`, called once
    when the episode ends; or an openenv-core Rubric, called on every step as
    `rubric(action, observation)`. The reward of the last step is the observation's
    `reward` and is journaled for the episode (`Session.record_reward`). A rubric that
    raises, or returns something that is not a finite number, gives that step an `error`
    saying so and a `reward` of None; nothing of the episode is lost.

    `reset` and `close` end the current episode: its children are cancelled and every
    worker's exit is confirmed before they return. Errors of a step (its code raising, a
    refused action, a step with no episode) come back as the observation's `error`, never
    as an exception of the server.
    """

    SUPPORTS_CONCURRENT_SESSIONS = True  # every episode is a tree of its own

    def __init__(
        self,
        model: Any = None,
        *,
        rubric: Rubric | RewardFn | None = None,
        limits: Any = None,
        store: str | None = None,
        session: Session | None = None,
        **supervisor: Any,
    ) -> None:
        scorer = Scorer(check_rubric(rubric))
        if session is None:
            _check_options(supervisor)
            session = Session(model, limits=limits, store=store, **supervisor)
        elif model is not None or limits is not None or store is not None or supervisor:
            raise InvalidArgument(
                "BroodEnvironment(session=...): the session brings its own model, limits and "
                "store; pass either a session or those options"
            )
        super().__init__(rubric=scorer.rubric if isinstance(scorer.rubric, Rubric) else None)
        self._session = session
        self._scorer = scorer
        self._episode: Episode | None = None
        self._episodes = 0
        self._closed = False

    # ---- an episode ------------------------------------------------------------------------
    def reset(
        self,
        seed: int | None = None,
        episode_id: str | None = None,
        prompt: str | None = None,
        context: Any = None,
        *,
        task_prompt: str | None = None,
        expected_answer: Any = None,
        **kwargs: Any,
    ) -> BroodObservation:
        """End the current episode (children cancelled, exit confirmed) and start a new one
        whose root waits for `step`. `prompt` (or repl_env's `task_prompt`) is its task,
        `context` the REPL's `context`; `expected_answer` goes to the rubric; `seed` is
        accepted and unused (brood's REPL draws nothing at random). Raises InvalidArgument
        for an argument it does not take."""
        if kwargs:
            raise InvalidArgument(
                f"reset() got arguments it does not take: {sorted(kwargs)}; it takes prompt "
                "(or task_prompt), context, expected_answer, episode_id and seed"
            )
        if prompt is not None and task_prompt is not None and prompt != task_prompt:
            raise InvalidArgument("reset(): pass the task as prompt or as task_prompt, not both")
        task = prompt if prompt is not None else task_prompt if task_prompt is not None else ""
        if not isinstance(task, str):
            raise InvalidArgument(f"reset(prompt=): must be a string, got {type(task).__name__}")
        if episode_id is not None and not isinstance(episode_id, str):
            raise InvalidArgument(
                f"reset(episode_id=): must be a string, got {type(episode_id).__name__}"
            )
        self._scorer.reset(expected_answer)
        self._episode = None
        self._session.reset(task, context)
        self._episodes += 1
        run_id = self._session.run_id
        self._episode = Episode(episode_id or run_id or str(self._episodes), run_id, task)
        return BroodObservation(run_id=run_id)

    def step(
        self, action: BroodAction, timeout_s: float | None = None, **kwargs: Any
    ) -> BroodObservation:
        """Run the action's code in the root's REPL (`timeout_s` bounds its compute seconds
        instead of Limits.step_timeout). When the code calls FINAL, or the episode ends
        otherwise, `done` is True, `answer` is set, the root's children are cancelled and
        the rubric's reward is in `reward`."""
        ep = self._episode
        if ep is None:
            return BroodObservation(
                error="no episode: call reset(prompt=...) before step() (over plain HTTP, "
                "each /step gets a new environment: keep a session with the WebSocket client)",
                done=True,
            )
        if ep.done:
            return BroodObservation(
                error=f"the episode {ep.run_id} has ended; call reset() to start another",
                done=True,
                answer=ep.answer,
                reward=ep.reward,
                children=self._session.children(),
                run_id=ep.run_id,
                iteration=len(ep.trajectory),
            )
        if not isinstance(action, BroodAction):
            why: str | None = (
                f"the action is a {type(action).__name__}, not a BroodAction; {ACTION_FORM}"
            )
        else:
            why = action.refused
        if why is not None:
            return BroodObservation(
                error=why,
                children=self._session.children(),
                run_id=ep.run_id,
                iteration=len(ep.trajectory),
            )
        code = f"FINAL({action.final_answer or ''!r})" if action.is_final else action.code
        try:
            result = self._session.step(code, timeout=timeout_s)
            obs = BroodObservation(
                stdout=result.stdout,
                stderr=result.stderr,
                error=result.error,
                done=result.done,
                answer=result.answer,
                children=result.children,
            )
        except BroodError as exc:  # a refused timeout, an episode that ended meanwhile
            obs = BroodObservation(
                error=str(exc), done=self._session.handle().done, children=self._session.children()
            )
        obs.run_id = ep.run_id
        if obs.done:  # where repl_env's rubrics (ExactMatchRubric, ...) read the answer
            obs.metadata = {"final_answer": obs.answer}
        ep.trajectory.append((action, obs))
        obs.iteration = len(ep.trajectory)
        ep.done, ep.answer = obs.done, obs.answer
        self._score(ep, action, obs)
        return obs

    def _score(self, ep: Episode, action: BroodAction, obs: BroodObservation) -> None:
        """Put the rubric's reward in `obs` and, at the episode's end, in the journal; a
        rubric that fails says so in `obs.error`."""
        try:
            obs.reward = self._scorer.score(action, obs, ep.trajectory)
        except Exception as exc:
            obs.reward = None
            failed = (
                str(exc)
                if isinstance(exc, NotAReward)
                else f"the rubric {_name(self._scorer.rubric)} raised {type(exc).__name__}: {exc}"
            )
            kept = "; the episode's answer is kept in the journal" if obs.done else ""
            obs.error = f"{obs.error}\n{failed}{kept}" if obs.error else f"{failed}{kept}"
            return
        if obs.done and obs.reward is not None:
            ep.reward = obs.reward
            info = {"rubric": _name(self._scorer.rubric), "episode_id": ep.episode_id}
            try:
                self._session.record_reward(obs.reward, info)
            except BroodError as exc:
                obs.error = f"the reward {obs.reward} could not be journaled: {exc}"

    @property
    def state(self) -> BroodState:
        ep = self._episode
        if ep is None:
            return BroodState()
        return BroodState(
            episode_id=ep.episode_id,
            step_count=len(ep.trajectory),
            run_id=ep.run_id,
            prompt=ep.prompt,
            done=ep.done,
            answer=ep.answer,
            reward=ep.reward,
            children=self._session.children(),
        )

    def get_metadata(self) -> EnvironmentMetadata:
        from brood import __version__

        return EnvironmentMetadata(
            name="brood",
            description=(
                "A recursive language model's REPL: code in, its output, answer and reward "
                "out; child runs (rlm_query, rlm_spawn) in confined workers that outlive a "
                "step, each episode a journaled tree of its own"
            ),
            version=__version__,
        )

    def close(self) -> None:
        """End the episode (children cancelled, exit confirmed) and the environment's
        session; later steps answer that there is no episode."""
        if self._closed:
            return
        self._closed = True
        self._episode = None
        self._session.close()


def _check_options(options: dict[str, Any]) -> None:
    unknown = sorted(set(options) - SUPERVISOR_OPTIONS)
    if unknown:
        raise InvalidArgument(
            f"unknown options {unknown}; the supervisor takes {sorted(SUPERVISOR_OPTIONS)} "
            "besides model, limits and store"
        )


class BroodEnvironmentFactory:
    """Makes the environments of one server, for openenv-core's `create_app`: every
    environment's episodes are trees of one supervisor made here (one zygote and warm
    pool, one journal, one loop), so a new environment costs no process start-up and
    `max_concurrency` bounds the workers of all episodes together. Each episode is still
    its own tree with its own confined workers, ended with confirmed exit at its reset
    or close.

    Arguments are `BroodEnvironment`'s. An openenv-core Rubric is copied (deepcopy) for
    each environment, so a stateful one (a TrajectoryRubric) sees only its own episodes;
    a reward function is shared. `close()` stops the supervisor, ending every episode."""

    def __init__(
        self,
        model: Any = None,
        *,
        rubric: Rubric | RewardFn | None = None,
        limits: Any = None,
        store: str | None = None,
        **supervisor: Any,
    ) -> None:
        _check_options(supervisor)
        self.rubric = check_rubric(rubric)
        if isinstance(self.rubric, Rubric):
            try:
                copy.deepcopy(self.rubric)
            except Exception as exc:
                raise InvalidArgument(
                    f"rubric: {_name(self.rubric)} cannot be copied for each episode "
                    f"({type(exc).__name__}: {exc}); make it copyable, or pass a function"
                ) from None
        self.engine = Engine(model, limits=limits, store=store, **supervisor)

    def __call__(self) -> BroodEnvironment:
        rubric = copy.deepcopy(self.rubric) if isinstance(self.rubric, Rubric) else self.rubric
        return BroodEnvironment(session=Session.on_engine(self.engine), rubric=rubric)

    @property
    def store_url(self) -> str:
        """The journal the episodes are written to (a password in it masked)."""
        return redact(self.engine.store.url)

    def close(self) -> None:
        """End every episode still going, confirm every worker's exit, close the journal."""
        self.engine.close()

    def __enter__(self) -> BroodEnvironmentFactory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

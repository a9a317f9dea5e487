"""A worker process: connect to the supervisor, wait for one run, run it, wait to be stopped."""

from __future__ import annotations

import _thread
import socket
import traceback

import cloudpickle

from brood.protocol import MAX_WORKER_FRAME, Failed, Final, Start, SyncChannel, user_message_cap
from brood.worker.agent import Agent
from brood.worker.confine import pids_capped, share_thread_arenas
from brood.worker.link import Link
from brood.worker.prompt import (
    cached_system_prompt,
    describe_budget,
    describe_context,
    describe_tools,
)
from brood.worker.repl import Repl, ReplayStop, StepClock
from brood.worker.runtime import Runtime
from brood.worker.tools import make_tools
from brood.worker.verbs import ERRORS, make_helpers


def first_message(start: Start, context: object, prompt: str | None = None) -> str:
    """A run's first user message: its task (`prompt`, else the Start's), its context
    described, and the follow-ups sent before it started."""
    parts = [start.prompt if prompt is None else prompt, "", describe_context(context)]
    parts += [f"[message from your parent] {m}" for m in start.messages]
    return "\n".join(parts)


def serve(sock: socket.socket) -> None:
    """Entry of a forked, confined worker, over its own end of a socketpair. Never returns
    normally: the process ends with os._exit."""
    chan = SyncChannel.over_socket(sock, limit=MAX_WORKER_FRAME)
    link = Link(chan)
    link.start_reader()  # while the worker waits in the warm pool, not after its Start
    start = link.starts.get()  # the reader exits the process if the supervisor goes first
    try:
        run(start, link)
    except BaseException as exc:  # anything that escapes the loop fails the run, with a reason
        error = traceback.format_exc()[-4000:]
        if isinstance(exc, ReplayStop):
            link.send(Failed(reason=_reason(exc), error=error, kind="diverged"))
        else:
            link.send(Failed(reason=_reason(exc), error=error))
    # Stay until the supervisor's Stop (handled by the reader thread) ends the process: on a
    # bare lock taken twice (a threading.Event builds a Condition, in Python, for nothing).
    forever = _thread.allocate_lock()
    forever.acquire()
    forever.acquire()


def report_unusable(sock: socket.socket, reason: str) -> None:
    """This worker cannot run anything (its confinement failed): the run it is handed
    fails with `reason`, so the failure is seen, never silently worked around."""
    chan = SyncChannel.over_socket(sock)
    chan.send(Failed(reason=reason, error=traceback.format_exc()[-4000:]))
    chan.recv()  # hold until the supervisor stops this worker (Stop or end of stream)


def _reason(exc: BaseException) -> str:
    from brood.errors import RATE_LIMITED_REASON, ModelError, RateLimited

    if isinstance(exc, RateLimited):
        return f"{RATE_LIMITED_REASON}{exc}"
    if isinstance(exc, ModelError):
        return f"model error: {exc}"
    if isinstance(exc, ReplayStop):
        return f"replay diverged: {exc}"
    return f"worker error: {type(exc).__name__}: {exc}"


def run(start: Start, link: Link) -> None:
    context = cloudpickle.loads(start.context) if start.context is not None else None
    limits = start.limits
    can_spawn = limits.can_start_child(start.depth)
    clock = StepClock()
    rt = Runtime(
        link,
        run_id=start.run_id,
        depth=start.depth,
        can_spawn=can_spawn,
        clock=clock,
        max_depth=limits.max_depth,
        limits=limits,
    )
    if pids_capped():
        # Threads of spawned work start as it comes (they count as model code's own:
        # confine.CGROUP_HEADROOM); sharing one arena, they take no GiB of worker_memory.
        share_thread_arenas()
    rt.model_name = start.model_name
    rt.replay = start.replay
    helpers = make_helpers(rt)
    rt.tools = make_tools(start.tools, rt)
    repl = Repl(
        {**rt.tools, **helpers, **ERRORS},
        context,
        clock=clock,
        blocked=limits.blocked_builtins,
        read_only=limits.read_only,
    )
    rt.namespace = repl.namespace
    rt.baseline()
    agent = Agent(rt, repl)
    if start.driven:
        agent.driven()
        return
    system = cached_system_prompt(can_spawn) + describe_tools(start.tools)
    if start.budget is not None:
        system += describe_budget(start.budget)
    if start.conversation:
        converse(agent, start, context, system)
        return
    cap = user_message_cap(limits.max_prompt_chars, start.prompt, start.messages)
    final = agent.loop(first_message(start, context), system, cap)
    link.send(final)


def converse(agent: Agent, start: Start, context: object, system: str) -> None:
    """A conversation root: each user turn continues the same history and REPL until
    FINAL, whose answer (a `Final`) the supervisor takes as the turn's; then the worker
    waits for the next `Turn`. A resumed one replays its journaled turns first. The first
    turn's message also describes the context, as a run's first message does."""
    link, limits = agent.rt.link, agent.rt.limits
    journaled = list(start.replay.user_turns) if start.replay is not None else []
    agent.history = agent.start_history(system)
    first = True
    while True:
        prompt = journaled.pop(0) if journaled else link.turns.get().prompt
        if first:
            message = first_message(start, context, prompt)
            cap = user_message_cap(limits.max_prompt_chars, prompt, start.messages)
        else:
            message, cap = prompt, user_message_cap(limits.max_prompt_chars, prompt)
        first = False
        end = agent.turn(message, cap)
        link.send(end)
        if isinstance(end, Failed):
            return


__all__ = ["Final", "serve"]

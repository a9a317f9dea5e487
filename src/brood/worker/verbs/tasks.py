"""Work started without waiting (`spawn`) and collected later (`rlm_await`,
`rlm_await_all`), possibly in a later step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from brood.errors import InvalidArgument
from brood.worker.handles import (
    Handle,
    Task,
    check_handle,
    check_handles,
    check_timeout,
    collect,
    start_task,
)
from brood.worker.runtime import Runtime, as_spawned
from brood.worker.verbs import calls, children, toolkit
from brood.worker.verbs.base import check_prompts, verb, verb_of

# What spawn starts as a Task: the query helpers that are not a single child run.
_AS_TASKS = (
    calls.llm_query,
    calls.llm_query_batched,
    children.rlm_query_batched,
    toolkit.llm_query_chunked,
    toolkit.map_files,
    toolkit.llm_map_reduce,
)


@verb
def spawn(fn: Callable[..., Any], *args: Any, rt: Runtime, **kw: Any) -> Handle:
    """Start a query helper (llm_query, llm_query_batched, rlm_query, rlm_query_batched,
    llm_query_chunked, map_files, llm_map_reduce) without waiting; returns a Task, or a
    ChildHandle for rlm_query. Collect it later with rlm_await."""
    target = verb_of(fn)
    if target is children.rlm_query or target is children.rlm_spawn:
        kw["blocking"] = False
        return children.rlm_query(*args, rt=rt, **kw)
    if target is children.rlm_query_batched and rt.can_spawn:
        prompts = check_prompts(
            args[0] if args else kw.pop("prompts", None), "spawn(rlm_query_batched)"
        )
        handles = children.spawn_children(rt, prompts, **kw)
        fut = rt.pool().submit(as_spawned, collect, rt, handles, None)
        return Task(rt, fut, "rlm_query_batched", handles)
    if target is not None and target in _AS_TASKS:
        return start_task(rt, fn.__name__, fn, *args, prompts=_plain_calls(target, args, kw), **kw)
    raise InvalidArgument(
        "spawn(fn, ...) starts one of llm_query, llm_query_batched, rlm_query, "
        "rlm_query_batched, llm_query_chunked, map_files, llm_map_reduce; got "
        f"{getattr(fn, '__name__', fn)!r}"
    )


@verb
def rlm_await(task: Handle, timeout: float | None = None, *, rt: Runtime) -> Any:
    """Collect a Task or ChildHandle, possibly in a later step. On timeout TimeoutError;
    the work keeps running."""
    handle = check_handle(task, "rlm_await")
    return handle.wait(check_timeout(timeout, "rlm_await"))


@verb
def rlm_await_all(tasks: list[Handle], timeout: float | None = None, *, rt: Runtime) -> list[Any]:
    """rlm_await over several tasks or handles; results in order."""
    handles = check_handles(tasks, "rlm_await_all", "tasks")
    return collect(rt, handles, check_timeout(timeout, "rlm_await_all"))


def _plain_calls(target: object, args: tuple[Any, ...], kw: dict[str, Any]) -> list[str]:
    """The prompts of the plain calls spawned llm_query or llm_query_batched will make
    (counted as under way from the spawn: `Runtime.reserve`); none for other helpers,
    whose calls are counted as they begin."""
    if target is calls.llm_query:
        prompt = args[0] if args else kw.get("prompt")
        return [prompt] if isinstance(prompt, str) else []
    if target is calls.llm_query_batched:
        prompts = args[0] if args else kw.get("prompts")
        if isinstance(prompts, list | tuple) and all(isinstance(p, str) for p in prompts):
            return list(prompts)
    return []

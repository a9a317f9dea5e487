"""Child runs (`rlm_query`, `rlm_query_batched`, `rlm_spawn`) and the verbs every handle
takes (`rlm_status`, `rlm_result`, `rlm_products`, `rlm_wait*`, `rlm_cancel`, `rlm_send`,
`rlm_children`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import cloudpickle

from brood.errors import InvalidArgument, ReplayDiverged
from brood.protocol import MAX_RETRIES, ChildUpdate, SpawnReq
from brood.worker.handles import (
    ChildHandle,
    Handle,
    check_child,
    check_handle,
    check_handles,
    check_timeout,
    collect,
    start_task,
    wait_handles,
)
from brood.worker.repl import ReplayStop
from brood.worker.runtime import Runtime
from brood.worker.verbs import calls
from brood.worker.verbs.base import check_prompt, check_prompts, verb


def spawn_children(
    rt: Runtime,
    prompts: Sequence[str],
    *,
    context: Any = None,
    model: str | None = None,
    timeout: float | None = None,
    pool: str | None = None,
    retries: int = 0,
    placement: str = "local",
) -> list[ChildHandle]:
    """Start one child run per prompt (one request to the supervisor); their handles."""
    rt.check_open()
    if placement not in ("local", "spread"):
        raise InvalidArgument(
            f"placement must be 'local' (this node) or 'spread' (another node of a "
            f"cluster), got {placement!r}"
        )
    if pool is not None and not isinstance(pool, str):
        raise InvalidArgument(f"pool must be the name of a pool (a str), got {pool!r}")
    if isinstance(retries, bool) or not isinstance(retries, int) or not 0 <= retries <= MAX_RETRIES:
        raise InvalidArgument(
            f"retries must be a whole number from 0 to {MAX_RETRIES} (attempts after the "
            f"first, for a child that fails or times out), got {retries!r}"
        )
    for i, p in enumerate(prompts):
        rt.fits(p, f"rlm_query_batched[{i}]" if len(prompts) > 1 else "rlm_query")
    blob = cloudpickle.dumps(context) if context is not None else None
    try:
        ids: list[str] = rt.link.request(
            SpawnReq(
                req_id=rt.link.next_id(),
                prompts=list(prompts),
                context=blob,
                model=model,
                timeout=timeout,
                step=rt.step,
                replaying=rt.replaying,
                pool=pool,
                retries=retries,
                placement=placement,  # type: ignore[arg-type]
            )
        )
    except ReplayDiverged as exc:
        raise ReplayStop(str(exc)) from None
    handles = []
    with rt.link.cond:
        for child_id, prompt in zip(ids, prompts, strict=True):
            rt.link.children.setdefault(child_id, ChildUpdate(child_id, "queued"))
            handles.append(ChildHandle(rt, child_id, prompt))
    for h in handles:
        rt.handles[h.id] = h
    return handles


@verb
def rlm_query(
    prompt: str,
    *,
    blocking: bool = True,
    context: Any = None,
    model: str | None = None,
    timeout: float | None = None,
    pool: str | None = None,
    retries: int = 0,
    placement: str = "local",
    rt: Runtime,
) -> Any:
    """Start a child run (a whole RLM with its own REPL) on `prompt`.

    blocking=True waits and returns its answer (raises ChildFailed if it fails);
    blocking=False returns a ChildHandle at once. `context` becomes the child's
    `context` variable; `timeout` bounds its wall-clock seconds; `pool` names a
    capacity pool the child holds a place in from its start to its end; `retries`
    starts a child that failed or timed out again (same handle), up to that many times.
    placement="spread" runs the child's subtree on another node of a cluster (here
    when there is none); it stays a child for every helper.
    """
    rt.fits(check_prompt(prompt, "rlm_query"), "rlm_query")
    if not rt.can_spawn:
        rt.note_depth()
        if blocking:
            return calls.llm_query(prompt, model, rt=rt)
        return start_task(rt, "llm_query", calls.llm_query, prompt, model, rt=rt, prompts=[prompt])
    (h,) = spawn_children(
        rt,
        [prompt],
        context=context,
        model=model,
        timeout=timeout,
        pool=pool,
        retries=retries,
        placement=placement,
    )
    return h.wait() if blocking else h


@verb
def rlm_query_batched(prompts: list[str], *, rt: Runtime, **kw: Any) -> list[str]:
    """Concurrent blocking children; answers in order. If any fails, raises ChildFailed
    once all have settled, naming the failed indices, with e.answers (None where failed)."""
    prompts = check_prompts(prompts, "rlm_query_batched")
    if not rt.can_spawn:
        rt.note_depth()
        return calls.llm_query_batched(prompts, kw.get("model"), rt=rt)
    return collect(rt, spawn_children(rt, prompts, **kw), None)


@verb
def rlm_spawn(prompt: str, *, rt: Runtime, **kw: Any) -> Any:
    """Start a child run without waiting: same as rlm_query(prompt, blocking=False)."""
    return rlm_query(prompt, blocking=False, rt=rt, **kw)


@verb
def rlm_status(h: Handle, *, rt: Runtime) -> str:
    """The child's state: queued, running, cancelling, completed, failed, cancelled or
    timed_out (an ask's: open, answered or cancelled). Never blocks."""
    return check_handle(h, "rlm_status").status()


@verb
def rlm_result(h: Handle, *, rt: Runtime) -> Any:
    """The child's answer if completed; raises ChildNotReady if it is still going,
    ChildFailed (with the reason) if it ended otherwise."""
    return check_handle(h, "rlm_result").result()


@verb
def rlm_products(h: Handle, *, rt: Runtime) -> dict[str, Any] | None:
    """The products (a JSON object) the child gave with FINAL(answer, products=...), or
    None if it gave none; raises like rlm_result if it did not complete."""
    return check_child(h, "rlm_products").products()


@verb
def rlm_wait(h: Handle, timeout: float | None = None, *, rt: Runtime) -> Any:
    """Block until the child ends and return its answer (raises ChildFailed). On timeout
    raises TimeoutError and the child keeps running."""
    handle = check_handle(h, "rlm_wait")
    return handle.wait(check_timeout(timeout, "rlm_wait"))


@verb
def rlm_wait_all(hs: list[Handle], timeout: float | None = None, *, rt: Runtime) -> list[Any]:
    """rlm_wait over several handles: answers in order; ChildFailed names failed indices
    (e.answers has None there). On timeout TimeoutError; the children keep running."""
    handles = check_handles(hs, "rlm_wait_all", "hs")
    return collect(rt, handles, check_timeout(timeout, "rlm_wait_all"))


@verb
def rlm_wait_any(hs: list[Handle], timeout: float | None = None, *, rt: Runtime) -> Handle:
    """Block until one of the handles has ended and return that handle. On timeout
    TimeoutError; the children keep running."""
    handles = check_handles(hs, "rlm_wait_any", "hs")
    timeout = check_timeout(timeout, "rlm_wait_any")
    if not handles:
        raise InvalidArgument("rlm_wait_any needs at least one handle")
    if not wait_handles(rt, handles, any, timeout):
        raise TimeoutError(
            f"none of {len(handles)} handles ended within {timeout} s; they keep running"
        )
    return next(h for h in handles if h.done)


@verb
def rlm_cancel(h: Handle, *, rt: Runtime) -> str:
    """Cancel the child and its whole subtree; returns once their exit is confirmed,
    with the final status. For an ask: withdraw it."""
    return check_handle(h, "rlm_cancel").cancel()


@verb
def rlm_send(h: Handle, message: str, *, rt: Runtime) -> None:
    """Send a follow-up instruction; the child sees it before its next model turn."""
    handle = check_handle(h, "rlm_send")
    if not isinstance(handle, ChildHandle):
        raise InvalidArgument("rlm_send needs a child-run handle, not a task")
    handle.send(message)


@verb
def rlm_children(*, rt: Runtime) -> list[ChildHandle]:
    """This run's child handles, newest last."""
    with rt.link.cond:
        ids = list(rt.link.children)
    return [h for i in ids if isinstance(h := rt.handles.get(i), ChildHandle)]

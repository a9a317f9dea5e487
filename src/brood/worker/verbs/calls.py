"""Plain model calls: `llm_query` and `llm_query_batched`."""

from __future__ import annotations

from brood.errors import ModelError, StaleHandle
from brood.worker.repl import ReplayStop
from brood.worker.runtime import Runtime
from brood.worker.verbs.base import check_prompt, check_prompts, verb


@verb
def llm_query(prompt: str, model: str | None = None, *, rt: Runtime) -> str:
    """One plain model call: the model's reply to `prompt`."""
    rt.fits(check_prompt(prompt, "llm_query"), "llm_query")
    return rt.call_model([{"role": "user", "content": prompt}], "llm_query", model)


@verb
def llm_query_batched(prompts: list[str], model: str | None = None, *, rt: Runtime) -> list[str]:
    """Concurrent plain model calls; replies in the order of `prompts`, same length. If
    some fail, raises ModelError once all have ended, with .failed (their indices) and
    .answers (every reply, None where one failed): no reply is lost."""
    prompts = check_prompts(prompts, "llm_query_batched")
    for i, p in enumerate(prompts):
        rt.fits(p, f"llm_query_batched[{i}]")

    with rt.clock.paused():  # every call ends before the batch says how it went
        results = rt.call_models(prompts, model)
    failed = [i for i, (_, exc) in enumerate(results) if exc is not None]
    if not failed:
        return [reply for reply, _ in results]  # type: ignore[misc]
    if isinstance(results[failed[0]][1], ReplayStop | StaleHandle):
        raise results[failed[0]][1]  # type: ignore[misc]
    reasons = "; ".join(f"#{i} {results[i][1]}" for i in failed[:5])
    err = ModelError(
        f"{len(failed)} of {len(prompts)} calls failed: {reasons}; e.answers holds every "
        "reply (None where failed), e.failed the indices"
    )
    err.failed = failed  # type: ignore[attr-defined]
    err.answers = [reply for reply, _ in results]  # type: ignore[attr-defined]
    raise err

"""Asks to a person: `ask_person`, and pi-rlm's form of it, `ask_user_question`. An open
ask is an `AskHandle`, which the child verbs (rlm_status, rlm_wait, rlm_cancel, ...) take."""

from __future__ import annotations

import math
from typing import Any

from brood.errors import InvalidArgument
from brood.lifecycle import AskState
from brood.protocol import AskOption, AskReq, AskUpdate
from brood.worker.handles import AskHandle, collect
from brood.worker.runtime import Runtime
from brood.worker.verbs.base import verb


def open_ask(
    rt: Runtime, question: object, options: object, deadline: object, default: object
) -> AskHandle:
    """Open one ask (a request to the supervisor); its handle."""
    rt.check_open()
    if not isinstance(question, str) or not question.strip():
        raise InvalidArgument("ask_person(question): the question must be non-empty text")
    if deadline is not None and not (
        isinstance(deadline, int | float)
        and not isinstance(deadline, bool)
        and math.isfinite(deadline)
        and deadline > 0
    ):
        raise InvalidArgument(
            f"ask_person(deadline=...) is seconds from now, a number > 0, or None for "
            f"none; got {deadline!r}"
        )
    if default is not None and (not isinstance(default, str) or not default.strip()):
        raise InvalidArgument(f"ask_person(default=...) is an option id or text, got {default!r}")
    ask_id: str = rt.link.request(
        AskReq(
            req_id=rt.link.next_id(),
            question=question,
            options=_ask_options(options),
            deadline=None if deadline is None else float(deadline),
            default=default,
            step=rt.step,
            replaying=rt.replaying,
        )
    )
    with rt.link.cond:  # an update may have come first (a replayed, answered ask)
        rt.link.asks.setdefault(ask_id, AskUpdate(ask_id, AskState.OPEN))
    return AskHandle(rt, ask_id, question)


@verb
def ask_person(
    question: str,
    *,
    options: list[Any] | None = None,
    deadline: float | None = None,
    default: str | None = None,
    blocking: bool = True,
    rt: Runtime,
) -> Any:
    """Ask a person. `options`: strings or {"id", "label"}; `deadline`: seconds from
    now; `default`: an option id or text, applied when the deadline passes. Blocking,
    returns {"answer": {"type": "choice"|"text", "id", "label", "text"}, "summary",
    "resolved_by"} (raises AskCancelled if it ends unanswered); else an AskHandle that
    rlm_status / rlm_result / rlm_wait* / rlm_cancel (withdraw) take."""
    h = open_ask(rt, question, options, deadline, default)
    return h.wait() if blocking else h


@verb
def ask_user_question(questions: list[dict[str, Any]], *, rt: Runtime) -> list[dict[str, Any]]:
    """pi-rlm's form: several questions ({"question", "options"?, "deadline"?,
    "default"?}) asked at once; blocks until all are answered; results in order."""
    if not isinstance(questions, list | tuple) or not all(isinstance(q, dict) for q in questions):
        raise InvalidArgument("ask_user_question(questions) takes a list of dicts")
    handles = []
    for i, q in enumerate(questions):
        unknown = set(q) - {"question", "options", "deadline", "default"}
        if unknown:
            raise InvalidArgument(
                f"ask_user_question: questions[{i}] has unknown keys {sorted(unknown)}; "
                "use question, options, deadline, default"
            )
        handles.append(
            open_ask(rt, q.get("question"), q.get("options"), q.get("deadline"), q.get("default"))
        )
    return collect(rt, handles, None)


def _ask_options(options: object) -> list[AskOption]:
    """ask_person's options: strings (each its own id and label) or {"id", "label"}."""
    if options is None:
        return []
    if isinstance(options, str) or not isinstance(options, list | tuple):
        raise InvalidArgument(
            f"ask_person(options=...) is a list of strings or {{'id', 'label'}} dicts, got "
            f"{type(options).__name__}"
        )
    out = []
    for i, o in enumerate(options):
        if isinstance(o, str) and o.strip():
            out.append(AskOption(o, o))
        elif (
            isinstance(o, dict)
            and isinstance(o.get("id"), str)
            and o["id"].strip()
            and isinstance(o.get("label", o.get("id")), str)
        ):
            out.append(AskOption(o["id"], o.get("label") or o["id"]))
        else:
            raise InvalidArgument(
                f"ask_person(options=...)[{i}] must be non-empty text or {{'id': ..., "
                f"'label': ...}}, got {o!r}"
            )
    ids = [o.id for o in out]
    if len(set(ids)) != len(ids):
        raise InvalidArgument(f"ask_person(options=...): option ids must differ, got {ids}")
    return out

"""Compaction of a run's history (Limits.compact_at), decided and built here; the agent loop
makes the one model call it takes.

Before a model turn, the history as the model last saw it (its last turn's messages and its
reply) is measured as `protocol.history_size` says: the prompt tokens the model reported for
that turn, else characters. Past Limits.compact_at, one "compact" model call asks the model
for a summary of the conversation so far (`summary_request`), and the run goes on from
`compacted`: its system prompt, its task (kept whole), the summary as its own reply, and a
user message that says compaction happened and how to re-read the REPL's variables, followed
by the newest output (which the summary call did not see). The supervisor checks that shape:
it answered the summary, so it knows it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from brood.protocol import COMPACT_PROMPT, history_size

# A compaction folds at least this many replies into its summary: right after one (whose
# conversation holds the summary alone) the run takes a turn before it may compact again.
MIN_REPLIES = 2

NOTICE = (
    "[brood] This conversation was compacted: it had reached {size:,} {unit}, past "
    "Limits.compact_at={limit:,}, so your {turns} turns so far were replaced by the summary "
    "above, which you wrote. Nothing computed is lost: every REPL variable is still there. "
    "SHOW_VARS() lists them; print one to re-read it. The output of your last reply follows."
)


@dataclass(frozen=True)
class Due:
    """A compaction that is due: the history's size, in `unit`, past Limits.compact_at."""

    size: int
    unit: str
    limit: int


def replies_in(messages: list[dict[str, Any]]) -> int:
    """The model's replies in a conversation [system, task, reply, output, ...]."""
    return max(0, (len(messages) - 2) // 2)


def due(messages: list[dict[str, Any]], prompt_tokens: int, compact_at: int | None) -> Due | None:
    """Whether `messages` (ending with the newest output, not yet sent) should be compacted
    before the next turn; `prompt_tokens`: what the model reported for the last turn."""
    if compact_at is None or replies_in(messages) < MIN_REPLIES:
        return None
    size, unit = history_size(prompt_tokens, messages[:-1])
    return Due(size, unit, compact_at) if size > compact_at else None


def summary_request(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The "compact" call's messages: the conversation the model has seen, and the request
    for a summary in place of the newest output."""
    return [*messages[:-1], {"role": "user", "content": COMPACT_PROMPT}]


def compacted(
    messages: list[dict[str, Any]], summary: str, due: Due, turns: int
) -> list[dict[str, Any]]:
    """The history that replaces `messages` once the model wrote `summary` of them, `turns`
    being the turns the run has taken."""
    notice = NOTICE.format(size=due.size, unit=due.unit, limit=due.limit, turns=turns)
    return [
        messages[0],
        messages[1],
        {"role": "assistant", "content": summary},
        {"role": "user", "content": notice + "\n\n" + str(messages[-1]["content"])},
    ]


__all__ = ["MIN_REPLIES", "NOTICE", "Due", "compacted", "due", "replies_in", "summary_request"]

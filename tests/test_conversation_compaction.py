"""A long conversation compacts (Limits.compact_at): a later user turn may begin with the
compaction, the turn after it still uses a variable set before it, and a conversation
rebuilt from the journal replays the summary instead of asking for it again."""

from __future__ import annotations

from typing import Any

import brood
from brood.journal import Journal
from brood.protocol import COMPACT_PROMPT
from tests.util import fast

FENCE = "```"
SUMMARY = "SUMMARY: x is 21 and y is 42."
PADDING = 20_000  # characters of each reply: the system prompt is about 10,000
COMPACT_AT = 45_000  # past after two padded replies, not after one


def repl(code: str) -> str:
    return f"{FENCE}repl\n{code}\n# {'p' * PADDING}\n{FENCE}"


class Chat:
    """Answers each user turn at once (FINAL in its first reply) and keeps what it saw."""

    def __init__(self) -> None:
        self.calls: list[list[dict[str, Any]]] = []

    def __call__(self, messages: list[dict[str, Any]], model: str | None = None) -> str:
        self.calls.append([dict(m) for m in messages])
        last = str(messages[-1]["content"])
        if last == COMPACT_PROMPT:
            return SUMMARY
        if "set x" in last:
            return repl("x = 21\nFINAL('x is set')")
        if "double x" in last:
            return repl("y = x * 2\nFINAL(f'y is {y}')")
        if "add them" in last:
            return repl("FINAL(f'sum is {x + y}')")
        return repl(f"FINAL('unexpected: ' + {last[:60]!r})")

    @property
    def summaries(self) -> int:
        return sum(c[-1]["content"] == COMPACT_PROMPT for c in self.calls)


def test_a_later_user_turn_compacts_first_and_still_uses_earlier_variables(tmp_path):
    url = f"sqlite:///{tmp_path}/j.db"
    chat = Chat()
    with brood.Supervisor(chat, store=url, limits=fast(compact_at=COMPACT_AT)) as sup:
        conv = sup.conversation()
        answers = [conv.send(p).answer for p in ("please set x", "now double x", "add them")]
        assert chat.summaries == 1
        # The third turn began with the compaction: system, task, summary, notice + prompt.
        after = chat.calls[-1]
        assert [m["role"] for m in after] == ["system", "user", "assistant", "user"]
        assert after[1]["content"].startswith("please set x")
        assert after[2]["content"] == SUMMARY
        assert after[3]["content"].endswith("add them")
        # Suspended, then rebuilt from the journal: the summary is replayed, not asked.
        assert conv.suspend() is True
        fourth = conv.send("double x")
        assert chat.summaries == 1
        conv.close()
    assert answers == ["x is set", "y is 42", "sum is 63"]
    assert (fourth.state, fourth.answer) == ("completed", "y is 42")
    # The fourth turn continued the compacted history, not the one before it.
    last = chat.calls[-1]
    assert [m["role"] for m in last] == ["system"] + ["user", "assistant"] * 2 + ["user"]
    assert last[2]["content"] == SUMMARY and last[-1]["content"] == "double x"
    with Journal(url) as journal:
        (example,) = journal.export(conv.id, "openai-chat")
        compacted = journal.store.events(conv.id, "compacted")
    assert len(compacted) == 1
    assert example["messages"][:-1] == last  # what the model last saw, then its reply

"""What a worker's frames must hold to, checked on receipt (DESIGN.md section 14).

A worker enforces brood's limits for its model's convenience; the supervisor enforces them
again here, on what it receives, because model code can write any frame on the worker's
channel. Each check reads a frame and what the supervisor itself knows of the run (the
replies it gave, the steps it saw begin), never what the worker says of itself. A frame
that a worker keeping the protocol never sends raises `Violation`, and the core ends the
run with `protocol violation: ...`. Refusals a well-behaved run can meet too (a model that
is not allowed, too many asks) are answered as errors in the REPL instead, by the core.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from brood.limits import Limits
from brood.protocol import (
    COMPACT_PROMPT,
    SYSTEM_PROMPT_CAP,
    ModelReq,
    Replay,
    StepBegan,
    StepDone,
    clip,
    history_size,
    step_capture,
)

# Requests of one run being answered at once. A worker makes at most 16 batched calls at
# once (worker.runtime.BATCH_WINDOW) plus one per thread of its spawned work (16) and its
# main thread's; more is a flood, each holding its frame in memory.
MAX_REQUESTS_IN_FLIGHT = 256
PRODUCTS_DEPTH = 64  # nesting of a FINAL's products (JSON arrays and objects)
# Room past a step's capture for the notes a worker adds to what it keeps (what was dropped,
# a limit's hint): a step cut to the capture here is one no worker sent.
NOTE_ROOM = 10_000
# A compaction folds at least this many replies (the worker's compaction.MIN_REPLIES): one
# right after another, with nothing new to fold, is refused.
MIN_COMPACT_REPLIES = 2


class Violation(Exception):
    """A frame no worker that keeps the protocol sends; the message says what is wrong."""


@dataclass
class Steps:
    """A run's REPL steps as the supervisor saw them: numbered from 1, one at a time, each
    begun before it ends. The first `replayed` steps of a resumed run replay its journal."""

    last: int = 0
    open: bool = False
    replayed: int = 0

    @property
    def replaying(self) -> bool:
        """Whether the worker is still rebuilding the REPL from the journal's steps."""
        return self.replayed > 0 and self.last <= self.replayed

    def begin(self, msg: StepBegan) -> None:
        if self.open:
            raise Violation(f"step {msg.step} began while step {self.last} had not ended")
        if msg.step != self.last + 1:
            raise Violation(f"step {msg.step} began after step {self.last}; steps go in order")
        if msg.replaying != (msg.step <= self.replayed):
            raise Violation(
                f"step {msg.step} said replaying={msg.replaying}, but the journal holds "
                f"{self.replayed} steps of this run"
            )
        self.last, self.open = msg.step, True

    def end(self, msg: StepDone) -> None:
        if not self.open or msg.step != self.last:
            under_way = f"step {self.last} is under way" if self.open else "no step is under way"
            raise Violation(f"step {msg.step} ended, but {under_way}")
        if msg.replayed != (msg.step <= self.replayed):
            raise Violation(
                f"step {msg.step} said replayed={msg.replayed}, but the journal holds "
                f"{self.replayed} steps of this run"
            )
        self.open = False


@dataclass
class Conversation:
    """A run's model turns as the supervisor answered them. A turn's request must be that
    conversation (the replies the gateway gave, each user message as long as it was) plus
    one new user message within its cap, so model code cannot grow, reorder or forge it.

    A compaction (Limits.compact_at) is a "compact" call: that conversation plus brood's
    COMPACT_PROMPT, asked only when the history passes the limit by the supervisor's own
    measure. Its reply, the summary, then stands for every reply so far: the next turn is
    the system prompt, the task, the summary and one new user message.

    A resumed run's worker replays journaled turns (and compactions) without asking:
    `resumed` starts the conversation where they left it, and the sizes of its user
    messages are learnt (within their caps) at its first live turn.

    A conversation root (Supervisor.conversation) is handed each later user message by
    the supervisor (`user_turn`, after a number of answered turns): that message has the
    cap of the prompt it holds, and Limits.max_iterations counts the model turns since it."""

    replies: list[str] = field(default_factory=list)
    user_sizes: list[int] = field(default_factory=list)
    open: bool = False
    turns: int = 0  # turns answered, compactions or not
    prompt_tokens: int = 0  # the last turn's, as its model reported them (0: not reported)
    compacting: tuple[int, str] | None = None  # the history's size at the compaction asked
    folded_at: int | None = None  # turns answered before the last compaction
    caps: dict[int, int] = field(default_factory=dict)  # handed after N turns -> its cap
    base: int = 0  # turns answered before the user turn under way (a conversation's)

    def __post_init__(self) -> None:
        self.turns = max(self.turns, len(self.replies))

    @classmethod
    def resumed(cls, replay: Replay) -> Conversation:
        """The conversation a resumed run's worker has rebuilt once it replayed `replay`."""
        replies: list[str] = []
        for n, reply in enumerate([*replay.turns, None]):
            if n in replay.compactions:
                replies = [replay.compactions[n]]
            if reply is not None:
                replies.append(reply)
        tokens = replay.turn_tokens[-1] if replay.turn_tokens else 0
        folded = max(replay.compactions, default=None)
        return cls(replies=replies, turns=len(replay.turns), prompt_tokens=tokens, folded_at=folded)

    def user_turn(self, at: int, cap: int) -> None:
        """A conversation's user turn is handed after `at` answered turns: its message
        holds a prompt the supervisor handed, within `cap`."""
        self.caps[at] = cap
        self.base = at

    def _cap_of(self, k: int, *, first_cap: int, cap: int) -> int:
        """The cap of user message `k` of the conversation as it stands: a handed turn's
        own, else the task's (k = 0) or the others'. After a compaction, message 0 is still
        the task and message k > 0 came after `folded_at` + k - 1 answered turns."""
        handed_after = k if self.folded_at is None or k == 0 else self.folded_at + k - 1
        return self.caps.get(handed_after, first_cap if k == 0 else cap)

    def check(self, msg: ModelReq, *, max_iterations: int, first_cap: int, cap: int) -> None:
        """Refuse a turn request that is not this conversation's next one."""
        turn = self.turns + 1
        label = f"model turn {turn}"
        if self.open:
            busy = "the compaction" if self.compacting else f"turn {turn - 1}"
            raise Violation(f"{label} was asked while {busy} was under way")
        if turn - self.base > max_iterations + 1:
            raise Violation(
                f"{label} is past Limits.max_iterations={max_iterations} (and the "
                "one turn that asks for the answer)"
            )
        self.user_sizes = self._sizes(msg, label, first_cap=first_cap, cap=cap)
        self.open = True

    def check_compact(
        self, msg: ModelReq, *, compact_at: int | None, first_cap: int, cap: int
    ) -> None:
        """Refuse a compaction that is not this conversation's, or not due."""
        label = f"the compaction after model turn {self.turns}"
        if self.open:
            raise Violation(f"{label} was asked while a call of its conversation was under way")
        if compact_at is None:
            raise Violation(f"{label} was asked, but Limits.compact_at is None")
        if len(self.replies) < MIN_COMPACT_REPLIES:
            raise Violation(
                f"{label}: its conversation holds {len(self.replies)} replies; a compaction "
                f"folds at least {MIN_COMPACT_REPLIES}"
            )
        sizes = self._sizes(msg, label, first_cap=first_cap, cap=cap)
        if msg.messages[-1]["content"] != COMPACT_PROMPT:
            raise Violation(f"{label}: its last message is not brood's request for a summary")
        size, unit = history_size(self.prompt_tokens, msg.messages[:-1])
        if size <= compact_at:
            raise Violation(
                f"{label}: the history has {size:,} {unit}, not past "
                f"Limits.compact_at={compact_at:,}"
            )
        self.user_sizes = sizes[:-1]  # the last is the request, not the conversation's
        self.compacting = (size, unit)
        self.open = True

    def _sizes(self, msg: ModelReq, label: str, *, first_cap: int, cap: int) -> list[int]:
        """The sizes of the user messages of `msg`, a request that must be this
        conversation plus one new user message within its cap."""
        messages = msg.messages
        expected = 2 * len(self.replies)
        if msg.new_from != expected or len(messages) != expected + 2:
            raise Violation(
                f"{label} sent {len(messages)} messages (new from {msg.new_from}); "
                f"this run's conversation has {expected} and a call adds one user message"
            )
        for i, m in enumerate(messages):
            if m.keys() != {"role", "content"}:
                raise Violation(f"{label}: message {i} has keys {sorted(m)[:5]}")
            role = "system" if i == 0 else ("user" if i % 2 else "assistant")
            if m["role"] != role:
                raise Violation(f"{label}: message {i} is {m['role']!r}, not {role!r}")
        system = messages[0]["content"]
        if len(system) > SYSTEM_PROMPT_CAP:
            raise Violation(
                f"{label}: a system prompt of {len(system):,} characters, over the "
                f"{SYSTEM_PROMPT_CAP:,} of brood's own"
            )
        for k, reply in enumerate(self.replies):
            if messages[2 + 2 * k]["content"] != reply:
                raise Violation(f"{label}: reply {k + 1} is not the one the model gave")
        known = len(self.user_sizes)
        for k in range(len(self.replies) + 1):
            size = len(messages[1 + 2 * k]["content"])
            if k < known and size != self.user_sizes[k]:
                raise Violation(
                    f"{label}: user message {k + 1} has {size:,} characters, it was "
                    f"sent with {self.user_sizes[k]:,}"
                )
            bound = self._cap_of(k, first_cap=first_cap, cap=cap)
            if k >= known and size > bound:
                raise Violation(
                    f"{label}: a message of {size:,} characters, over "
                    f"Limits.max_prompt_chars={cap:,}"
                    + (" (with the run's task and first messages)" if k == 0 else "")
                )
        return [len(messages[1 + 2 * k]["content"]) for k in range(len(self.replies) + 1)]

    def answered(self, reply: str | None, prompt_tokens: int = 0) -> None:
        """The turn under way ended: with the model's `reply` (its prompt having been
        `prompt_tokens`, as the model reported them), or None when it failed."""
        self.open = False
        if reply is not None:
            self.replies.append(reply)
            self.turns += 1
            self.prompt_tokens = prompt_tokens

    def compacted(self, summary: str | None) -> None:
        """The compaction under way ended: with the model's `summary`, which stands for
        every reply so far from now on, or None when it failed."""
        self.open = False
        self.compacting = None
        if summary is not None:
            self.replies = [summary]
            self.user_sizes = self.user_sizes[:1]  # the task's message stays
            self.folded_at = self.turns


def check_call(msg: ModelReq, limits: Limits) -> None:
    """A plain call (`llm_query`): one user message within Limits.max_prompt_chars."""
    messages = msg.messages
    if msg.new_from != 0 or len(messages) != 1 or messages[0].keys() != {"role", "content"}:
        raise Violation("a plain model call carries exactly one message, its prompt")
    if messages[0]["role"] != "user":
        raise Violation(f"a plain model call's message is {messages[0]['role']!r}, not 'user'")
    size = len(messages[0]["content"])
    if size > limits.max_prompt_chars:
        raise Violation(
            f"a plain model call of {size:,} characters, over "
            f"Limits.max_prompt_chars={limits.max_prompt_chars:,}"
        )


def check_prompts(prompts: list[str], limits: Limits) -> None:
    for p in prompts:
        if len(p) > limits.max_prompt_chars:
            raise Violation(
                f"a child's prompt of {len(p):,} characters, over "
                f"Limits.max_prompt_chars={limits.max_prompt_chars:,}"
            )


def checked_products(products: dict[str, Any] | None, cap: int) -> dict[str, Any] | None:
    """A FINAL's products if they are a JSON object of at most `cap` characters' worth."""
    if products is None:
        return None
    size = _json_size(products, PRODUCTS_DEPTH)
    if size > cap:
        raise Violation(f"FINAL products of {size:,} characters, over Limits.answer_limit={cap:,}")
    return products


def _json_size(value: Any, depth: int) -> int:
    """How many characters `value` takes as `json.dumps` writes it, at least (what the worker
    measured against the cap; escapes only add); Violation if it is not JSON (bytes, a NaN,
    an int JSON readers lose, keys that are not str) or nests deeper than `depth`."""
    if isinstance(value, str):
        return len(value) + 2
    if value is None or isinstance(value, bool):
        return 4
    if isinstance(value, int):
        if abs(value) > 2**53:
            raise Violation(f"FINAL products hold the integer {value}, past what JSON keeps exact")
        return len(str(value))
    if isinstance(value, float):
        if not math.isfinite(value):
            raise Violation(f"FINAL products hold {value!r}, which JSON has no value for")
        return len(repr(value))
    if depth <= 0:
        raise Violation(f"FINAL products nest deeper than {PRODUCTS_DEPTH} levels")
    if isinstance(value, list):
        return 2 * max(1, len(value)) + sum(_json_size(v, depth - 1) for v in value)
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise Violation("FINAL products hold an object whose keys are not all str")
        items = sum(len(k) + 4 + _json_size(v, depth - 1) for k, v in value.items())
        return 2 * max(1, len(value)) + items
    raise Violation(f"FINAL products hold a {type(value).__name__}, which is not JSON")


def output_cap(output_limit: int) -> int:
    """Characters of a step's output (or code) taken from a worker: what it keeps of one
    step for Limits.output_limit, with room for its notes."""
    return step_capture(output_limit) + NOTE_ROOM


def clipped_step(msg: StepDone, cap: int) -> StepDone:
    """A step's code and output, at most `cap` characters each (`output_cap`); a part cut
    here gets a note saying so."""
    code, stdout, stderr = (clip(t, cap) for t in (msg.code, msg.stdout, msg.stderr))
    error = None if msg.error is None else clip(msg.error, cap)
    if (code, stdout, stderr, error) == (msg.code, msg.stdout, msg.stderr, msg.error):
        return msg
    return StepDone(msg.step, code, stdout, stderr, error, msg.duration, msg.pending[:1000])


def weight(value: Any) -> int:
    """About how many bytes `value` adds to the journal: its strings and bytes, and a little
    for everything else (what Limits.journal_bytes_per_run counts)."""
    if isinstance(value, str | bytes):
        return len(value)
    if isinstance(value, dict):
        total = 0
        for k, v in value.items():
            # Strings inline: a model call's messages are dicts of strings, weighed per call.
            total += len(k) if type(k) is str else weight(k)
            total += len(v) if type(v) is str else weight(v)
        return total
    if isinstance(value, list | tuple):
        return sum([weight(v) for v in value]) + 2
    return 8

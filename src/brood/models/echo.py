"""`echo`: a model for trying brood with no model server.

Its replies are real REPL code, which brood runs in confined workers like any model's:

- a root with a `context` looks at it (its type, its size, its first lines), splits it into
  chunks, starts one child run per chunk without waiting, counts the whole context itself
  meanwhile, collects the children's counts and answers with a summary it computed;
- a child given a chunk (its task says so) counts the chunk's lines, words and characters
  in code and answers with them as JSON;
- a run with no context looks at its task (its length, its words, one `llm_query`) and
  answers with those figures as a JSON object, which every output of a flow state binds;
- a task that begins with "Ask" asks a person (`ask_person`, yes or no, with a deadline
  and the default "no"), then answers with what the person said;
- a plain call (`llm_query`) is answered with the prompt's first line and its size.

Deterministic: a reply depends only on the messages, so the same task and context give the
same replies, code and output in the journal (run ids and times aside). Tokens are
reported as characters / 4, so budgets and usage read as they would with a real model.
"""

from __future__ import annotations

import re

from brood.errors import InvalidArgument
from brood.models.base import Completion, Messages, Model

DEFAULT_CHUNKS = 4  # a root's context is split into at most this many chunks (echo:N)
MAX_CHUNKS = 64  # Limits.max_children_per_run's default: one run may start this many
ASK_DEADLINE_S = 120  # a try-out ask waits this long for a person, then takes its default
SHOWN_LINES = 3  # lines of the context a root prints before splitting it
CHARS_PER_TOKEN = 4  # what echo reports as usage, a common rule of thumb for English

# The task of a child the echo root starts; a run whose task holds it counts its chunk.
CHUNK_TASK = "Count the lines, words and characters of chunk"
_CHUNK = re.compile(re.escape(CHUNK_TASK) + r" (\d+) of (\d+)")
# What brood's worker writes, which echo reads as a model would (worker/prompt.py,
# worker/agent.py); the tests run every path against the real worker.
_REPL_PROMPT = "persistent REPL"
_CONTEXT_LINE = re.compile(
    r"\n\n(There is no context: `context` is None\.|`context` is (?:a|an) [^\n]*)(?:\n|$)"
)
_NO_CONTEXT = "There is no context"
_ANSWER_NOW = "Answer now: reply with one ```repl block"
_ASK = re.compile(r"\A\s*ask\b[\s:,.-]*", re.IGNORECASE)
# A step's error as its output shows it: `NameError: …`, `brood.errors.ChildFailed: …`.
_ERROR = re.compile(
    r"^(?:[a-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Failed|Timeout|Exceeded|Cancelled|"
    r"NotReady|Diverged|Interrupt|Exit)\b.*$",
    re.MULTILINE,
)


class EchoModel(Model):
    """The `echo` model spec: replies that explore the run's context with real code.

    `chunks` (1..64) bounds how many chunks, and so child runs, a root splits its context
    into (fewer when the context has fewer lines or items, or the tree's limits leave
    fewer children).
    """

    name = "echo"
    instant = True  # its replies are computed from the messages alone: no I/O, no lock

    def __init__(self, chunks: int = DEFAULT_CHUNKS) -> None:
        if isinstance(chunks, bool) or not isinstance(chunks, int) or not 1 <= chunks <= MAX_CHUNKS:
            raise InvalidArgument(
                f"EchoModel(chunks=...) must be an int from 1 to {MAX_CHUNKS}, got {chunks!r}"
            )
        self.chunks = chunks

    def complete(self, messages: Messages, model: str | None = None) -> Completion:
        text = self.reply(messages)
        sent = sum(len(str(m.get("content", ""))) for m in messages)
        return Completion(
            text,
            input_tokens=sent // CHARS_PER_TOKEN,
            output_tokens=len(text) // CHARS_PER_TOKEN,
        )

    def reply(self, messages: Messages) -> str:
        """The reply to `messages`: a function of them alone."""
        system = next(
            (str(m.get("content", "")) for m in messages if m.get("role") == "system"), ""
        )
        users = [str(m.get("content", "")) for m in messages if m.get("role") == "user"]
        if _REPL_PROMPT not in system or not users:
            return plain_reply(users[-1] if users else "")
        turn = sum(1 for m in messages if m.get("role") == "assistant")
        last = users[-1]
        # The output it prints never starts a line with an error's name (an item's lines are
        # joined, values are shown by repr): such a line is the step's error.
        if turn and _ERROR.search(last):
            return _stopped(turn, last)
        task, has_context = _read_task(users[0])
        if m := _CHUNK.search(task):
            stages = _chunk_stages(int(m.group(1)))
        elif _ASK.match(task):
            stages = _ask_stages(_ASK.sub("", task, count=1).strip() or task.strip())
        elif has_context:
            stages = _context_stages(self.chunks)
        else:
            stages = _task_stages(task)
        if _ANSWER_NOW in last and turn < len(stages):  # the last turn: everything left, at once
            words = " ".join(s[0] for s in stages[turn:])
            return _reply(words, "\n\n".join(s[1] for s in stages[turn:]))
        if turn >= len(stages):
            return _reply("I have nothing left to do.", "FINAL('echo: no steps were left')")
        return _reply(*stages[turn])


def plain_reply(prompt: str) -> str:
    """What `llm_query(prompt)` gets from echo: the prompt's first line and its size."""
    first = prompt.strip().splitlines()[0] if prompt.strip() else ""
    if len(first) > 80:
        first = first[:79] + "…"
    return f"echo: {first!r} ({len(prompt):,} characters, {len(prompt.split()):,} words)"


def from_spec(rest: str) -> EchoModel:
    """The model an `echo` spec names: `echo`, or `echo:N` for at most N chunks."""
    if not rest:
        return EchoModel()
    if not rest.isdigit() or not 1 <= int(rest) <= MAX_CHUNKS:
        raise InvalidArgument(
            f"model spec 'echo:{rest}': the number of chunks must be a whole number from 1 "
            f"to {MAX_CHUNKS}; write echo or echo:N"
        )
    return EchoModel(int(rest))


def _read_task(first: str) -> tuple[str, bool]:
    """A run's task, and whether it has a context, from its first user message (the task,
    a blank line, what `context` is, then any messages from its parent)."""
    found = _CONTEXT_LINE.search(first)
    if found is None:
        return first, False
    return first[: found.start()], not found.group(1).startswith(_NO_CONTEXT)


def _reply(words: str, code: str) -> str:
    return f"{words}\n```repl\n{code.strip()}\n```"


def _stopped(turn: int, feedback: str) -> str:
    """A step failed: echo does not guess, it answers with the error it saw (the last
    line that names one)."""
    said = _ERROR.findall(feedback)[-1]
    message = f"echo stopped: its last step (turn {turn}) raised {said[:300]}"
    return _reply("My last step failed, so I stop and say why.", f"FINAL({message!r})")


# ---- the code of each path, stage by stage: (what the model says, the code) ---------------
Stage = tuple[str, str]

_PIECES = '''
import json


def pieces_of(value):
    """The context as lines of text: a str's lines, a list's items, a dict's items."""
    if value is None:
        return []
    if isinstance(value, str):
        return value.splitlines()
    if isinstance(value, dict):
        return [f"{k}: {v if isinstance(v, str) else json.dumps(v, default=str)}"
                for k, v in value.items()]
    if isinstance(value, (list, tuple)):
        return [v if isinstance(v, str) else json.dumps(v, default=str) for v in value]
    return str(value).splitlines()


def counts_of(value):
    text = "\\n".join(pieces_of(value))
    return {"lines": len(text.splitlines()), "words": len(text.split()), "chars": len(text)}


def many(n, word):
    return f"{n:,} {word}{'' if n == 1 else 's'}"
'''

_LOOK = (
    _PIECES
    + """

pieces = pieces_of(context)
kind = type(context).__name__
unit = "lines" if isinstance(context, str) else "items"
if isinstance(context, str):
    size = f"{many(len(context), 'character')} in {many(len(pieces), 'line')}"
elif isinstance(context, dict):
    size = many(len(context), "key")
elif isinstance(context, (list, tuple)):
    size = many(len(context), "item")
else:
    size = many(len(pieces), "line") + " of text"
print(f"context: a {kind} of {size}")
for number, piece in enumerate(pieces[:@SHOWN@], 1):
    print(f"{number:>4}| {' '.join(piece[:100].splitlines())}")  # one line each
if len(pieces) > @SHOWN@:
    print(f"    ... and {len(pieces) - @SHOWN@:,} more")
if not pieces:
    FINAL(f"the context is an empty {kind}: nothing to count")

# One child per chunk, as many as this run may start (none at the deepest level).
left = budget_remaining()
room = (min(left["children_left_for_this_run"], left["children_left"])
        if left["depth"] + 1 < left["max_depth"] else 0)
n = min(@CHUNKS@, len(pieces), room or @CHUNKS@)
by_children = room > 0
step, extra = divmod(len(pieces), n)
bounds = []
for i in range(n):
    start = bounds[-1][1] if bounds else 0
    bounds.append((start, start + step + (1 if i < extra else 0)))


def chunk_of(a, b):
    if isinstance(context, (list, tuple)):
        return list(context[a:b])
    if isinstance(context, dict):
        return dict(list(context.items())[a:b])
    return "\\n".join(pieces[a:b])


chunks = [chunk_of(a, b) for a, b in bounds]
how = "one child run each" if by_children else "counted here: this run may start no child runs"
print(f"split into {many(n, 'chunk')} of {', '.join(str(b - a) for a, b in bounds)} {unit}; "
      f"{how}")
"""
)

_FAN_OUT = """
task = "@CHUNK_TASK@"
if by_children:
    handles = [rlm_spawn(f"{task} {i} of {n} in `context`.", context=chunk)
               for i, chunk in enumerate(chunks, 1)]
    print(f"started {len(handles)} child runs")
mine = counts_of(context)  # my own work while they count
print(f"my own count of the whole: {many(mine['lines'], 'line')}, "
      f"{many(mine['words'], 'word')}, {many(mine['chars'], 'character')}")
if by_children:
    answers = rlm_wait_all(handles)
else:
    answers = [json.dumps({"chunk": i, **counts_of(c)}) for i, c in enumerate(chunks, 1)]
for answer in answers:
    print(answer)
"""

_SUMMARY = """
counts = [json.loads(a) for a in answers]
total = {k: sum(c[k] for c in counts) for k in ("lines", "words", "chars")}
check = "agrees with" if total["words"] == mine["words"] else "differs from"
per_chunk = "; ".join(
    f"{c['chunk']}: {many(c['lines'], 'line')}, {many(c['words'], 'word')}, "
    f"{many(c['chars'], 'char')}"
    for c in counts
)
FINAL(
    f"a {kind} of {size}, in {many(len(counts), 'chunk')}: {many(total['lines'], 'line')}, "
    f"{many(total['words'], 'word')}, {many(total['chars'], 'character')} (the word count "
    f"{check} my own count of the whole). Per chunk: {per_chunk}",
    products={"chunks": counts, "total": total, "whole": mine},
)
"""

_COUNT_CHUNK = (
    _PIECES
    + """

counts = {"chunk": @INDEX@, **counts_of(context)}
first = pieces_of(context)[:1]
print(f"chunk @INDEX@ begins: {first[0][:100]!r}" if first else "chunk @INDEX@ is empty")
FINAL(json.dumps(counts))
"""
)

_LOOK_AT_TASK = """
import json

task = @TASK@
words = task.split()
facts = {
    "task": (task.strip().splitlines() or [""])[0][:200],
    "chars": len(task),
    "words": len(words),
    "lines": len(task.splitlines()),
    "longest_word": max(words, key=len) if words else "",
}
print(facts)
facts["llm_query"] = llm_query(task) if words else ""
print(facts["llm_query"])
"""

_ASK_PERSON = """
question = @QUESTION@
reply = ask_person(question, options=["yes", "no"], deadline=@DEADLINE@, default="no")
print(reply)
"""

_TELL = """
said = reply["answer"].get("label") or reply["answer"].get("text")
if reply["resolved_by"] == "deadline":
    FINAL(f"nobody answered {question!r} within @DEADLINE@ s; the default applies: {said}")
FINAL(f"{reply['resolved_by']} answered {question!r}: {said}")
"""


def _fill(code: str, **values: object) -> str:
    for key, value in values.items():
        code = code.replace(f"@{key}@", str(value))
    return code


def _context_stages(chunks: int) -> list[Stage]:
    look = _fill(_LOOK, SHOWN=SHOWN_LINES, CHUNKS=chunks)
    return [
        ("I look at `context` first: its type, its size and its first lines.", look),
        (
            "I start one child per chunk without waiting, and count the whole myself meanwhile.",
            _fill(_FAN_OUT, CHUNK_TASK=CHUNK_TASK),
        ),
        ("I add up the children's counts and answer.", _SUMMARY),
    ]


def _chunk_stages(index: int) -> list[Stage]:
    return [("I count my chunk and answer.", _fill(_COUNT_CHUNK, INDEX=index))]


def _task_stages(task: str) -> list[Stage]:
    return [
        (
            "There is no context, so I look at the task itself.",
            _fill(_LOOK_AT_TASK, TASK=repr(task)),
        ),
        ("I answer with what I found.", "FINAL(json.dumps(facts))"),
    ]


def _ask_stages(question: str) -> list[Stage]:
    return [
        (
            "The task asks a person, so I ask, with a deadline and a default.",
            _fill(_ASK_PERSON, QUESTION=repr(question), DEADLINE=ASK_DEADLINE_S),
        ),
        ("I answer with what the person said.", _fill(_TELL, DEADLINE=ASK_DEADLINE_S)),
    ]


__all__ = ["CHUNK_TASK", "EchoModel", "from_spec", "plain_reply"]

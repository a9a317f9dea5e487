"""The agent loop: model reply -> every repl block in order -> output back -> until FINAL."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from brood.errors import BroodError
from brood.lifecycle import TERMINAL_VALUES
from brood.protocol import (
    FAILURE_TEXT_CAP,
    Failed,
    Final,
    StepBegan,
    StepDone,
    StepResult,
    WorkerLimits,
    clip,
    history_size,
    step_capture,
)
from brood.worker import compaction
from brood.worker.repl import Repl, StepOutput, truncate
from brood.worker.runtime import Runtime

OPEN_FENCE = re.compile(r"^\s*```\s*(repl|python|py)\s*$")
ANY_FENCE = re.compile(r"^\s*```")
NO_CODE = (
    "Your reply had no ```repl block, so nothing ran. Write code in a ```repl fence, "
    "or call FINAL(answer) inside one to finish."
)
ANSWER_NOW = (
    "You have used all {n} iterations. Answer now: reply with one ```repl block that calls "
    "FINAL(answer) with your best answer."
)


# A step error that a worker limit causes, and the limit to name: (error prefix, field, unit).
LIMIT_ERRORS = (
    ("MemoryError", "worker_memory", "bytes of address space"),
    ("OSError: [Errno 27]", "worker_file_size", "bytes per file"),  # EFBIG
    ("OSError: [Errno 24]", "worker_open_files", "open files"),  # EMFILE
    ("OSError: [Errno 28]", "worker_disk", "bytes in its scratch directory"),  # ENOSPC
    ("BlockingIOError: [Errno 11]", "worker_processes", "processes and threads of its own"),
)


def limit_hint(error: str, limits: WorkerLimits) -> str | None:
    """A note naming the worker limit a step's error may come from, with its value."""
    for prefix, field, unit in LIMIT_ERRORS:
        value = getattr(limits, field)
        if error.startswith(prefix) and value is not None:
            return (
                f"note: this worker is limited to Limits.{field}={value} {unit}; "
                "do the work in smaller pieces"
            )
    return None


@dataclass
class Blocks:
    code: list[str]
    problem: str | None = None


def extract_blocks(reply: str) -> Blocks:
    """Every ```repl / ```python block of a reply, in order; a problem if a fence is unclosed."""
    blocks: list[str] = []
    current: list[str] | None = None
    other_open = False
    opened_at = 0
    for n, line in enumerate(reply.splitlines(), 1):
        if current is not None:
            if line.strip() == "```":
                blocks.append("\n".join(current))
                current = None
            else:
                current.append(line)
        elif other_open:
            if line.strip() == "```":
                other_open = False
        elif OPEN_FENCE.match(line):
            current, opened_at = [], n
        elif ANY_FENCE.match(line):
            other_open = True
    if current is not None:
        return Blocks(
            blocks,
            f"Your reply opens a ```repl fence on line {opened_at} but never closes it, so that "
            "block did not run. Close every block with a line of ```.",
        )
    return Blocks(blocks)


class Agent:
    """Runs one run's loop in the worker's main thread."""

    def __init__(self, rt: Runtime, repl: Repl) -> None:
        self.rt = rt
        self.repl = repl
        self.limits = rt.limits
        self.history: list[dict[str, Any]] = []  # the model's conversation, grown by turns
        self.answered = 0  # model turns answered in the run, across its user turns

    def run_code(self, code: str, timeout: float | None = None) -> StepOutput:
        """Run one block as a REPL step and journal it; its output, with brood's notes added
        to stderr. `timeout` bounds this step instead of Limits.step_timeout."""
        rt = self.rt
        rt.step += 1
        # The supervisor journals the step's start and starts its own clock of it first.
        rt.link.request(StepBegan(req_id=rt.link.next_id(), step=rt.step, replaying=rt.replaying))
        shown = self.limits.output_limit
        limit = timeout if timeout is not None else self.limits.step_timeout
        capture = step_capture(shown)
        out = self.repl.run(code, limit, capture)
        stderr = out.stderr
        if out.error and (hint := limit_hint(out.error, self.limits)):
            stderr += hint + "\n"
        if self.rt.notes:
            stderr += "".join(n + "\n" for n in self.rt.notes)
            self.rt.notes.clear()
        if not self.rt.replaying:  # a replayed step is in the journal already
            pending = self.rt.pending_calls()
            self.rt.link.send(
                StepDone(self.rt.step, code, out.stdout, stderr, out.error, out.duration, pending)
            )
        else:
            self.rt.link.send(StepDone(self.rt.step, "", "", "", None, 0.0, replayed=True))
        written = out.written + len(stderr) - len(out.stderr)
        return StepOutput(out.stdout, stderr, out.error, out.duration, written)

    def feedback(self, reply: str) -> str:
        blocks = extract_blocks(reply)
        parts: list[str] = []
        limit = self.limits.output_limit
        for i, code in enumerate(blocks.code, 1):
            out = self.run_code(code)
            text = out.stdout + out.stderr
            label = f"block {i} of {len(blocks.code)}" if len(blocks.code) > 1 else "output"
            shown = truncate(text, limit, out.written) if text else "(no output)"
            parts.append(f"[{label}]\n" + shown)
            if self.rt.final is not None:
                break
        if blocks.problem:
            parts.append(blocks.problem)
        elif not blocks.code:
            parts.append(NO_CODE)
        return "\n\n".join(parts)

    def notices(self) -> str:
        """Follow-up messages and settled children since the last turn, one line each."""
        link = self.rt.link
        with link.cond:
            inbox, link.inbox[:] = list(link.inbox), []
            settled = [
                u
                for cid, u in link.children.items()
                if u.state in TERMINAL_VALUES and cid not in self.rt.seen
            ]
        lines = list(inbox)
        for u in settled:
            self.rt.seen.add(u.child_id)
            h = self.rt.handles.get(u.child_id)
            task = f" (task: {h.prompt[:60]!r})" if h else ""
            how = (
                "answered; collect it with rlm_result"
                if u.state == "completed"
                else (f"ended {u.state}: {u.reason or u.error}")
            )
            lines.append(f"[notice] child {u.child_id}{task} {how}")
        return "\n".join(lines)

    def loop(self, first_message: str, system: str, first_cap: int | None = None) -> Final | Failed:
        """The model's turns until FINAL, from a history of the system prompt alone (see
        `turn`); `first_cap` is the cap of the first user message, which holds the task."""
        self.history = self.start_history(system)
        return self.turn(first_message, first_cap)

    def start_history(self, system: str) -> list[dict[str, Any]]:
        """The history a run's model turns begin from: its system prompt."""
        return [{"role": "system", "content": system}]

    def turn(self, message: str, first_cap: int | None = None) -> Final | Failed:
        """One user turn: `message` joins the history (the system prompt and, in a
        conversation, every earlier turn), then the model's turns until FINAL, at most
        Limits.max_iterations of them and one that asks for the answer. Each user message
        is kept within its cap (the supervisor refuses a turn whose message is not):
        `first_cap` for `message` (by default the others'), Limits.max_prompt_chars for the
        others. The history keeps the model's last reply, so a next turn continues it."""
        rt = self.rt
        rt.final, rt.products = None, None
        messages = self.history
        messages.append({"role": "user", "content": message})
        max_iter = self.limits.max_iterations
        cap = self.limits.max_prompt_chars
        first_cap = cap if first_cap is None else first_cap
        for turn in range(max_iter):
            if self.answered:  # a conversation's later user turn may compact first, too
                compacted = self.compact(messages, self.answered)
                if isinstance(compacted, Failed):
                    return compacted
                self.history = messages = compacted
            extra = self.notices()
            if extra:
                messages[-1]["content"] = extra + "\n\n" + messages[-1]["content"]
            messages[-1]["content"] = clip(messages[-1]["content"], first_cap if turn == 0 else cap)
            reply = rt.call_model(messages, "turn", None)
            self.answered += 1
            messages.append({"role": "assistant", "content": reply})
            feedback = self.feedback(reply)
            if rt.final is not None:
                return self.final(rt.final)
            messages.append({"role": "user", "content": feedback})
        compacted = self.compact(messages, self.answered)
        if isinstance(compacted, Failed):
            return compacted
        self.history = messages = compacted
        last = messages[-1]["content"] + "\n\n" + ANSWER_NOW.format(n=max_iter)
        # Its last message is this turn's first only when no turn ran (max_iterations=0).
        messages[-1]["content"] = clip(last, first_cap if max_iter == 0 else cap)
        reply = rt.call_model(messages, "turn", None)
        self.answered += 1
        messages.append({"role": "assistant", "content": reply})
        blocks = extract_blocks(reply)
        for code in blocks.code:
            self.run_code(code)
            if rt.final is not None:
                return self.final(rt.final)
        return self.final(reply.strip(), reason="answer after max_iterations")

    def compact(self, messages: list[dict[str, Any]], turns: int) -> list[dict[str, Any]] | Failed:
        """`messages` before turn `turns` + 1, compacted if their history passes
        Limits.compact_at (`compaction`); a resumed run compacts where its journal did,
        with the journaled summary. A summary call that fails fails the run, saying so:
        what the journal holds stays, the model's error with it."""
        rt = self.rt
        limit = self.limits.compact_at
        replay = rt.replay
        summary = replay.compactions.pop(turns, None) if replay is not None else None
        if summary is not None:
            size, unit = history_size(rt.prompt_tokens, messages[:-1])
            due: compaction.Due | None = compaction.Due(size, unit, limit or 0)
        elif replay is not None and replay.turns:
            return messages  # the journal's next turn came without a compaction before it
        else:
            due = compaction.due(messages, rt.prompt_tokens, limit)
        if due is None:
            return messages
        if summary is None:
            try:
                summary = rt.call_model(compaction.summary_request(messages), "compact", None)
            except BroodError as exc:
                return Failed(
                    reason=clip(
                        f"compaction failed: the summary call before turn {turns + 1} (the "
                        f"history had {due.size:,} {due.unit}, past Limits.compact_at="
                        f"{due.limit:,}) raised {type(exc).__name__}: {exc}; the journal "
                        "keeps every turn and step so far. Fix the model, or raise "
                        "Limits.compact_at (None: never compact), and run the task again",
                        FAILURE_TEXT_CAP,
                    ),
                    error=f"{type(exc).__name__}: {exc}",
                )
        # The supervisor knows the system prompt, the task and the summary it answered.
        rt.turn_sent = 2
        return compaction.compacted(messages, summary, due, turns)

    def final(self, answer: str, reason: str = "answer") -> Final | Failed:
        """The run's end: its answer, or a failure when the answer (or its products, as
        JSON) is over the cap."""
        cap = self.limits.answer_limit
        products = self.rt.products
        for what, size in (
            ("answer", len(answer)),
            ("products", len(json.dumps(products)) if products is not None else 0),
        ):
            if size > cap:
                return Failed(
                    reason=f"the FINAL {what} has {size:,} characters, over "
                    f"Limits.answer_limit={cap:,}; nothing over the cap is sent",
                    error="",
                )
        return Final(answer, reason, products)

    def driven(self) -> None:
        """A Session root: steps come from the trainer's code, not from a model."""
        rt = self.rt
        while True:
            ex = rt.link.execs.get()
            out = self.run_code(ex.code, ex.timeout)
            if rt.final is None:
                rt.link.send(StepResult(ex.req_id, out.stdout, out.stderr, out.error, False, None))
                continue
            end = self.final(rt.final)
            answer, error = (
                (end.answer, out.error) if isinstance(end, Final) else (None, end.reason)
            )
            rt.link.send(StepResult(ex.req_id, out.stdout, out.stderr, error, True, answer))
            rt.link.send(end)
            return

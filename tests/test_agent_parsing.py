"""Finding the code in a model reply: ```repl / ```python fences, in order, problems named."""

from __future__ import annotations

import io
from typing import Any

from brood.limits import Limits
from brood.models import ScriptedModel
from brood.protocol import (
    Deliver,
    Final,
    ModelReq,
    Msg,
    Reply,
    StepBegan,
    StepDone,
    SyncChannel,
    WorkerLimits,
)
from brood.worker.agent import ANSWER_NOW, NO_CODE, Agent, Blocks, extract_blocks
from brood.worker.helpers import Runtime, make_helpers
from brood.worker.link import Link
from brood.worker.repl import Repl


def reply(*lines: str) -> str:
    return "\n".join(lines)


def test_a_repl_block() -> None:
    text = reply("Let me look.", "```repl", "print(len(context))", "```", "Done.")
    assert extract_blocks(text) == Blocks(["print(len(context))"])


def test_python_and_py_fences_are_accepted_too() -> None:
    text = reply("```python", "a = 1", "```", "```py", "b = 2", "```")
    assert extract_blocks(text).code == ["a = 1", "b = 2"]


def test_several_blocks_come_back_in_order_with_their_lines_intact() -> None:
    text = reply(
        "First:",
        "```repl",
        "x = 1",
        "",
        "def f():",
        "    return x",
        "```",
        "Then:",
        "```python",
        "print(f())",
        "```",
        "```repl",
        "FINAL(f())",
        "```",
    )
    blocks = extract_blocks(text)
    assert blocks.code == ["x = 1\n\ndef f():\n    return x", "print(f())", "FINAL(f())"]
    assert blocks.problem is None


def test_other_fences_are_ignored_even_when_they_contain_code() -> None:
    text = reply(
        "```json",
        '{"a": 1}',
        "```",
        "```",
        "print('a bare fence is not run')",
        "```",
        "```bash",
        "rm -rf /",
        "```",
        "```repl",
        "ok = True",
        "```",
    )
    assert extract_blocks(text) == Blocks(["ok = True"])


def test_a_repl_fence_inside_another_fence_is_not_run() -> None:
    text = reply("```markdown", "Example:", "```repl", "print('quoted')", "```", "```")
    # The first bare ``` closes the markdown block; the one after it opens a bare fence.
    assert extract_blocks(text).code == []


def test_fences_may_be_indented_and_padded() -> None:
    text = reply("  ```repl  ", "x = 1", "  ```  ")
    assert extract_blocks(text).code == ["x = 1"]


def test_windows_line_endings() -> None:
    assert extract_blocks("```repl\r\nx = 1\r\n```\r\n").code == ["x = 1"]


def test_an_empty_block_is_still_a_block() -> None:
    assert extract_blocks(reply("```repl", "```")).code == [""]


def test_no_block() -> None:
    assert extract_blocks("The answer is 42.") == Blocks([])
    assert extract_blocks("") == Blocks([])
    assert extract_blocks("I would write ```repl inline``` but that is prose.") == Blocks([])


def test_an_unclosed_fence_is_reported_with_its_line_and_earlier_blocks_kept() -> None:
    text = reply("```repl", "a = 1", "```", "Now:", "```repl", "b = 2")
    blocks = extract_blocks(text)
    assert blocks.code == ["a = 1"]
    assert blocks.problem is not None
    assert "opens a ```repl fence on line 5 but never closes it" in blocks.problem
    assert "did not run" in blocks.problem
    assert "Close every block with a line of ```" in blocks.problem


def test_an_unclosed_fence_on_the_first_line() -> None:
    blocks = extract_blocks("```python\nprint(1)")
    assert blocks.code == []
    assert blocks.problem is not None and "line 1 " in blocks.problem


# ---- the loop around the parser: a real Runtime over an in-memory channel ----------------
class GatewayLink(Link):
    """A link whose model calls are answered here, as the supervisor's gateway would; each
    request is also written to the channel, so the test sees what the worker asked."""

    def __init__(self, chan: SyncChannel, model: ScriptedModel) -> None:
        super().__init__(chan)
        self.model = model

    def request(self, msg: Msg, **_: Any) -> Any:  # stall=, what=: the real link waits
        if isinstance(msg, ModelReq):
            self.chan.send(msg)
            return self.model.complete(msg.messages, msg.model).text
        if isinstance(msg, StepBegan):  # journaled and clocked by the supervisor
            self.chan.send(msg)
            return None
        return super().request(msg)

    def request_reply(self, msg: Msg, **kw: Any) -> Reply:  # a model turn: the whole reply
        return Reply(msg.req_id, value=self.request(msg, **kw))  # type: ignore[attr-defined]


def make_agent(script: list[Any], **limits: Any) -> tuple[Agent, io.BytesIO]:
    sent = io.BytesIO()
    link = GatewayLink(SyncChannel(io.BytesIO(), sent), ScriptedModel(script))
    repl = Repl({}, "some context")
    rt = Runtime(
        link,
        run_id="r-test",
        depth=0,
        can_spawn=False,
        clock=repl.clock,
        max_depth=1,
        limits=WorkerLimits.from_limits(Limits(max_depth=1, step_timeout=None, **limits)),
    )
    repl.namespace.update(make_helpers(rt))
    rt.namespace = repl.namespace
    return Agent(rt, repl), sent


def messages_sent(sent: io.BytesIO) -> list[Msg]:
    chan = SyncChannel(io.BytesIO(sent.getvalue()), io.BytesIO())
    out = []
    while (msg := chan.recv()) is not None:
        out.append(msg)
    return out


def test_every_block_of_a_reply_runs_in_order_and_is_journaled() -> None:
    agent, sent = make_agent([])
    text = agent.feedback(reply("```repl", "x = 2", "```", "```repl", "print(x * 21)", "```"))
    assert text == "[block 1 of 2]\n(no output)\n\n[block 2 of 2]\n42\n"
    steps = [m for m in messages_sent(sent) if isinstance(m, StepDone)]
    assert [(s.step, s.code, s.stdout) for s in steps] == [
        (1, "x = 2", ""),
        (2, "print(x * 21)", "42\n"),
    ]


def test_blocks_after_final_do_not_run() -> None:
    agent, _ = make_agent([])
    agent.feedback(reply("```repl", "FINAL('done')", "```", "```repl", "ran = True", "```"))
    assert agent.rt.final == "done"
    assert "ran" not in agent.repl.namespace


def test_a_reply_without_code_is_told_so() -> None:
    agent, _ = make_agent([])
    assert agent.feedback("I think it is 42.") == NO_CODE


def test_an_unclosed_fence_is_reported_after_the_blocks_that_ran() -> None:
    agent, _ = make_agent([])
    text = reply("```repl", "print(1)", "```", "```repl", "print(2)")
    problem = extract_blocks(text).problem
    assert problem is not None
    assert agent.feedback(text) == "[output]\n1\n\n\n" + problem


def test_long_output_reaches_the_model_truncated_with_a_note() -> None:
    agent, sent = make_agent([], output_limit=100)
    text = agent.feedback(reply("```repl", "print('x' * 5000)", "```"))
    assert "output truncated: 5,001 characters" in text
    assert text.count("x") <= 100
    (step,) = [m for m in messages_sent(sent) if isinstance(m, StepDone)]
    assert len(step.stdout) == 5001, "the journal keeps the whole output"


def test_the_loop_feeds_output_back_until_final() -> None:
    agent, sent = make_agent(
        [
            reply("```repl", "n = len(context)", "print(n)", "```"),
            reply("```repl", "FINAL(f'{n} characters')", "```"),
        ]
    )
    final = agent.loop("Count the characters.", "system prompt")
    assert final == Final("12 characters")
    kinds = [type(m).__name__ for m in messages_sent(sent)]
    assert kinds == ["ModelReq", "StepBegan", "StepDone", "ModelReq", "StepBegan", "StepDone"]


def test_the_model_sees_its_output_in_the_next_turn() -> None:
    seen: list[list[dict[str, Any]]] = []

    def second(messages: list[dict[str, Any]]) -> str:
        seen.append([dict(m) for m in messages])  # the loop appends to the list later
        return reply("```repl", "FINAL('ok')", "```")

    agent, _ = make_agent([reply("```repl", "print('hello')", "```"), second])
    agent.loop("task", "system prompt")
    (messages,) = seen
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[-1]["content"] == "[output]\nhello\n"


def test_a_message_from_the_parent_arrives_before_the_next_turn() -> None:
    seen: list[str] = []

    def first(messages: list[dict[str, Any]]) -> str:
        seen.append(messages[-1]["content"])
        return reply("```repl", "FINAL('ok')", "```")

    agent, _ = make_agent([first])
    agent.rt.link._dispatch(Deliver(message="focus on section 2"))
    agent.loop("task", "system prompt")
    assert seen == ["[message from your parent] focus on section 2\n\ntask"]


def test_after_max_iterations_the_model_is_asked_to_answer_now() -> None:
    seen: list[str] = []

    def last(messages: list[dict[str, Any]]) -> str:
        seen.append(messages[-1]["content"])
        return "My best guess is 7."

    script = [reply("```repl", "print('working')", "```")] * 2 + [last]
    agent, _ = make_agent(script, max_iterations=2)
    final = agent.loop("task", "system prompt")
    assert final == Final("My best guess is 7.", reason="answer after max_iterations")
    assert seen[0].endswith(ANSWER_NOW.format(n=2))


def test_a_final_block_in_the_last_reply_still_counts() -> None:
    script = [
        reply("```repl", "print('working')", "```"),
        reply("```repl", "FINAL('late but right')", "```"),
    ]
    agent, _ = make_agent(script, max_iterations=1)
    assert agent.loop("task", "system prompt") == Final("late but right")

"""Conversations: one root REPL and one model history across user turns, journaled and
resumed after a crash between turns (Supervisor.conversation)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import brood
from brood.journal import Journal
from brood.supervisor.frames import Conversation, Violation
from tests.test_hostile_frames import convo_messages, turn
from tests.test_resume import CRASH_TIMEOUT_S, wait_gone
from tests.util import FAST, Gate, Signal, fast

FENCE = "```"


def repl(code: str) -> str:
    return f"{FENCE}repl\n{code}\n{FENCE}"


# A model that answers each user turn by what it asks, with code that uses the variables
# of earlier turns; it keeps every conversation it was shown.
CHAT = """
def chat(messages, model=None):
    SEEN.append([dict(m) for m in messages])
    last = messages[-1]["content"]
    if "set x" in last:
        return "```repl\\nx = 21\\nFINAL('x is set')\\n```"
    if "double x" in last:
        return "```repl\\ny = x * 2\\nFINAL(f'y is {y}')\\n```"
    if "add them" in last:
        return "```repl\\nprint(x + y)\\n```"
    if last.startswith("[output]"):
        return "```repl\\nFINAL(f'sum is {x + y}')\\n```"
    return "```repl\\nFINAL('unexpected: ' + repr(last[:80]))\\n```"
"""


def scripted_chat() -> tuple[list[list[dict]], object]:
    space: dict = {"SEEN": []}
    exec(CHAT, space)
    return space["SEEN"], space["chat"]


def test_three_turns_keep_the_namespace_and_the_convo_messages():
    seen, chat = scripted_chat()
    with brood.Supervisor(chat, limits=FAST) as sup:
        conv = sup.conversation(context="the context")
        first = conv.send("please set x")
        second = conv.send("now double x")
        third = conv.send("add them")
        assert conv.status() == "running"  # between turns the root goes on
        turns = conv.turns()
        ended = conv.close()
        row = sup.store.get_run(conv.id)
    assert [r.answer for r in (first, second, third)] == ["x is set", "y is 42", "sum is 63"]
    assert {r.run_id for r in (first, second, third)} == {conv.id}
    assert {r.state for r in (first, second, third)} == {"completed"}
    # Each turn's usage is that turn's: the third took two model turns.
    assert [r.usage["model_calls"] for r in (first, second, third)] == [1, 1, 2]
    # The model saw one history: system prompt, every earlier turn, then the new prompt.
    last = seen[-1]
    assert [m["role"] for m in last] == ["system"] + ["user", "assistant"] * 3 + ["user"]
    assert last[1]["content"].startswith("please set x\n\n`context` is a str")
    assert [m["content"] for m in last[3::2]] == ["now double x", "add them", "[output]\n63\n"]
    assert "x = 21" in last[2]["content"]
    assert [t["prompt"] for t in turns] == ["please set x", "now double x", "add them"]
    assert [t["answer"] for t in turns] == ["x is set", "y is 42", "sum is 63"]
    assert (ended.state, ended.answer) == ("completed", "sum is 63")
    assert (row["state"], row["reason"]) == ("completed", "conversation closed after 3 turns")


def test_a_turn_on_a_closed_conversation_is_a_clear_error():
    _, chat = scripted_chat()
    with brood.Supervisor(chat, limits=FAST) as sup:
        with sup.conversation() as conv:
            conv.send("set x")
        assert conv.closed
        with pytest.raises(brood.ConversationClosed, match=r"is closed \(completed") as err:
            conv.send("double x")
        assert "Supervisor.conversation()" in str(err.value)
        assert conv.close().state == "completed"  # closing again does nothing
        with pytest.raises(brood.InvalidArgument, match="send\\(prompt\\)"):
            sup.conversation().send("  ")
        with pytest.raises(brood.InvalidArgument, match="timeout"):
            sup.conversation().send("set x", timeout=-1)
        with pytest.raises(brood.InvalidArgument, match="not a conversation"):
            sup.resume_conversation(sup.run("set x").run_id)
        with pytest.raises(brood.ConversationClosed, match="is closed"):
            sup.resume_conversation(conv.id)
    with pytest.raises(brood.ConversationClosed, match="its supervisor was closed"):
        conv.send("double x")


def test_between_turns_the_root_holds_no_slot_and_its_children_are_cancelled(tmp_path):
    gate = Gate(tmp_path, "never")
    replies = {
        "start": repl(
            "h = rlm_spawn('slow child')\nFINAL('started ' + str(rlm_status(h) != 'completed'))"
        ),
        "look": repl("FINAL(rlm_status(h))"),
    }

    def chat(messages, model=None):
        last = messages[-1]["content"]
        if last.startswith("slow child"):
            return repl(gate.wait_code + "\nFINAL('never')")
        if last.startswith("other"):
            return repl("FINAL('other done')")
        return replies[next(k for k in replies if k in last)]

    with brood.Supervisor(chat, limits=fast(max_concurrency=1)) as sup:
        conv = sup.conversation()
        assert conv.send("start a child").answer == "started True"
        # The conversation waits for its next turn holding no slot: another tree runs.
        assert sup.run("other tree").answer == "other done"
        assert conv.send("look at the child").answer == "cancelled"
        tree = sup.store.runs(conv.id)
    child = next(r for r in tree if r["parent_id"] == conv.id)
    assert (child["state"], child["reason"]) == ("cancelled", "its conversation turn ended")


def test_max_iterations_counts_per_turn():
    def chat(messages, model=None):
        last = messages[-1]["content"]
        if last.startswith("[output]"):
            return repl("FINAL('done')")
        return repl("print('working')")

    with brood.Supervisor(chat, limits=fast(max_iterations=2)) as sup, sup.conversation() as conv:
        answers = [conv.send(f"task {n}") for n in range(4)]
    # Four turns of two model turns each: eight in all, past max_iterations + 1.
    assert [(r.state, r.answer) for r in answers] == [("completed", "done")] * 4


def test_a_turn_past_its_timeout_ends_the_conversation(tmp_path):
    gate = Gate(tmp_path, "never")

    def chat(messages, model=None):
        if "slow" in messages[-1]["content"]:
            return repl(gate.wait_code)
        return repl("FINAL('quick')")

    with brood.Supervisor(chat, limits=FAST) as sup:
        conv = sup.conversation()
        assert conv.send("quick one").answer == "quick"
        result = conv.send("slow one", timeout=0.5)
        assert result.state == "timed_out"
        assert "conversation turn 2 timed out after 0.5 s" in result.error
        with pytest.raises(brood.ConversationClosed, match="timed_out"):
            conv.send("quick one")


def test_the_journal_and_the_export_show_each_turn(tmp_path):
    _, chat = scripted_chat()
    url = f"sqlite:///{tmp_path}/j.db"
    with brood.Supervisor(chat, limits=FAST, store=url) as sup, sup.conversation() as conv:
        conv.send("set x")
        conv.send("double x")
    with Journal(url) as journal:
        events = journal.events(conv.id)
        records = list(journal.export(conv.id))
    kinds = [e["kind"] for e in events if e["kind"] in ("user_turn", "turn_answer")]
    assert kinds == ["user_turn", "turn_answer"] * 2
    answers = [e["data"]["answer"] for e in events if e["kind"] == "turn_answer"]
    assert answers == ["x is set", "y is 42"]
    assert [r["turn"] for r in records] == [1, 2]
    assert [m["content"] for m in records[-1]["messages"][3::2]] == ["double x"]


# ---- a crash between turns --------------------------------------------------------------
def crash_after(url: str, prompt: str, conv_id: str | None = None) -> tuple[str, str]:
    """One turn of a conversation (a new one, or `conv_id` resumed) in another process,
    then SIGKILL it between turns. Returns (the conversation's id, the turn's answer)."""
    script = textwrap.dedent(f"""
        import brood
        SEEN = []
        {textwrap.indent(CHAT, "        ").strip()}
        sup = brood.Supervisor(chat, store={url!r},
                               limits=brood.Limits(shutdown_grace=0.3, term_grace=0.3))
        conv_id = {conv_id!r}
        conv = sup.resume_conversation(conv_id) if conv_id else sup.conversation("the context")
        print(conv.id, flush=True)
        print(conv.send({prompt!r}).answer, flush=True)
        import signal; signal.pause()
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        got_id = proc.stdout.readline().strip()
        answer = proc.stdout.readline().strip()
    finally:
        proc.kill()
        proc.wait(CRASH_TIMEOUT_S)
        proc.stdout.close()
    wait_gone(proc.pid)
    return got_id, answer


def test_a_conversation_killed_between_turns_resumes_with_its_variables(tmp_path):
    url = f"sqlite:///{tmp_path}/j.db"
    conv_id, first = crash_after(url, "please set x")
    same_id, second = crash_after(url, "now double x", conv_id)  # uses x of turn 1
    assert (same_id, first, second) == (conv_id, "x is set", "y is 42")
    seen, chat = scripted_chat()
    with brood.Supervisor(chat, limits=FAST, store=url) as sup:
        conv = sup.resume_conversation(conv_id)
        assert conv.id == conv_id
        third = conv.send("add them")  # uses x of turn 1 and y of turn 2
        fourth = conv.send("double x")
        turns = conv.turns()
    # The earlier turns were replayed from the journal, not asked again: the model was
    # asked only the new turns, and saw the whole history with them.
    assert (third.state, third.answer, fourth.answer) == ("completed", "sum is 63", "y is 42")
    assert len(seen) == 3
    contents = [m["content"] for m in seen[0]]
    assert contents[1].startswith("please set x\n\n`context` is a str")
    assert contents[3::2] == ["now double x", "add them"]
    assert [t["answer"] for t in turns] == ["x is set", "y is 42", "sum is 63", "y is 42"]
    with Journal(url) as journal:
        resumes = journal.store.events(conv_id, "resume")
    assert len(resumes) == 2


def test_a_supervisor_closed_between_turns_leaves_the_conversation_resumable(tmp_path):
    url = f"sqlite:///{tmp_path}/j.db"
    _, chat = scripted_chat()
    with brood.Supervisor(chat, limits=FAST, store=url) as sup:
        conv = sup.conversation()
        assert conv.send("set x").answer == "x is set"
    with pytest.raises(brood.ConversationClosed, match="resume_conversation"):
        conv.send("double x")
    with Journal(url) as journal:
        row = journal.run(conv.id)
        suspended = journal.store.events(conv.id, "suspended")
    assert (row["state"], row["stale"]) == ("running", True)
    assert "resume_conversation" in suspended[0]["data"]["reason"]
    seen, chat = scripted_chat()
    with brood.Supervisor(chat, limits=FAST, store=url) as sup:
        again = sup.resume_conversation(conv.id)
        assert again.send("double x").answer == "y is 42"
        assert again.close().state == "completed"
    assert len(seen) == 1


# ---- the supervisor's check of a conversation's model turns ------------------------------
def test_a_user_turn_has_its_prompts_cap_and_its_own_max_iterations():
    kw = dict(max_iterations=1, first_cap=100, cap=5)
    plain = Conversation()  # a run that is not a conversation: unchanged
    plain.check(turn(convo_messages([], ["task"]), 0), **kw)
    plain.answered("r1")
    with pytest.raises(Violation, match="a message of 40 characters"):
        plain.check(turn(convo_messages(["r1"], ["task", "p" * 40]), 2), **kw)

    convo = Conversation()
    convo.check(turn(convo_messages([], ["task"]), 0), **kw)
    convo.answered("r1")  # the first user turn ends with its FINAL
    convo.user_turn(1, 40)  # the supervisor hands a prompt of 40 characters' cap
    with pytest.raises(Violation, match="a message of 41 characters"):
        convo.check(turn(convo_messages(["r1"], ["task", "p" * 41]), 2), **kw)
    convo.check(turn(convo_messages(["r1"], ["task", "p" * 40]), 2), **kw)
    convo.answered("r2")
    users = ["task", "p" * 40, "out"]
    # The turn asking for the answer.
    convo.check(turn(convo_messages(["r1", "r2"], users), 4), **kw)
    convo.answered("r3")
    with pytest.raises(Violation, match=r"model turn 4 is past Limits\.max_iterations=1"):
        convo.check(turn(convo_messages(["r1", "r2", "r3"], [*users, "more"]), 6), **kw)


def test_a_turn_the_crash_interrupted_goes_on_first_after_the_resume(tmp_path):
    url = f"sqlite:///{tmp_path}/j.db"
    in_turn = Signal(tmp_path, "in-turn-2")
    os.mkfifo(tmp_path / "never")
    script = textwrap.dedent(f"""
        import brood
        SEEN = []
        {textwrap.indent(CHAT, "        ").strip()}
        def blocking(messages, model=None):
            if "double x" in messages[-1]["content"]:
                open({in_turn.path!r}, "w").write("1")
                open({str(tmp_path / "never")!r}).read()  # until the process is killed
            return chat(messages)
        sup = brood.Supervisor(blocking, store={url!r},
                               limits=brood.Limits(shutdown_grace=0.3, term_grace=0.3))
        conv = sup.conversation()
        print(conv.id, flush=True)
        print(conv.send("set x").answer, flush=True)
        conv.send("double x")
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        conv_id = proc.stdout.readline().strip()
        assert proc.stdout.readline().strip() == "x is set"
        in_turn.wait()
    finally:
        proc.kill()
        proc.wait(CRASH_TIMEOUT_S)
        proc.stdout.close()
    wait_gone(proc.pid)
    seen, chat = scripted_chat()
    with brood.Supervisor(chat, limits=FAST, store=url) as sup:
        conv = sup.resume_conversation(conv_id)
        third = conv.send("add them")  # once turn 2 has gone on to its answer
        turns = conv.turns()
    assert third.answer == "sum is 63"
    assert [t["answer"] for t in turns] == ["x is set", "y is 42", "sum is 63"]
    assert [m["content"] for m in seen[0]][3::2] == ["double x"]  # turn 2, asked again


def test_a_conversation_runs_on_the_model_it_was_given():
    _, chat = scripted_chat()

    def never(messages, model=None):
        raise AssertionError("the supervisor's own model is not the conversation's")

    with brood.Supervisor(never, limits=FAST) as sup, sup.conversation(model=chat) as conv:
        assert conv.send("set x").answer == "x is set"
        assert conv.send("double x").answer == "y is 42"


def test_a_suspended_conversation_frees_its_worker_and_its_next_turn_resumes_it():
    seen, chat = scripted_chat()
    with brood.Supervisor(chat, limits=FAST) as sup, sup.conversation(model=chat) as conv:
        assert conv.send("set x").answer == "x is set"
        serving = sup.statistics()["workers"]["runs"]
        assert conv.suspend() is True
        assert conv.suspended and not conv.closed and conv.status() == "running"
        assert sup.statistics()["workers"]["runs"] == serving - 1
        assert conv.send("double x").answer == "y is 42"  # replayed, then the new turn
        assert not conv.suspended
    assert len(seen) == 2  # the first turn was not asked again


def test_an_ask_left_open_by_a_turn_is_withdrawn_at_its_end():
    def chat(messages, model=None):
        last = messages[-1]["content"]
        if "ask the person" in last:
            return repl("a = ask_person('Deploy?', blocking=False)\nFINAL('asked')")
        return repl("FINAL(rlm_status(a))")

    with brood.Supervisor(chat, limits=FAST) as sup, sup.conversation() as conv:
        assert conv.send("ask the person").answer == "asked"
        assert sup.asks() == []
        assert conv.send("how is the ask").answer == "cancelled"


def test_a_conversation_is_resumed_as_one_not_as_a_plain_tree(tmp_path):
    url = f"sqlite:///{tmp_path}/j.db"
    _, chat = scripted_chat()
    with brood.Supervisor(chat, limits=FAST, store=url) as sup:
        conv = sup.conversation()
        conv.send("set x")
    with brood.Supervisor(chat, limits=FAST, store=url) as sup:
        with pytest.raises(brood.InvalidArgument, match="resume_conversation"):
            sup.resume(conv.id)
        assert sup.resume_conversation(conv.id).send("double x").answer == "y is 42"


def test_a_suspended_conversation_can_be_closed_and_followed_by_another_handle(tmp_path):
    url = f"sqlite:///{tmp_path}/j.db"
    _, chat = scripted_chat()
    with brood.Supervisor(chat, limits=FAST, store=url) as sup:
        conv = sup.conversation()
        conv.send("set x")
        conv.suspend()
        other = sup.resume_conversation(conv.id)  # rebuilt here from the journal
        assert other.send("double x").answer == "y is 42"
        assert conv.send("add them").answer == "sum is 63"  # the same, live conversation
        second = sup.conversation()
        second.send("set x")
        assert second.suspend() and second.suspend() is False
        assert second.close().state == "completed"
        row = sup.store.get_run(second.id)
    assert (row["state"], row["reason"]) == ("completed", "conversation closed after 1 turn")

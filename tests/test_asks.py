"""Asks to a person: ask_person in the REPL, answers from Python and the CLI, deadlines with
defaults, withdrawal, the end of a run, and a crash with asks open. Real workers, scripted
models; the person is the test."""

from __future__ import annotations

import functools
import json

import pytest
from typer.testing import CliRunner

import brood
from brood.cli.main import app
from tests.util import FAST, Signal, fast, until

FENCE = "```"


def code(source: str) -> str:
    return f"{FENCE}repl\n{source}\n{FENCE}"


until = functools.partial(until, every=0.005)


def ask_events(sup: brood.Supervisor, run_id: str) -> list[dict]:
    sup.store.flush()
    return [e["data"] for e in sup.store.events(run_id, "ask")]


def test_three_asks_open_at_once_one_answered_while_the_others_stay_open(tmp_path):
    opened = Signal(tmp_path, "opened")
    steps = [
        code(
            "a = ask_person('Deploy now?', options=['yes', 'no'], blocking=False)\n"
            "b = ask_person('Your name?', blocking=False)\n"
            "c = ask_person('Colour?', options=[{'id': 'r', 'label': 'Red'}], blocking=False)\n"
            f"{opened.code}"
        ),
        code(
            "import json\n"
            "got = rlm_wait(b)\n"
            "FINAL(json.dumps([got, rlm_status(a), rlm_status(c), rlm_status(b)]))"
        ),
    ]
    with brood.Supervisor(brood.ScriptedModel({"root": steps}), limits=FAST) as sup:
        h = sup.spawn("root")
        opened.wait()
        listed = sup.asks()
        assert [a["question"] for a in listed] == ["Deploy now?", "Your name?", "Colour?"]
        assert listed[0]["options"] == [
            {"id": "yes", "label": "yes"},
            {"id": "no", "label": "no"},
        ]
        assert all(a["run_id"] == h.id and a["state"] == "open" for a in listed)
        name = listed[1]["id"]
        result = sup.answer(name, "Ada Lovelace", by="alice")
        got, status_a, status_c, status_b = json.loads(h.wait(timeout=60))
        left = sup.asks()
        ops = [(e["op"], e["ask"]) for e in ask_events(sup, h.id)]
    assert (
        result
        == got
        == {
            "answer": {"type": "text", "id": None, "label": None, "text": "Ada Lovelace"},
            "summary": "Ada Lovelace (answered by alice)",
            "resolved_by": "alice",
        }
    )
    assert (status_a, status_c, status_b) == ("open", "open", "answered")
    assert left == []  # the run ended: its open asks were cancelled
    a_id, c_id = listed[0]["id"], listed[2]["id"]
    assert ops[:3] == [("opened", a_id), ("opened", name), ("opened", c_id)]
    assert ops[3] == ("answered", name)
    assert sorted(ops[4:]) == sorted([("cancelled", a_id), ("cancelled", c_id)])


def test_a_choice_is_answered_by_id_or_label_and_bad_answers_are_refused(tmp_path):
    opened = Signal(tmp_path, "opened")
    steps = [
        code(
            "a = ask_person('Ship?', options=[{'id': 'y', 'label': 'Yes, ship'}, 'no'], "
            f"blocking=False)\n{opened.code}"
        ),
        code("FINAL(rlm_wait(a)['answer']['id'])"),
    ]
    with brood.Supervisor(brood.ScriptedModel({"root": steps}), limits=FAST) as sup:
        h = sup.spawn("root")
        opened.wait()
        (ask,) = sup.asks()
        with pytest.raises(brood.InvalidArgument, match=r"'maybe' is none of the options"):
            sup.answer(ask["id"], "maybe")
        with pytest.raises(brood.InvalidArgument, match=r"no ask 'a-nope'"):
            sup.answer("a-nope", "yes")
        result = sup.answer(ask["id"], "yes, SHIP", by="bob")  # a label, any case
        with pytest.raises(brood.InvalidArgument, match=rf"ask {ask['id']} is answered"):
            sup.answer(ask["id"], "no")
        assert h.wait(timeout=60) == "y"
    assert result["answer"] == {
        "type": "choice",
        "id": "y",
        "label": "Yes, ship",
        "text": "Yes, ship",
    }
    assert result["resolved_by"] == "bob"


def test_a_withdrawn_ask_raises_ask_cancelled_from_every_wait():
    root = code(
        "h = ask_person('Still needed?', blocking=False)\n"
        "out = [rlm_cancel(h), rlm_status(h)]\n"
        "for wait in (rlm_wait, rlm_result, lambda x: rlm_wait_all([x])):\n"
        "    try:\n        wait(h)\n"
        "    except AskCancelled as e:\n        out.append(e.ask == h.id)\n"
        "FINAL(repr(out))"
    )
    with brood.Supervisor(brood.ScriptedModel({"root": [root]}), limits=FAST) as sup:
        result = sup.run("root")
        (_, cancelled) = ask_events(sup, result.run_id)
    assert result.answer == "['cancelled', 'cancelled', True, True, True]", result
    assert cancelled["op"] == "cancelled" and cancelled["reason"].startswith("withdrawn by run")


def test_a_deadline_applies_the_default_or_ends_the_ask():
    root = code(
        "got = ask_person('Proceed?', options=['yes', 'no'], deadline=0.05, default='no')\n"
        "try:\n    ask_person('Anything else?', deadline=0.05)\n"
        "except AskCancelled as e:\n    why = str(e)\n"
        "import json\nFINAL(json.dumps([got, why]))"
    )
    with brood.Supervisor(brood.ScriptedModel({"root": [root]}), limits=FAST) as sup:
        result = sup.run("root")
    got, why = json.loads(result.answer)
    assert got["resolved_by"] == "deadline"
    assert got["answer"] == {"type": "choice", "id": "no", "label": "no", "text": "no"}
    assert "deadline (0.05 s) passed with no answer and no default" in why


@pytest.mark.parametrize(
    ("call", "message"),
    [
        ("ask_person('q', deadline=-5)", "deadline=...) is seconds from now, a number > 0"),
        ("ask_person('')", "the question must be non-empty text"),
        ("ask_person('q', options='yes')", "is a list of strings or"),
        ("ask_person('q', options=['a', 'a'])", "option ids must differ"),
        ("ask_person('q', options=['a'], default='b')", "default='b') is none of the options"),
    ],
)
def test_bad_asks_are_refused_before_anything_is_asked(call, message):
    root = code(f"try:\n    {call}\nexcept InvalidArgument as e:\n    FINAL(str(e))")
    with brood.Supervisor(brood.ScriptedModel({"root": [root]}), limits=FAST) as sup:
        result = sup.run("root")
        assert ask_events(sup, result.run_id) == []
    assert message in result.answer, result


def test_a_run_waiting_on_a_person_gives_up_its_slot_and_says_so(tmp_path):
    root = code("FINAL(ask_person('Go?', options=['go'])['answer']['id'])")
    other = code("FINAL('other done')")
    model = brood.ScriptedModel({"root": [root], "other": [other]})
    url = f"sqlite:///{tmp_path}/j.db"
    with brood.Supervisor(model, store=url, limits=fast(max_concurrency=1)) as sup:
        h = sup.spawn("root")
        until(lambda: sup.statistics()["waiting_for_person"])
        stats = sup.statistics()
        (ask,) = sup.asks()
        assert stats["waiting_for_person"] == {h.id: [ask["id"]]}
        assert stats["free_slots"] == 1 and h.status() == "running"
        runner = CliRunner()
        said = f"waiting for a person: {ask['id']}"
        for command in (["ps"], ["tree", h.id], ["show", h.id]):
            out = runner.invoke(app, [*command, "--store", url], env={"COLUMNS": "200"})
            assert said in " ".join(out.output.split()), (command, out.output)
        shown = json.loads(runner.invoke(app, ["show", h.id, "--store", url, "--json"]).output)
        assert shown["waiting_for"] == [ask["id"]]
        # The one slot is free: another run completes while the first waits for a person.
        assert sup.run("other").answer == "other done"
        sup.answer(ask["id"], "go")
        assert h.wait(timeout=60) == "go"


def test_brood_asks_and_brood_answer_reach_the_owning_supervisor(tmp_path):
    url = f"sqlite:///{tmp_path}/j.db"
    opened = Signal(tmp_path, "opened")
    steps = [
        code(f"a = ask_person('Merge?', options=['yes', 'no'], blocking=False)\n{opened.code}"),
        code("FINAL(rlm_wait(a)['summary'])"),
    ]
    runner = CliRunner()
    with brood.Supervisor(brood.ScriptedModel({"root": steps}), store=url, limits=FAST) as sup:
        h = sup.spawn("root")
        opened.wait()
        listed = runner.invoke(app, ["asks", "--store", url, "--json"])
        assert listed.exit_code == 0, listed.output
        (ask,) = json.loads(listed.output)
        assert (ask["run_id"], ask["question"]) == (h.id, "Merge?")
        text = runner.invoke(app, ["asks", "--store", url])
        assert ask["id"] in text.output and "Merge?" in text.output
        bad = runner.invoke(app, ["answer", ask["id"], "maybe", "--store", url])
        assert bad.exit_code == 2 and "'maybe' is none of the options" in bad.output
        unknown = runner.invoke(app, ["answer", "a-00000000", "yes", "--store", url])
        assert unknown.exit_code == 2 and "no ask 'a-00000000'" in unknown.output
        done = runner.invoke(app, ["answer", ask["id"], "yes", "--as", "carol", "--store", url])
        assert done.exit_code == 0, done.output
        assert done.output.strip() == f"{ask['id']} answered: yes (chosen by carol)"
        assert h.wait(timeout=60) == "yes (chosen by carol)"
        again = runner.invoke(app, ["answer", ask["id"], "no", "--store", url])
        assert again.exit_code == 2 and "has ended" in again.output
        assert json.loads(runner.invoke(app, ["asks", "--store", url, "--json"]).output) == []


def test_a_trainer_plays_the_person_through_the_session():
    with brood.Session(brood.ScriptedModel({}), limits=FAST) as env:
        env.reset("episode")
        env.step("h = ask_person('Pick one', options=['a', 'b'], blocking=False)")
        (ask,) = env.asks()
        result = env.answer(ask["id"], "b")
        obs = env.step("print(rlm_result(h)['answer']['id'], rlm_result(h)['resolved_by'])")
    assert result["resolved_by"] == "trainer"
    assert obs.stdout.strip() == "b trainer"


def test_ask_user_question_asks_several_at_once(tmp_path):
    root = code(
        "import json\n"
        "FINAL(json.dumps(ask_user_question([\n"
        "    {'question': 'First?', 'options': ['x'], 'deadline': 0.05, 'default': 'x'},\n"
        "    {'question': 'Second?', 'deadline': 0.05, 'default': 'fine'},\n"
        "])))"
    )
    with brood.Supervisor(brood.ScriptedModel({"root": [root]}), limits=FAST) as sup:
        result = sup.run("root")
    first, second = json.loads(result.answer)
    assert first["answer"]["id"] == "x" and second["answer"]["text"] == "fine"


def test_a_crash_with_asks_open_then_a_resume_adopts_them(tmp_path):
    """Three asks; one answered (through `brood answer` to the first process); the
    supervisor is SIGKILLed; the resume replays the answered ask without asking again and
    adopts the two open ones (same ids, same deadline), which `brood answer` then answers
    through the new process."""
    import textwrap

    from tests.test_resume import crash

    steps = [
        code(
            "a = ask_person('Region?', options=['eu', 'us'], blocking=False)\n"
            "b = ask_person('Owner?', deadline=3600, blocking=False)\n"
            "c = ask_person('Budget?', blocking=False)\n"
            "print('asked')"
        ),
        code(
            "import json\nFINAL(json.dumps([r['answer']['text'] for r in rlm_wait_all([a, b, c])]))"
        ),
    ]
    url = f"sqlite:///{tmp_path}/j.db"
    script = textwrap.dedent(f"""
        import brood, json, signal
        STEPS = json.loads({json.dumps(json.dumps(steps))})
        sup = brood.Supervisor(brood.ScriptedModel({{"root": STEPS}}), store={url!r},
                               limits=brood.Limits(shutdown_grace=0.3, term_grace=0.3))
        print(sup.spawn("root task").id, flush=True)
        signal.pause()
    """)
    runner = CliRunner()

    def open_asks() -> list[dict]:
        out = runner.invoke(app, ["asks", "--store", url, "--json"])
        return json.loads(out.output) if out.exit_code == 0 else []

    def answer_one() -> None:
        until(lambda: len(open_asks()) == 3)
        asked[:] = open_asks()
        done = runner.invoke(app, ["answer", asked[0]["id"], "eu", "--store", url])
        assert done.exit_code == 0, done.output

    asked: list[dict] = []
    root_id = crash(script, answer_one)
    region, owner, budget = asked
    assert region["question"] == "Region?"
    assert [a["id"] for a in open_asks()] == [owner["id"], budget["id"]]

    with brood.Supervisor(brood.ScriptedModel({"root": steps}), store=url, limits=FAST) as sup:
        h = sup.resume(root_id)
        until(lambda: len(sup.asks()) == 2)
        adopted = sup.asks()
        assert [a["id"] for a in adopted] == [owner["id"], budget["id"]]
        assert adopted[0]["deadline"] == owner["deadline"]  # counted from the first opening
        for ask, value in ((owner, "Grace"), (budget, "1000")):
            done = runner.invoke(app, ["answer", ask["id"], value, "--store", url])
            assert done.exit_code == 0, done.output
        assert json.loads(h.wait(timeout=60)) == ["eu", "Grace", "1000"]
        ops = [e["op"] for e in ask_events(sup, root_id)]
    assert ops.count("opened") == 3  # the answered ask was not asked again
    assert ops.count("answered") == 3

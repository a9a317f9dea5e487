"""Children through the REPL helpers, against real worker processes."""

from __future__ import annotations

import dataclasses

import pytest

import brood
from brood.models.scripted import read_log
from tests.util import FAST, Gate, Signal, fast

FENCE = "```"


def repl(code: str) -> str:
    return f"{FENCE}repl\n{code}\n{FENCE}"


def test_blocking_child_returns_42():
    model = brood.ScriptedModel(
        {
            "root": [repl("x = rlm_query('child: what is 6*7?')\nFINAL(x)")],
            "child:": [repl("FINAL(str(6*7))")],
        }
    )
    with brood.Supervisor(model, limits=FAST) as sup:
        result = sup.run("root task")
    assert result.state == "completed"
    assert result.answer == "42"


def test_batched_children_keep_order_and_length():
    # Each child answers its own index, read from its task in its first user message.
    model = brood.ScriptedModel(
        {
            "root": [
                repl(
                    "xs = rlm_query_batched([f'child: echo {i}' for i in range(6)])\n"
                    "FINAL(','.join(xs))"
                )
            ],
            "child:": [lambda msgs: repl(f"FINAL({msgs[1]['content'].split()[2]!r})")],
        }
    )
    with brood.Supervisor(model, limits=FAST) as sup:
        result = sup.run("root task")
    assert result.answer == "0,1,2,3,4,5"


def test_three_blocks_of_one_reply_share_a_namespace():
    reply = "\n".join([repl("a = 1"), "some prose", repl("b = a + 1"), repl("FINAL(str(a + b))")])
    with brood.Supervisor(brood.ScriptedModel([reply]), limits=FAST) as sup:
        assert sup.run("task").answer == "3"


def test_child_count_limit_is_refused_never_a_shorter_list():
    model = brood.ScriptedModel(
        {
            "root": [
                repl(
                    "try:\n    rlm_query_batched([f'child {i}' for i in range(5)])\n"
                    "except LimitExceeded as e:\n    FINAL(f'{e.kind} {e.value} {e.limit} | {e}')"
                )
            ],
            "child": [repl("FINAL('c')")],
        }
    )
    with brood.Supervisor(model, limits=fast(max_children_per_run=3)) as sup:
        result = sup.run("root task")
        assert result.answer.startswith("max_children_per_run 5 3 | ")
        assert "Limits(max_children_per_run=...)" in result.answer
        # Refused at admission: not one child was started.
        assert [r["id"] for r in sup.store.runs(result.run_id)] == [result.run_id]


def test_tree_wide_child_limit():
    model = brood.ScriptedModel(
        {
            "root": [
                repl(
                    "a = rlm_query('child one')\ntry:\n    rlm_query('child two')\n"
                    "except LimitExceeded as e:\n    FINAL(e.kind)"
                )
            ],
            "child": [repl("FINAL('c')")],
        }
    )
    with brood.Supervisor(model, limits=fast(max_children=1)) as sup:
        assert sup.run("root").answer == "max_children"


def test_per_child_timeout_ends_a_child_that_never_finishes():
    model = brood.ScriptedModel(
        {
            "root": [
                repl(
                    "h = rlm_spawn('child: loop forever', timeout=0.5)\n"
                    "try:\n    rlm_wait(h)\nexcept ChildFailed as e:\n"
                    "    FINAL(f'{e.status}: {e.reason}')"
                )
            ],
            "child:": [repl("while True:\n    pass")],
        }
    )
    with brood.Supervisor(model, limits=fast(step_timeout=None)) as sup:
        result = sup.run("root")
    assert result.answer == "timed_out: timed out after 0.5 s"


def test_callbacks_fire_once_each_with_depth_and_error():
    starts, ends = [], []
    model = brood.ScriptedModel(
        {
            "root": [
                repl(
                    "h = rlm_spawn('child: fail')\ntry:\n    rlm_wait(h)\n"
                    "except ChildFailed:\n    pass\nFINAL('done')"
                )
            ],
            "child:": [],  # no reply at all: the child's model call fails
        }
    )
    with brood.Supervisor(model, limits=FAST, on_start=starts.append, on_end=ends.append) as sup:
        result = sup.run("root")
    assert result.answer == "done"
    assert sorted((i.depth, i.state) for i in starts) == [(0, "running"), (1, "running")]
    by_depth = {i.depth: i for i in ends}
    assert len(ends) == 2
    assert by_depth[0].state == "completed" and by_depth[0].error is None
    assert by_depth[1].state == "failed"
    assert "model error" in by_depth[1].reason
    assert all(i.duration is not None and i.duration >= 0 for i in ends)


def test_spawn_work_collect_across_steps(tmp_path):
    started, go = Signal(tmp_path, "started"), Gate(tmp_path, "go")
    model = brood.ScriptedModel(
        {
            "child:": [started.notify_then(go.blocking_reply(repl("FINAL('child answer')")))],
        }
    )
    with brood.Session(model, limits=FAST) as env:
        env.reset("root task")
        obs = env.step("h = rlm_spawn('child: slow work')\nprint(rlm_status(h))")
        assert obs.error is None and obs.stdout.strip() in {"queued", "running"}
        started.wait()  # the child is inside its model call
        obs = env.step("x = sum(range(10))\nprint(x, rlm_status(h))")
        # The parent hears `running` once it is committed; the child's worker may start
        # (and reach its model call) while that commit is under way.
        x, seen = obs.stdout.split()
        assert x == "45" and seen in {"queued", "running"}
        assert obs.children == [{"id": obs.children[0]["id"], "status": "running"}]
        go.open()
        obs = env.step("FINAL(rlm_wait(h))")
        assert obs.done and obs.answer == "child answer"


def test_wait_timeout_leaves_the_child_running(tmp_path):
    started, go = Signal(tmp_path, "started"), Gate(tmp_path, "go")
    model = brood.ScriptedModel(
        {
            "child:": [started.notify_then(go.blocking_reply(repl("FINAL('late')")))],
        }
    )
    with brood.Session(model, limits=FAST) as env:
        env.reset("root")
        env.step("h = rlm_spawn('child: slow')")
        started.wait()
        obs = env.step(
            "try:\n    rlm_wait(h, timeout=0.05)\nexcept TimeoutError as e:\n"
            "    print('timeout;', rlm_status(h), ';', e)"
        )
        # (The parent's own view may lag the commit of the child's start; see above.)
        assert obs.stdout.startswith(("timeout; running ;", "timeout; queued ;"))
        assert "keeps running" in obs.stdout
        assert [c["status"] for c in obs.children] == ["running"]
        go.open()
        assert env.step("print(rlm_wait(h))").stdout.strip() == "late"


def test_failed_child_surfaces_as_child_failed_with_reason():
    model = brood.ScriptedModel(
        {
            "root": [
                repl(
                    "h = rlm_spawn('child: crash')\ntry:\n    rlm_wait(h)\n"
                    "except ChildFailed as e:\n    FINAL(f'{e.status}|{e.reason}')"
                )
            ],
            "child:": [repl("import os\nos._exit(3)")],
        }
    )
    with brood.Supervisor(model, limits=FAST) as sup:
        assert sup.run("root").answer == "failed|worker exited with status 3"


def test_follow_up_reaches_the_childs_next_model_turn(tmp_path):
    started, go = Signal(tmp_path, "started"), Gate(tmp_path, "go")

    def second_turn(messages):
        return repl(f"FINAL({messages[-1]['content']!r})")

    model = brood.ScriptedModel(
        {
            "child:": [
                started.notify_then(go.blocking_reply(repl("print('working')"))),
                second_turn,
            ],
        }
    )
    with brood.Session(model, limits=FAST) as env:
        env.reset("root")
        env.step("h = rlm_spawn('child: wait for orders')")
        started.wait()
        env.step("rlm_send(h, 'use the blue paint')")
        go.open()
        answer = env.step("print(rlm_wait(h))").stdout
    assert "[message from your parent] use the blue paint" in answer
    assert "working" in answer  # the step output follows the message in the same turn


def test_send_to_an_ended_child_is_an_error():
    model = brood.ScriptedModel(
        {
            "root": [
                repl(
                    "h = rlm_spawn('child: quick')\nrlm_wait(h)\ntry:\n"
                    "    rlm_send(h, 'too late')\nexcept BroodError as e:\n    FINAL(str(e))"
                )
            ],
            "child:": [repl("FINAL('ok')")],
        }
    )
    with brood.Supervisor(model, limits=FAST) as sup:
        assert "a follow-up cannot reach a run that has ended" in sup.run("root").answer


@pytest.mark.parametrize("n", [3])
def test_status_result_and_not_ready(tmp_path, n):
    go = Gate(tmp_path, "go")
    model = brood.ScriptedModel({"child:": [go.blocking_reply(repl("FINAL('r')"))]})
    with brood.Session(model, limits=FAST) as env:
        env.reset("root")
        obs = env.step(
            "h = rlm_spawn('child: x')\ntry:\n    rlm_result(h)\n"
            "except ChildNotReady as e:\n    print('not ready:', e)"
        )
        assert "not ready: child" in obs.stdout and "rlm_wait" in obs.stdout
        go.open()
        obs = env.step(
            "print(rlm_wait(h), rlm_result(h), rlm_status(h), h.done, len(rlm_children()))"
        )
        assert obs.stdout.split() == ["r", "r", "completed", "True", "1"]


def test_a_child_started_with_a_model_name_uses_it_for_every_call():
    def chat(messages, model=None):
        task = messages[1]["content"] if len(messages) > 1 else messages[0]["content"]
        if task.startswith("root"):
            return repl("FINAL(rlm_query('child: which model?', model='small-model'))")
        if task.startswith("child"):
            return repl("FINAL(llm_query('plain') + ' / ' + " + repr(str(model)) + ")")
        return f"plain call on {model}"

    limits = dataclasses.replace(FAST, models=["small-model"])
    with brood.Supervisor(chat, limits=limits) as sup:
        result = sup.run("root task")
        (child,) = [r for r in sup.store.runs(result.run_id) if r["depth"] == 1]
    assert result.answer == "plain call on small-model / small-model"
    assert child["model"] == "small-model"


def test_model_code_names_only_the_models_the_user_allows():
    """Limits.models is an allow-list (by default the supervisor's own model): any other
    name model code passes is refused with the list, and no call is made with it."""
    seen: list[str | None] = []

    def chat(messages, model=None):
        task = messages[1]["content"] if len(messages) > 1 else messages[0]["content"]
        seen.append(model)
        if task.startswith("root"):
            code = (
                "out = []\n"
                "for name in ['o1-pro', 'x@http://127.0.0.1:9/v1', 'chat', None]:\n"
                "    try:\n"
                "        out.append(llm_query('plain', model=name))\n"
                "    except InvalidArgument as e:\n"
                "        out.append(str(e))\n"
                "try:\n"
                "    rlm_query('child', model='o1-pro')\n"
                "except InvalidArgument as e:\n"
                "    out.append(str(e))\n"
                "FINAL('\\n'.join(out))"
            )
            return repl(code)
        return f"plain call on {model}"

    with brood.Supervisor(chat, limits=FAST) as sup:
        result = sup.run("root task")
        assert result.state == "completed", result
        assert len(sup.store.runs(result.run_id)) == 1  # no child started
    lines = result.answer.splitlines()
    for refused, name in ((lines[0], "o1-pro"), (lines[1], "x@http"), (lines[4], "o1-pro")):
        assert f"model '{name}" in refused and "is not one this tree may use" in refused
        assert "Limits.models: 'chat'" in refused, refused
    assert lines[2:4] == ["plain call on chat", "plain call on None"]
    assert "o1-pro" not in seen and not any("127.0.0.1" in str(m) for m in seen)


def test_a_closed_supervisor_refuses_new_runs():
    sup = brood.Supervisor(brood.ScriptedModel([repl("FINAL('x')")]), limits=FAST)
    sup.close()
    with pytest.raises(brood.SupervisorClosed, match="closed"):
        sup.run("task")


def test_cancelling_a_spawned_batch_reports_it_cancelled(tmp_path):
    started = Signal(tmp_path, "started")
    never = Gate(tmp_path, "never")
    # One child announces itself: a second announcement could find the test's end of the
    # fifo closing (a BrokenPipeError in that child's model call, so a failed child).
    model = brood.ScriptedModel(
        {
            "child: one": [started.notify_then(never.blocking_reply("x"))],
            "child: two": [never.blocking_reply("x")],
        }
    )
    with brood.Session(model, limits=FAST) as env:
        env.reset("root task")
        env.step("t = spawn(rlm_query_batched, ['child: one', 'child: two'])")
        started.wait()  # a child of the batch is inside its model call
        obs = env.step("print(rlm_cancel(t))\nprint(rlm_status(t))")
        first, second = obs.stdout.split()
        assert (first, second) == ("cancelled", "cancelled"), obs
        assert obs.children and {c["status"] for c in obs.children} == {"cancelled"}, obs


def test_a_root_s_sub_model_runs_everything_below_its_own_turns(tmp_path):
    # The root's model answers the root's turns only (it has no script for anything else);
    # its llm_query, its child's turns and its grandchild's run on sub_model, passed down.
    root = brood.ScriptedModel(
        {"root": [repl("a = llm_query('plain: say s')\nFINAL(a + rlm_query('child: go'))")]},
        log_path=tmp_path / "root.log",
    )
    below = brood.ScriptedModel(
        {
            "plain:": ["s"],
            "child:": [repl("FINAL('c' + rlm_query('grandchild: go'))")],
            "grandchild:": [repl("FINAL('g')")],
        },
        log_path=tmp_path / "below.log",
    )
    below.name = "scripted-below"
    with brood.Supervisor(lambda m: "not this model", limits=fast(max_depth=3)) as sup:
        result = sup.run("root task", model=root, sub_model=below)
        assert result.answer == "scg"
        rows = sup.store.runs(result.run_id)
    assert [(r["depth"], r["model"]) for r in rows] == [(0, "scripted")] + [
        (d, "scripted-below") for d in (1, 2)
    ]
    assert [c["key"] for c in read_log(tmp_path / "root.log")] == ["root"]
    assert [c["key"] for c in read_log(tmp_path / "below.log")] == [
        "plain:",
        "child:",
        "grandchild:",
    ]

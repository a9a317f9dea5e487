"""brood trees as verifiers rollouts: a scripted policy behind a local OpenAI-compatible
server, played through verifiers' own episode path (env.serving, env.run_slot, the
interception endpoint, the rollout's scoring), a rubric, one rollout timing out."""

from __future__ import annotations

import asyncio
import json
import sys
import types

import pytest

from brood.journal import Journal
from tests.fake_openai import FakeOpenAI
from tests.util import SHARED, Gate

pytestmark = pytest.mark.train

vf = pytest.importorskip("verifiers.v1")
from brood.integrations.verifiers import (  # noqa: E402
    METADATA_KEY,
    BroodHarness,
    load_environment,
)

FENCE = "```"
PLUGIN = "brood_verifiers_rollouts"  # the environment package verifiers finds by id
CHILD_MODEL = "python:tests.test_verifiers_env:child_chat"
LIMITS = {**SHARED, "max_depth": 2, "max_iterations": 5}


def repl(code: str) -> str:
    return f"{FENCE}repl\n{code}\n{FENCE}"


def child_chat(messages: list[dict]) -> str:
    """The user's model for children and plain calls (not the policy)."""
    task = next(m["content"] for m in messages if m["role"] == "user")
    if "child: 6*7" in task:
        return repl("FINAL(str(6 * 7))")
    return "7"  # a plain llm_query


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData]):
    @vf.reward(weight=1.0)
    async def exact(self, trace: vf.Trace) -> float:
        """The rubric: 1 for the right answer, 0.5 for another, 0 for none."""
        reply = trace.last_reply
        return 1.0 if reply == self.data.answer else 0.5 if reply else 0.0


class SumTaskset(vf.Taskset[SumTask, vf.TasksetConfig]):
    def load(self) -> list[SumTask]:
        cfg = self.config.task
        return [
            SumTask(SumData(name="child", prompt="task-a: 6*7?", answer="42"), cfg),
            SumTask(SumData(name="plain", prompt="task-b: 4 then 7?", answer="48"), cfg),
            SumTask(
                SumData(
                    name="stuck",
                    prompt="task-c: never ends",
                    answer="0",
                    timeout=vf.TaskTimeout(agent=4.0),
                ),
                cfg,
            ),
        ]


@pytest.fixture
def plugin(monkeypatch):
    """An environment package as a user writes one: its taskset, with brood's harness
    re-exported, so brood is the taskset's harness."""
    module = types.ModuleType(PLUGIN)
    module.SumTaskset = SumTaskset
    module.BroodHarness = BroodHarness
    module.__all__ = ["BroodHarness", "SumTaskset"]
    monkeypatch.setitem(sys.modules, PLUGIN, module)
    return PLUGIN


def play(
    plugin: str, script: dict, harness: dict, monkeypatch, names=None, *, brood_loads=False
) -> tuple:
    """Each task of the taskset (those of `names` if given) played once through verifiers'
    own episode path, the policy served by a local OpenAI-compatible server; returns the
    traces by task name and the requests the policy's server received."""
    monkeypatch.setenv("BROOD_TEST_POLICY_KEY", "k")
    with FakeOpenAI(script) as server:
        if brood_loads:
            env = load_environment(plugin, **harness)
        else:
            config = vf.SingleAgentEnvConfig(
                taskset={"id": plugin},
                agent={
                    "runtime": {"type": "subprocess"},
                    "harness": {"id": plugin, **harness},
                },
            )
            env = vf.load_environment(config)
        ctx = vf.ModelContext(
            model="policy",
            client=vf.EvalClientConfig(
                base_url=server.base_url, api_key_var="BROOD_TEST_POLICY_KEY"
            ),
        )
        tasks = env.taskset if names is None else env.taskset.include(names=names)

        async def episodes() -> list:
            async with env.serving():
                slots = [slot for task in tasks for slot in env.slots(task, 1)]
                return await asyncio.gather(*(env.run_slot(slot, ctx) for slot in slots))

        played = asyncio.run(episodes())
        requests = server.requests
    return {e.task.data.name: e.traces[0] for e in played}, requests


def task_of(request) -> str:
    return request.first_user_message.split(":")[0][-6:]


def test_three_rollouts_are_brood_trees_scored_by_the_rubric_one_timing_out(
    plugin, tmp_path, monkeypatch
):
    stuck = Gate(tmp_path, "never-opened")
    script = {
        "task-a": [repl("x = rlm_query('child: 6*7?')\nFINAL(x)")],
        "task-b": [repl("y = llm_query('plain: say 7')\nprint(y)"), repl("FINAL('4' + y)")],
        "task-c": [repl(stuck.wait_code)],
    }
    store = f"sqlite:///{tmp_path / 'rollouts.db'}"
    harness = {"sub_model": CHILD_MODEL, "store": store, "limits": LIMITS}
    traces, policy_calls = play(plugin, script, harness, monkeypatch)
    assert {n: t.reward for n, t in traces.items()} == {"child": 1.0, "plain": 0.5, "stuck": 0.0}
    for trace in traces.values():  # as the eval runner and the trainer write them
        json.dumps(trace.to_record())

    # The trajectory is the root's own turns, as the policy saw them through the endpoint.
    child = traces["child"]
    assert child.ok and child.stop_condition == "agent_completed"
    assert child.num_turns == 1
    assert [m.role for m in child.messages] == ["system", "user", "assistant"]
    assert "rlm_query('child: 6*7?')" in child.messages[-1].content
    assert child.root_reply == "42"
    # The child's turns (on the user's model) are the metadata, with the tree's state.
    tree = child.info[METADATA_KEY]
    assert (tree["state"], tree["answer"]) == ("completed", "42")
    (kid,) = tree["children"]
    assert (kid["parent_id"], kid["depth"], kid["prompt"]) == (tree["run_id"], 1, "child: 6*7?")
    assert (kid["state"], kid["answer"]) == ("completed", "42")
    assert [m["role"] for m in kid["messages"]] == ["system", "user", "assistant"]
    assert "child: 6*7?" in kid["messages"][1]["content"]
    assert kid["messages"][-1]["content"] == repl("FINAL(str(6 * 7))")
    assert tree["calls"] == [] and kid["calls"] == []
    assert child.metrics["brood_runs"] == 2.0

    plain = traces["plain"]
    assert plain.num_turns == 2 and plain.root_reply == "47"
    assert [m.role for m in plain.messages] == ["system", "user", "assistant", "user", "assistant"]
    (call,) = plain.info[METADATA_KEY]["calls"]
    assert (call["kind"], call["response"]) == ("llm_query", "7")
    assert call["messages"] == [{"role": "user", "content": "plain: say 7"}]
    assert plain.info[METADATA_KEY]["children"] == []

    # Timed out (the task's own agent timeout): the tree was cancelled, its trace kept and
    # scored (no answer), its state recorded.
    late = traces["stuck"]
    assert late.is_timeout and late.stop_condition == "agent_timeout"
    assert late.rewards["exact"].score == 0.0
    assert late.last_reply == ""  # no answer (root_reply stays None if it made no turn)
    assert late.num_turns <= sum(task_of(r) == "task-c" for r in policy_calls) <= 1
    assert late.info[METADATA_KEY]["state"] == "cancelled"
    assert late.info[METADATA_KEY]["answer"] is None

    # Only the roots' turns reached the policy; each reward is journaled on its root.
    assert sorted(map(task_of, policy_calls))[:3] == ["task-a", "task-b", "task-b"]
    with Journal(store) as journal:
        rewards = sorted(
            [e["data"]["reward"] for e in journal.store.events(r["id"], "reward")]
            for r in journal.roots(10)
        )
    assert rewards == [[0.0], [0.5], [1.0]]


def test_a_tree_past_the_harness_timeout_ends_timed_out_and_is_scored(
    plugin, tmp_path, monkeypatch
):
    stuck = Gate(tmp_path, "never-opened")
    harness = {"sub_model": CHILD_MODEL, "timeout": 1.0, "limits": LIMITS}
    script = {"task-c": [repl(stuck.wait_code)]}
    traces, _ = play(plugin, script, harness, monkeypatch, names=["stuck"], brood_loads=True)
    late = traces["stuck"]
    assert late.is_timeout and late.stop_condition == "agent_timeout"
    assert late.info[METADATA_KEY]["state"] == "timed_out"
    assert late.reward == 0.0 and late.last_reply == ""


def test_without_a_sub_model_the_policy_plays_the_children_too_as_other_branches(
    plugin, monkeypatch
):
    script = {
        "task-a": [repl("x = rlm_query('child: 6*7?')\nFINAL(x)")],
        "child: 6*7": [repl("FINAL(str(6 * 7))")],
    }
    traces, policy_calls = play(plugin, script, {"limits": LIMITS}, monkeypatch, names=["child"])
    trace = traces["child"]
    assert trace.reward == 1.0 and trace.root_reply == "42"
    assert len(policy_calls) == 2 and trace.num_turns == 2
    # verifiers keeps the child's conversation as a branch of its own beside the root's
    firsts = sorted(b.messages[1].content.split(":")[0][-6:] for b in trace.branches)
    assert firsts == ["child", "task-a"]
    assert [c["state"] for c in trace.info[METADATA_KEY]["children"]] == ["completed"]


def test_a_policy_endpoint_that_fails_is_an_error_of_the_rollout_not_a_score(plugin, monkeypatch):
    # The policy's server has no reply for the task: it answers 400, and the root fails.
    traces, policy_calls = play(plugin, {}, {"limits": LIMITS}, monkeypatch, names=["child"])
    trace = traces["child"]
    assert not trace.ok and len(policy_calls) == 1
    assert trace.stop_condition == "provider_error" and trace.rewards == {}  # not scored
    assert "no script key" in trace.errors[-1].message
    assert trace.info[METADATA_KEY]["state"] == "failed"


def test_bad_harness_settings_are_refused_naming_the_field():
    from brood.integrations.verifiers import BroodHarnessConfig

    with pytest.raises(ValueError, match="no field 'max_dpth'; did you mean 'max_depth'"):
        BroodHarnessConfig(limits={"max_dpth": 2})
    with pytest.raises(ValueError, match=r"Limits\.max_depth must be >= 1"):
        BroodHarnessConfig(limits={"max_depth": 0})
    with pytest.raises(ValueError, match="sub_model: unknown model spec 'gpt-4'"):
        BroodHarnessConfig(sub_model="gpt-4")


def test_load_environment_wants_a_package_that_exports_brood_s_harness(monkeypatch):
    module = types.ModuleType("brood_verifiers_plain")
    module.SumTaskset = SumTaskset
    module.__all__ = ["SumTaskset"]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    with pytest.raises(vf.EnvError, match="does not export brood's harness; add `from brood"):
        load_environment(module.__name__)

"""A reward journaled for a run (a rubric's score), for the training exports to carry."""

import pytest

import brood
from brood.journal import Journal
from tests.util import FAST


def rewards(store: str, run_id: str) -> list[dict]:
    with Journal(store) as journal:
        return [e["data"] for e in journal.store.events(run_id, "reward")]


def test_a_run_s_reward_is_journaled_with_its_info(tmp_path):
    store = f"sqlite:///{tmp_path / 'j.db'}"
    with brood.Supervisor(lambda m: "```repl\nFINAL('4')\n```", store=store, limits=FAST) as sup:
        h = sup.spawn("2+2?")
        assert h.wait_result().answer == "4"
        h.record_reward(1.0, {"rubric": "exact"})
        with pytest.raises(brood.InvalidArgument, match="reward: must be a finite number"):
            h.record_reward(float("nan"))
        with pytest.raises(brood.InvalidArgument, match="JSON-serializable"):
            h.record_reward(0.5, {"x": object()})
    assert rewards(store, h.id) == [{"reward": 1.0, "info": {"rubric": "exact"}}]


def test_a_session_records_its_episode_s_reward(tmp_path):
    store = f"sqlite:///{tmp_path / 'j.db'}"
    with brood.Session(lambda m: "", store=store, limits=FAST) as env:
        with pytest.raises(brood.BroodError, match="no episode"):
            env.record_reward(1)
        env.reset("task")
        obs = env.step("FINAL('done')")
        assert obs.done
        env.record_reward(0.25)
        run_id = env.run_id
    assert rewards(store, run_id) == [{"reward": 0.25}]

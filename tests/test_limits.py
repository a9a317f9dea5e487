"""Limits: validated, keyword-only, frozen; admission refuses with a LimitExceeded that explains."""

from __future__ import annotations

import dataclasses
import math
import pickle

import pytest

from brood.errors import BroodError, InvalidArgument, LimitExceeded
from brood.limits import Limits

FLAGS = {"confine", "network", "read_only"}
PATHS = {"fs_read", "fs_write"}
# The numeric fields: the tests below go through each of them.
FIELDS = [
    f.name
    for f in dataclasses.fields(Limits)
    if f.name not in FLAGS | PATHS | {"blocked_builtins", "pools", "models"}
]
WORKER = {
    "worker_memory",
    "worker_cpu_seconds",
    "worker_processes",
    "worker_file_size",
    "worker_open_files",
    "worker_disk",
}
OPTIONAL = {
    "child_timeout",
    "step_timeout",
    "stall_timeout",
    "token_budget",
    "cost_budget",
    "compact_at",
    "hibernate_after",
    "max_workers",
} | WORKER
AT_LEAST_ONE = {"max_depth", "max_concurrency", "max_iterations", "max_workers"}
# 0 s: "already expired"; compact_at 0: every turn would compact
POSITIVE = {"child_timeout", "step_timeout", "stall_timeout", "compact_at"}
FLOOR = (
    {name: 1 for name in AT_LEAST_ONE}
    | {"output_limit": 100, "answer_limit": 100}
    | {"max_prompt_chars": 2_000, "max_chunks": 1}
    | {"worker_memory": 64 * 2**20, "worker_cpu_seconds": 1, "worker_processes": 1}
    | {"worker_file_size": 1, "worker_open_files": 16}
    | {"worker_disk": 2**20, "journal_bytes_per_run": 2**20}
)
INT_FIELDS = {
    "max_depth",
    "max_children",
    "max_children_per_run",
    "max_concurrency",
    "max_iterations",
    "token_budget",
    "output_limit",
    "answer_limit",
    "max_prompt_chars",
    "max_chunks",
    "journal_bytes_per_run",
    "max_asks_per_run",
    "compact_at",
    "max_workers",
} | WORKER


def test_defaults_are_valid_and_round_trip_through_to_dict() -> None:
    limits = Limits()
    others = {"blocked_builtins", "pools", "models"}
    assert set(limits.to_dict()) == set(FIELDS) | FLAGS | PATHS | others
    assert Limits(**limits.to_dict()) == limits
    custom = Limits(max_depth=2, max_children=64, child_timeout=None, pools={"gpu": 2})
    assert Limits(**custom.to_dict()) == custom


def test_limits_are_keyword_only_and_frozen() -> None:
    with pytest.raises(TypeError):
        Limits(2)  # type: ignore[misc]
    limits = Limits(max_depth=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        limits.max_depth = 5  # type: ignore[misc]


def test_to_dict_is_a_copy() -> None:
    limits = Limits()
    d = limits.to_dict()
    d["max_depth"] = 99
    assert limits.max_depth == 3


@pytest.mark.parametrize("name", FIELDS)
@pytest.mark.parametrize("bad", ["3", True, [1], object()])
def test_a_non_number_is_refused_naming_the_field(name: str, bad: object) -> None:
    kind = "a whole number" if name in INT_FIELDS else "a number"
    with pytest.raises(InvalidArgument, match=rf"Limits\.{name} must be {kind}") as info:
        Limits(**{name: bad})
    assert type(bad).__name__ in str(info.value)


@pytest.mark.parametrize("name", sorted(set(FIELDS) - POSITIVE))
def test_a_negative_value_is_refused_naming_the_field_and_floor(name: str) -> None:
    floor = FLOOR.get(name, 0)
    with pytest.raises(InvalidArgument, match=rf"Limits\.{name} must be >= {floor}, got -1"):
        Limits(**{name: -1})


@pytest.mark.parametrize("name", sorted(FLAGS))
@pytest.mark.parametrize("bad", [0, "yes", None])
def test_a_flag_must_be_true_or_false(name: str, bad: object) -> None:
    with pytest.raises(InvalidArgument, match=rf"Limits\.{name} must be True or False"):
        Limits(**{name: bad})


@pytest.mark.parametrize("name", sorted(PATHS))
def test_paths_are_a_list_made_absolute_and_a_bad_one_is_refused(name: str) -> None:
    import os

    assert getattr(Limits(**{name: ["data", "/srv"]}), name) == (
        os.path.abspath("data"),
        "/srv",
    )
    assert getattr(Limits(**{name: "/srv"}), name) == ("/srv",)
    with pytest.raises(InvalidArgument, match=rf"Limits\.{name} must be a list of paths"):
        Limits(**{name: [3]})


def test_blocked_builtins_take_names_or_the_pi_rlm_preset() -> None:
    assert Limits(blocked_builtins="pi-rlm").blocked_builtins == (
        "eval",
        "exec",
        "compile",
        "globals",
        "locals",
    )
    assert Limits(blocked_builtins=["open"]).blocked_builtins == ("open",)
    with pytest.raises(InvalidArgument, match="preset 'strict' is unknown"):
        Limits(blocked_builtins="strict")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="list of builtin names"):
        Limits(blocked_builtins=["not a name"])


def test_a_blocked_builtin_that_is_no_builtin_is_refused_naming_the_close_one() -> None:
    """A typo would block nothing at all, silently."""
    with pytest.raises(InvalidArgument) as info:
        Limits(blocked_builtins=["open", "evl"])
    message = str(info.value)
    assert message.startswith("Limits.blocked_builtins: 'evl' is not a Python builtin")
    assert "did you mean 'eval'?" in message
    with pytest.raises(InvalidArgument, match="'llm_query' is not a Python builtin"):
        Limits(blocked_builtins=("llm_query",))
    assert Limits(blocked_builtins=["__import__", "print"]).blocked_builtins == (
        "__import__",
        "print",
    )


@pytest.mark.parametrize("name", sorted(POSITIVE))
@pytest.mark.parametrize("value", [0, -1])
def test_a_timeout_must_be_positive_or_none(name: str, value: int) -> None:
    with pytest.raises(InvalidArgument, match=rf"Limits\.{name} must be > 0, .*use None"):
        Limits(**{name: value})


@pytest.mark.parametrize("name", sorted(AT_LEAST_ONE))
def test_zero_is_refused_where_at_least_one_is_needed(name: str) -> None:
    with pytest.raises(InvalidArgument, match=rf"Limits\.{name} must be >= 1, got 0"):
        Limits(**{name: 0})


@pytest.mark.parametrize("name", sorted(set(FIELDS) - set(FLOOR) - POSITIVE))
def test_zero_is_accepted_elsewhere(name: str) -> None:
    assert getattr(Limits(**{name: 0}), name) == 0


@pytest.mark.parametrize("name", sorted(OPTIONAL))
def test_optional_limits_accept_none(name: str) -> None:
    assert getattr(Limits(**{name: None}), name) is None


def accepted(values: dict[str, object]) -> list[str]:
    """The fields whose bad value `Limits` accepts instead of raising InvalidArgument."""
    taken = []
    for name, value in values.items():
        try:
            Limits(**{name: value})
        except InvalidArgument as exc:
            assert f"Limits.{name}" in str(exc)
        else:
            taken.append(name)
    return taken


def test_required_limits_refuse_none() -> None:
    assert accepted(dict.fromkeys(sorted(set(FIELDS) - OPTIONAL))) == []


def test_nan_is_refused() -> None:
    assert accepted(dict.fromkeys(sorted(OPTIONAL - {"token_budget"}), math.nan)) == []


def test_integer_limits_refuse_fractions() -> None:
    assert accepted(dict.fromkeys(sorted(INT_FIELDS), 2.5)) == []


# ---- depth --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("max_depth", "depth", "allowed"),
    [(1, 0, False), (2, 0, True), (2, 1, False), (3, 1, True), (3, 2, False)],
)
def test_a_run_starts_children_only_if_depth_plus_one_is_below_max_depth(
    max_depth: int, depth: int, allowed: bool
) -> None:
    assert Limits(max_depth=max_depth).can_start_child(depth) is allowed


# ---- admission ----------------------------------------------------------------------------
def test_children_up_to_the_limits_are_admitted() -> None:
    limits = Limits(max_children=10, max_children_per_run=4)
    limits.admit_children(tree_total=6, run_total=0, count=4)
    limits.admit_children(tree_total=0, run_total=3, count=1)
    limits.admit_children(tree_total=10, run_total=4, count=0)


def test_too_many_children_in_the_tree_is_refused_with_values_and_fix() -> None:
    limits = Limits(max_children=10, max_children_per_run=64)
    with pytest.raises(LimitExceeded) as info:
        limits.admit_children(tree_total=8, run_total=0, count=3)
    exc = info.value
    assert (exc.kind, exc.value, exc.limit) == ("max_children", 11, 10)
    message = str(exc)
    assert "max_children" in message and "11" in message and "10" in message
    assert "the tree has 8 children already" in message
    assert "Limits(max_children=...)" in message


def test_too_many_children_of_one_run_is_refused_with_values_and_fix() -> None:
    limits = Limits(max_children=100, max_children_per_run=4)
    with pytest.raises(LimitExceeded) as info:
        limits.admit_children(tree_total=4, run_total=4, count=1)
    exc = info.value
    assert (exc.kind, exc.value, exc.limit) == ("max_children_per_run", 5, 4)
    assert "this run has 4 children already" in str(exc)
    assert "Limits(max_children_per_run=...)" in str(exc)


def test_the_tree_limit_is_reported_first_when_both_break() -> None:
    limits = Limits(max_children=2, max_children_per_run=2)
    with pytest.raises(LimitExceeded) as info:
        limits.admit_children(tree_total=2, run_total=2, count=1)
    assert info.value.kind == "max_children"


def test_limit_exceeded_is_a_brood_error_with_a_default_fix() -> None:
    exc = LimitExceeded("max_iterations", 21, 20)
    assert isinstance(exc, BroodError)
    assert str(exc) == (
        "limit max_iterations exceeded: this request would reach 21, the limit is 20; "
        "raise Limits(max_iterations=...) or do with fewer"
    )


def test_limit_exceeded_pickles_with_its_fields() -> None:
    exc = pickle.loads(pickle.dumps(LimitExceeded("max_children", 11, 10)))
    assert (exc.kind, exc.value, exc.limit) == ("max_children", 11, 10)


def test_limit_exceeded_pickles_with_its_message() -> None:
    limits = Limits(max_children=10)
    with pytest.raises(LimitExceeded) as info:
        limits.admit_children(tree_total=8, run_total=0, count=3)
    assert str(pickle.loads(pickle.dumps(info.value))) == str(info.value)


def test_models_is_an_allow_list_of_names() -> None:
    assert Limits().models is None
    assert Limits(models=["a", "b", "a"]).models == ("a", "b")
    with pytest.raises(InvalidArgument, match=r"Limits\.models must be a list of model names"):
        Limits(models="gpt-4.1")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match=r"Limits\.models: '' is not a model name"):
        Limits(models=[""])

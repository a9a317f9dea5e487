"""Retries of an OpenAI-compatible server's 429 and 5xx answers, with the clock faked."""

from __future__ import annotations

import json

import pytest

import brood
from tests.fake_openai import FakeOpenAI, Reply
from tests.util import FAST

FINAL_OK = "```repl\nFINAL('ok')\n```"


def recording_sleep(path):
    """A `sleep` for OpenAIModel that records the waits instead of sleeping."""

    def sleep(seconds: float) -> None:
        with open(path, "a") as f:
            f.write(json.dumps(seconds) + "\n")

    return sleep


def waits(path) -> list[float]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_429_and_5xx_are_retried_honoring_retry_after(tmp_path, gate_clock):
    """In a tree, a 429 is the gateway's: its gate waits the Retry-After for every call to
    the endpoint (jittered up to 10%). The model retries 5xx answers itself."""
    script = {
        "task": [
            Reply(status=429, error="slow down", headers=(("Retry-After", "7"),)),
            Reply(status=503, error="overloaded"),
            Reply(status=500, error="oops", headers=(("retry-after-ms", "250"),)),
            FINAL_OK,
        ]
    }
    log = tmp_path / "sleeps"
    with FakeOpenAI(script) as server:
        model = brood.OpenAIModel(
            "m", base_url=server.base_url, max_retries=4, sleep=recording_sleep(log)
        )
        with brood.Supervisor(model, limits=FAST) as sup:
            result = sup.run("task")
        statuses = [ex.status for ex in server.requests]
    assert result.answer == "ok"
    assert statuses == [429, 503, 500, 200]
    assert len(gate_clock) == 1 and 7.0 <= gate_clock[0] <= 7.7
    # Retry-After honored; without it, brood's own backoff (0.5 s doubling).
    assert waits(log) == [0.5, 0.25]


def test_a_429_that_never_lifts_fails_the_run_rate_limited(tmp_path, gate_clock):
    script = {"task": [Reply(status=429, error="quota exhausted")] * 5}
    log = tmp_path / "sleeps"
    with FakeOpenAI(script) as server:
        model = brood.OpenAIModel(
            "m", base_url=server.base_url, max_retries=2, sleep=recording_sleep(log)
        )
        with brood.Supervisor(model, limits=FAST) as sup:
            result = sup.run("task")
        assert len(server.requests) == 5  # the gateway's 5 tries; the model retried none
    assert result.state == "failed"
    assert result.error.startswith("model error: rate limited: model 'm' at http://127.0.0.1:")
    assert "RateLimitError" in result.error and "quota exhausted" in result.error
    assert "tried 5 times" in result.error
    assert waits(log) == []
    # 1 s doubling, each with up to 10% jitter
    assert len(gate_clock) == 4, gate_clock
    for wait, base in zip(gate_clock, [1, 2, 4, 8], strict=True):
        assert base <= wait <= base * 1.1, gate_clock


def test_outside_a_tree_openai_model_retries_429_then_raises_rate_limited(tmp_path):
    script = {
        "task": [Reply(status=429, error="quota exhausted", headers=(("Retry-After", "3"),))] * 3
    }
    log = tmp_path / "sleeps"
    with FakeOpenAI(script) as server:
        model = brood.OpenAIModel(
            "m", base_url=server.base_url, max_retries=2, sleep=recording_sleep(log)
        )
        with pytest.raises(brood.RateLimited) as caught:
            model.complete([{"role": "user", "content": "task"}])
        assert len(server.requests) == 3
    assert caught.value.retry_after == 3.0
    assert isinstance(caught.value, brood.ModelError)
    assert "RateLimitError after 3 tries" in str(caught.value)
    assert "quota exhausted" in str(caught.value)
    assert waits(log) == [3.0, 3.0]


def test_a_huge_retry_after_is_capped(tmp_path, gate_clock, caplog):
    script = {
        "task": [Reply(status=429, headers=(("Retry-After", "86400"),)), "ok"],
        "tree": [Reply(status=429, headers=(("Retry-After", "86400"),)), FINAL_OK],
    }
    log = tmp_path / "sleeps"
    with FakeOpenAI(script) as server:
        model = brood.OpenAIModel("m", base_url=server.base_url, sleep=recording_sleep(log))
        assert model.complete([{"role": "user", "content": "task"}]).text == "ok"
        assert waits(log) == [30.0]  # the model's own retry: at most 30 s
        with brood.Supervisor(model, limits=FAST) as sup:
            assert sup.run("tree").answer == "ok"
    # the gateway's gate: at most 60 s (plus jitter), and said in the log
    assert len(gate_clock) == 1 and 60.0 <= gate_clock[0] <= 66.0
    assert "asked to wait 86400" in caplog.text


def test_a_client_error_is_not_retried(tmp_path):
    script = {"task": [Reply(status=400, error="bad request"), FINAL_OK]}
    with FakeOpenAI(script) as server:
        model = brood.OpenAIModel("m", base_url=server.base_url, sleep=recording_sleep(tmp_path))
        with brood.Supervisor(model, limits=FAST) as sup:
            result = sup.run("task")
        assert len(server.requests) == 1
    assert result.state == "failed" and "BadRequestError" in result.error


def test_a_reply_that_is_not_a_chat_completion_is_retried_then_named(tmp_path):
    garbage = Reply(raw=b"<html>gateway error</html>")
    log = tmp_path / "sleeps"
    with FakeOpenAI({"task": [garbage, FINAL_OK], "other": [garbage] * 2}) as server:
        url = server.base_url
        model = brood.OpenAIModel("m", base_url=url, max_retries=1, sleep=recording_sleep(log))
        with brood.Supervisor(model, limits=FAST) as sup:
            recovered = sup.run("task")
            failed = sup.run("other")
    assert recovered.answer == "ok"
    assert waits(log) == [0.5, 0.5]  # each retried once, like a 5xx
    assert failed.state == "failed"
    assert (
        f"model 'm' at {url}: the reply is not a chat completion (2 tries): HTTP 200, "
        "application/json, 26 bytes: '<html>gateway error</html>'"
    ) in failed.error
    assert "JSONDecodeError" not in failed.error


PAGE = b"<html><body>\x1b]0;owned\x07\x1b[2J502 Bad Gateway\r" + b"." * 300 + b"</body></html>"


@pytest.mark.parametrize(
    ("reply", "told"),
    [
        (
            Reply(raw=b"<html>gateway error</html>", content_type="text/html"),
            "the reply is not a chat completion (3 tries): HTTP 200, text/html, 26 bytes: "
            "'<html>gateway error</html>'",
        ),
        (
            Reply(raw=b'{"detail": "no such route"}'),
            "the reply is not a chat completion (3 tries): HTTP 200, application/json, 27 "
            """bytes: '{"detail": "no such route"}'""",
        ),
        (
            Reply(raw=b"[1, 2]"),
            "the reply is not a chat completion (3 tries): HTTP 200, application/json, 6 "
            "bytes: '[1, 2]'",
        ),
        (
            Reply(raw=b"", content_type="text/plain"),
            "the reply is not a chat completion (3 tries): HTTP 200, text/plain, an empty body",
        ),
        (
            Reply(status=502, raw=PAGE, content_type="text/html; charset=utf-8"),
            f"an error reply (3 tries): HTTP 502, text/html; charset=utf-8, {len(PAGE)} bytes, "
            "the first 200: '<html><body>\\x1b]0;owned\\x07\\x1b[2J502 Bad Gateway\\r...",
        ),
    ],
    ids=["html", "other-json", "json-list", "empty", "error-page"],
)
def test_a_reply_that_is_not_a_chat_completion_says_what_came_back(tmp_path, reply, told):
    """Status, content type and the first 200 bytes of the body, escaped so a terminal
    shows them rather than obeying them; never a Python class name such as JSONDecodeError
    or AttributeError."""
    log = tmp_path / "sleeps"
    with FakeOpenAI({"task": [reply] * 3}) as server:
        url = server.base_url
        model = brood.OpenAIModel("m", base_url=url, max_retries=2, sleep=recording_sleep(log))
        with pytest.raises(brood.ModelError) as caught:
            model.complete([{"role": "user", "content": "task"}])
        assert len(server.requests) == 3
    message = str(caught.value)
    assert message.startswith(f"model 'm' at {url}: {told}"), message
    assert not any(word in message for word in ("Error", "JSONDecode", "Attribute"))
    assert message.isprintable(), "no control character reaches a terminal"
    if reply.raw == PAGE:  # 200 bytes of the body, then no more
        shown = message.split(": '", 1)[1].removesuffix("'")
        assert shown.encode().decode("unicode_escape").encode("latin-1") == PAGE[:200]
    assert waits(log) == [0.5, 1.0]  # retried like a 5xx


def test_in_a_tree_an_error_page_fails_the_run_saying_what_came_back(tmp_path):
    page = Reply(status=503, raw=b"<h1>Service Unavailable</h1>", content_type="text/html")
    with FakeOpenAI({"task": [page] * 2}) as server:
        url = server.base_url
        model = brood.OpenAIModel(
            "m", base_url=url, max_retries=1, sleep=recording_sleep(tmp_path / "sleeps")
        )
        with brood.Supervisor(model, limits=FAST) as sup:
            failed = sup.run("task")
    assert failed.state == "failed"
    assert failed.error == (
        f"model error: model 'm' at {url}: an error reply (2 tries): HTTP 503, text/html, 28 "
        "bytes: '<h1>Service Unavailable</h1>'"
    )

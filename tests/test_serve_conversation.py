"""Conversations over `brood serve`'s OpenAI-compatible endpoint, driven by the real
`openai` client: `conversation_id` ("new", then the id the answer carries) makes each
chat completion a turn of one root REPL."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from brood.journal import Journal
from tests.test_conversation import scripted_chat
from tests.test_serve import TOKEN, serving


def client_of(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=TOKEN, max_retries=0)


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def test_the_openai_client_continues_a_conversation_by_its_id(tmp_path):
    seen, chat = scripted_chat()
    with serving(tmp_path, chat) as s:
        client = client_of(s.base_url)
        messages = [{"role": "system", "content": "be brief"}, *user("please set x")]
        raw = client.chat.completions.with_raw_response.create(
            model="chat", messages=messages, extra_body={"conversation_id": "new"}
        )
        first = raw.parse()
        conv_id = first.model_extra["conversation_id"]
        assert raw.headers["x-brood-conversation-id"] == conv_id
        assert raw.headers["x-brood-run-id"] == conv_id
        assert first.choices[0].message.content == "x is set"
        assert first.usage is not None and first.usage.total_tokens == 0
        # A client that keeps the whole exchange sends it again: only its last user
        # message is read, the conversation holds its own history.
        again = [*messages, {"role": "assistant", "content": "x is set"}, *user("now double x")]
        second = client.chat.completions.create(
            model="chat", messages=again, extra_body={"conversation_id": conv_id}
        )
        assert second.choices[0].message.content == "y is 42"
        assert second.model_extra["conversation_id"] == conv_id
        chunks = list(
            client.chat.completions.create(
                model="chat",
                messages=user("add them"),
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"conversation_id": conv_id},
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == "sum is 63"
        assert chunks[-1].usage is not None
        assert {c.model_extra["conversation_id"] for c in chunks} == {conv_id}
        root = s.client.get(f"/v1/runs/{conv_id}").json()
        assert root["state"] == "running"  # between turns
    history = [m["content"] for m in seen[-1]]
    assert history[1].startswith("please set x")
    assert "`context` is a list of 1 item" in history[1]  # the other messages: its context
    assert history[3::2] == ["now double x", "add them", "[output]\n63\n"]


def test_a_conversation_goes_on_in_a_server_started_again(tmp_path):
    _, chat = scripted_chat()
    with serving(tmp_path, chat) as s:
        first = client_of(s.base_url).chat.completions.create(
            model="chat", messages=user("set x"), extra_body={"conversation_id": "new"}
        )
    conv_id = first.model_extra["conversation_id"]
    seen, chat = scripted_chat()
    with serving(tmp_path, chat) as s:
        second = client_of(s.base_url).chat.completions.create(
            model="chat", messages=user("double x"), extra_body={"conversation_id": conv_id}
        )
        assert second.choices[0].message.content == "y is 42"
    assert len(seen) == 1  # the first turn was replayed from the journal, not asked again


def test_bad_conversation_ids_are_refused_naming_the_field(tmp_path):
    _, chat = scripted_chat()
    with serving(tmp_path, chat) as s:
        client = client_of(s.base_url)

        def turn(conv_id, text="set x"):
            return client.chat.completions.create(
                model="chat", messages=user(text), extra_body={"conversation_id": conv_id}
            )

        with pytest.raises(openai.NotFoundError):
            turn("r-00000000")
        with pytest.raises(openai.UnprocessableEntityError) as wrong_type:
            turn(7)
        assert "conversation_id must be" in str(wrong_type.value)
        plain = client.chat.completions.with_raw_response.create(model="chat", messages=user("x"))
        with pytest.raises(openai.UnprocessableEntityError, match="not a conversation"):
            turn(plain.headers["x-brood-run-id"])
        conv_id = turn("new").model_extra["conversation_id"]
        cancelled = s.client.post(f"/v1/runs/{conv_id}/cancel")
        assert cancelled.json()["state"] == "cancelled"
        with pytest.raises(openai.ConflictError) as closed:
            turn(conv_id, "double x")
        error = json.loads(closed.value.response.text)["error"]
        assert f"conversation {conv_id} is closed (cancelled" in error["message"]
        assert error["fix"] == 'pass "conversation_id": "new" to start another conversation'


def test_past_its_bound_a_server_suspends_the_least_recently_used_conversation(
    tmp_path, monkeypatch
):
    monkeypatch.setattr("brood.serve.host.LIVE_CONVERSATIONS", 1)
    seen, chat = scripted_chat()
    with serving(tmp_path, chat) as s:
        client = client_of(s.base_url)

        def turn(conv_id: str, text: str) -> Any:
            return client.chat.completions.create(
                model="chat", messages=user(text), extra_body={"conversation_id": conv_id}
            )

        a = turn("new", "set x").model_extra["conversation_id"]
        b = turn("new", "set x").model_extra["conversation_id"]
        assert turn(a, "double x").choices[0].message.content == "y is 42"
        assert turn(b, "double x").choices[0].message.content == "y is 42"
    assert len(seen) == 4  # each turn asked once: a suspended one is replayed, not asked
    with Journal(f"sqlite:///{tmp_path / 'brood.db'}") as journal:
        reasons = [e["data"]["reason"] for e in journal.store.events(a, "suspended")]
    assert reasons[0] == "suspended between turns; the next turn resumes it from the journal"

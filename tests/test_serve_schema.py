"""`brood serve` against its own OpenAPI document, property-based (schemathesis): requests
drawn from the document the server serves at GET /openapi.json, valid and invalid, reach a
real server (a uvicorn thread, a file journal, a scripted model, real workers:
`tests.test_serve.serving`). Whatever they carry, no answer is a 5xx or shows a traceback,
and every refusal is JSON with an "error" object; without the token, or with a wrong one,
every request is refused with 401 and does nothing.

Bounded and reproducible: a few dozen requests per operation, the same ones on every run
(derandomized), no example database written. One server serves every operation of a test:
a server per operation would start a supervisor and its workers each time."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import schemathesis
import schemathesis.checks
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import APIOperation, BaseSchema, Case, GenerationMode

from tests.test_serve import (
    BREAK,
    GREET,
    SCRIPT,
    TOKEN,
    Served,
    code,
    flow_status,
    serving,
    until,
    wait_state,
)

AUTH = {"Authorization": f"Bearer {TOKEN}"}
# Any prompt is answered at once, so every run a drawn request starts ends quickly; the
# prompts of tests.test_serve keep their replies (a spawning tree, an ask, a broken model).
ANY_PROMPT = dict(SCRIPT, **{"": [code("FINAL('ok')")]})
CONTEXT = [{"role": "user", "content": "seeded"}]  # what the spawning root reads
MODEL = "scripted"  # the served model's name, the only one a chat completion may ask for
TRACEBACK = ("Traceback", 'File "')
# Streams that follow a tree until its root has ended: never asked about a live run.
STREAMS = ("/v1/runs/{run_id}/events", "/v1/runs/{run_id}/tree/live")
EXAMPLES = 30  # requests drawn per operation
TIMEOUT_S = 15  # a request's bound; none comes near it

BOUNDED = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],  # a request that starts a run is slow
)


# ---- the server under test ---------------------------------------------------------------
@dataclass
class Seeded:
    """A server, and ids its journal holds: ended runs, a live one, an open ask."""

    served: Served
    ended: list[str]
    live: list[str]
    asks: list[str]


@pytest.fixture
def seeded(tmp_path) -> Iterator[Seeded]:
    """A server whose journal holds a finished tree (a root and its child), a failed run, a
    finished flow, a paused one (live), and an open ask."""
    with serving(tmp_path, script=ANY_PROMPT) as s:
        c = s.client
        tree = c.post("/v1/runs", json={"prompt": "spawning root", "context": CONTEXT})
        failed = c.post("/v1/runs", json={"prompt": "broken root"})
        asking = c.post("/v1/runs", json={"prompt": "asking root"})
        finished = c.post("/v1/flows", json={"spec": GREET, "inputs": {"name": "owls"}})
        paused = c.post("/v1/flows", json={"spec": BREAK, "inputs": {"name": "x"}})
        tree_id, failed_id = tree.json()["run_id"], failed.json()["run_id"]
        finished_id, paused_id = finished.json()["run_id"], paused.json()["run_id"]
        wait_state(c, tree_id, "completed")
        wait_state(c, failed_id, "failed")
        flow_status(c, finished_id, "finished")
        flow_status(c, paused_id, "paused")
        (ask,) = until(lambda: c.get("/v1/asks").json()["asks"])
        assert ask["run_id"] == asking.json()["run_id"]
        (child,) = c.get(f"/v1/runs/{tree_id}/tree").json()["children"]
        ended = [tree_id, child["id"], failed_id, finished_id]
        yield Seeded(s, ended=ended, live=[paused_id], asks=[ask["id"]])


def document(s: Served) -> BaseSchema:
    """The document the server serves, loaded by schemathesis."""
    return schemathesis.openapi.from_dict(s.client.get("/openapi.json").json())


def operations(api: BaseSchema) -> list[APIOperation]:
    """The document's operations, those that end a run or a flow last (so the others find
    the live ones live)."""
    found = [result.ok() for result in api.get_all_operations()]
    assert len(found) > 15
    return sorted(found, key=lambda op: op.path.endswith(("/cancel", "/stop")))


def reaching(api: BaseSchema, seeded: Seeded) -> BaseSchema:
    """Requests about a run, a flow or an ask name a drawn id or one the journal holds, and
    some chat completions ask the served model: so they reach the endpoints' work, not only
    their 404."""

    def flatmap_path_parameters(context: Any, path_parameters: Any) -> st.SearchStrategy[Any]:
        if not isinstance(path_parameters, dict) or context.operation is None:
            return st.just(path_parameters)
        runs = seeded.ended + ([] if context.operation.path in STREAMS else seeded.live)
        variants = [st.just(path_parameters)]
        for name, ids in (("run_id", runs), ("ask_id", seeded.asks)):
            if name in path_parameters:
                variants.append(
                    st.sampled_from(ids).map(lambda i, n=name: {**path_parameters, n: i})
                )
        return st.one_of(variants)

    def flatmap_body(context: Any, body: Any) -> st.SearchStrategy[Any]:
        """A body as drawn, or one that does the endpoint's work: a chat completion asking
        the served model, with a last message that is a user's with text; a flow with a
        spec the model can run."""
        path = None if context.operation is None else context.operation.path
        if not isinstance(body, dict) or path not in ("/v1/chat/completions", "/v1/flows"):
            return st.just(body)
        if path == "/v1/flows":
            inputs = body["inputs"] if isinstance(body.get("inputs"), dict) else {}
            return st.sampled_from([body, dict(body, spec=GREET, inputs={**inputs, "name": "x"})])
        messages = list(body["messages"]) if isinstance(body.get("messages"), list) else []
        last = messages.pop() if messages and isinstance(messages[-1], dict) else {}
        content = last.get("content")
        if not isinstance(content, str) or not content.strip():
            content = "say ok"
        task = dict(last, role="user", content=content)
        return st.sampled_from([body, dict(body, model=MODEL, messages=[*messages, task])])

    api.hook(flatmap_path_parameters)
    api.hook(flatmap_body)
    return api


def for_each_request(
    operation: APIOperation,
    check: Callable[[Case], None],
    modes: tuple[GenerationMode, ...] = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE),
) -> None:
    """`check` every request drawn for `operation`, valid ones and invalid ones."""

    @BOUNDED
    @given(case=st.one_of([operation.as_strategy(mode) for mode in modes]))
    def each(case: Case) -> None:
        check(case)

    each()


# ---- what every answer must be ---------------------------------------------------------
def tracebacks(value: Any) -> list[str]:
    """The strings in a JSON value that show a traceback, but for the `error` of a run row:
    the traceback tail of a failed run, what the journal keeps (README, the `runs` table)."""
    if isinstance(value, str):
        return [value] if any(mark in value for mark in TRACEBACK) else []
    if isinstance(value, list):
        return [t for item in value for t in tracebacks(item)]
    if isinstance(value, dict):
        row = {"id", "state", "error"} <= value.keys()
        return [t for k, v in value.items() if not (row and k == "error") for t in tracebacks(v)]
    return []


def body_tracebacks(content_type: str, text: str) -> list[str]:
    """The tracebacks in a body: a JSON one, or each line of an event stream (its `data:`
    as JSON when it is), or any other text."""
    if content_type.startswith("application/json"):
        return tracebacks(json.loads(text))
    if not content_type.startswith("text/event-stream"):
        return tracebacks(text)
    found = []
    for line in text.splitlines():
        data = line.removeprefix("data:")
        try:
            found += tracebacks(json.loads(data) if data != line else line)
        except ValueError:
            found += tracebacks(line)
    return found


def answered(case: Case, base_url: str, headers: dict[str, str]) -> Any:
    """Send `case`, and check its answer: no 5xx, no traceback, and a refusal is JSON with
    an "error" object that says something."""
    response = case.call(base_url=base_url, headers=headers, timeout=TIMEOUT_S)
    sent = f"{case.as_curl_command(base_url=base_url)}\n-> {response.status_code}"
    text = response.content.decode("utf-8", "replace")
    content_type = response.headers.get("content-type", [""])[0]
    assert response.status_code < 500, f"{sent} {text[:2000]}"
    assert not body_tracebacks(content_type, text), f"{sent} {text[:4000]}"
    if response.status_code >= 400:
        assert content_type.startswith("application/json"), f"{sent} {content_type}: {text}"
        error = json.loads(text)["error"]
        assert isinstance(error, dict) and isinstance(error.get("message"), str), sent
        assert error["message"].strip(), f"{sent} {text}"
    return response


# ---- the properties ----------------------------------------------------------------------
def test_no_request_gets_a_5xx_or_a_traceback_and_every_refusal_is_json(seeded, subtests):
    base_url = seeded.served.base_url
    for operation in operations(reaching(document(seeded.served), seeded)):
        with subtests.test(msg=operation.label):
            for_each_request(operation, lambda case: answered(case, base_url, AUTH))


# The operations whose bodies the document describes whole.
DESCRIBED = ("POST /v1/runs", "POST /v1/runs/{run_id}/send")


def test_a_body_the_document_calls_valid_is_never_refused_as_malformed(seeded, subtests):
    """It starts a run or reaches one (or finds its id unknown, or the run ended): never a
    400 or a 422, which would say the document allows what the server refuses."""
    base_url = seeded.served.base_url

    def taken(case: Case) -> None:
        response = answered(case, base_url, AUTH)
        accepted = schemathesis.checks.positive_data_acceptance
        case.validate_response(response, checks=[accepted], headers=AUTH)

    api = reaching(document(seeded.served), seeded)
    described = [op for op in operations(api) if op.label in DESCRIBED]
    assert len(described) == len(DESCRIBED)
    for operation in described:
        with subtests.test(msg=operation.label):
            for_each_request(operation, taken, modes=(GenerationMode.POSITIVE,))


WRONG = [None, "", "Bearer", "Bearer wrong", f"Bearer {TOKEN}x", f"Basic {TOKEN}", TOKEN]


def test_without_the_right_token_every_request_is_refused_with_401_json_and_does_nothing(
    tmp_path,
):
    with serving(tmp_path, script=ANY_PROMPT) as s:
        every = st.one_of([op.as_strategy() for op in operations(document(s))])

        @settings(BOUNDED, max_examples=4 * EXAMPLES)
        @given(case=every, authorization=st.sampled_from(WRONG))
        def refused(case: Case, authorization: str | None) -> None:
            headers = {} if authorization is None else {"Authorization": authorization}
            response = answered(case, s.base_url, headers)
            assert response.status_code == 401, case.as_curl_command(base_url=s.base_url)
            assert response.headers["www-authenticate"] == ["Bearer"]
            assert "Authorization: Bearer" in response.json()["error"]["fix"]

        refused()
        assert s.client.get("/v1/runs").json()["runs"] == []  # no run, no flow was started

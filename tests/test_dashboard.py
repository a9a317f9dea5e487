"""The dashboard in a real headless Chromium (Debian's `chromium`, driven by Playwright):
a real uvicorn server, a file journal, a scripted model and real workers. `make test-all`
runs these; each test leaves a screenshot in its temporary folder."""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from brood.backends.owners import owner_token
from brood.lifecycle import RunRecord, RunState
from brood.store.base import open_store
from tests.test_serve import TOKEN, Served, code, serving, until, wait_state

playwright = pytest.importorskip("playwright.sync_api")

pytestmark = pytest.mark.browser

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
WAIT_MS = 30_000  # the longest a page waits for what a test expects
KIDS_PAGE = 50  # children an open node shows at first (dash.js)


class Gate:
    """A scripted reply that waits until the test opens it (bounded, so a failing test frees
    its thread): the run stays where the test wants it while the browser looks."""

    def __init__(self) -> None:
        self.opened = threading.Event()

    def reply(self, text: str) -> Callable[[list[dict[str, Any]]], str]:
        def answer(messages: list[dict[str, Any]]) -> str:
            self.opened.wait(60)
            return text

        return answer


@pytest.fixture
def gates() -> Iterator[list[Gate]]:
    made = [Gate() for _ in range(3)]
    yield made
    for g in made:
        g.opened.set()


@pytest.fixture
def browser() -> Iterator[Any]:
    if CHROMIUM is None:
        pytest.skip("no chromium on this machine: apt-get install chromium")
    with playwright.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield b
        finally:
            b.close()


def new_page(context: Any) -> Any:
    page = context.new_page()
    page.set_default_timeout(WAIT_MS)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.errors = errors
    return page


def open_page(browser: Any, s: Served, path: str) -> Any:
    """A page at `path`, opened from a login URL (`?token=`), as `brood serve` prints it."""
    context = browser.new_context(viewport={"width": 1300, "height": 900})
    page = new_page(context)
    page.goto(s.base_url + path + ("&" if "?" in path else "?") + f"token={TOKEN}")
    page.wait_for_selector("#main .page")
    return page


def node(page: Any, run_id: str) -> Any:
    return page.locator(f'li.node[data-run="{run_id}"]')


def children_of(s: Served, run_id: str) -> list[str]:
    return [c["id"] for c in s.client.get(f"/v1/runs/{run_id}/tree").json()["children"]]


def shot(page: Any, tmp_path: Path, name: str) -> None:
    path = tmp_path / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 0
    assert page.errors == [], page.errors


def test_the_token_is_taken_from_the_login_url_once_and_kept_until_refused(tmp_path, browser):
    with serving(tmp_path) as s:
        root = s.client.post("/v1/runs", json={"prompt": "quick root"}).json()["run_id"]
        wait_state(s.client, root, "completed")
        page = open_page(browser, s, "/?state=completed")
        assert page.url == s.base_url + "/?state=completed"  # gone from the address bar
        page.locator(f'a.id[href="/runs/{root}"]').first.wait_for()
        assert page.locator("#token-form").is_hidden()
        key = f"brood-token {s.base_url}"
        assert page.evaluate("(k) => localStorage.getItem(k)", key) == TOKEN
        assert page.evaluate("document.cookie") == ""  # a header only, never a cookie

        page.reload()  # a reload, and a new tab of the same browser, ask for nothing
        page.locator(f'a.id[href="/runs/{root}"]').first.wait_for()
        tab = new_page(page.context)
        tab.goto(s.base_url + f"/runs/{root}")
        tab.locator("pre.answer", has_text="quick").wait_for()
        assert tab.locator("#token-form").is_hidden()

        # A token the server refuses (it was restarted, say) is forgotten, and asked for.
        page.evaluate("(k) => localStorage.setItem(k, 'stale')", key)
        page.reload()
        page.locator("#token-form").wait_for(state="visible")
        assert page.evaluate("(k) => localStorage.getItem(k)", key) is None
        page.fill("#token-form input", TOKEN)
        page.click("#token-form button")
        page.locator(f'a.id[href="/runs/{root}"]').first.wait_for()
        assert page.evaluate("(k) => localStorage.getItem(k)", key) == TOKEN
        shot(page, tmp_path, "logged-in")
        shot(tab, tmp_path, "second-tab")


def test_the_tree_grows_live_while_the_run_spawns_children(tmp_path, browser, gates):
    script = {
        "grow": [
            code("a = rlm_spawn('leaf one')\nprint('started one')"),
            gates[0].reply(code("b = rlm_spawn('leaf two')\nprint('started two')")),
            gates[1].reply(code("FINAL(rlm_wait(a) + rlm_wait(b))")),
        ],
        "leaf one": [code("FINAL('1')")],
        "leaf two": [code("FINAL('2')")],
    }
    with serving(tmp_path, script=script) as s:
        root = s.client.post("/v1/runs", json={"prompt": "grow"}).json()["run_id"]
        first = until(lambda: children_of(s, root))[0]
        page = open_page(browser, s, f"/runs/{root}")
        page.evaluate("window.sameDocument = true")
        node(page, first).wait_for()
        assert node(page, root).locator(".state").first.inner_text() == "running"

        gates[0].opened.set()  # the root starts its second child while the page watches
        second = until(lambda: (kids := children_of(s, root)) and len(kids) == 2 and kids[1])
        node(page, second).wait_for()
        assert node(page, second).locator(".what").inner_text() == "leaf two"
        page.locator(f'li.node[data-run="{second}"] .state.s-completed').wait_for()

        gates[1].opened.set()
        page.locator('#head [data-field="state"].s-completed').wait_for()
        page.locator("pre.answer", has_text="12").wait_for()
        assert page.evaluate("window.sameDocument") is True  # grown in place, never reloaded
        page.locator(f'li.node[data-run="{first}"] .state.s-completed').wait_for()
        assert page.locator("li.node").count() == 3
        shot(page, tmp_path, "tree-grew")


def test_a_run_page_shows_its_trajectory(tmp_path, browser):
    script = {
        "steps": [
            code("x = 6 * 7\nprint('x is', x)"),
            code("print(llm_query('say <b>hi</b>'))\nFINAL(str(x))"),
        ],
        "say <b>hi</b>": ["<script>window.hacked = 1</script>hi"],
    }
    with serving(tmp_path, script=script) as s:
        root = s.client.post("/v1/runs", json={"prompt": "steps"}).json()["run_id"]
        wait_state(s.client, root, "completed")
        page = open_page(browser, s, f"/runs/{root}")
        steps = page.locator("li.entry.step")
        steps.nth(1).wait_for()
        assert steps.count() == 2
        assert "x = 6 * 7" in steps.nth(0).locator("pre.code").inner_text()
        assert steps.nth(0).locator("pre.out").inner_text().strip() == "x is 42"
        assert page.locator("li.entry.turn").count() == 2
        query = page.locator("li.entry.query")
        assert "<script>window.hacked = 1</script>hi" in query.locator("pre.reply").inner_text()
        assert page.evaluate("window.hacked") is None  # shown as text, never run
        assert page.locator("pre.answer").inner_text() == "42"
        shot(page, tmp_path, "trajectory")


def test_an_ask_is_answered_from_the_form_and_the_run_goes_on(tmp_path, browser):
    script = {
        "asking root": [
            code(
                "r = ask_person('Ship the <i>release</i>?', options=['yes', 'no'])\n"
                "FINAL('chose ' + r['answer']['id'])"
            )
        ]
    }
    with serving(tmp_path, script=script) as s:
        root = s.client.post("/v1/runs", json={"prompt": "asking root"}).json()["run_id"]
        until(lambda: s.client.get("/v1/asks").json()["asks"])
        page = open_page(browser, s, "/asks")
        form = page.locator("article.ask")
        assert form.locator(".question").inner_text() == "Ship the <i>release</i>?"
        page.fill("article.ask input.by", "Ada")
        form.locator("button", has_text="yes").click()
        page.locator("text=No run is waiting for a person.").wait_for()
        run = wait_state(s.client, root, "completed")
        assert run["answer"] == "chose yes"
        asked = [e for e in s.client.get(f"/v1/runs/{root}/events?after=0").text.split("\n")]
        assert any('"op": "answered"' in line and "Ada" in line for line in asked)
        page.goto(s.base_url + f"/runs/{root}")  # kept: a new address asks for nothing
        page.locator("li.entry.ask-entry", has_text="yes (chosen by Ada)").wait_for()
        shot(page, tmp_path, "ask-answered")


def test_a_run_is_cancelled_from_its_button_and_its_subtree_shows_cancelled(
    tmp_path, browser, gates
):
    script = {
        "big root": [
            code("hs = [rlm_spawn(f'slow leaf {i}') for i in range(3)]\nrlm_wait_all(hs)")
        ],
        **{f"slow leaf {i}": [gates[2].reply(code("FINAL('late')"))] for i in range(3)},
    }
    with serving(tmp_path, script=script) as s:
        root = s.client.post("/v1/runs", json={"prompt": "big root"}).json()["run_id"]
        kids = until(lambda: (k := children_of(s, root)) and len(k) == 3 and k)
        page = open_page(browser, s, f"/runs/{root}")
        for k in kids:
            node(page, k).wait_for()
        page.click("button.danger")
        page.locator('#head [data-field="state"].s-cancelled').wait_for()
        for k in kids:
            page.locator(f'li.node[data-run="{k}"] .state.s-cancelled').wait_for()
        assert wait_state(s.client, root, "cancelled")["state"] == "cancelled"
        for k in kids:
            assert s.client.get(f"/v1/runs/{k}").json()["state"] == "cancelled"
        assert page.locator("button.danger").count() == 0  # an ended run offers no cancel
        shot(page, tmp_path, "cancelled")


def write_big_tree(url: str, children: int, grandchildren: int) -> str:
    """A completed tree of 1 + children * (1 + grandchildren) runs, written to the journal as
    a supervisor would (no workers: the point is the page, not the runs)."""
    store = open_store(url)
    try:
        token = owner_token()
        store.insert_supervisor(token, os.getpid(), socket.gethostname(), None).result()
        now = time.time()

        def record(run_id: str, parent: str | None, depth: int) -> RunRecord:
            return RunRecord(run_id, "r-big", parent, depth, run_id, f"task of {run_id}")

        records = [record("r-big", None, 0)]
        for i in range(children):
            kid = f"r-k{i:03d}"
            records.append(record(kid, "r-big", 1))
            records += [record(f"{kid}-{j:03d}", kid, 2) for j in range(grandchildren)]
        futures = []
        for n, rec in enumerate(records):
            rec.state, rec.reason, rec.answer = RunState.COMPLETED, "answer", str(n)
            rec.usage = {"model_calls": 1, "input_tokens": 10, "output_tokens": 5}
            rec.created_at = now + n * 1e-4
            rec.started_at, rec.ended_at = rec.created_at, rec.created_at + 1
            futures += [store.insert_run(rec, token), store.transition(rec, "running", "completed")]
        for fut in futures:
            fut.result()
        store.close_supervisor(token).result()
    finally:
        store.close()
    return "r-big"


def test_a_ten_thousand_run_tree_opens_collapsed_and_pages_its_children(tmp_path, browser):
    with serving(tmp_path) as s:
        root = write_big_tree(f"sqlite:///{tmp_path / 'brood.db'}", 99, 100)
        assert s.client.get(f"/v1/runs/{root}").json()["subtree_usage"]["model_calls"] == 10_000
        page = open_page(browser, s, f"/runs/{root}")
        page.locator("#tree-summary", has_text="10000 runs").wait_for()
        # The root is open with its first page of children, each of them collapsed.
        assert page.locator("li.node").count() == 1 + KIDS_PAGE
        assert node(page, "r-k000").locator(".kids").inner_text() == "100 children"
        page.locator("li.more button").first.click()
        node(page, "r-k098").wait_for()
        assert page.locator("li.node").count() == 1 + 99
        node(page, "r-k007").locator(".toggle").click()  # open one child: its first page
        node(page, "r-k007-049").wait_for()
        assert node(page, "r-k007").locator("li.node").count() == KIDS_PAGE
        node(page, "r-k007").locator(".toggle").first.click()  # and close it again
        node(page, "r-k007-000").wait_for(state="detached")
        assert page.locator("li.node").count() == 1 + 99
        shot(page, tmp_path, "ten-thousand")


def test_a_flow_page_draws_its_machine_with_entries_and_instances(tmp_path, browser):
    spec = {
        "name": "review",
        "states": [
            {"id": "draft", "entry": True, "prompt": "Draft {topic}", "inputs": ["topic"]},
            {"id": "check", "prompt": "Check the draft", "max_entries": 2},
        ],
        "transitions": [{"from": "draft", "to": "check"}],
    }
    script = {"Draft owls": [code("FINAL('a draft')")], "Check the draft": [code("FINAL('ok')")]}
    with serving(tmp_path, script=script) as s:
        started = s.client.post("/v1/flows", json={"spec": spec, "inputs": {"topic": "owls"}})
        flow_id = started.json()["run_id"]
        until(lambda: s.client.get(f"/v1/flows/{flow_id}").json()["status"] == "finished")
        page = open_page(browser, s, f"/flows/{flow_id}")
        draft, check = (page.locator(f'g.box[data-state="{sid}"]') for sid in ("draft", "check"))
        assert "draft ▶" in draft.locator(".box-title").text_content()  # the entry state
        assert draft.locator(".box-line").nth(0).text_content() == "entered 1 of 1"
        assert check.locator(".box-line").nth(0).text_content() == "entered 1 of 2"
        assert check.locator(".box-line").nth(1).text_content() == "1 completed"
        assert page.locator("path.edge").count() == 1
        assert page.locator("table.runs tbody tr").count() == 2  # one instance per state
        shot(page, tmp_path, "flow")
        page.locator("table.runs a.id").first.click()  # to an instance's run page
        page.locator("li.entry.step").first.wait_for()
        shot(page, tmp_path, "flow-instance")

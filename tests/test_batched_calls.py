"""llm_query_batched keeps up to 16 calls in flight from the calling thread: replies come in
the order of the prompts, a failed call fails alone, and the worker starts no thread."""

from __future__ import annotations

import threading
import time
from typing import Any

import brood
from brood.worker.runtime import BATCH_WINDOW

PROMPTS = [f"p{i}" for i in range(40)]  # over two windows of 16

NO_THREAD = f"""import _thread
before = _thread._count()
replies = llm_query_batched({PROMPTS!r})
print('threads started:', _thread._count() - before)
FINAL(','.join(replies))"""

ONE_FAILS = """try:
    llm_query_batched(['a', 'boom', 'c'])
except ModelError as exc:
    print('failed:', exc.failed, 'answers:', exc.answers)
FINAL('done')"""


SHARED = """tasks = [spawn(llm_query_batched, [f's{j}-{i}' for i in range(20)]) for j in range(16)]
mine = llm_query_batched([f'm-{i}' for i in range(20)])
theirs = rlm_await_all(tasks)
FINAL(f'{len(mine)} {sum(len(t) for t in theirs)}')"""


def repl(code: str) -> str:
    return f"```repl\n{code}\n```"


def chat_fn(messages: list[dict[str, Any]]) -> str:
    content = messages[-1]["content"]
    if content == "boom":
        raise RuntimeError("the model fell over")
    if content.startswith("no thread"):
        return repl(NO_THREAD)
    if content.startswith("one fails"):
        return repl(ONE_FAILS)
    if content.startswith("shared"):
        return repl(SHARED)
    return content.upper()


def _stdout(sup: brood.Supervisor, run_id: str) -> str:
    return "".join(e["data"]["stdout"] for e in sup.store.events(run_id, "step"))


def test_replies_come_in_order_and_no_thread_starts() -> None:
    with brood.Supervisor(chat_fn) as sup:
        result = sup.run("no thread: a batch")
        out = _stdout(sup, result.run_id)
    assert result.answer == ",".join(p.upper() for p in PROMPTS), result
    assert "threads started: 0" in out, out


def test_a_failed_call_fails_alone_and_every_reply_is_kept() -> None:
    with brood.Supervisor(chat_fn) as sup:
        result = sup.run("one fails: a batch")
        out = _stdout(sup, result.run_id)
    assert result.answer == "done", result
    assert "failed: [1] answers: ['A', None, 'C']" in out, out


class _Busy:
    """A chat_fn whose plain calls take a moment, counting how many are under way at once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.now = self.most = 0

    def __call__(self, messages: list[dict[str, Any]]) -> str:
        content = messages[-1]["content"]
        if content.startswith("shared"):
            return chat_fn(messages)
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
        time.sleep(0.005)  # the model's own time: calls overlap while they wait
        with self.lock:
            self.now -= 1
        return content


def test_every_batch_of_a_worker_shares_its_call_slots() -> None:
    # 16 spawned batches and one in the step, 340 calls: never more than BATCH_WINDOW in
    # flight at once (as many as 16 blocking call threads once made), so a busy run is no
    # flood of requests to the supervisor.
    busy = _Busy()
    with brood.Supervisor(busy) as sup:
        result = sup.run("shared: batches everywhere")
    assert result.answer == "20 320", result
    assert 1 < busy.most <= BATCH_WINDOW, busy.most

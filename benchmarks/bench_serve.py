"""`brood serve`: how long a journaled event takes to reach an SSE client, and what the
tree endpoint costs for a 10,000-run tree.

A real uvicorn server (`brood.serve.make_app`, no model, a token) runs in a thread on a
loopback port, over an SQLite journal in a temporary folder. This benchmark writes that
journal itself through the store, as a supervisor would: a supervisor row for this process
(so the server counts it as alive), and the runs, transitions and events below. The client
is httpx.

Commit to SSE. One root stays `running` with its supervisor alive, so its event stream
(`GET /v1/runs/{id}/events`) stays open. Each of SAMPLES rounds writes one event of the
root through the store and waits for its commit (the write's future), then reads the
stream until that event arrives:

  commit           from just before `store.event(...)` to its future resolving: the
                   journal's own commit of one event (the floor)
  commit to SSE    from the commit to the event's `data:` line at the client

The stream polls the journal every POLL_S (`brood.serve.stream`), so commit to SSE is
mostly the wait for the next poll. A client of a real tree hears of events at any point of
the poll cycle, so each round starts after an untimed pause drawn uniformly from
[0, POLL_S): without it, each write would follow the stream's last read at once and wait
a whole poll. The mean wait for the next poll is then about POLL_S / 2; the poll interval
is printed next to the figures, and so is the journal read the stream does at each poll
(whether the tree is done, then its events after the last one sent), done directly.

Tree endpoint. A completed tree of TREE_RUNS runs (a root, CHILDREN children, GRANDCHILDREN
grandchildren under each, with usage and answers) is written to the same journal. Timed,
ROUNDS times each, interleaved (the order rotates per round), after one untimed warm-up:

  GET /tree        `GET /v1/runs/{root}/tree` until the whole body is read
  Journal.tree     `Journal(url).tree(root)` in this process: the journal's tree assembly
                   (the server's work without HTTP and JSON)
  store.runs       `store.runs(root)` on a read-only store of the same journal: reading
                   the same rows (the floor)

The figures are medians; the response size is printed too. No targets are set: the issue
asks for the numbers.
"""

from __future__ import annotations

import json
import os
import random
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx2 as httpx
import uvicorn

from _common import (
    MIB,
    MS,
    Row,
    RunFailed,
    finish,
    median,
    no_leftovers,
    parse_args,
    quantile,
    spread_ms,
    wait_until,
)
from brood.backends.owners import owner_token
from brood.journal import Journal
from brood.lifecycle import RunRecord, RunState
from brood.serve import make_app
from brood.serve.stream import POLL_S
from brood.store.base import Store, open_store

BENCH = "serve"
SAMPLES = 80  # timed events through the stream
WARMUP = 3  # untimed events first: the stream's first reads, the client's first lines
CHILDREN = 99
GRANDCHILDREN = 100
TREE_RUNS = 1 + CHILDREN + CHILDREN * GRANDCHILDREN  # 10,000
ROUNDS = 5  # timed reads of the tree of each kind
TOKEN = "bench-serve-token"
START_TIMEOUT_S = 15.0  # only stops a hung set-up: the server starts within a second
STOP_TIMEOUT_S = 30.0
CLIENT_TIMEOUT_S = 60.0  # only stops a hung read: an event arrives within a poll or two
USAGE = {"model_calls": 2, "input_tokens": 1800, "output_tokens": 240, "cost": 0.0031}
SEED = 20240611

GET_TREE, JOURNAL_TREE, STORE_RUNS = "GET /tree", "Journal.tree", "store.runs"
KINDS = (GET_TREE, JOURNAL_TREE, STORE_RUNS)


# ---- the journal, written as a supervisor would ---------------------------------------------
def run_record(
    run_id: str, root_id: str, parent_id: str | None, depth: int, prompt: str
) -> RunRecord:
    return RunRecord(
        id=run_id,
        root_id=root_id,
        parent_id=parent_id,
        depth=depth,
        key=None if parent_id is None else run_id,
        prompt=prompt,
        model="scripted",
    )


def write_tree(store: Store, supervisor: str) -> str:
    """A completed tree of TREE_RUNS runs; its root's id (untimed set-up)."""
    now = time.time()
    root = run_record("r-tree", "r-tree", None, 0, "Summarise the findings of every chunk. " * 4)
    records = [root]
    for i in range(CHILDREN):
        child = run_record(f"r-c{i:03d}", root.id, root.id, 1, f"Chunk {i}: summarise it. " * 6)
        records.append(child)
        for j in range(GRANDCHILDREN):
            prompt = f"Chunk {i}, section {j}: list the claims it makes. " * 3
            records.append(run_record(f"r-c{i:03d}-{j:03d}", root.id, child.id, 2, prompt))
    futures = []
    for n, rec in enumerate(records):
        rec.state = RunState.COMPLETED
        rec.reason = "FINAL"
        rec.answer = f"Run {n}: three claims, each backed by a quoted sentence. " * 2
        rec.usage = dict(USAGE)
        rec.created_at = now + n * 1e-4  # children after their parent, as the store orders
        rec.started_at = rec.created_at + 0.01
        rec.ended_at = rec.created_at + 1.5
        rec.pid = 4242
        futures.append(store.insert_run(rec, supervisor))
        futures.append(store.transition(rec, "running", "completed"))
    for fut in futures:
        fut.result()
    return root.id


def write_live_root(store: Store, supervisor: str) -> RunRecord:
    """A root that stays running (its supervisor is this process), so its stream stays open."""
    rec = run_record("r-live", "r-live", None, 0, "Keep writing events until told to stop.")
    store.insert_run(rec, supervisor).result()
    rec.state = RunState.RUNNING
    rec.started_at = time.time()
    rec.pid = os.getpid()
    store.transition(rec, "queued", "running").result()
    return rec


# ---- the server -------------------------------------------------------------------------------
@contextmanager
def serving(url: str) -> Iterator[tuple[httpx.Client, Any]]:
    """A server in a thread on a loopback port bound here; shut down at the end."""
    app = make_app(store_url=url, token=TOKEN)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_until(
            lambda: server.started or not thread.is_alive(), START_TIMEOUT_S, "the server start"
        )
        if not server.started:
            raise RunFailed("the server did not start")
        with httpx.Client(
            base_url=f"http://127.0.0.1:{port}",
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=CLIENT_TIMEOUT_S,
        ) as client:
            yield client, app
    finally:
        server.should_exit = True
        thread.join(STOP_TIMEOUT_S)
        sock.close()
        if thread.is_alive():
            raise RunFailed(f"the server did not stop within {STOP_TIMEOUT_S:g} s")


# ---- commit to SSE ----------------------------------------------------------------------------
def next_event(lines: Iterator[str]) -> tuple[float, dict[str, Any]]:
    """The next event's `data:` line from the stream: when it arrived, and the event."""
    for line in lines:
        if line.startswith("data:"):
            return time.perf_counter(), json.loads(line.removeprefix("data:").strip())
    raise RunFailed("the event stream ended while an event was awaited")


def stream_latency(
    client: httpx.Client, app: Any, store: Store, live: RunRecord
) -> tuple[list[float], list[float], list[float]]:
    """SAMPLES events through the root's stream: each one's commit time and commit to
    client time, after WARMUP untimed ones; then the direct poll reads (the root still
    live). The root ends at the end, which ends the stream."""
    rng = random.Random(SEED)
    pause = threading.Event()
    commits: list[float] = []
    latencies: list[float] = []
    with client.stream("GET", f"/v1/runs/{live.id}/events") as response:
        if response.status_code != 200:
            raise RunFailed(f"GET events answered {response.status_code}: {response.read()!r}")
        lines = response.iter_lines()
        for n in range(WARMUP + SAMPLES):
            pause.wait(rng.uniform(0.0, POLL_S))  # a random point of the poll cycle
            t0 = time.perf_counter()
            store.event(live, "message", {"n": n, "text": f"progress note {n}"}).result()
            t_commit = time.perf_counter()
            t_client, ev = next_event(lines)
            if ev["run_id"] != live.id or ev["data"].get("n") != n:
                raise RunFailed(f"the stream sent {ev} where event n={n} was awaited")
            if n >= WARMUP:
                commits.append(t_commit - t0)
                latencies.append(t_client - t_commit)
        polls = poll_read(app, live, store)
        live.state, live.reason, live.answer = RunState.COMPLETED, "FINAL", "done"
        live.ended_at = time.time()
        store.transition(live, "running", "completed").result()
        rest = list(lines)  # the stream ends at its next poll, the root having ended
        if any(line.startswith("data:") for line in rest):
            raise RunFailed(f"the stream sent more than was written: {rest}")
    return commits, latencies, polls


def poll_read(app: Any, live: RunRecord, store: Store) -> list[float]:
    """The journal read the stream does at each poll, done directly on the server's own
    host while the root is live: whether the tree is done, then its events after the
    last-but-one (one event)."""
    host = app.state.host
    seqs = [e["seq"] for e in store.events(live.id)]
    after = seqs[-2]
    took = []
    for _ in range(WARMUP + SAMPLES):
        t0 = time.perf_counter()
        host.tree_done(live.id)
        got = host.journal.store.events(root_id=live.id, after=after)
        took.append(time.perf_counter() - t0)
        if len(got) != 1:
            raise RunFailed(f"the direct poll read {len(got)} events, expected 1")
    return took[WARMUP:]


# ---- the tree endpoint ------------------------------------------------------------------------
def count_runs(node: dict[str, Any]) -> int:
    return 1 + sum(count_runs(c) for c in node["children"])


def tree_reads(client: httpx.Client, url: str, root_id: str) -> tuple[dict[str, list[float]], int]:
    """ROUNDS reads of the tree of each kind, after one untimed warm-up of each; the
    seconds per kind, and the size of the endpoint's answer in bytes."""
    size = 0

    def get_tree() -> None:
        nonlocal size
        response = client.get(f"/v1/runs/{root_id}/tree")
        if response.status_code != 200:
            raise RunFailed(f"GET tree answered {response.status_code}: {response.text[:500]}")
        size = len(response.content)

    took: dict[str, list[float]] = {k: [] for k in KINDS}
    with Journal(url) as journal:
        reader = open_store(url, readonly=True)
        try:
            read: dict[str, Callable[[], Any]] = {
                GET_TREE: get_tree,
                JOURNAL_TREE: lambda: journal.tree(root_id),
                STORE_RUNS: lambda: reader.runs(root_id),
            }
            # Untimed: the warm-up, and a check that all three read the whole tree.
            get_tree()
            tree = client.get(f"/v1/runs/{root_id}/tree").json()
            counts = {
                GET_TREE: count_runs(tree),
                JOURNAL_TREE: count_runs(journal.tree(root_id)),
                STORE_RUNS: len(reader.runs(root_id)),
            }
            if set(counts.values()) != {TREE_RUNS}:
                raise RunFailed(f"reads of the tree found {counts} runs, expected {TREE_RUNS}")
            calls = tree["subtree_usage"]["model_calls"]
            if calls != TREE_RUNS * USAGE["model_calls"]:
                raise RunFailed(f"the tree's subtree usage counts {calls} model calls")
            for n in range(ROUNDS):
                for kind in KINDS[n % len(KINDS) :] + KINDS[: n % len(KINDS)]:
                    t0 = time.perf_counter()
                    read[kind]()
                    took[kind].append(time.perf_counter() - t0)
        finally:
            reader.close()
    return took, size


def measure(tmp: str) -> tuple[list[float], list[float], list[float], dict[str, list[float]], int]:
    url = f"sqlite:///{tmp}/brood.db"
    store = open_store(url)
    supervisor = owner_token()
    try:
        store.insert_supervisor(supervisor, os.getpid(), socket.gethostname(), None).result()
        t0 = time.perf_counter()
        tree_root = write_tree(store, supervisor)
        print(f"(wrote the {TREE_RUNS:,}-run tree in {time.perf_counter() - t0:.1f} s, untimed)")
        live = write_live_root(store, supervisor)
        with serving(url) as (client, app):
            commits, latencies, polls = stream_latency(client, app, store, live)
            took, size = tree_reads(client, url, tree_root)
        store.close_supervisor(supervisor).result()
    finally:
        store.close()
    return commits, latencies, polls, took, size


def main() -> None:
    args = parse_args(__doc__ or "")
    with tempfile.TemporaryDirectory(prefix="brood-bench-serve-") as tmp:
        commits, latencies, polls, took, size = measure(tmp)
    left = no_leftovers(BENCH)

    print(f"journal commit of one event   {spread_ms(commits)}")
    print(f"commit to SSE at the client   {spread_ms(latencies)}")
    print(f"one poll's journal read       {spread_ms(polls)}  (direct, on the server's host)")
    print(f"stream poll interval          {POLL_S * MS:.0f} ms (mean wait for the next poll: half)")
    for kind in KINDS:
        print(f"{kind:<13} {TREE_RUNS:,} runs  {spread_ms(took[kind])}")
    med = {k: median(xs) for k, xs in took.items()}
    lat_med, lat_p90 = median(latencies), quantile(latencies, 0.9)
    com_med, com_p90 = median(commits), quantile(commits, 0.9)
    print(
        f"\nheadline: a committed event reaches the SSE client in {lat_med * MS:.1f} ms "
        f"(median; p90 {lat_p90 * MS:.1f} ms) = {lat_med / com_med:.0f}x the journal's own "
        f"commit ({com_med * MS:.3f} ms); it is the stream's poll of {POLL_S * MS:.0f} ms, "
        f"whose mean wait is ~{POLL_S / 2 * MS:.0f} ms, plus a read of "
        f"{median(polls) * MS:.3f} ms"
    )
    print(
        f"headline: GET /tree of {TREE_RUNS:,} runs takes {med[GET_TREE] * MS:.0f} ms "
        f"= {med[GET_TREE] / med[STORE_RUNS]:.2f}x reading its rows ({med[STORE_RUNS] * MS:.0f} "
        f"ms); Journal.tree alone {med[JOURNAL_TREE] * MS:.0f} ms = "
        f"{med[JOURNAL_TREE] / med[STORE_RUNS]:.2f}x; the answer is {size / MIB:.1f} MiB"
    )

    rows = [
        Row(BENCH, "commit to SSE event at the client (median)", lat_med, "s", com_med),
        Row(BENCH, "commit to SSE event at the client (p90)", lat_p90, "s", com_p90),
        Row(BENCH, "  floor: journal commit of one event (median)", com_med, "s"),
        Row(BENCH, "  floor: journal commit of one event (p90)", com_p90, "s"),
        Row(BENCH, "  stream poll interval (POLL_S)", POLL_S, "s"),
        Row(BENCH, "  one poll's journal read, direct (median)", median(polls), "s"),
        Row(BENCH, f"GET /tree, {TREE_RUNS:,} runs (median)", med[GET_TREE], "s", med[STORE_RUNS]),
        Row(BENCH, "  Journal.tree, direct (median)", med[JOURNAL_TREE], "s", med[STORE_RUNS]),
        Row(BENCH, "  floor: store.runs(root) (median)", med[STORE_RUNS], "s"),
        Row(BENCH, "  GET /tree answer size", size, "B"),
    ]
    finish(BENCH, rows, left, args.json)


if __name__ == "__main__":
    main()

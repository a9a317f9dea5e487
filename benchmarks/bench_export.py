"""Memory of a 10,000-run training export (`brood export --format`), which streams.

A journal of one tree of 10,000 runs (a root, 99 children, 100 grandchildren under each
but one) of 3 model turns each (an 8 KB system prompt by reference, a 2 KB message per
turn) is written straight through the store: what an export reads, without running
10,000 trees. Each format is then exported in a fresh process writing to /dev/null, and
its peak RSS growth is measured (the peak RSS, VmHWM, after the export, less the RSS
before it, the journal already open). Target: at most 64 MiB for each format. The floor
is the same export of a tree of 1,000 runs: a streamed export grows only by the outline
it holds of the tree (ids and states, a few hundred bytes a run), where one held whole
would grow with the output (~0.3 GB at 10,000 runs).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from _common import MIB, Row, finish, no_leftovers, parse_args

BENCH = "export"
RUNS = 10_000
SMALL = 1_000
TURNS = 3
TARGET_MIB = 64
FORMATS = ("jsonl", "openai-chat", "verifiers")
SYSTEM = "You are a recursive language model. " * 230  # ~8 KB, as brood's own prompt


def build(url: str, runs: int) -> str:
    """A tree of `runs` runs written through the store; returns its root's id."""
    from brood.lifecycle import RunRecord
    from brood.store.base import open_store

    store = open_store(url)
    try:
        store.insert_supervisor("1:bench-gone", 1, "nowhere", None)
        root = RunRecord(
            id="r-root", root_id="r-root", parent_id=None, depth=0, key=None, prompt="t"
        )
        store.event(root, "prompt", {"ref": "p1", "content": SYSTEM})
        recs = [root]
        kids = max(1, (runs - 1) // 101)
        for i in range(kids):
            recs.append(
                RunRecord(
                    id=f"r-{i}",
                    root_id="r-root",
                    parent_id="r-root",
                    depth=1,
                    key=f"k{i}",
                    prompt=f"child {i}",
                )
            )
        i = 0
        while len(recs) < runs:
            parent = f"r-{i % kids}"
            recs.append(
                RunRecord(
                    id=f"r-{parent}-{i}",
                    root_id="r-root",
                    parent_id=parent,
                    depth=2,
                    key=f"g{i}",
                    prompt=f"grandchild {i}",
                )
            )
            i += 1
        for rec in recs:
            store.insert_run(rec, "1:bench-gone")
            rec.answer, rec.reason = "42", "answer"
            store.transition(rec, "queued", "completed")
            for t in range(TURNS):
                head = [{"role": "system", "prompt_ref": "p1", "suffix": "\nBudget."}]
                msg = {"role": "user", "content": f"{rec.prompt} turn {t} " + "x" * 2000}
                request = [*head, msg] if t == 0 else [{"role": "assistant", "content": "ok"}, msg]
                data = {
                    "kind": "turn",
                    "request": request,
                    "response": "```repl\nprint(1)\n```",
                    "input_tokens": 10,
                    "output_tokens": 2,
                    "cost": None,
                    "model": "m",
                }
                store.event(rec, "model_call", data)
            store.event(rec, "reward", {"reward": 1.0})
        store.flush()
    finally:
        store.close()
    return "r-root"


def export_in_this_process(url: str, root: str, fmt: str) -> None:
    """Run one export to /dev/null and print what it cost (the child's side)."""
    from brood.exports import write_jsonl
    from brood.journal import Journal

    with Journal(url) as journal, open(os.devnull, "w") as out:
        before = rss_bytes()
        t0 = time.perf_counter()
        lines = write_jsonl(journal.export(root, fmt), out)
        seconds = time.perf_counter() - t0
        peak = status_bytes("VmHWM")
    print(json.dumps({"growth": max(0, peak - before), "seconds": seconds, "lines": lines}))


def rss_bytes() -> int:
    return status_bytes("VmRSS")


def status_bytes(field: str) -> int:
    """A size from /proc/self/status: VmRSS now, VmHWM its peak. (ru_maxrss would not do:
    after fork and exec it can still hold the parent's peak.)"""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure(url: str, root: str, fmt: str) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, __file__, "--child", url, root, fmt],
        capture_output=True,
        text=True,
        check=True,
    )
    result: dict[str, float] = json.loads(out.stdout.splitlines()[-1])
    return result


def main() -> None:
    args = parse_args(__doc__ or "")
    rows = []
    with tempfile.TemporaryDirectory(prefix="brood-bench-export-") as tmp:
        urls = {}
        for runs in (SMALL, RUNS):
            urls[runs] = f"sqlite:///{os.path.join(tmp, f'j{runs}.db')}"
            t0 = time.perf_counter()
            build(urls[runs], runs)
            print(f"journal of {runs:,} runs written in {time.perf_counter() - t0:.1f} s")
        for fmt in FORMATS:
            small = measure(urls[SMALL], "r-root", fmt)
            big = measure(urls[RUNS], "r-root", fmt)
            print(
                f"{fmt}: {big['lines']:,} lines in {big['seconds']:.1f} s "
                f"({RUNS / big['seconds']:,.0f} runs/s); peak growth "
                f"{big['growth'] / MIB:.1f} MiB ({small['growth'] / MIB:.1f} MiB at {SMALL:,} runs)"
            )
            rows.append(
                Row(
                    BENCH,
                    f"peak RSS growth, {fmt} export of {RUNS:,} runs",
                    big["growth"],
                    "B",
                    small["growth"] or None,
                    f"<= {TARGET_MIB} MiB",
                    big["growth"] <= TARGET_MIB * MIB,
                )
            )
            rows.append(Row(BENCH, f"  {fmt} export, runs per second", RUNS / big["seconds"], "/s"))
    finish(BENCH, rows, no_leftovers(BENCH), args.json)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        export_in_this_process(*sys.argv[2:5])
    else:
        main()

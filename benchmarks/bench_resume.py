"""Resume of a crashed tree of 200 finished and 50 unfinished runs.

A supervisor in another process runs a root that starts 250 children. 200 of them answer
after two turns; 50 make one turn and then block in their second model call. Once all 50
are blocked, that process is killed with SIGKILL. The benchmark then resumes the tree in
this process and times it from `resume()` until the tree has answered: the root replays its
two journaled turns, adopts all 250 children by key (200 hand back their journaled answers,
50 replay their one journaled turn and go on live), and finishes.

The floor is reading the same journal: the tree with usage (`Journal.tree`) and every
run's events. The model's own log checks that the replay made no model call for recorded
work: the only calls after the crash are the 50 blocked turns and the root's last turn.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from typing import Any

import brood
from _common import Row, finish, median, no_leftovers, parse_args, wait_until
from brood.journal import Journal

BENCH = "resume"
FINISHED, UNFINISHED = 200, 50
ROUNDS = 3
F = "```"
ROOT = [
    f"{F}repl\nhs = [rlm_spawn(f'child {{i}}: work') for i in range({FINISHED + UNFINISHED})]\n{F}",
    f"{F}repl\nanswers = rlm_wait_all(hs)\n{F}",
    f"{F}repl\nFINAL(str(len(answers)))\n{F}",
]
TURN = f"{F}repl\nx = 1\n{F}"
DONE = f"{F}repl\nFINAL('ok')\n{F}"
LIMITS: dict[str, Any] = dict(
    max_concurrency=300,
    max_children=1000,
    max_children_per_run=1000,
    max_depth=2,
    shutdown_grace=0.2,
    term_grace=0.2,
)


def script_of() -> dict[str, list[str]]:
    """Every child makes two turns and answers; the crashing process swaps the second turn
    of children 200..249 for one that blocks."""
    script: dict[str, list[str]] = {"root task": ROOT}
    for i in range(FINISHED + UNFINISHED):
        script[f"child {i}: work"] = [TURN, DONE]
    return script


CRASH = textwrap.dedent("""
    import os, sys, json, brood
    store, log, blocked, never, limits = sys.argv[1:6]
    F = "```"
    def blocker(messages):
        with open(blocked, "a") as f:
            f.write("1\\n")
        open(never).read()
    script = json.loads(sys.stdin.read())
    for i in range(%d, %d):
        script[f"child {i}: work"][1] = blocker
    model = brood.ScriptedModel(script, log_path=log)
    sup = brood.Supervisor(model, store=store, limits=brood.Limits(**json.loads(limits)))
    print(sup.spawn("root task").id, flush=True)
    import signal; signal.pause()
""") % (FINISHED, FINISHED + UNFINISHED)


def crash(tmp: str) -> tuple[str, str]:
    store = f"sqlite:///{tmp}/j.db"
    blocked, never = os.path.join(tmp, "blocked"), os.path.join(tmp, "never")
    os.mkfifo(never)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            CRASH,
            store,
            os.path.join(tmp, "before.jsonl"),
            blocked,
            never,
            json.dumps(LIMITS),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(json.dumps(script_of()))
    proc.stdin.close()
    root = proc.stdout.readline().strip()

    def all_blocked() -> bool:
        return os.path.exists(blocked) and len(open(blocked).read().split()) == UNFINISHED

    try:
        wait_until(all_blocked, 120, f"{UNFINISHED} children blocked in their second turn")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
    return store, root


def calls(path: str) -> list[tuple[str, int]]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [(c["key"], c["turn"]) for c in map(json.loads, f)]


def journaled_turns(store: str, root: str) -> set[tuple[str, int]]:
    """(run prompt, turn index) of every model turn journaled before the resume."""
    with Journal(store) as journal:
        prompts = {r["id"]: r["prompt"] for r in journal.store.runs(root)}
        events = journal.store.events(root_id=root)
    resume_at = next(e["seq"] for e in events if e["kind"] == "resume")
    seen: dict[str, int] = {}
    out = set()
    for e in events:
        if e["seq"] < resume_at and e["kind"] == "model_call" and e["data"]["kind"] == "turn":
            turn = seen.get(e["run_id"], 0)
            seen[e["run_id"]] = turn + 1
            out.add((prompts[e["run_id"]], turn))
    return out


def read_journal(store: str, root: str) -> float:
    t0 = time.perf_counter()
    with Journal(store) as journal:
        tree = journal.tree(root)
        stack, n = [tree], 0
        while stack:
            node = stack.pop()
            n += len(journal.store.events(node["id"]))
            stack.extend(node["children"])
    return time.perf_counter() - t0


def one_round() -> tuple[float, float, list[tuple[str, int]], set[tuple[str, int]]]:
    with tempfile.TemporaryDirectory(prefix="brood-bench-resume-") as tmp:
        store, root = crash(tmp)
        no_leftovers(BENCH)  # the crashed supervisor's zygote took its workers down
        floor = min(read_journal(store, root) for _ in range(3))
        log = os.path.join(tmp, "after.jsonl")
        model = brood.ScriptedModel(script_of(), log_path=log)
        with brood.Supervisor(model, store=store, limits=brood.Limits(**LIMITS)) as sup:
            t0 = time.perf_counter()
            answer = sup.resume(root).wait(timeout=300)
            took = time.perf_counter() - t0
        assert answer == str(FINISHED + UNFINISHED), answer
        return took, floor, calls(log), journaled_turns(store, root)


def main() -> None:
    args = parse_args(__doc__ or "")
    results = [one_round() for _ in range(ROUNDS)]
    # A call in flight at the crash (made, not yet journaled) is made again, rightly; a
    # journaled one never is.
    repeated = [sorted(set(c) & recorded) for _, _, c, recorded in results]
    for i, (took, floor, c, recorded) in enumerate(results, 1):
        print(
            f"round {i}: resume to answer {took * 1e3:.0f} ms; reading the journal "
            f"{floor * 1e3:.0f} ms; {len(recorded)} journaled turns; model calls after the "
            f"crash: {len(c)}, of them repeating a journaled turn: {len(repeated[i - 1])}"
        )
    left = no_leftovers(BENCH)
    again = sum(map(len, repeated))
    rows = [
        Row(
            BENCH,
            f"resume {FINISHED}+{UNFINISHED} runs to the answer",
            median([r[0] for r in results]),
            "s",
            median([r[1] for r in results]),
        ),
        Row(BENCH, "model calls for recorded work", again, "", None, "0", again == 0),
    ]
    finish(BENCH, rows, left, args.json)


if __name__ == "__main__":
    main()

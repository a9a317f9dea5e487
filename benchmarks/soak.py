"""Soak: one Supervisor runs trees of hostile model code for a while; then nothing may be left.

`make soak` runs this with its defaults (120 s, 4 trees in flight, a fixed seed that is
printed). A scripted chat_fn, driven by a seeded `random.Random`, makes every tree: its
root runs 1-3 steps drawn from CATALOGUE (busy loops, swallowed or disarmed step clocks, a
fork bomb, memory and output hogs, a big file write, setsid escapes, a loopback connect,
secret reads, a kill of the worker's zygote (refused where Landlock scopes signals),
SystemExit, os._exit, recursion, a 5 MB FINAL, sleeps past the step clock, benign steps)
and then FINALs; some steps start children (blocking, cancelled, waited on, or left
running at FINAL) whose own scripts are drawn from the same catalogue. K trees are kept in
flight until the time is up; the rest are then given a few seconds and cancelled.

What it checks, printed as a report (exit status 1 on any failure, 2 from the watchdog):

- every tree, and every run in it (read back through `brood.journal.Journal`), ended in a
  terminal state with a non-empty reason, and no tree outlived its root timeout by much;
- a run whose own code brood is meant to contain (everything but the known gaps and the
  steps that end a worker on purpose) did not end `failed`, or `timed_out` without children;
- a step that defeats the in-worker step clock (a bare `except:` around a busy loop, a
  disarmed itimer, a fork loop) still ends its run within step_timeout + step_grace + 10 s;
- no escape probe succeeded (a secret read, a loopback connect to this process) and the
  supervisor kept taking work, including one last benign tree after the soak;
- no process outlived its run: pids the setsid escapes print are gone soon after their
  tree ends; once every tree has ended only the zygote and warm workers carry this
  supervisor's BROOD_OWNER mark; after close() nothing does, close() had nothing to sweep,
  and this process has no child processes;
- the SQLite journal passes `PRAGMA integrity_check`, every run row of the soak is terminal
  with a reason, and the supervisor row is closed;
- this process's RSS after close(), gc.collect() and malloc_trim is within max(64 MiB, 25%) of the
  baseline taken after a warm-up tree (baseline, peak and final are printed).

It also prints counts per catalogue entry (planned, run, how each step ended, how runs
that were in it ended), per final state and reason, and trees per minute; and it notes,
without failing, what looks odd: a run that ended in a step otherwise than that entry's
`expect`, a benign or child-starting step that raised, a call into the supervisor that
took over a second, a turn of the soak's own loop that took seconds. A watchdog thread
dumps every thread's stack and the trees in flight, kills this supervisor's processes and
exits 2 if the soak is not done `seconds + 120` s after it started.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import faulthandler
import gc
import os
import random
import re
import shutil
import signal
import socket
import sqlite3
import statistics
import string
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import psutil

import brood
from brood.journal import Journal
from brood.testing import OWNER_ENV

MIB = 1024 * 1024
DEFAULT_SEED = 20240917
DEFAULT_SECONDS = 120.0
DEFAULT_TREES = 4

# Limits of the soak's supervisor: short graces and clocks, so a hostile tree ends soon.
STEP_TIMEOUT_S = 3.0
CHILD_TIMEOUT_S = 20.0
ROOT_TIMEOUT_S = 45.0
MAX_DEPTH = 3
MAX_CONCURRENCY = 6
WORKER_MEMORY = 512 * MIB
WORKER_CPU_SECONDS = 20
WORKER_PROCESSES = 64  # a fork bomb spins this many processes on a 2-core machine
WORKER_FILE_SIZE = 256 * MIB

TREE_SLACK_S = 30.0  # a tree still going this long past its root timeout did not end
DEFAULT_STEP_GRACE_S = 5.0  # Limits.step_grace where this brood has one
SWALLOW_SLACK_S = 10.0  # a step that defeats the step clock ends its run by
# step_timeout + step_grace + this (the supervisor's own clock, then the kill)
DRAIN_S = 5.0  # after the time is up, trees get this long before they are cancelled
ESCAPEE_GRACE_S = 5.0  # a process a run started must be gone this long after its tree ended
QUIESCE_S = 5.0  # once every tree has ended, strays get this long to disappear
WATCHDOG_SLACK_S = 120.0
PROGRESS_EVERY_S = 10.0
SLOW_CALL_S = 1.0  # a call into the supervisor (not a cancel) slower than this is noted
SLOW_CANCEL_S = 5.0  # a cancel of a tree slower than this is noted
SLOW_TURN_S = 3.0  # a turn of the soak's loop slower than this is noted
RSS_EVERY_S = 0.2
RSS_SLACK_BYTES = 64 * MIB
RSS_SLACK_RATIO = 0.25

FENCE = "`" * 3
SID = re.compile(r"\[soak (S\d+)\]")
MARKER = re.compile(r"^# soak: (\w+)", re.MULTILINE)
ESCAPEE_PID = re.compile(r"SOAK-PID (\d+)")
ESCAPED = re.compile(r"SOAK-ESCAPE[^\n]*")

# What brood is meant to do with an entry's code.
BENIGN = "benign"  # nothing to contain
CONTAINED = "contained"  # contained within the step (error, refusal, limit); the run goes on
MAY_END = "may end"  # contained, or the worker dies at a limit and the run fails
FATAL = "fatal"  # ends the run on purpose (failed)
SWALLOWS = "swallows"  # defeats the in-worker step clock; the supervisor's own one ends it
# How a run ends when its step defeats the step clock (or, with a memory hog before a fork
# loop, when the kernel kills it at its memory limit).
STOPPED = r"^failed: step timeout ignored|^timed_out: |^failed: .*(cpu|CPU|memory limit)"
CHILD = "child"  # starts a child run


@dataclass(frozen=True)
class Entry:
    """One kind of step: model code (a string.Template; see Soak.render for its names)."""

    name: str
    kind: str
    weight: int
    code: str
    # How a run that ends during this step may end ("state: reason", a regex searched);
    # anything else, but a cancel, is noted as suspicious.
    expect: str = ""


# Model code holding its worker's channel: `frame(dict)` writes a frame of its own.
FORGE = (
    "import gc, struct, msgspec\n"
    "from brood.worker.link import Link\n"
    "link = next(o for o in gc.get_objects() if isinstance(o, Link))\n"
    "def raw(data):\n"
    "    with link.chan._lock:\n"
    "        link.chan._w.write(data)\n"
    "def frame(obj):\n"
    "    body = msgspec.msgpack.encode(obj)\n"
    "    raw(struct.pack('>I', len(body)) + body)\n"
    "def rid():\n"
    "    return link.next_id()\n"
)
# After a forged frame that ends the run: the run ends in this step, not a later one.
ENDS_HERE = "\nimport time\ntime.sleep(30)"

CATALOGUE: tuple[Entry, ...] = (
    Entry("print_sum", BENIGN, 3, "print(1 + 1)"),
    Entry("busy_loop", CONTAINED, 2, "while True:\n    pass"),
    Entry(
        "bare_except_busy_loop",
        SWALLOWS,
        1,
        "while True:\n    try:\n        while True:\n            pass\n    except:\n        pass",
        STOPPED,
    ),
    Entry(
        "disarm_step_clock",
        SWALLOWS,
        1,
        "import signal\nsignal.setitimer(signal.ITIMER_REAL, 0)\nwhile True:\n    pass",
        STOPPED,
    ),
    # A fork loop defeats the in-worker clock too: CPython runs os.register_at_fork hooks
    # (logging's _releaseLock) as Python code right after each fork, and a StepTimeout
    # raised inside one is printed as "Exception ignored" and dropped.
    Entry(
        "fork_bomb",
        SWALLOWS,
        1,
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
        STOPPED,
    ),
    Entry(
        "memory_hog",
        MAY_END,
        2,
        "x = []\nwhile True:\n    x.append(bytearray(10**7))",
        r"memory",
    ),
    Entry("huge_print", CONTAINED, 2, "for _ in range(200):\n    print('x' * 1_000_000)"),
    Entry(
        "big_file_write",
        CONTAINED,
        2,
        "chunk, n = b'x' * (1 << 24), 0\n"
        "try:\n"
        "    with open('soak-big.bin', 'wb') as f:\n"
        "        while True:\n"
        "            f.write(chunk)\n"
        "            n += 1\n"
        "except OSError as e:\n"
        "    print('write stopped after', n, 'chunks:', type(e).__name__, e.errno)",
    ),
    Entry(
        "setsid_escape",
        CONTAINED,
        2,
        "import os, time\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    try:\n"
        "        os.setsid()\n"
        "        time.sleep(10**6)\n"
        "    finally:\n"
        "        os._exit(0)\n"
        "print('SOAK-PID', pid)",
    ),
    Entry(
        "setsid_exec_clean_env",
        CONTAINED,
        1,
        "import os, sys, time\n"
        "r, w = os.pipe()\n"
        "if os.fork() == 0:\n"
        "    try:\n"
        "        os.setsid()\n"
        "        pid = os.fork()\n"
        "        if pid == 0:\n"
        "            os.execve(sys.executable, [sys.executable, '-c',\n"
        "                      'import time; time.sleep(10**6)', '$escapee'], {})\n"
        "        os.write(w, str(pid).encode())\n"
        "    finally:\n"
        "        os._exit(0)\n"
        "os.close(w)\n"
        "print('SOAK-PID', os.read(r, 32).decode())",
    ),
    Entry(
        "connect_loopback",
        CONTAINED,
        2,
        "import socket\n"
        "s = socket.socket()\n"
        "s.settimeout(2)\n"
        "try:\n"
        "    s.connect(('127.0.0.1', $port))\n"
        "    print('SOAK-ESCAPE connected to the soak on 127.0.0.1:$port')\n"
        "except OSError as e:\n"
        "    print('connect refused:', type(e).__name__, e.errno)\n"
        "finally:\n"
        "    s.close()",
    ),
    Entry(
        "read_secrets",
        CONTAINED,
        2,
        "import os\n"
        "for p in $secrets:\n"
        "    try:\n"
        "        if os.path.isdir(p):\n"
        "            got = os.listdir(p)\n"
        "        else:\n"
        "            with open(p, 'rb') as f:\n"
        "                got = f.read(64)\n"
        "        print('SOAK-ESCAPE read', p, len(got))\n"
        "    except OSError as e:\n"
        "        print('read refused:', p, type(e).__name__)",
    ),
    Entry(
        "kill_zygote",
        CONTAINED,
        1,
        "import os\n"
        "ppid = os.getppid()\n"
        "if ppid in (0, 1, $soak_pid):\n"
        "    print('not the zygote:', ppid)\n"
        "else:\n"
        "    try:\n"
        "        os.kill(ppid, 9)\n"
        "        print('SOAK-ZYGOTE-KILLED', ppid)\n"
        "    except OSError as e:\n"
        "        print('kill refused:', type(e).__name__)",
    ),
    Entry("raise_system_exit", CONTAINED, 2, "raise SystemExit"),
    Entry("os_exit", FATAL, 1, "import os\nos._exit(3)", r"^failed: worker exited with status 3$"),
    Entry("deep_recursion", CONTAINED, 2, "def f(n):\n    return f(n + 1)\nf(0)"),
    Entry(
        "stack_overflow",
        MAY_END,
        1,
        "import sys\nsys.setrecursionlimit(10**7)\ndef g(n):\n    return g.__call__(n + 1)\ng(0)",
        r"^failed: worker exited with signal 11$",
    ),
    Entry(
        "final_5mb",
        FATAL,
        1,
        "FINAL('x' * 5_000_000)",
        r"^failed: the FINAL answer has 5,000,000 characters, over Limits.answer_limit",
    ),
    Entry("sleep_past_step_clock", CONTAINED, 2, "import time\ntime.sleep($sleep)"),
    # The forged-frame catalogue (tests/test_hostile_frames.py): model code writes frames of
    # its own on its worker's channel; the supervisor ends the run naming the violation.
    Entry(
        "forge_huge_call",
        FATAL,
        1,
        FORGE + "frame({'type': 'ModelReq', 'req_id': rid(), 'kind': 'llm_query',"
        " 'messages': [{'role': 'user', 'content': 'x' * 20_000_000}]})" + ENDS_HERE,
        r"^failed: protocol violation: a plain model call of 20,000,000 characters",
    ),
    Entry(
        "forge_final_bytes",
        FATAL,
        1,
        FORGE + "frame({'type': 'Final', 'answer': 'a', 'products': {'b': b'raw'}})" + ENDS_HERE,
        r"^failed: protocol violation: FINAL products hold a bytes",
    ),
    Entry(
        "forge_step_out_of_order",
        FATAL,
        1,
        FORGE + "frame({'type': 'StepDone', 'step': 10**6, 'code': '', 'stdout': 'x' * 10**7,"
        " 'stderr': '', 'error': None, 'duration': 0.0})" + ENDS_HERE,
        r"^failed: protocol violation: step 1000000 ended",
    ),
    Entry(
        "forge_flood",
        FATAL,
        1,
        FORGE + "raw(b''.join(struct.pack('>I', len(b)) + b for b in [msgspec.msgpack.encode("
        "{'type': 'BudgetReq', 'req_id': i}) for i in range(3000)]))" + ENDS_HERE,
        r"^failed: protocol violation: more than \d+ requests at once",
    ),
    Entry(
        "forge_too_deep",
        FATAL,
        1,
        FORGE + "e = msgspec.msgpack.encode\n"
        "body = (b'\\x83' + e('type') + e('Final') + e('answer') + e('a') + e('products')"
        " + b'\\x81' + e('a') + b'\\x91' * 100_000 + b'\\xc0')\n"
        "raw(struct.pack('>I', len(body)) + body)" + ENDS_HERE,
        r"^failed: protocol violation: .*nested too deeply",
    ),
    Entry(
        "forge_blocked",
        CONTAINED,
        1,
        FORGE + "frame({'type': 'Blocked', 'req_id': 0, 'blocked': True})\n"
        "print('computing on a slot it kept:', sum(range(10**6)))",
    ),
    Entry(
        "forge_divergence",
        FATAL,
        1,
        FORGE + "frame({'type': 'Failed', 'reason': 'replay diverged: forged', 'error': '',"
        " 'kind': 'diverged'})" + ENDS_HERE,
        r"^failed: replay diverged: forged$",
    ),
)

CHILD_ACTIONS: tuple[Entry, ...] = (
    Entry(
        "child_query",
        CHILD,
        2,
        "try:\n"
        "    print('child answered', len(rlm_query($prompt, timeout=$child_timeout)))\n"
        "except ChildFailed as e:\n"
        "    print('child failed:', e.status, e.reason)",
    ),
    Entry(
        "child_spawn_cancel",
        CHILD,
        2,
        "import time\n"
        "$var = rlm_spawn($prompt, timeout=$child_timeout)\n"
        "time.sleep($pause)\n"
        "print('cancelled child:', rlm_cancel($var))",
    ),
    Entry(
        "child_spawn_wait",
        CHILD,
        1,
        "$var = rlm_spawn($prompt, timeout=$child_timeout)\n"
        "try:\n"
        "    print('child answered', len(rlm_wait($var, timeout=$pause)))\n"
        "except TimeoutError:\n"
        "    print('child still', rlm_status($var))\n"
        "except ChildFailed as e:\n"
        "    print('child failed:', e.status, e.reason)",
    ),
    Entry(
        "child_left_running",
        CHILD,
        2,
        "$var = rlm_spawn($prompt, timeout=$child_timeout)\n"
        "print('left running:', rlm_status($var))",
    ),
)

FINAL_OK = Entry("final_ok", BENIGN, 0, "FINAL('ok $sid')", r"^completed: answer$")
ENTRIES = {e.name: e for e in (*CATALOGUE, *CHILD_ACTIONS, FINAL_OK)}
FINALS = {"final_ok", "final_5mb"}  # entries that call FINAL
TERMINAL = {s.value for s in brood.RunState if s.terminal}


def repl(code: str) -> str:
    return f"{FENCE}repl\n{code}\n{FENCE}"


@dataclass
class Script:
    """What one run's model says: one step per turn, the last one FINAL."""

    sid: str
    depth: int
    parent: str | None
    steps: list[str]  # entry names, in turn order (the last is final_ok)
    replies: list[str] = field(default_factory=list)
    children: list[Script] = field(default_factory=list)

    def own_kinds(self) -> set[str]:
        return {ENTRIES[s].kind for s in self.steps}

    def summary(self) -> str:
        it = iter(self.children)
        parts = [
            f"{s}({next(it).summary()})" if ENTRIES[s].kind == CHILD else s for s in self.steps[:-1]
        ]
        return ", ".join(parts) or "-"


@dataclass
class Tree:
    number: int
    script: Script
    handle: brood.RunHandle
    started: float
    result: brood.RunResult | None = None
    ended: float | None = None
    cancelled_at_end: bool = False
    extra: bool = False  # the warm-up tree or the one after the soak


@dataclass
class Findings:
    """Failed checks and suspicious notes, grouped by kind (a kind is printed three times as
    it happens, then counted), so that one broken thing does not bury the rest."""

    SHOWN = 3

    failed: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    noted: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))

    def fail(self, what: str, kind: str | None = None) -> None:
        self._add(self.failed, "FAIL", what, kind)

    def note(self, what: str, kind: str | None = None) -> None:
        self._add(self.noted, "note", what, kind)

    def _add(self, into: dict[str, list[str]], label: str, what: str, kind: str | None) -> None:
        seen = into[kind or what]
        seen.append(what)
        if len(seen) <= self.SHOWN:
            print(f"{label}: {what}", flush=True)

    @staticmethod
    def summary(found: dict[str, list[str]]) -> list[str]:
        return [
            lines[0] if len(lines) == 1 else f"{len(lines)} x {kind}; e.g. {lines[0]}"
            for kind, lines in found.items()
        ]


def rss() -> int:
    return int(psutil.Process().memory_info().rss)


def collect() -> None:
    """Free what nobody holds, and give the allocator's free pages back to the system
    (glibc's malloc_trim): RSS then counts memory held, not memory freed and cached, so
    the check is about leaks, not about how busy the allocator was."""
    gc.collect()
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)


def cpu_seconds() -> float:
    """CPU seconds this process (all its threads) has used."""
    times = psutil.Process().cpu_times()
    return float(times.user + times.system)


def alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def proc_owner(pid: int) -> str | None:
    prefix = (OWNER_ENV + "=").encode()
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read()
    except OSError:
        return None
    for item in env.split(b"\0"):
        if item.startswith(prefix):
            return item[len(prefix) :].decode(errors="replace")
    return None


def ppid_of(pid: int) -> int | None:
    try:
        return int(psutil.Process(pid).ppid())
    except psutil.Error:
        return None


def proc_cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def describe(pids: Iterable[int]) -> str:
    out = []
    for pid in sorted(pids):
        try:
            ppid = psutil.Process(pid).ppid()
        except psutil.Error:
            ppid = -1
        out.append(f"{pid} (ppid {ppid}): {proc_cmdline(pid)[:100]}")
    return "; ".join(out)


def normal_reason(reason: str | None) -> str:
    """A reason with ids and numbers blanked, so that equal kinds of ending count together."""
    text = (reason or "").strip().splitlines()[0] if (reason or "").strip() else "<empty>"
    text = re.sub(r"\br-[0-9a-f]+", "r-…", text)
    text = re.sub(r"\bstep \d+\b", "step N", text)
    text = re.sub(r"\d+\.\d+|\d{1,3}(,\d{3})+|\d{4,}", "N", text)
    return text[:160]


def sqlite_path(url: str) -> str | None:
    if not url.startswith("sqlite:///") or url.endswith(":memory:"):
        return None
    return url[len("sqlite:///") :]


class Soak:
    def __init__(self, args: argparse.Namespace, workdir: str) -> None:
        self.args = args
        self.workdir = workdir
        self.rng = random.Random(args.seed)
        self.url: str = args.store or f"sqlite:///{workdir}/soak.db"
        self.scripts: dict[str, Script] = {}
        self.scripts_lock = threading.Lock()
        self.trees: list[Tree] = []
        self.in_flight: dict[str, Tree] = {}
        self.failures = Findings()
        self.planned: Counter[str] = Counter()
        self.escapees: list[tuple[int, float, str]] = []  # (pid, deadline, run id)
        self.zygote_kills: list[str] = []
        self.refused: str | None = None
        self.rss_peak = 0
        self._stop_sampler = threading.Event()
        self.marker = f"soak-escapee-{os.getpid()}"
        # Something for the loopback connect to reach, and a file to read, were they let through.
        self.listener = socket.create_server(("127.0.0.1", 0))
        secret = os.path.join(workdir, "secret.txt")
        with open(secret, "w") as f:
            f.write("not for model code\n")
        secrets = ["/etc/shadow", os.path.join(os.path.expanduser("~"), ".ssh"), secret]
        if sqlite_path(self.url):
            secrets.append(str(sqlite_path(self.url)))
        self.template_names = {
            "port": str(self.listener.getsockname()[1]),
            "secrets": repr(tuple(secrets)),
            "soak_pid": str(os.getpid()),
            "sleep": repr(STEP_TIMEOUT_S * 3),
            "child_timeout": repr(CHILD_TIMEOUT_S),
            "escapee": self.marker,
        }
        self.swallow_bound = STEP_TIMEOUT_S + DEFAULT_STEP_GRACE_S + SWALLOW_SLACK_S
        self.latency: dict[str, list[float]] = defaultdict(list)
        self.max_turn = 0.0
        self.t0 = time.monotonic()
        self.sup: brood.Supervisor | None = None
        self.mark = ""  # BROOD_OWNER of every process the supervisor starts
        self.journal_id = ""  # the supervisor's id in the journal

    # ---- the model ------------------------------------------------------------------------
    def chat(self, messages: list[dict[str, Any]], model: str | None = None) -> str:
        """The scripted model of every run: the run's Script, one reply per turn."""
        users = [str(m.get("content", "")) for m in messages if m.get("role") == "user"]
        found = SID.search(users[0]) if users else None
        with self.scripts_lock:
            script = self.scripts.get(found.group(1)) if found else None
        if script is None:
            return "plain reply"
        turn = sum(1 for m in messages if m.get("role") == "assistant")
        if turn < len(script.replies):
            return script.replies[turn]
        return repl("FINAL('script exhausted')")

    # ---- plans ----------------------------------------------------------------------------
    def plan(self, depth: int, parent: str | None) -> Script:
        with self.scripts_lock:
            sid = f"S{len(self.scripts) + 1}"
            script = Script(sid, depth, parent, [])
            self.scripts[sid] = script
        child_p = 0.35 if depth == 0 else 0.15
        for _ in range(self.rng.randint(1, 3)):
            if depth + 1 < MAX_DEPTH and self.rng.random() < child_p:
                action = self.rng.choices(CHILD_ACTIONS, [e.weight for e in CHILD_ACTIONS])[0]
                script.children.append(self.plan(depth + 1, sid))
                script.steps.append(action.name)
            else:
                entry = self.rng.choices(CATALOGUE, [e.weight for e in CATALOGUE])[0]
                script.steps.append(entry.name)
        script.steps.append(FINAL_OK.name)
        children = iter(script.children)
        for n, name in enumerate(script.steps):
            child = next(children) if ENTRIES[name].kind == CHILD else None
            script.replies.append(repl(self.render(ENTRIES[name], script, n, child)))
            self.planned[name] += 1
        return script

    def prompt(self, script: Script) -> str:
        return f"[soak {script.sid}] depth {script.depth}: {script.summary()}"

    def render(self, entry: Entry, script: Script, n: int, child: Script | None) -> str:
        names = dict(
            self.template_names,
            sid=script.sid,
            var=f"h{n}",
            pause=repr(self.rng.choice([0.0, 0.3, 1.0, 2.0])),
            prompt=repr(self.prompt(child)) if child else "''",
        )
        return f"# soak: {entry.name}\n" + string.Template(entry.code).substitute(names)

    def warmup_script(self) -> Script:
        """A benign tree (a root that asks a child and answers) to warm up before the baseline."""
        with self.scripts_lock:
            n = len(self.scripts)
            child = Script(f"S{n + 2}", 1, f"S{n + 1}", ["print_sum", "final_ok"])
            root = Script(f"S{n + 1}", 0, None, ["child_query", "final_ok"], children=[child])
            self.scripts[root.sid] = root
            self.scripts[child.sid] = child
        for script in (child, root):
            kids = iter(script.children)
            for i, name in enumerate(script.steps):
                kid = next(kids) if ENTRIES[name].kind == CHILD else None
                script.replies.append(repl(self.render(ENTRIES[name], script, i, kid)))
        return root

    # ---- running --------------------------------------------------------------------------
    def start_tree(self, sup: brood.Supervisor, script: Script | None = None) -> Tree | None:
        """Start a tree: a planned soak tree, or `script` (a warm-up or the last tree)."""
        extra = script is not None
        script = script or self.plan(0, None)
        try:
            with self.timed("spawn"):
                handle = sup.spawn(self.prompt(script), timeout=ROOT_TIMEOUT_S)
        except brood.BroodError as exc:
            self.refused = f"{type(exc).__name__}: {exc}"
            self.failures.fail(f"the supervisor refused a new tree: {self.refused}")
            return None
        tree = Tree(len(self.trees) + 1, script, handle, time.monotonic(), extra=extra)
        self.trees.append(tree)
        self.in_flight[handle.id] = tree
        return tree

    def collect(self, tree: Tree) -> None:
        """A tree has ended: note how, and check the processes its runs started."""
        with self.timed("wait_result"):
            tree.result = tree.handle.wait_result(timeout=30)
        tree.ended = time.monotonic()
        del self.in_flight[tree.handle.id]
        res = tree.result
        print(
            f"  tree {tree.number:3d} {res.run_id} {res.state:9s} {tree.ended - tree.started:5.1f}s"
            f"  {normal_reason(res.error) if res.error else 'answer'}"
            f"{'  [cancelled at end]' if tree.cancelled_at_end else ''}"
            f"  <{tree.script.summary()}>",
            flush=True,
        )
        assert self.sup is not None
        with self.timed("store.events"):
            events = self.sup.store.events(kind="step", root_id=res.run_id)
        for event in events:
            data = event["data"] or {}
            out = str(data.get("stdout") or "")
            for match in ESCAPED.finditer(out):
                self.failures.fail(
                    f"escape in run {event['run_id']}: {match.group(0)[:200]}",
                    f"escape: {normal_reason(match.group(0))}",
                )
            for match in ESCAPEE_PID.finditer(out):
                self.escapees.append(
                    (int(match.group(1)), time.monotonic() + ESCAPEE_GRACE_S, event["run_id"])
                )
            if "SOAK-ZYGOTE-KILLED" in out:
                self.zygote_kills.append(event["run_id"])

    def find_mark(self) -> str:
        """The BROOD_OWNER value the supervisor gave its processes, read from its zygote (the
        child of this process that carries one), so as not to depend on how brood makes it."""
        for child in psutil.Process().children():
            mark = proc_owner(child.pid)
            if mark:
                return mark
        raise RuntimeError(f"no child of this process carries {OWNER_ENV}: no zygote found")

    def ours(self, pid: int) -> bool:
        """Whether `pid` is a process this soak's supervisor (or its model code) started."""
        owner = proc_owner(pid)
        if owner is not None:
            return owner == self.mark
        return self.marker in proc_cmdline(pid)

    def check_escapees(self, final: bool = False) -> None:
        now = time.monotonic()
        keep = []
        for pid, deadline, run_id in self.escapees:
            if not alive(pid) or not self.ours(pid):
                continue
            if final or now > deadline:
                self.failures.fail(
                    f"process {pid} started by run {run_id} outlived its tree by "
                    f"{ESCAPEE_GRACE_S:g} s: {describe([pid])}",
                    "a process a run started outlived its tree",
                )
            else:
                keep.append((pid, deadline, run_id))
        self.escapees = keep

    def overdue(self, now: float) -> None:
        for tree in list(self.in_flight.values()):
            if now - tree.started > ROOT_TIMEOUT_S + TREE_SLACK_S:
                self.failures.fail(
                    f"tree {tree.number} ({tree.handle.id}) did not end "
                    f"{ROOT_TIMEOUT_S + TREE_SLACK_S:g} s after it started (root timeout "
                    f"{ROOT_TIMEOUT_S:g} s); its runs: {self.snapshot(tree)}; cancelling it"
                )
                tree.cancelled_at_end = True
                with self.timed("cancel"):
                    tree.handle.cancel()
                self.collect(tree)

    def snapshot(self, tree: Tree) -> str:
        def walk(node: dict[str, Any]) -> list[str]:
            own = f"{node.get('id')}={node.get('state')}"
            return [own] + [x for c in node.get("children", []) for x in walk(c)]

        try:
            return ", ".join(walk(tree.handle.tree()))
        except brood.BroodError as exc:
            return f"(no snapshot: {exc})"

    def sample_rss(self) -> None:
        while not self._stop_sampler.wait(RSS_EVERY_S):
            self.rss_peak = max(self.rss_peak, rss())

    def progress(self, sup: brood.Supervisor, t0: float) -> None:
        with self.timed("statistics"):
            stats = sup.statistics()
        workers = stats["workers"]
        print(
            f"[{time.monotonic() - t0:5.0f}s] trees started {len(self.trees)}, in flight "
            f"{len(self.in_flight)} | runs {stats['runs']} queued {stats['queued']} | workers "
            f"serving {workers['runs']} warm {workers['warm']} "
            f"{workers['memory_bytes'] / MIB:.0f} MiB | rss {rss() / MIB:.0f} MiB",
            flush=True,
        )

    def run(self) -> int:
        args = self.args
        print(
            f"soak: {args.seconds:g} s, {args.trees} trees in flight, seed {args.seed}, "
            f"journal {self.url}",
            flush=True,
        )
        limits = brood.Limits(
            shutdown_grace=0.3,
            term_grace=0.3,
            step_timeout=STEP_TIMEOUT_S,
            child_timeout=CHILD_TIMEOUT_S,
            max_depth=MAX_DEPTH,
            max_concurrency=MAX_CONCURRENCY,
            worker_memory=WORKER_MEMORY,
            worker_cpu_seconds=WORKER_CPU_SECONDS,
            worker_processes=WORKER_PROCESSES,
            worker_file_size=WORKER_FILE_SIZE,
        )
        print(f"limits: {limits}", flush=True)
        grace = getattr(limits, "step_grace", None)
        self.swallow_bound = STEP_TIMEOUT_S + (grace or DEFAULT_STEP_GRACE_S) + SWALLOW_SLACK_S
        sampler = threading.Thread(target=self.sample_rss, name="soak-rss", daemon=True)
        sup = brood.Supervisor(self.chat, limits=limits, store=self.url)
        self.sup = sup
        self.journal_id = sup._engine.core.owner
        self.mark = self.find_mark()
        closed = False
        try:
            warm = self.start_tree(sup, self.warmup_script())
            if warm is None:
                return self.report(sup, 0, 0.0, 0)
            res = warm.handle.wait_result(timeout=60)
            self.collect(warm)
            if res.state != "completed":
                self.failures.fail(f"the warm-up tree ended {res.state}: {res.error}")
            seen = self.our_processes()
            if not seen:
                self.failures.fail(
                    f"no process carries {OWNER_ENV}={self.mark}: leak checks are blind"
                )
            collect()
            baseline = rss()
            self.rss_peak = baseline
            sampler.start()
            print(f"baseline rss after the warm-up tree: {baseline / MIB:.1f} MiB", flush=True)

            t0 = self.t0 = time.monotonic()
            end = t0 + args.seconds
            next_progress = t0 + PROGRESS_EVERY_S
            turn = (time.monotonic(), cpu_seconds())
            while turn[0] < end and self.refused is None:
                while len(self.in_flight) < args.trees and self.refused is None:
                    self.start_tree(sup)
                self.poll()
                now = time.monotonic()
                if now >= next_progress:
                    self.progress(sup, t0)
                    next_progress = now + PROGRESS_EVERY_S
                time.sleep(0.05)
                self.check_stall(*turn)
                turn = (time.monotonic(), cpu_seconds())
            soak_s = time.monotonic() - t0
            ended_in_time = sum(not t.extra and t.ended is not None for t in self.trees)

            drain_end = time.monotonic() + DRAIN_S
            while self.in_flight and time.monotonic() < drain_end:
                self.poll()
                time.sleep(0.05)
            for tree in list(self.in_flight.values()):
                tree.cancelled_at_end = True
                with self.timed("cancel"):
                    state = tree.handle.cancel()
                if state not in TERMINAL:
                    self.failures.fail(f"cancel of tree {tree.handle.id} returned {state!r}")
                self.collect(tree)
            deadline = time.monotonic() + ESCAPEE_GRACE_S
            while self.escapees and time.monotonic() < deadline:
                self.check_escapees()
                time.sleep(0.1)
            self.check_escapees(final=True)
            self.check_quiet(sup)

            last = self.start_tree(sup, self.warmup_script())
            if last is not None:
                res = last.handle.wait_result(timeout=60)
                self.collect(last)
                if res.state != "completed":
                    self.failures.fail(
                        f"after the soak, a benign tree ended {res.state}: {res.error}"
                    )
            closed = True
            self.close(sup)
            self._stop_sampler.set()
            collect()
            return self.report(sup, baseline, soak_s, ended_in_time)
        finally:
            if not closed:
                with contextlib.suppress(Exception):
                    sup.close()
            self.listener.close()

    def check_stall(self, since: float, cpu_then: float) -> None:
        """One turn of the soak's loop is a few milliseconds of work: a long one means this
        process (the supervisor's) was starved or blocked."""
        took = time.monotonic() - since
        self.max_turn = max(self.max_turn, took)
        if took > SLOW_TURN_S:
            self.failures.note(
                f"a turn of the soak's loop took {took:.1f} s (at {time.monotonic() - self.t0:.0f}"
                f" s; this process used {cpu_seconds() - cpu_then:.2f} s of CPU in it)",
                f"a turn of the soak's loop took over {SLOW_TURN_S:g} s",
            )

    @contextlib.contextmanager
    def timed(self, call: str) -> Iterator[None]:
        """Note how long a call into the supervisor or its journal took: none should block
        for long (a cancel waits for exits, so it gets longer)."""
        t = time.monotonic()
        try:
            yield
        finally:
            took = time.monotonic() - t
            self.latency[call].append(took)
            limit = SLOW_CANCEL_S if call == "cancel" else SLOW_CALL_S
            if took > limit:
                self.failures.note(
                    f"{call}() took {took:.1f} s (at {time.monotonic() - self.t0:.0f} s)",
                    f"{call}() took over {limit:g} s",
                )

    def poll(self) -> None:
        for tree in list(self.in_flight.values()):
            if tree.handle.done:
                self.collect(tree)
        self.overdue(time.monotonic())
        self.check_escapees()

    def check_quiet(self, sup: brood.Supervisor) -> None:
        """Every tree has ended: only the zygote (a child of this process) and warm workers
        may carry the supervisor's mark, and no escapee marker may be running."""
        deadline = time.monotonic() + QUIESCE_S
        while True:
            idle = set(sup._engine.backend.idle_pids())
            strays = [
                p for p in self.our_processes() if p not in idle and ppid_of(p) != os.getpid()
            ]
            if not strays or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        if strays:
            self.failures.fail(
                f"{len(strays)} process(es) outlived their runs (every tree had ended): "
                + describe(strays)
            )

    def our_processes(self) -> list[int]:
        """Every process that carries the supervisor's mark (or an escapee's). This reads
        every process's environment, which waits on a fork loop's memory map lock for
        seconds: it is kept out of the soak's loop, which only checks escapees by pid."""
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != os.getpid():
                pid = int(entry)
                if self.ours(pid) and alive(pid):
                    found.append(pid)
        return found

    def close(self, sup: brood.Supervisor) -> None:
        t = time.monotonic()
        try:
            sup.close()
        except brood.ChildCleanupError as exc:
            self.failures.fail(f"close() could not confirm every exit: {exc} (pids {exc.pids})")
        print(f"close() took {time.monotonic() - t:.2f} s", flush=True)
        escaped = list(getattr(sup._engine.backend, "escaped", []))
        if escaped:
            self.failures.fail(
                f"close() had to sweep {len(escaped)} process(es) that outlived their runs: "
                f"{escaped}"
            )

    # ---- the report -----------------------------------------------------------------------
    def report(self, sup: brood.Supervisor, baseline: int, soak_s: float, ended: int) -> int:
        final_rss = rss()  # after close() and collect(), before the journal is read back
        fail = self.failures.fail
        left = self.our_processes()
        if left:
            fail(f"{len(left)} process(es) left after close(): {describe(left)}")
        children = psutil.Process().children(recursive=True)
        if children:
            fail(f"this process still has children after close(): {[c.pid for c in children]}")
        self.check_escapees(final=True)

        runs = self.check_journal()
        self.print_counts(runs)

        print("\n== memory (this process) ==")
        limit = baseline + max(RSS_SLACK_BYTES, int(baseline * RSS_SLACK_RATIO))
        print(
            f"rss baseline {baseline / MIB:.1f} MiB, peak {self.rss_peak / MIB:.1f} MiB, "
            f"final {final_rss / MIB:.1f} MiB (limit {limit / MIB:.1f} MiB)"
        )
        if baseline and final_rss > limit:
            fail(
                f"rss after close is {final_rss / MIB:.1f} MiB, over baseline "
                f"{baseline / MIB:.1f} MiB + max(64 MiB, 25%)"
            )

        print("\n== throughput ==")
        minutes = soak_s / 60 if soak_s else 0.0
        rate = ended / minutes if minutes else 0.0
        print(
            f"{sum(not t.extra for t in self.trees)} trees started in the soak (and "
            f"{sum(t.extra for t in self.trees)} benign ones before and after), {ended} ended "
            f"within its {soak_s:.0f} s: {rate:.1f} trees/min; "
            f"{sum(t.cancelled_at_end for t in self.trees)} cancelled at the end"
        )
        print(f"longest turn of the soak's loop: {self.max_turn:.2f} s")
        for call, took in sorted(self.latency.items()):
            print(
                f"{call}(): {len(took)} calls, median {statistics.median(took) * 1e3:.1f} ms, "
                f"max {max(took) * 1e3:.0f} ms"
            )
        if self.zygote_kills:
            print(f"zygote kills delivered: {len(self.zygote_kills)} ({self.zygote_kills})")

        print("\n== verdict ==")
        for line in Findings.summary(self.failures.noted):
            print(f"note: {line}")
        if self.failures.failed:
            failed = Findings.summary(self.failures.failed)
            print(f"FAILED: {len(failed)} kind(s) of check failed (seed {self.args.seed}):")
            for line in failed:
                print(f"  - {line}")
            print(f"journal kept at {self.url}")
            return 1
        print(f"ok: every check passed (seed {self.args.seed})")
        return 0

    def check_journal(self) -> list[dict[str, Any]]:
        """Every run of every soak tree, read back from the journal, ended with a reason;
        a contained run did not fail; the SQLite file is intact; the supervisor row closed."""
        fail = self.failures.fail
        runs: list[dict[str, Any]] = []
        with Journal(self.url) as journal:
            for tree in self.trees:
                root = journal.tree(tree.handle.id)
                stack = [root]
                while stack:
                    node = stack.pop()
                    stack.extend(node["children"])
                    node["tree"] = tree
                    runs.append(node)
        for run in runs:
            if run["state"] not in TERMINAL:
                fail(
                    f"run {run['id']} is {run['state']} in the journal after close()",
                    f"a run is {run['state']} in the journal after close()",
                )
            if not (run["reason"] or "").strip():
                fail(
                    f"run {run['id']} ended {run['state']} with an empty reason",
                    f"a run ended {run['state']} with an empty reason",
                )
            self.check_expectation(run)
        path = sqlite_path(self.url)
        if path is None:
            self.failures.note(f"{self.url} is not a SQLite file: integrity_check skipped")
            return runs
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            check = db.execute("PRAGMA integrity_check").fetchall()
            if check != [("ok",)]:
                fail(f"PRAGMA integrity_check: {check[:5]}")
            roots = [t.handle.id for t in self.trees]
            marks = ",".join("?" * len(roots))
            bad = db.execute(
                f"SELECT id, state, reason FROM runs WHERE root_id IN ({marks})",
                roots,
            ).fetchall()
            for rid, state, reason in bad:
                if state not in TERMINAL or not (reason or "").strip():
                    fail(
                        f"journal row {rid}: state {state!r}, reason {reason!r}",
                        f"a journal row is {state!r} with reason {normal_reason(reason)!r}",
                    )
            print(f"\njournal: integrity_check ok, {len(bad)} run rows of the soak's trees")
            row = db.execute(
                "SELECT closed_at FROM supervisors WHERE id=?", (self.journal_id,)
            ).fetchone()
            if row is None or row[0] is None:
                fail(f"the supervisor's row is not closed in the journal: {row}")
        finally:
            db.close()
        return runs

    def script_of(self, run: dict[str, Any]) -> Script | None:
        found = SID.search(run["prompt"] or "")
        return self.scripts.get(found.group(1)) if found else None

    def check_expectation(self, run: dict[str, Any]) -> None:
        """A run whose own code is benign or contained does not fail; nor does it time out
        unless it waited on children."""
        script = self.script_of(run)
        if script is None:
            return
        kinds = script.own_kinds()
        if not kinds <= {BENIGN, CONTAINED, CHILD}:
            return
        why = f"run {run['id']} ({script.summary()}) ended {run['state']}: {run['reason']!r}"
        kind = f"a run ended {run['state']}: {normal_reason(run['reason'])!r}"
        if run["state"] == "failed":
            self.failures.fail(
                f"{why}, though brood is meant to contain its code",
                f"{kind}, though its code is contained",
            )
        elif run["state"] == "timed_out" and CHILD not in kinds:
            self.failures.fail(
                f"{why}, though its steps are bounded by the step clock",
                f"{kind}, though its steps are bounded by the step clock",
            )

    @staticmethod
    def swallowed_for(journal: Journal, run: dict[str, Any], name: str) -> float | None:
        """Seconds from the model turn that gave the step `name` to its run's end."""
        turns = [
            e
            for e in journal.events(run["id"])
            if e["kind"] == "model_call" and f"# soak: {name}" in str(e["data"].get("response"))
        ]
        if not turns or run["ended_at"] is None:
            return None
        return float(run["ended_at"] - turns[-1]["at"])

    def check_swallowed(self, run: dict[str, Any], name: str, took: float) -> None:
        """A step that swallows or disarms StepTimeout is still stopped: by the supervisor's
        own step clock (step_timeout + step_grace), not by a child or root timeout."""
        if took > self.swallow_bound:
            self.failures.fail(
                f"run {run['id']} ran {took:.1f} s after its {name} step began (the step clock "
                f"allows {STEP_TIMEOUT_S:g} s + step_grace); it ended {run['state']}: "
                f"{run['reason']!r}",
                f"a step that defeats the step clock ({name}) was not stopped within "
                f"{self.swallow_bound:g} s",
            )

    def print_counts(self, runs: list[dict[str, Any]]) -> None:
        executed: Counter[str] = Counter()
        step_end: dict[str, Counter[str]] = defaultdict(Counter)
        run_end: dict[str, Counter[str]] = defaultdict(Counter)
        stopped: dict[str, list[float]] = defaultdict(list)
        with Journal(self.url) as journal:
            for run in runs:
                script = self.script_of(run)
                names = []
                for step in journal.steps(run["id"]):
                    found = MARKER.search(str(step.get("code") or ""))
                    if not found:
                        continue
                    name = found.group(1)
                    names.append(name)
                    executed[name] += 1
                    error = step.get("error")
                    step_end[name][str(error).split(":", 1)[0] if error else "ok"] += 1
                    if error and ENTRIES[name].kind in (BENIGN, CHILD):
                        self.failures.note(
                            f"run {run['id']}: its {name} step raised {str(error)[:300]!r}",
                            f"a {name} step raised {str(error).split(':', 1)[0]}",
                        )
                if script is not None:
                    # The step the run was in when it ended: a FINAL step is journaled, any
                    # other is not if it ended the run (then it is the first not journaled).
                    if names and names[-1] in FINALS:
                        ending = names[-1]
                    else:
                        ending = script.steps[min(len(names), len(script.steps) - 1)]
                    how = f"{run['state']}: {normal_reason(run['reason'])}"
                    run_end[ending][how] += 1
                    expect = ENTRIES[ending].expect
                    raw = f"{run['state']}: {(run['reason'] or '').strip()}"
                    if run["state"] != "cancelled" and expect and not re.search(expect, raw):
                        self.failures.note(
                            f"run {run['id']} ended during {ending} as {raw[:200]!r}, not "
                            f"/{expect}/ (its steps: {script.summary()})",
                            f"a run ended during {ending} as {how!r}",
                        )
                    if ENTRIES[ending].kind == SWALLOWS and run["state"] != "cancelled":
                        took = self.swallowed_for(journal, run, ending)
                        if took is not None:
                            stopped[ending].append(took)
                            self.check_swallowed(run, ending, took)

        print("\n== catalogue: planned / stepped, how steps ended; how runs in it ended ==")
        for name in ENTRIES:
            if not self.planned[name] and not executed[name]:
                continue
            steps = ", ".join(f"{k} {v}" for k, v in step_end[name].most_common())
            print(
                f"{name:24s} {ENTRIES[name].kind:9s} planned {self.planned[name]:3d}  "
                f"stepped {executed[name]:3d}  [{steps}]"
            )
            for how, n in run_end[name].most_common():
                print(f"{'':34s}{n:3d} run(s) ended here -> {how}")
            if stopped[name]:
                print(
                    f"{'':34s}    its run ended {min(stopped[name]):.1f}-{max(stopped[name]):.1f}"
                    f" s after the step began (bound {self.swallow_bound:g} s)"
                )

        print("\n== runs by final state and reason ==")
        by_state: Counter[str] = Counter(r["state"] for r in runs)
        by_depth: Counter[int] = Counter(r["depth"] for r in runs)
        depths = dict(sorted(by_depth.items()))
        print(f"{len(runs)} runs; by state {dict(by_state)}; by depth {depths}")
        reasons: Counter[tuple[str, str]] = Counter(
            (r["state"], normal_reason(r["reason"])) for r in runs
        )
        for (state, reason), n in sorted(reasons.items(), key=lambda x: (x[0][0], -x[1])):
            print(f"  {n:4d}  {state:9s}  {reason}")


# ---- the watchdog -------------------------------------------------------------------------
def start_watchdog(soak: Soak, after_s: float) -> None:
    """Dump state, kill the supervisor's processes and exit 2 if the soak is not done."""

    def bite() -> None:
        time.sleep(after_s)
        print(f"\nWATCHDOG: the soak is not done after {after_s:g} s; dumping state", flush=True)
        for tree in list(soak.in_flight.values()):
            print(
                f"  in flight: tree {tree.number} {tree.handle.id} for "
                f"{time.monotonic() - tree.started:.0f} s <{tree.script.summary()}>",
                flush=True,
            )
        with contextlib.suppress(Exception):
            print(f"  processes: {describe(soak.our_processes())}", flush=True)
        faulthandler.dump_traceback(all_threads=True)
        if soak.mark:
            for pid in soak.our_processes():
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        print(f"journal kept at {soak.url}", flush=True)
        sys.stdout.flush()
        os._exit(2)

    threading.Thread(target=bite, name="soak-watchdog", daemon=True).start()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else "")
    parser.add_argument("--seconds", type=float, default=DEFAULT_SECONDS, help="soak time")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="seeds every script")
    parser.add_argument("--trees", type=int, default=DEFAULT_TREES, help="trees in flight")
    parser.add_argument("--store", help="journal URL (default: SQLite in a temporary dir)")
    args = parser.parse_args(argv)
    if args.seconds <= 0 or args.trees < 1:
        parser.error("--seconds must be > 0 and --trees >= 1")
    if args.store and args.store.endswith(":memory:"):
        parser.error("--store: the journal is read back after close(); use a file or a server")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = tempfile.mkdtemp(prefix="brood-soak-")
    soak = Soak(args, workdir)
    start_watchdog(soak, args.seconds + WATCHDOG_SLACK_S)
    status = soak.run()
    keep = status != 0 or bool(soak.failures.noted)
    if keep and status == 0:
        print(f"journal kept at {soak.url} (for the notes)")
    if args.store or not keep:  # with --store, the work dir holds only the secret file
        shutil.rmtree(workdir, ignore_errors=True)
    return status


if __name__ == "__main__":
    sys.exit(main())

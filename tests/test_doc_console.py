"""Every ```console block of the README and of the tutorial (docs/tutorial/), its commands
typed in order, as a newcomer types them, in a fresh directory: the README is one journey,
the tutorial another (its pages in their order, so a page reads the notes and the journal
the pages before it left). Each command is a real `brood` process of this interpreter, on
the no-server model: a model server's spec (`openai:...`, `local:smollm2`) gets `echo` in
its place. Each exits as the page says, and where the page's comment says what it shows,
the output says it.

A placeholder is filled as the newcomer fills it: RUN_ID from `brood ps` (the newest tree),
ASK_ID from `brood asks`. A command ending in `&` is a background process the journey later
waits for (the tree it starts is in the journal before the next command, as a person would
see); `kill -9 %N` kills the Nth live one; `brood logs --follow` runs until its run ends;
`brood serve` starts on a free port, answers, and is stopped. Lines that cannot run here are
in SKIPPED with the reason, and a test checks that every console line is run or skipped."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from brood.journal import Journal
from tests.test_readme_journeys import until
from tests.test_resume import wait_gone
from tests.util import read_until, stop

ROOT = Path(__file__).resolve().parent.parent
TUTORIAL = ROOT / "docs" / "tutorial"
# The tutorial's pages in the order its index lists them.
ORDER = re.findall(r"^\d+\. \[[^]]*\]\(([\w-]+\.md)\)", (TUTORIAL / "index.md").read_text(), re.M)
JOURNEYS = {"README": [ROOT / "README.md"], "tutorial": [TUTORIAL / name for name in ORDER]}
BLOCK = re.compile(r"^```console\n(.*?)^```$", re.S | re.M)
COMMENT = re.compile(r"\s+#\s.*$")
SERVER_SPEC = re.compile(r"^(?:openai|anthropic|gemini|local):")
BROOD = [sys.executable, "-m", "brood.cli.main"]
TIMEOUT_S = 120
LOGIN = re.compile(r"log in at (http://[^/]+)/\?token=(\S+)")

NEEDS_SERVER = "needs a model server"
# Every console line that is not run, and why. The key is the command as printed, without
# its comment. A line added to the pages is run or listed here (see the last test).
SKIPPED = {
    # Builds .venv from nothing (minutes); `brood demo` is run by tests/test_cli.py and make
    # test is the suite itself.
    "make demo": "builds the venv; brood demo runs in tests/test_cli.py",
    "make test": "the suite itself",
    "make venv && . .venv/bin/activate": "builds the venv; the test runs this interpreter's brood",
    # Installing brood: the test runs the brood already installed in its interpreter.
    'pip install "git+https://HOST/PATH/brood.git"': "installs brood from a clone's remote",
    "make dist && pip install dist/rlm_brood-0.1.0-py3-none-any.whl": "builds and installs a wheel",
    ".venv/bin/pip install -e '.[local]'": "installs llama-cpp-python (minutes)",
    # A long-running demo server: `brood serve` itself is run (first-run.md).
    "make demo-serve": "runs the demo, then serves until stopped; brood serve is run instead",
    # The real model servers of docs/tutorial/real-model.md; the brood lines beside them run
    # with `echo` in the server's place.
    "vllm serve Qwen/Qwen2.5-7B-Instruct --port 8000": NEEDS_SERVER,
    "ollama pull qwen2.5:7b": NEEDS_SERVER,
    "llama-server -m qwen2.5-7b-instruct-q4_k_m.gguf --port 8080": NEEDS_SERVER,
    "export OPENAI_API_KEY=sk-...": NEEDS_SERVER,
}

COUNT = "16 words"  # what `echo` answers about the tutorial's notes
# What a line's comment says it shows, checked on its output (keyed by the whole line).
Check = Callable[[str, "Journey"], bool]
EXPECT: dict[str, Check] = {
    'brood run "Count the words in the notes" --context notes.txt --model echo': (
        lambda out, j: COUNT in out
    ),
    # real-model.md's first, on the model BROOD_MODEL names (echo here)
    'brood run "Count the words in the notes" --context notes.txt': lambda out, j: COUNT in out,
    "brood ps                    # the trees in the journal, .brood/brood.db": (
        lambda out, j: "completed" in out and (j.cwd / ".brood" / "brood.db").is_file()
    ),
    "brood tree RUN_ID           # the root and one child per chunk: state, time, calls, "
    "tokens": lambda out, j: out.count("completed") == 4,
    "brood logs RUN_ID           # each model turn, the code it ran, what it printed": (
        lambda out, j: "rlm_wait_all" in out and "ended: completed" in out
    ),
    "brood asks                  # from any terminal": lambda out, j: "deploy to prod?" in out,
    "brood answer ASK_ID yes --as alice": lambda out, j: "answered: yes" in out,
    "brood ps                     # the tree, with its state, calls, tokens and cost": (
        lambda out, j: "running" in out
    ),
    "brood tree RUN_ID            # its runs, live": lambda out, j: "running" in out,
    # what the follower printed by the time the run ended: the message it was sent too
    "brood logs RUN_ID --follow   # its trajectory as it is written, until the run ends": (
        lambda out, j: "Also count the lines" in out and "ended: cancelled" in out
    ),
    'brood send RUN_ID "Also count the lines"   # before the run\'s next model turn': (
        lambda out, j: out.startswith("sent to r-")
    ),
    "brood cancel RUN_ID          # returns once every worker's exit is confirmed": (
        lambda out, j: out.strip().endswith("cancelled")
    ),
    "brood ps                          # recent trees, newest first; stale ones marked": (
        lambda out, j: "RUN" in out and "STATE" in out
    ),
    "brood tree RUN_ID                 # the tree: state, depth, time, calls, tokens, cost": (
        lambda out, j: j.roots()[0]["run_id"] in out
    ),
    "brood logs RUN_ID                 # model turns, the code each ran, what it printed": (
        lambda out, j: "ended: " in out
    ),
    "brood show RUN_ID                 # prompt, answer, reason, usage, steps": (
        lambda out, j: "prompt:" in out
    ),
    "brood export RUN_ID --format jsonl > calls.jsonl   # one JSON line per model call": (
        lambda out, j: all(json.loads(line) for line in out.splitlines()) and bool(out)
    ),
    "brood ps                # the run is live, waiting for a person": (
        lambda out, j: "running" in out and "waiting for a person" in out
    ),
    "brood ps                # the tree is marked stale: its supervisor is gone": (
        lambda out, j: "stale" in out
    ),
    "brood asks              # the ask is open again, under the same id": (
        lambda out, j: j.asked[j.roots()[0]["run_id"]] in out
    ),
}


def console_lines(page: Path) -> list[tuple[str, str]]:
    """(where, line) for every command of the page's console blocks: its `$ ` and any
    backslash continuations joined, its comment kept."""
    found = []
    for n, match in enumerate(BLOCK.finditer(page.read_text()), 1):
        text = re.sub(r"\\\n\s*", "", match.group(1))
        for line in text.splitlines():
            if line.startswith("$ "):
                found.append((f"{page.relative_to(ROOT)}#{n}", line[2:].strip()))
    return found


def command(line: str) -> str:
    return COMMENT.sub("", line)


def keys(line: str) -> list[str]:
    """Where a line's check is found in EXPECT: the line, its command, and its command with
    `--model echo` in a model server's place (the check of the line it stands for)."""
    text = command(line)
    served = re.sub(r"--model (?:\"[^\"]*\"|\S+)", "--model echo", text)
    return [line, text, served]


def running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@dataclass
class Job:
    line: str
    proc: subprocess.Popen[str]
    run_id: str | None = None
    killed: bool = False  # by `kill -9`
    settled: bool = False  # ended, as the command that ended its tree says


@dataclass
class Journey:
    cwd: Path
    env: dict[str, str]
    jobs: list[Job] = field(default_factory=list)
    followers: list[Job] = field(default_factory=list)
    asked: dict[str, str] = field(default_factory=dict)  # run id: the id of its ask

    # ---- what the newcomer reads from the journal ------------------------------------------
    def brood(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*BROOD, *args],
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            env=self.env,
            cwd=self.cwd,
        )

    def journal(self) -> Journal | None:
        """The journal `brood ps` and `brood asks` read (None: no run has made it yet)."""
        db = self.cwd / ".brood" / "brood.db"
        return Journal(f"sqlite:///{db}") if db.is_file() else None

    def roots(self) -> list[dict[str, Any]]:
        """What `brood ps` shows: the trees, newest first."""
        journal = self.journal()
        if journal is None:
            return []
        with journal:
            return journal.roots()

    def asks(self) -> list[dict[str, Any]]:
        """What `brood asks` shows: the open asks, oldest first."""
        journal = self.journal()
        if journal is None:
            return []
        with journal:
            return journal.asks()

    def fill(self, args: list[str]) -> list[str]:
        filled = []
        for arg in args:
            if arg == "RUN_ID":
                arg = self.roots()[0]["run_id"]  # the newest tree, first in `brood ps`
            elif arg == "ASK_ID":
                arg = self.asks()[0]["id"]
            filled.append(arg)
        return filled

    def live(self) -> list[Job]:
        return [job for job in self.jobs if job.proc.poll() is None]

    # ---- one line --------------------------------------------------------------------------
    def type(self, where: str, line: str) -> None:
        text = command(line)
        if text in SKIPPED:
            return
        args = shlex.split(text)
        if args[0] == "printf":
            done = subprocess.run(["bash", "-c", text], cwd=self.cwd, timeout=TIMEOUT_S)
            assert done.returncode == 0, f"{where}: {line}"
            return
        if args[0] == "export":
            name, _, value = args[1].partition("=")
            assert name == "BROOD_MODEL" and SERVER_SPEC.match(value), f"{where}: {line}"
            self.env[name] = "echo"
            return
        if args[:2] == ["kill", "-9"]:
            job = self.live()[int(args[2].lstrip("%")) - 1]
            workers = psutil.Process(job.proc.pid).children(recursive=True)
            assert workers, f"{where}: {job.line} runs no worker to be ended"
            job.proc.send_signal(signal.SIGKILL)
            job.proc.communicate(timeout=TIMEOUT_S)
            job.killed = True
            wait_gone(job.proc.pid)
            # brood's own watchdog ends its workers, before anything resumes the tree
            until(lambda: not [w for w in workers if running(w)])
            until(lambda: any(r["stale"] for r in self.roots() if r["run_id"] == job.run_id))
            return
        assert args[0] == "brood", f"{where}: {line!r} is neither run nor in SKIPPED"
        args = self.fill(args[1:])
        for i, arg in enumerate(args[:-1]):
            if arg == "--model" and SERVER_SPEC.match(args[i + 1]):
                args[i + 1] = "echo"
        if args[0] == "serve":
            self.serve(where, args)
        elif args[-1] == "&":
            self.background(where, line, args[:-1])
        elif "--follow" in args:
            self.follow(line, args)
        else:
            self.foreground(where, line, args)

    def foreground(self, where: str, line: str, args: list[str]) -> None:
        into = None
        if ">" in args:
            at = args.index(">")
            args, into = args[:at], args[at + 1]
        out = self.brood(*args)
        assert out.returncode == 0, f"{where}: {line}\n{out.stdout}{out.stderr}"
        if into is not None:
            (self.cwd / into).write_text(out.stdout)
        # The background run the command ends exits as the page says, before the newcomer
        # types on (the shell reports it done): answered, 0; cancelled, 1.
        if args[0] == "answer":
            (run_id,) = [run for run, ask in self.asked.items() if ask == args[1]]
            by = args[args.index("--as") + 1]
            self.settle(run_id, 0, f"{by} answered")
        elif args[0] == "cancel":
            self.settle(args[1], 1, f"run {args[1]} cancelled")
        check = next((EXPECT[k] for k in keys(line) if k in EXPECT), None)
        assert check is None or check(out.stdout, self), f"{where}: {line}\n{out.stdout}"

    def settle(self, run_id: str, code: int, said: str) -> None:
        for job in self.jobs:
            if job.run_id == run_id and not (job.killed or job.settled):
                stdout, stderr = job.proc.communicate(timeout=TIMEOUT_S)
                job.settled = True
                assert job.proc.returncode == code, f"{job.line}\n{stdout}{stderr}"
                assert said in stdout + stderr, f"{job.line}\n{stdout}{stderr}"

    def background(self, where: str, line: str, args: list[str]) -> None:
        """Started, and typed on once the tree it runs is in the journal (and, for a task
        that asks a person, once its ask is open), as a newcomer would see it."""
        before = {r["run_id"] for r in self.roots()}
        proc = subprocess.Popen(
            [*BROOD, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=self.env,
            cwd=self.cwd,
        )
        job = Job(line, proc)
        self.jobs.append(job)
        if args[0] == "resume":
            job.run_id = args[1]
            until(lambda: not any(r["stale"] for r in self.roots() if r["run_id"] == args[1]))
        else:
            new = until(lambda: [r for r in self.roots() if r["run_id"] not in before])
            job.run_id = new[0]["run_id"]
        if args[0] == "resume" or args[1].startswith("Ask"):
            (ask,) = until(lambda: [a for a in self.asks() if a["run_id"] == job.run_id])
            if args[0] == "resume":  # the same ask, open again
                assert ask["id"] == self.asked[job.run_id], (ask, self.asked)
            self.asked[job.run_id] = ask["id"]
        assert proc.poll() is None, f"{where}: {line} ended early: {proc.communicate()}"

    def follow(self, line: str, args: list[str]) -> None:
        """`brood logs RUN --follow`: prints as the run goes, and returns when it ends."""
        proc = subprocess.Popen(
            [*BROOD, *args], stdout=subprocess.PIPE, text=True, env=self.env, cwd=self.cwd
        )
        self.followers.append(Job(line, proc))

    def serve(self, where: str, args: list[str]) -> None:
        """`brood serve` on a free port: it answers with its own token, then is stopped."""
        proc = subprocess.Popen(
            [*BROOD, *args, "--port", "0"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=self.env,
            cwd=self.cwd,
        )
        try:
            found = read_until(proc, LOGIN, TIMEOUT_S)
            base, token = found[1], found[2]
            request = urllib.request.Request(
                base + "/v1/models", headers={"Authorization": f"Bearer {token}"}
            )
            with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
                models = json.loads(response.read())
            assert [m["id"] for m in models["data"]] == ["echo"], models
        finally:
            status = stop(proc, TIMEOUT_S)
        assert status in (0, -signal.SIGTERM), status

    # ---- the end -------------------------------------------------------------------------
    def finish(self) -> None:
        """Every background process ends as the page says: answered (0), cancelled (1) or
        killed; a follower once its run has ended."""
        for job in self.jobs:
            if not (job.killed or job.settled):
                stdout, stderr = job.proc.communicate(timeout=TIMEOUT_S)
                assert job.proc.returncode == 0, f"{job.line}\n{stdout}{stderr}"
        for follower in self.followers:
            stdout, _ = follower.proc.communicate(timeout=TIMEOUT_S)
            assert follower.proc.returncode == 0, follower.line
            check = next((EXPECT[k] for k in keys(follower.line) if k in EXPECT), None)
            assert "ended: " in stdout and (check is None or check(stdout, self)), stdout

    def abandon(self) -> None:
        for job in [*self.jobs, *self.followers]:
            if job.proc.poll() is None:
                job.proc.kill()
            job.proc.communicate()


def walk(name: str, tmp_path: Path) -> None:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("BROOD_MODEL", "BROOD_TOKEN", "BROOD_STORE")
    }
    env["COLUMNS"] = "200"  # rich wraps at COLUMNS
    journey = Journey(tmp_path, env)
    try:
        for page in JOURNEYS[name]:
            for where, line in console_lines(page):
                journey.type(where, line)
        journey.finish()
    finally:
        journey.abandon()


def test_the_readme_console_lines_run_as_printed(tmp_path):
    walk("README", tmp_path)


def test_the_tutorial_console_lines_run_as_printed_in_order(tmp_path):
    walk("tutorial", tmp_path)


def test_every_console_line_is_run_or_skipped_with_a_reason():
    lines = [
        (w, line) for pages in JOURNEYS.values() for p in pages for w, line in console_lines(p)
    ]
    assert len(ORDER) >= 5 and any(w.startswith("README.md") for w, _ in lines)
    runnable = ("brood ", "printf ", "kill -9 %", "export BROOD_MODEL=")
    for where, line in lines:
        text = command(line)
        assert text in SKIPPED or text.startswith(runnable), f"{where}: {line!r}"
    # Nothing stale in the tables: every skipped line and every check is still printed.
    assert set(SKIPPED) <= {command(line) for _, line in lines}
    assert set(EXPECT) <= {key for _, line in lines for key in keys(line)}


def test_the_skipped_lines_name_what_the_repository_has():
    """A skipped line is not run, but what it names exists: its make targets, its extras
    and the wheel `make dist` builds."""
    import tomllib

    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wheel = f"{project['name'].replace('-', '_')}-{project['version']}-py3-none-any.whl"
    for text in SKIPPED:
        for target in re.findall(r"\bmake ([\w-]+)", text):
            assert target in targets, f"{text!r}: no make target {target}"
        for extra in re.findall(r"\.\[(\w+)\]", text):
            assert extra in project["optional-dependencies"], f"{text!r}: no extra {extra}"
        for name in re.findall(r"dist/(\S+\.whl)", text):
            assert name == wheel, f"{text!r}: make dist builds {wheel}"

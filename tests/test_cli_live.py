"""`brood run` draws a live tree on a terminal that updates as children start and end."""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
import threading

from tests.fake_openai import FakeOpenAI

ANSI = re.compile(r"\x1b\[[0-9;?]*[a-zA-Z]")
READ_TIMEOUT_S = 60


def read_until(fd: int, seen: list[str], predicate) -> str:
    """Read the terminal until `predicate(text so far)` holds (bounded by READ_TIMEOUT_S)."""
    while not predicate(text := ANSI.sub("", "".join(seen))):
        ready, _, _ = select.select([fd], [], [], READ_TIMEOUT_S)
        assert ready, f"the terminal showed nothing new for {READ_TIMEOUT_S} s:\n{text[-2000:]}"
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # the other end closed
            chunk = b""
        if not chunk:
            return text
        seen.append(chunk.decode(errors="replace"))
    return text


def test_the_live_tree_shows_a_child_running_then_completed(tmp_path):
    release = threading.Event()

    def script(body):
        task = next(m["content"] for m in body["messages"] if m["role"] == "user")
        if task.startswith("root"):
            return "```repl\nFINAL('root got ' + rlm_query('child: slow part'))\n```"
        release.wait(READ_TIMEOUT_S)  # the child's model call waits for the test
        return "```repl\nprint('child step output')\nFINAL('done')\n```"

    with FakeOpenAI(script) as server:
        master, slave = pty.openpty()
        env = {**os.environ, "COLUMNS": "200", "TERM": "xterm"}
        env.pop("BROOD_MODEL", None)
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "brood.cli.main",
                "run",
                "root task",
                "--model",
                f"openai:m@{server.base_url}",
                "--store",
                f"sqlite:///{tmp_path}/j.db",
            ],
            stdout=subprocess.PIPE,
            stderr=slave,
            env=env,
            text=True,
        )
        os.close(slave)
        seen: list[str] = []
        try:
            text = read_until(
                master,
                seen,
                lambda t: "child: slow part" in t and re.search(r"r-\w+ running d1", t) is not None,
            )
            assert re.search(r"r-\w+ running d0", text)
            release.set()
            text = read_until(
                master,
                seen,
                lambda t: (
                    re.search(r"r-\w+ completed d1", t) is not None
                    and re.search(r"r-\w+ completed d0", t) is not None
                ),
            )
            out, _ = proc.communicate(timeout=READ_TIMEOUT_S)
        finally:
            release.set()
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
            os.close(master)
    assert proc.returncode == 0
    assert out.strip() == "root got done"
    assert "child step output" in text  # the last line of output is shown in the tree

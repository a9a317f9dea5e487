"""Test tools: gates that let a test and model code meet without sleeping."""

from __future__ import annotations

import getpass
import os
import re
import select
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import brood

# Where pytest makes tmp_path: model code in these tests meets the test through files there
# (gates, pid files), so the tests' limits let workers write there. The escape catalogue
# (test_trust.py) uses brood's defaults instead.
TEST_FILES = os.path.join(tempfile.gettempdir(), f"pytest-of-{getpass.getuser()}")
SHARED = dict(shutdown_grace=0.3, term_grace=0.3, fs_write=(TEST_FILES,))

FAST = brood.Limits(**SHARED, max_depth=3)  # type: ignore[arg-type]


def until(condition: Callable[[], Any], timeout: float = 60.0, every: float = 0.02) -> Any:
    """Poll `condition` every `every` seconds until it returns something true (that value),
    bounded by `timeout`."""
    pause = threading.Event()
    for _ in range(int(timeout / every)):
        if value := condition():
            return value
        pause.wait(every)
    raise AssertionError("the condition never held")


def fast(**kw: object) -> brood.Limits:
    base: dict[str, object] = dict(SHARED, max_depth=3)
    base.update(kw)
    return brood.Limits(**base)  # type: ignore[arg-type]


class Gate:
    """A named pipe. Code in a worker blocks in `wait_code` (or a scripted reply built with
    `blocking_reply`) until the test calls `open()`; `open()` blocks until that code waits.
    """

    def __init__(self, tmp_path: Path, name: str) -> None:
        self.path = str(tmp_path / name)
        os.mkfifo(self.path)

    @property
    def wait_code(self) -> str:
        return f"open({self.path!r}).read()"

    def open(self) -> None:
        with open(self.path, "w") as f:
            f.write("go")

    def blocking_reply(self, reply: str):
        """A scripted reply that waits for this gate before answering `reply`."""
        path = self.path

        def answer(messages: list[dict]) -> str:
            with open(path) as f:
                f.read()
            return reply

        return answer


class Signal:
    """The reverse of a Gate: model code announces it reached a point; the test waits for it."""

    def __init__(self, tmp_path: Path, name: str) -> None:
        self.path = str(tmp_path / name)
        os.mkfifo(self.path)

    @property
    def code(self) -> str:
        return f"open({self.path!r}, 'w').write('1')"

    def notify_then(self, reply):
        """A scripted reply that announces itself, then gives `reply` (a str or callable)."""
        path = self.path

        def answer(messages: list[dict]) -> str:
            with open(path, "w") as f:
                f.write("1")
            return reply(messages) if callable(reply) else reply

        return answer

    def wait(self) -> None:
        """Block until an announcement arrives. A read can end empty (the end of an earlier
        writer's file), so read again until the announcement itself is read."""
        while True:
            with open(self.path) as f:
                if f.read():
                    return


def pid_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie (a zombie has exited; its parent, which may
    not be ours to wait for, has only not reaped it yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def read_until(
    proc: subprocess.Popen[bytes], pattern: re.Pattern[str], timeout: float
) -> re.Match[str]:
    """Read `proc`'s stderr until `pattern` matches what it said (a server's address, say);
    fails naming what it said if it ends or stays silent `timeout` seconds first. Reads the
    descriptor itself: a buffered reader could hold a line that select() no longer sees."""
    assert proc.stderr is not None
    said = ""
    while not (found := pattern.search(said)):
        ready, _, _ = select.select([proc.stderr], [], [], timeout)
        chunk = os.read(proc.stderr.fileno(), 65536) if ready else b""
        assert chunk, f"it said no {pattern.pattern!r}: {said!r} (exit {proc.poll()})"
        said += chunk.decode(errors="replace")
    return found


def stop(proc: subprocess.Popen[bytes], timeout: float) -> int:
    """SIGTERM `proc` and reap it (SIGKILL past `timeout`); its exit status."""
    proc.terminate()
    try:
        proc.wait(timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()
    return proc.returncode

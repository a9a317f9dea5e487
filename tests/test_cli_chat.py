"""`brood chat`: a conversation in the terminal, as a real process with stdin piped."""

from __future__ import annotations

import os
import pty
import re
import signal
import subprocess

from brood.journal import Journal
from tests.test_cli import BROOD
from tests.test_cli_live import READ_TIMEOUT_S, read_until

CHAT_MODEL = """
def chat(messages, model=None):
    last = messages[-1]["content"]
    if "set x" in last:
        return "```repl\\nx = 21\\nFINAL('x is set')\\n```"
    if "double x" in last:
        return "```repl\\ny = x * 2\\nFINAL(f'y is {y}')\\n```"
    if "add them" in last:
        return "```repl\\nprint(x + y)\\n```"
    if "escape" in last:
        return "```repl\\nFINAL('\\\\x1b]0;pwned\\\\x07plain\\\\x1b[2J text')\\n```"
    if "context" in last:
        return "```repl\\nFINAL(context.upper())\\n```"
    if last.startswith("[output]"):
        return "```repl\\nFINAL(f'sum is {x + y}')\\n```"
    return "```repl\\nFINAL('unexpected: ' + repr(last[:80]))\\n```"
"""


def chat_env(tmp_path) -> dict[str, str]:
    (tmp_path / "chatmodel.py").write_text(CHAT_MODEL)
    env = {k: v for k, v in os.environ.items() if k not in ("BROOD_MODEL", "PYTHONPATH")}
    return env | {"COLUMNS": "200", "PYTHONPATH": str(tmp_path)}


def chat(tmp_path, *args: str, lines: str) -> subprocess.CompletedProcess[str]:
    url = f"sqlite:///{tmp_path}/j.db"
    return subprocess.run(
        [*BROOD, "chat", "--model", "python:chatmodel:chat", "--store", url, *args],
        input=lines,
        capture_output=True,
        text=True,
        timeout=120,
        env=chat_env(tmp_path),
    )


def conversation_id(stderr: str) -> str:
    return stderr.split("conversation ", 1)[1].split()[0]


def test_each_line_is_a_turn_and_end_of_input_closes_it(tmp_path):
    context = tmp_path / "notes.txt"
    context.write_text("some notes")
    lines = "set x\n\ndouble x\nadd them\nescape\nread the context\n"
    out = chat(tmp_path, "--context", str(context), lines=lines)
    assert out.returncode == 0, out.stderr
    answers = out.stdout.splitlines()
    assert answers == ["x is set", "y is 42", "sum is 63", "plain text", "SOME NOTES"]
    assert "\x1b" not in out.stdout  # model text reaches the terminal cleaned
    conv_id = conversation_id(out.stderr)
    assert f"conversation {conv_id} closed (completed)" in out.stderr
    with Journal(f"sqlite:///{tmp_path}/j.db") as journal:
        run = journal.run(conv_id)
        prompts = [e["data"]["prompt"] for e in journal.store.events(conv_id, "user_turn")]
    assert (run["state"], run["reason"]) == ("completed", "conversation closed after 5 turns")
    assert prompts == ["set x", "double x", "add them", "escape", "read the context"]


def test_exit_closes_it_and_a_closed_conversation_is_not_resumed(tmp_path):
    out = chat(tmp_path, lines="set x\nexit\ndouble x\n")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["x is set"]
    conv_id = conversation_id(out.stderr)
    again = chat(tmp_path, "--resume", conv_id, lines="double x\n")
    assert again.returncode == 2
    assert f"error: conversation {conv_id} is closed (completed" in again.stderr
    assert "Start another with brood chat" in again.stderr
    assert "Traceback" not in again.stderr


def test_ctrl_c_between_turns_keeps_it_for_resume(tmp_path):
    url = f"sqlite:///{tmp_path}/j.db"
    proc = subprocess.Popen(
        [*BROOD, "chat", "--model", "python:chatmodel:chat", "--store", url],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=chat_env(tmp_path),
    )
    try:
        conv_id = conversation_id(proc.stderr.readline())
        proc.stdin.write("set x\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == "x is set\n"
        proc.send_signal(signal.SIGINT)  # waiting for the next line
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err
    assert f"continue with `brood chat --resume {conv_id}`" in err
    resumed = chat(tmp_path, "--resume", conv_id, lines="double x\nadd them\n")
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout.splitlines() == ["y is 42", "sum is 63"]
    assert f"conversation {conv_id} resumed" in resumed.stderr


def test_on_a_terminal_it_prompts_for_each_line_and_ctrl_d_closes_it(tmp_path):
    master, slave = pty.openpty()
    url = f"sqlite:///{tmp_path}/j.db"
    proc = subprocess.Popen(
        [*BROOD, "chat", "--model", "python:chatmodel:chat", "--store", url],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=chat_env(tmp_path) | {"TERM": "xterm"},
    )
    os.close(slave)
    seen: list[str] = []
    try:
        read_until(master, seen, lambda t: t.rstrip().endswith(">"))
        os.write(master, b"set x\n")
        read_until(master, seen, lambda t: "x is set" in t and t.rstrip().endswith(">"))
        os.write(master, b"double x\n")
        read_until(master, seen, lambda t: "y is 42" in t and t.rstrip().endswith(">"))
        os.write(master, b"\x04")  # Ctrl-D: end of input
        text = read_until(master, seen, lambda t: "closed (completed)" in t)
        assert proc.wait(READ_TIMEOUT_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    assert re.search(r"conversation r-\w+ closed \(completed\)", text)

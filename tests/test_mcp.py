"""MCP servers' tools in the REPL: a stdio server written here with the `mcp` SDK, started
by the supervisor, called from model code, killed and started again, gone after close."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

import brood
from brood.journal import Journal
from tests.fake_openai import FakeOpenAI
from tests.test_cli import brood as brood_cli
from tests.util import FAST, pid_alive

pytest.importorskip("mcp")

FENCE = "```"

SERVER = """
import os, sys
from mcp.server import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

with open(sys.argv[1], "a") as f:  # every start of this server, by pid
    f.write(f"{os.getpid()}\\n")

server = MCPServer("Demo")


@server.tool()
def add(a: int, b: int) -> int:
    '''Add two numbers.'''
    return a + b


@server.tool()
def whoami() -> int:
    '''The pid of the server.'''
    return os.getpid()


@server.tool()
def crash() -> str:
    '''Ends the server in the middle of the call.'''
    os._exit(3)


@server.tool()
def refuse(why: str) -> str:
    '''Always fails, saying why.'''
    raise ToolError(why)


server.run()
"""


def repl(code: str) -> str:
    return f"{FENCE}repl\n{code}\n{FENCE}"


@pytest.fixture
def server(tmp_path) -> tuple[str, object]:
    """The command of a stdio MCP server, and the file its pids are written to."""
    script = tmp_path / "demo_server.py"
    script.write_text(SERVER)
    starts = tmp_path / "starts"
    return f"{sys.executable} {script} {starts}", starts


def pids(starts) -> list[int]:
    return [int(line) for line in starts.read_text().split()]


def test_a_stdio_server_s_tools_are_called_from_model_code(tmp_path, server):
    command, starts = server
    seen: list[str] = []

    def first(messages: list[dict]) -> str:
        seen.append(messages[0]["content"])
        return repl("FINAL(str(demo_add(2, b=40)))")

    url = f"sqlite:///{tmp_path}/j.db"
    with brood.Supervisor(
        brood.ScriptedModel({"sum": [first]}), limits=FAST, store=url, mcp_servers=[command]
    ) as sup:
        result = sup.run("sum task")
        [pid] = pids(starts)
        assert pid_alive(pid)  # one session per supervisor, kept between runs
    assert result.state == "completed", result.error
    assert result.answer == "42"
    assert "- demo_add(a: int, b: int)" in seen[0]
    assert "Add two numbers." in seen[0]
    with Journal(url) as journal:
        [ev] = [e for e in journal.store.events() if e["kind"] == "tool_call"]
    assert json.loads(ev["data"]["call"]) == ["demo_add", [2], {"b": 40}]
    assert ev["data"]["result"] == 42
    assert not pid_alive(pid)  # gone after close


def test_bad_arguments_and_a_failing_tool_are_errors_in_the_run(server):
    command, _ = server
    code = "\n".join(
        [
            "out = []",
            "for call in (lambda: demo_add('two', 3), lambda: demo_add(1), "
            "lambda: demo_add(1, 2, c=3), lambda: demo_refuse('no way')):",
            "    try:",
            "        call()",
            "    except (InvalidArgument, ToolError) as e:",
            "        out.append(f'{type(e).__name__}: {e}')",
            "FINAL('\\n'.join(out))",
        ]
    )
    model = brood.ScriptedModel({"bad": [repl(code)]})
    with brood.Supervisor(model, limits=FAST, mcp_servers=[f"demo={command}"]) as sup:
        result = sup.run("bad task")
    assert result.state == "completed", result.error
    wrong, missing, unknown, refused = result.answer.split("\n")
    assert wrong.startswith("InvalidArgument: tool demo_add(a: int, b: int): argument 'a'")
    assert "'two' is not of type 'integer'" in wrong
    assert "missing the argument 'b'" in missing
    assert "no argument 'c'" in unknown
    assert refused.startswith("ToolError: tool demo_refuse failed:") and "no way" in refused


def test_a_killed_server_is_started_again_at_the_next_call(server):
    command, starts = server
    model = brood.ScriptedModel({"who": [repl("FINAL(str(demo_whoami()))")]})
    with brood.Supervisor(model, limits=FAST, mcp_servers=[command]) as sup:
        first = int(sup.run("who task").answer)
        os.kill(first, signal.SIGKILL)
        again = sup.run("who task")
        assert again.state == "completed", again.error
        second = int(again.answer)
        assert second != first
        assert pids(starts) == [first, second]
    assert not pid_alive(second)


def test_a_server_that_dies_mid_call_is_a_tool_error_and_others_go_on(server):
    command, starts = server
    code = (
        "try:\n    demo_crash()\nexcept ToolError as e:\n    said = str(e)\n"
        "FINAL(said + ' | ' + str(demo_add(1, 1)))"
    )
    model = brood.ScriptedModel({"crash": [repl(code)]})
    with brood.Supervisor(model, limits=FAST, mcp_servers=[command]) as sup:
        result = sup.run("crash task")
    assert result.state == "completed", result.error
    said, answer = result.answer.split(" | ")
    assert said.startswith("tool demo_crash: the MCP server demo (")
    assert "was gone again after it was started again; check the server" in said
    assert answer == "2"
    assert len(pids(starts)) == 3  # the first, the one the retry started, the one after
    assert not any(pid_alive(p) for p in pids(starts))


def test_a_command_that_does_not_start_is_refused_at_start(tmp_path):
    with pytest.raises(brood.BroodError, match=r"MCP server .*no-such-mcp-server.* did not start"):
        brood.Supervisor(
            brood.ScriptedModel([]), mcp_servers=[str(tmp_path / "no-such-mcp-server")]
        )
    broken = tmp_path / "broken.py"
    broken.write_text("raise SystemExit('this is no server')")
    with pytest.raises(brood.BroodError, match="did not start"):
        brood.Supervisor(brood.ScriptedModel([]), mcp_servers=[f"{sys.executable} {broken}"])


HTTP_SERVER = """
import socket, uvicorn
from mcp.server import MCPServer

server = MCPServer("Web")


@server.tool()
def shout(word: str) -> str:
    '''The word in capitals.'''
    return word.upper()


sock = socket.socket()
sock.bind(("127.0.0.1", 0))
sock.listen(64)  # connections wait in the backlog until uvicorn accepts them
print(sock.getsockname()[1], flush=True)
uvicorn.Server(uvicorn.Config(server.streamable_http_app(), log_level="warning")).run(
    sockets=[sock]
)
"""


def test_a_streamable_http_server_s_tools_are_called_by_url(tmp_path):
    script = tmp_path / "web_server.py"
    script.write_text(HTTP_SERVER)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        model = brood.ScriptedModel({"loud": [repl("FINAL(web_shout('hi'))")]})
        with brood.Supervisor(
            model, limits=FAST, mcp_servers=[f"http://127.0.0.1:{port}/mcp"]
        ) as sup:
            result = sup.run("loud task")
    finally:
        proc.terminate()
        proc.wait(30)
        proc.stdout.close()
    assert result.state == "completed", result.error
    assert result.answer == "HI"


def test_brood_run_takes_an_mcp_server(tmp_path, server):
    command, starts = server
    script = {"sum it": [repl("FINAL(str(calc_add(20, 22)))")]}
    with FakeOpenAI(script) as fake:
        out = brood_cli(
            "run",
            "sum it",
            "--model",
            f"openai:fake@{fake.base_url}",
            "--store",
            f"sqlite:///{tmp_path}/j.db",
            "--mcp",
            f"calc={command}",
            "--no-live",
        )
        gone = brood_cli(
            "run",
            "sum it",
            "--model",
            f"openai:fake@{fake.base_url}",
            "--store",
            f"sqlite:///{tmp_path}/j.db",
            "--mcp",
            str(tmp_path / "no-such-server"),
        )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "42"
    assert not any(pid_alive(p) for p in pids(starts))
    assert gone.returncode == 2
    assert "no-such-server" in gone.stderr and "did not start" in gone.stderr

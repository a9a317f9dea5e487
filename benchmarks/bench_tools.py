"""A tool call's round trip against an `llm_query` through the model gateway.

Both are a request frame from the worker to the supervisor and a Reply back: `llm_query`
runs an instant chat_fn in the gateway's thread pool and journals a `model_call`; a tool
call checks its arguments against the tool's signature, runs the function in a thread of
its own and journals a `tool_call`. Model code in one supervisor makes CALLS sequential
calls of each, timed inside the REPL block with time.perf_counter, three runs per series
(the median is reported), alternating, so both meet the same machine. With the `mcp` SDK
installed, a third series calls a tool of a stdio MCP server (FastMCP's successor,
`MCPServer`) through the same path.

Reported: microseconds per call of each, and the tool call's ratio to llm_query. No
target: the issue asks for the ratio.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
import tempfile
from pathlib import Path
from typing import Any

import brood
from _common import Row, finish, median, no_leftovers, parse_args, run_completed

BENCH = "tools"
CALLS = 1000
WARM_UP = 50
REPEATS = 3
US = 1e6

BLOCK = """```repl
import time
for _ in range({warm}):
    {call}
t0 = time.perf_counter()
seen = set()
for _ in range({calls}):
    seen.add({call})
FINAL(repr(((time.perf_counter() - t0) / {calls} * 1e6, sorted(seen))))
```"""
CALLS_OF = {
    "llm_query": "llm_query('q')",
    "tool": "lookup('q', 1)",
    "mcp": "bench_lookup('q', 1)",
}

SERVER = """
from mcp.server import MCPServer

server = MCPServer("bench")


@server.tool()
def lookup(word: str, n: int) -> str:
    '''The word, once.'''
    return "a"


server.run()
"""


def lookup(word: str, n: int) -> str:
    """The word, once (a tool that does nothing, to time the round trip)."""
    return "a"


def chat_fn(messages: list[dict[str, Any]], model: str | None = None) -> str:
    content = messages[-1]["content"]
    if content == "q":
        return "a"
    kind = content.split()[0]
    return BLOCK.format(warm=WARM_UP, calls=CALLS, call=CALLS_OF[kind])


def one_run(sup: brood.Supervisor, kind: str, i: int) -> float:
    res = run_completed(sup, f"{kind} {i}: sequential calls")
    us, seen = ast.literal_eval(res.answer or "")
    if seen != ["a"]:
        raise RuntimeError(f"the {kind} run got {seen}")
    return float(us)


def main() -> None:
    args = parse_args(__doc__ or "")
    kinds = ["llm_query", "tool"]
    servers = []
    with tempfile.TemporaryDirectory() as folder:
        if importlib.util.find_spec("mcp") is not None:
            script = Path(folder) / "bench_server.py"
            script.write_text(SERVER)
            servers.append(f"{sys.executable} {script}")
            kinds.append("mcp")
        limits = brood.Limits(step_timeout=None, shutdown_grace=0.5, term_grace=0.5)
        with brood.Supervisor(
            model=chat_fn, limits=limits, tools=[lookup], mcp_servers=servers
        ) as sup:
            for kind in kinds:
                one_run(sup, kind, -1)  # first-use costs on both sides
            times: dict[str, list[float]] = {k: [] for k in kinds}
            for i in range(REPEATS):
                for kind in kinds:
                    times[kind].append(one_run(sup, kind, i))
    left = no_leftovers(BENCH)

    q = median(times["llm_query"])
    rows = [Row(BENCH, "llm_query via gateway, per call", round(q, 3), "us")]
    print(f"llm_query through the gateway   {q:8.1f} us/call  (runs: {times['llm_query']})")
    for kind, what in (("tool", "tool call (supervisor side)"), ("mcp", "MCP tool call (stdio)")):
        if kind not in times:
            continue
        t = median(times[kind])
        print(f"{what:31} {t:8.1f} us/call = {t / q:.2f}x llm_query  (runs: {times[kind]})")
        rows.append(Row(BENCH, f"{what}, per call", round(t, 3), "us", round(q, 3)))
    print(
        f"\nheadline: a tool call takes {median(times['tool']) / q:.2f}x an llm_query's round trip"
    )
    finish(BENCH, rows, left, args.json)


if __name__ == "__main__":
    main()

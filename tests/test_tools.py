"""The user's tools in the REPL: called from model code against real workers, checked,
journaled, replayed on resume; in the worker when marked so; from `brood run --tool`."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import textwrap

import pytest

import brood
from brood.journal import Journal
from tests.fake_openai import FakeOpenAI
from tests.test_cli import brood as brood_cli
from tests.test_resume import crash
from tests.util import FAST, Signal

FENCE = "```"


def repl(code: str) -> str:
    return f"{FENCE}repl\n{code}\n{FENCE}"


@dataclasses.dataclass
class Point:
    x: int
    y: int


def forecast(city: str, days: int = 3) -> dict:
    """The weather in `city` for the next `days` days."""
    return {"city": city, "days": [f"sun {i}" for i in range(days)], "pid": os.getpid()}


def norm(p: Point, scale: float = 1.0) -> float:
    """The length of `p`, times `scale`."""
    return (p.x**2 + p.y**2) ** 0.5 * scale


def explode(why: str) -> str:
    """Always fails."""
    raise RuntimeError(f"boom: {why}")


def not_json() -> object:
    """Returns what JSON cannot hold."""
    return object()


def where() -> int:
    """The pid of the process it runs in."""
    return os.getpid()


class Opaque:
    """Nothing model code could pass as JSON."""


def takes_opaque(o: Opaque) -> None:
    """Takes an Opaque."""


def events(url: str, kind: str) -> list[dict]:
    with Journal(url) as journal:
        return [e for e in journal.store.events() if e["kind"] == kind]


def test_a_tool_called_from_model_code_runs_in_the_supervisor_and_is_journaled(tmp_path):
    seen: list[str] = []

    def first(messages: list[dict]) -> str:
        seen.append(messages[0]["content"])
        return repl("import json\nw = forecast('Oslo', days=2)\nFINAL(json.dumps(w))")

    url = f"sqlite:///{tmp_path}/j.db"
    model = brood.ScriptedModel({"weather": [first]})
    with brood.Supervisor(model, limits=FAST, store=url, tools=[forecast]) as sup:
        result = sup.run("weather task", context=None)
    assert result.state == "completed", result.error
    answer = json.loads(result.answer)
    assert answer["days"] == ["sun 0", "sun 1"]
    assert answer["pid"] == os.getpid()  # the supervisor's process, not the worker's
    # The system prompt describes it from its signature and docstring.
    assert "- forecast(city: str, days: int = 3) -> dict" in seen[0]
    assert "The weather in `city` for the next `days` days." in seen[0]
    [ev] = events(url, "tool_call")
    assert ev["data"]["tool"] == "forecast"
    assert json.loads(ev["data"]["call"]) == ["forecast", ["Oslo"], {"days": 2}]
    assert ev["data"]["result"]["days"] == ["sun 0", "sun 1"]


def test_arguments_are_checked_against_the_signature_and_converted(tmp_path):
    code = "\n".join(
        [
            "out = [norm({'x': 3, 'y': 4}, scale=2)]",
            "for bad in (\"norm({'x': 'three', 'y': 4})\", \"norm(5)\", \"norm()\", "
            "\"norm({'x': 1, 'y': 1}, 2, 3)\", \"norm({'x': 1, 'y': 1}, scale='big')\"):",
            "    try:",
            "        eval(bad)",
            "    except InvalidArgument as e:",
            "        out.append(str(e))",
            "FINAL(json.dumps(out))",
        ]
    )
    model = brood.ScriptedModel({"check": [repl("import json\n" + code)]})
    with brood.Supervisor(model, limits=FAST, tools=[norm]) as sup:
        result = sup.run("check task")
    assert result.state == "completed", result.error
    first, *errors = json.loads(result.answer)
    assert first == 10.0  # a dict became the Point the annotation names
    assert len(errors) == 5
    assert all(e.startswith("tool norm") for e in errors)
    assert "argument 'p' must be Point, got dict" in errors[0]
    assert "Expected `int`, got `str` - at `$.x`" in errors[0]
    assert "argument 'p' must be Point" in errors[1]
    assert "missing a required argument: 'p'" in errors[2]
    assert "too many positional arguments" in errors[3]
    assert "argument 'scale' must be float" in errors[4]
    # The model is told the fields of the object a parameter takes.
    spec = brood.Tool(norm).spec
    assert spec.signature == "(p: Point, scale: float = 1.0) -> float"
    assert 'p (Point) is an object: {"x": int, "y": int}' in spec.doc


def test_a_tool_that_raises_gives_the_model_a_tool_error_and_the_run_goes_on(tmp_path):
    code = "\n".join(
        [
            "out = []",
            "for call in (lambda: explode('now'), not_json):",
            "    try:",
            "        call()",
            "    except ToolError as e:",
            "        out.append(f'{e.tool}: {e}')",
            "FINAL(' | '.join(out))",
        ]
    )
    model = brood.ScriptedModel({"fail": [repl(code)]})
    with brood.Supervisor(model, limits=FAST, tools=[explode, not_json]) as sup:
        result = sup.run("fail task")
        again = sup.run("fail task")  # the supervisor keeps serving
    assert result.state == "completed", result.error
    assert "explode: tool explode raised RuntimeError: boom: now" in result.answer
    assert "not_json: tool not_json returned a object, which is not JSON" in result.answer
    assert again.state == "completed"


def test_a_tool_past_its_timeout_raises_tool_error(tmp_path):
    gate = tmp_path / "gate"
    os.mkfifo(gate)

    def stuck() -> str:
        """Waits for a gate that only the test opens."""
        with open(gate) as f:
            return f.read()

    code = "try:\n    stuck()\nexcept ToolError as e:\n    FINAL(str(e))"
    model = brood.ScriptedModel({"slow": [repl(code)]})
    try:
        with brood.Supervisor(model, limits=FAST, tools=[brood.Tool(stuck, timeout=0.2)]) as sup:
            result = sup.run("slow task")
    finally:
        with open(gate, "w") as f:  # lets the tool's thread end
            f.write("late")
    assert result.state == "completed", result.error
    assert "tool stuck did not return within 0.2 s" in result.answer


def test_a_tool_marked_in_worker_runs_confined_in_the_worker(tmp_path):
    model = brood.ScriptedModel({"pids": [repl("FINAL(f'{here()} {there()}')")]})
    tools = [brood.Tool(where, name="here", in_worker=True), brood.Tool(where, name="there")]
    with brood.Supervisor(model, limits=FAST, tools=tools) as sup:
        result = sup.run("pids task")
    assert result.state == "completed", result.error
    here, there = map(int, result.answer.split())
    assert there == os.getpid()
    assert here != os.getpid()  # the worker's process


def test_the_decorator_makes_a_tool_that_still_calls_as_the_function():
    @brood.tool(timeout=5)
    def double(n: int) -> int:
        """Twice `n`."""
        return 2 * n

    assert isinstance(double, brood.Tool) and double.timeout == 5
    assert double(21) == 42
    assert brood.tool(where).name == "where"
    assert double.spec.signature == "(n: int) -> int"


def test_bad_tools_are_refused_at_start_naming_the_fix():
    with pytest.raises(brood.InvalidArgument, match="tool name 'llm_query' is the name of a REPL"):
        brood.Supervisor(brood.ScriptedModel([]), tools=[brood.Tool(where, name="llm_query")])
    with pytest.raises(brood.InvalidArgument, match="module 'no_such_mod' cannot be imported"):
        brood.Supervisor(brood.ScriptedModel([]), tools=["no_such_mod:fn"])
    with pytest.raises(brood.InvalidArgument, match="has no 'nope'"):
        brood.Supervisor(brood.ScriptedModel([]), tools=["os:nope"])
    with pytest.raises(brood.InvalidArgument, match="parameter 'o' is annotated Opaque"):
        brood.Tool(takes_opaque)
    with pytest.raises(brood.InvalidArgument, match="a tool must be a function, got int"):
        brood.Tool(3)  # type: ignore[arg-type]
    with pytest.raises(brood.InvalidArgument, match="timeout=-1"):
        brood.Tool(where, timeout=-1)


TOOL_MODULE = """
import os

def lookup(word: str) -> str:
    '''The word, shouted; each call is counted in a file.'''
    with open(os.environ["COUNT_FILE"], "a") as f:
        f.write(word + "\\n")
    return word.upper()
"""


def test_a_tool_call_is_replayed_on_resume_without_calling_it_again(tmp_path, monkeypatch):
    (tmp_path / "crash_tools.py").write_text(TOOL_MODULE)
    count = tmp_path / "count"
    monkeypatch.setenv("COUNT_FILE", str(count))
    monkeypatch.syspath_prepend(str(tmp_path))
    url = f"sqlite:///{tmp_path}/j.db"
    mark, fifo = tmp_path / "mark", tmp_path / "fifo"
    os.mkfifo(fifo)
    reached = Signal(tmp_path, "reached")
    first = repl("w = lookup('hello')")
    # Its step begins once the tool's call is journaled (the journal is written in order).
    second = repl(
        "import os\n"
        f"if not os.path.exists({str(mark)!r}):\n"
        f"    open({str(mark)!r}, 'w').close()\n"
        f"    {reached.code}\n"
        f"    open({str(fifo)!r}).read()  # the supervisor is killed meanwhile"
    )
    script = [first + "\n" + second, repl("FINAL(w + ' ' + lookup('again'))")]
    code = textwrap.dedent(f"""
        import sys, json, brood
        sys.path.insert(0, {str(tmp_path)!r})
        script = json.loads({json.dumps(json.dumps(script))})
        sup = brood.Supervisor(
            brood.ScriptedModel({{"shout": script}}), store={url!r},
            limits=brood.Limits(shutdown_grace=0.3, term_grace=0.3, fs_write=[{str(tmp_path)!r}]),
            tools=["crash_tools:lookup"])
        print(sup.spawn("shout task").id, flush=True)
        import signal; signal.pause()
    """)
    root_id = crash(code, reached.wait)
    assert count.read_text().split() == ["hello"]
    model = brood.ScriptedModel({"shout": script})
    with brood.Supervisor(model, store=url, limits=FAST, tools=["crash_tools:lookup"]) as sup:
        result = sup.resume(root_id).wait_result()
    assert result.state == "completed", result.error
    assert result.answer == "HELLO AGAIN"
    # 'hello' came back from the journal; only the live call ran the function.
    assert count.read_text().split() == ["hello", "again"]
    assert [json.loads(e["data"]["call"])[1] for e in events(url, "tool_call")] == [
        ["hello"],
        ["again"],
    ]


def test_brood_run_takes_a_tool_as_module_function(tmp_path):
    (tmp_path / "cli_tools.py").write_text(TOOL_MODULE)
    count = tmp_path / "count"
    script = {"shout it": [repl("FINAL(lookup('quiet'))")]}
    env = {
        "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path]),
        "COUNT_FILE": str(count),
    }
    with FakeOpenAI(script) as server:
        out = brood_cli(
            "run",
            "shout it",
            "--model",
            f"openai:fake@{server.base_url}",
            "--store",
            f"sqlite:///{tmp_path}/j.db",
            "--tool",
            "cli_tools:lookup",
            "--no-live",
            "--json",
            env=env,
        )
        missing = brood_cli(
            "run",
            "shout it",
            "--model",
            f"openai:fake@{server.base_url}",
            "--store",
            f"sqlite:///{tmp_path}/j.db",
            "--tool",
            "cli_tools_gone:lookup",
            env=env,
        )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["answer"] == "QUIET"
    logs = brood_cli("logs", result["run_id"], "--store", f"sqlite:///{tmp_path}/j.db")
    assert logs.returncode == 0, logs.stderr
    assert 'tool lookup("quiet")' in logs.stdout and '"QUIET"' in logs.stdout
    assert missing.returncode == 2
    assert "module 'cli_tools_gone' cannot be imported" in missing.stderr


def test_a_session_has_the_tools_too():
    with brood.Session(brood.ScriptedModel([]), limits=FAST, tools=[forecast]) as env:
        env.reset("use a tool")
        obs = env.step("print(forecast('Rome', 1)['days'])")
    assert obs.error is None, obs.error
    assert obs.stdout.strip() == "['sun 0']"


def test_the_runs_of_a_flow_s_states_have_the_tools_too():
    noted: list[str] = []

    def note(text: str) -> str:
        """Keeps `text` for the user."""
        noted.append(text)
        return "noted"

    spec = {
        "name": "with-a-tool",
        "states": [{"id": "one", "entry": True, "prompt": "Use the tool", "outputs": ["text"]}],
        "transitions": [],
    }
    model = brood.ScriptedModel({"Use the tool": [repl("FINAL(note('from a flow'))")]})
    with brood.Supervisor(model, limits=FAST, tools=[note]) as sup:
        assert sup.flow_run(spec).wait() == "finished"
    assert noted == ["from a flow"]

"""Flows and the trust boundary (DESIGN.md section 14): the supervisor never opens a path
model code named, parses a spec from model code as text only (bounded in size and nesting,
its problems told without the text), and counts the flows a run's code starts as that
run's children for every tree limit.

Every attack is model code run in a real confined worker (the scripted model `coder` of
the escape catalogue answers the code a task holds); some also skip the REPL helper and
send the request frame themselves, as a model that read brood's source would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest

import brood
from brood.flow.load import MAX_SPEC_DEPTH
from brood.spec_text import MAX_SPEC_BYTES
from brood.supervisor.control import key_path
from tests.trust_util import coder, limits, outcome, probe_code, refused, require, task
from tests.util import Gate, Signal

# Model code that sends a FlowReq itself, past the REPL helper and its checks.
RAW = """import gc
from brood.worker.link import Link
from brood.protocol import FlowReq
link = next(o for o in gc.get_objects() if isinstance(o, Link))
def raw_flow(spec, inputs='{}'):
    return link.request(FlowReq(req_id=link.next_id(), op='run', spec=spec, inputs=inputs))
"""

BOUND = f"{MAX_SPEC_BYTES:,}-byte bound"
TOO_DEEP = f"nested more than {MAX_SPEC_DEPTH} levels deep"
GROWTH_BOUND = 200 * 2**20  # the supervisor's memory, past what it held before the attack


def secret() -> str:
    return "sk-flowsecret-" + uuid.uuid4().hex


def hidden(text: str) -> str:
    """Python that makes `text` at run time: the step's code (which the journal keeps)
    does not hold it."""
    return f"{text[::-1]!r}[::-1]"


def journal_holds(tmp_path: Path, needle: str) -> bool:
    """Whether any file of the journal (the database, its WAL) holds `needle`."""
    files = list(tmp_path.glob("j.db*"))
    assert files, "no journal file"
    return any(needle.encode() in f.read_bytes() for f in files)


@pytest.fixture
def store(tmp_path) -> str:
    return f"sqlite:///{tmp_path}/j.db"


def sup_of(store: str, lim: brood.Limits | None = None) -> brood.Supervisor:
    return brood.Supervisor(coder, limits=lim or limits(), store=store)


def foreach_spec(items_max: int = 1000, retries: int = 0) -> dict:
    """One state run once per item of the flow input `item` (a trivial task each)."""
    return {
        "states": [
            {
                "id": "each",
                "entry": True,
                "prompt": "trivial {item}",
                "inputs": [{"name": "item", "type": "json"}],
                "foreach": {"over": "item", "max": items_max},
                "retries": retries,
                "outputs": ["text"],
            }
        ],
        "transitions": [],
    }


def ledger(sup: brood.Supervisor, flow_id: str) -> list[dict]:
    return [e["data"] for e in sup.store.events(flow_id, "flow")]


def flow_of(runs: list[dict]) -> dict:
    (flow,) = [r for r in runs if r["model"] == "flow"]
    return flow


# ---- paths: the worker reads them, the supervisor never does --------------------------------
def test_a_spec_path_outside_scratch_is_refused_by_the_workers_confinement(
    store, tmp_path, monkeypatch
):
    key = secret()
    outside = tmp_path / "secret.yaml"
    outside.write_text(f"states: {key}\n")
    # A project of the supervisor's user, its working directory: a relative path in model
    # code is the worker's own (its scratch), never the supervisor's.
    project = tmp_path / "project"
    project.mkdir()
    (project / "flow.yaml").write_text(f"api_key: {key}\nstates: {key}\n")
    (project / ".env").write_text(f"OPENAI_API_KEY={key}\n")
    monkeypatch.chdir(project)
    with sup_of(store) as sup:
        require(sup.limits, "files")
        ctl_key = key_path(sup._engine.control.path)  # the control socket's secret
        with open(ctl_key) as f:
            control_secret = f.read().strip()
        assert len(control_secret) >= 16
        result, got = outcome(
            sup,
            RAW
            + f"tr('absolute', lambda: flow_run({str(outside)!r}))\n"
            + "tr('relative', lambda: flow_run('flow.yaml'))\n"
            + "tr('env', lambda: flow_run('.env'))\n"
            + f"tr('ctl_key', lambda: flow_run({ctl_key!r}))\n"
            + f"tr('raw_absolute', lambda: raw_flow({str(outside)!r}))\n"
            + "tr('raw_relative', lambda: raw_flow('flow.yaml'))\n"
            + f"tr('raw_ctl_key', lambda: raw_flow({ctl_key!r}))",
        )
        runs = sup.store.runs(result.run_id)
    refused(got["absolute"])
    assert str(outside) in got["absolute"][2]
    refused(got["relative"], "FileNotFoundError")
    assert "flow.yaml" in got["relative"][2] and "scratch" in got["relative"][2]
    refused(got["ctl_key"])
    # A name that is no file of the worker's, or one sent past the helper, is text to the
    # supervisor: a YAML string, not a spec.
    for sent in ("env", "raw_absolute", "raw_relative", "raw_ctl_key"):
        refused(got[sent], "InvalidSpec")
        assert "got a string" in got[sent][2], got[sent]
    assert key not in json.dumps(got) and control_secret not in json.dumps(got)
    assert [r["id"] for r in runs] == [result.run_id]  # no flow started
    assert not journal_holds(tmp_path, key) and not journal_holds(tmp_path, control_secret)


def test_a_fifo_or_a_device_named_as_a_spec_is_refused_at_once_and_the_supervisor_serves_on(
    store, tmp_path, monkeypatch
):
    # A FIFO in the supervisor's working directory too: were the supervisor to open the
    # name a worker sent, it would wait for a writer forever.
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    os.mkfifo(cwd / "spec.json")
    monkeypatch.chdir(cwd)
    attacked, go = Signal(tmp_path, "attacked"), Gate(tmp_path, "go")
    body = (
        RAW
        + "import time\nos.mkfifo('spec.json')\nos.symlink('/dev/zero', 'zero.yaml')\n"
        + "began = time.monotonic()\n"
        + "tr('fifo', lambda: flow_run('spec.json'))\n"
        + "tr('zero', lambda: flow_run('zero.yaml'))\n"
        + "tr('raw_fifo', lambda: raw_flow('spec.json'))\n"
        + "tr('raw_zero', lambda: raw_flow('/dev/zero'))\n"
        + "R['seconds'] = time.monotonic() - began\n"
        + f"{attacked.code}\n{go.wait_code}\n"
    )
    before = psutil.Process().memory_info().rss
    with sup_of(store, limits(fs_write=[str(tmp_path)])) as sup:
        attacker = sup.spawn(task(probe_code(body)))
        attacked.wait()
        # The attacker's tree is still live: another tree is served meanwhile.
        other = sup.run("trivial task")
        assert (other.state, other.answer) == ("completed", "alive")
        assert attacker.status() == "running"
        go.open()
        got = json.loads(attacker.wait(timeout=60))
        grown = psutil.Process().memory_info().rss - before
    for attempt in ("fifo", "zero"):
        refused(got[attempt], "InvalidSpec")
        assert "not a regular file" in got[attempt][2], got[attempt]
    for attempt in ("raw_fifo", "raw_zero"):
        refused(got[attempt], "InvalidSpec")
        assert "got a string" in got[attempt][2], got[attempt]
    assert got["seconds"] < 30, got  # at once: nothing waited for a writer or read on
    assert grown < GROWTH_BOUND, f"the supervisor grew by {grown:,} bytes"


# ---- bounds: size and nesting -------------------------------------------------------------------
def test_a_spec_nested_100k_levels_deep_is_refused_naming_the_bound(store):
    levels = 100_000
    with sup_of(store) as sup:
        result, got = outcome(
            sup,
            RAW
            + f"deep_json = '[' * {levels} + ']' * {levels}\n"
            + f"deep_yaml = 'a: ' + '[' * {levels} + ']' * {levels}\n"
            + "tr('json', lambda: flow_run(deep_json))\n"
            + "tr('yaml', lambda: flow_run(deep_yaml))\n"
            + "tr('raw_json', lambda: raw_flow(deep_json))\n"
            + "tr('raw_yaml', lambda: raw_flow(deep_yaml))\n"
            + "d = x = dict()\n"
            + f"for _ in range({levels}):\n    x['a'] = dict()\n    x = x['a']\n"
            + "tr('dict', lambda: flow_run(d))",
        )
        runs = sup.store.runs(result.run_id)
    for sent in ("json", "yaml", "raw_json", "raw_yaml"):
        refused(got[sent], "InvalidSpec")
        assert TOO_DEEP in got[sent][2], got[sent]
    refused(got["dict"], "InvalidArgument")  # the worker cannot write it as JSON
    assert [r["id"] for r in runs] == [result.run_id]


def _aliases() -> str:
    """YAML whose aliases each nest what they name 40 levels deeper: no line of it is
    deep, what it stands for is."""
    lines = ["a0: &a0 " + "[" * 40 + "1" + "]" * 40]
    lines += [f"a{i}: &a{i} " + "[" * 40 + f"*a{i - 1}" + "]" * 40 for i in range(1, 4)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("deep.json", "[" * 100_000 + "]" * 100_000),
        ("deep.yaml", "a: " + "[" * 100_000 + "]" * 100_000),
        ("aliases.yaml", _aliases()),
    ],
)
def test_brood_flow_validate_names_the_depth_bound_without_a_traceback(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    done = subprocess.run(
        [sys.executable, "-m", "brood.cli.main", "flow", "validate", str(path)],
        capture_output=True,
        text=True,
        timeout=90,
    )
    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert TOO_DEEP in output, output
    assert "Traceback" not in output and "RecursionError" not in output, output


def test_an_oversized_spec_is_refused_naming_its_size_before_anything_is_journaled(store, tmp_path):
    size = MAX_SPEC_BYTES + 10
    big = "x: " + "a" * (size - 3)
    with sup_of(store) as sup:
        result, got = outcome(
            sup,
            RAW
            + f"big = 'x: ' + 'a' * {size - 3}\n"
            + "open('big.yaml', 'w').write(big)\n"
            + "tr('text', lambda: flow_run(big))\n"
            + "tr('file', lambda: flow_run('big.yaml'))\n"
            + "tr('raw', lambda: raw_flow(big))",
        )
        for attempt in ("text", "file", "raw"):
            refused(got[attempt], "InvalidSpec")
            assert f"{size:,} bytes" in got[attempt][2] and BOUND in got[attempt][2], got
        # The user's own specs: text, a file, and a device (whose size says nothing).
        user_file = tmp_path / "big.yaml"
        user_file.write_text(big)
        for spec, says in ((big, f"{size:,} bytes"), (user_file, f"{size:,} bytes")):
            with pytest.raises(brood.InvalidSpec, match=says) as caught:
                sup.flow_run(spec)
            assert BOUND in str(caught.value)
        with pytest.raises(brood.InvalidSpec, match=f"more than the {BOUND}"):
            sup.flow_run(Path("/dev/zero"))
        sup.store.flush()
        assert [r["id"] for r in sup.store.runs()] == [result.run_id]


# ---- problems are told in the schema's own words -------------------------------------------------
def test_a_spec_holding_a_secret_is_refused_without_quoting_it(store, tmp_path):
    key = secret()
    make = f"key = {hidden(key)}\n"
    spec = (
        "dict(states=[dict(id='a', entry=True, prompt='p', outputs=['t'], retries=key, "
        "**dict([(key, 1)]))], transitions=[dict(to=key, when=dict(output=key, op='eq', "
        "value=key), **dict([('from', 'a')]))], subagents=dict([(key, dict(prompt='p', "
        "bogus=key))]), **dict([(key, key)]))"
    )
    yaml_text = "'states:\\n  - id: a\\n    ' + key + ': 1\\n    prompt: *' + key + '\\n'"
    with sup_of(store) as sup:
        result, got = outcome(
            sup,
            RAW
            + make
            + f"spec = {spec}\n"
            + "tr('dict', lambda: flow_run(spec))\n"
            + "tr('raw', lambda: raw_flow(json.dumps(spec)))\n"
            + f"tr('yaml', lambda: flow_run({yaml_text}))\n"
            + "tr('twice', lambda: raw_flow('{\"' + key + '\": 1, \"' + key + '\": 2}'))\n"
            + "tr('scalar', lambda: raw_flow(key))\n"
            + "R['full'] = ''\n"
            + "try:\n    flow_run(spec)\nexcept Exception as e:\n    R['full'] = str(e)",
        )
        runs = sup.store.runs(result.run_id)
    for attempt in ("dict", "raw", "yaml", "twice", "scalar"):
        refused(got[attempt], "InvalidSpec")
    full = got["full"]
    assert key not in json.dumps(got)
    # What is wrong, where, in the schema's words: no value, no unknown key, no name.
    assert "(top level): an unknown key (allowed:" in full
    assert "states[0]: an unknown key (allowed:" in full
    assert "states[0].retries: must be a whole number\n" in full + "\n"
    assert "subagents[…]: an unknown key (allowed:" in full
    assert "transitions[0].to: names no state of the spec" in full
    assert "transitions[0].when.output: names an output the from state" in full
    assert "found a key twice" in got["twice"][2]
    assert "got a string" in got["scalar"][2]
    assert [r["id"] for r in runs] == [result.run_id]
    assert not journal_holds(tmp_path, key)


# ---- tree limits hold for flows a run's code starts -------------------------------------------
def test_flow_run_is_refused_when_the_run_may_start_no_children(store):
    spec = json.dumps(foreach_spec())
    with sup_of(store, limits(max_depth=1)) as sup:
        result, got = outcome(
            sup,
            RAW
            + f"tr('helper', lambda: flow_run({spec!r}, dict(item=[1])))\n"
            + f"tr('raw', lambda: raw_flow({spec!r}, json.dumps(dict(item=[1]))))",
        )
        runs = sup.store.runs(result.run_id)
    for attempt in ("helper", "raw"):
        refused(got[attempt], "LimitExceeded")
        assert "max_depth" in got[attempt][2], got
    assert [r["id"] for r in runs] == [result.run_id]


@pytest.mark.parametrize("limit", ["max_children", "max_children_per_run"])
def test_a_foreach_of_10_items_starts_what_the_limit_leaves_and_fails_naming_it(store, limit):
    bound = 3
    lim = limits(**{limit: bound, "max_concurrency": 4})
    spec = json.dumps(foreach_spec(items_max=1000, retries=3))
    with sup_of(store, lim) as sup:
        result, got = outcome(
            sup,
            f"fid = flow_run({spec!r}, dict(item=list(range(10))))\n"
            "R['status'] = flow_wait(fid, timeout=120)\n"
            "R['reason'] = flow_status(fid)['reason']\n"
            "R['left'] = budget_remaining()",
        )
        runs = sup.store.runs(result.run_id)
        flow = flow_of(runs)
        events = ledger(sup, flow["id"])
    assert got["status"] == "paused", got  # failure_policy escalate: the entry failed
    assert limit in got["reason"] and "could not start" in got["reason"], got
    # The flow's own run counts as a child: two instances fit, the third is refused, and
    # the foreach made no more than that third (what the limit left, plus one).
    spawned = [e for e in events if e["kind"] == "spawned"]
    failed = [e for e in events if e["kind"] == "settled" and e["outcome"] == "failed"]
    assert len(spawned) == bound - 1
    assert [(e["item"], e.get("retry")) for e in failed] == [(bound - 1, False)]
    assert limit in failed[0]["reason"]
    assert not [e for e in events if e["kind"] in ("retry", "start_retry")]  # not tried again
    assert len(runs) <= 1 + bound  # the whole tree, in the journal
    instances = [r for r in runs if r["parent_id"] == flow["id"]]
    assert len(instances) == bound - 1
    # The flow's run is no level: its instances are at the depth of the root's children.
    assert flow["depth"] == 0 and {r["depth"] for r in instances} == {1}
    left = got["left"]["children_left" if limit == "max_children" else "children_left_for_this_run"]
    assert left == 0


def test_max_children_per_run_counts_a_runs_own_children_and_every_run_of_its_flows(store):
    spec = json.dumps(foreach_spec())
    with sup_of(store, limits(max_children_per_run=3, max_children=100)) as sup:
        result, got = outcome(
            sup,
            "R['child'] = rlm_query('trivial child')\n"
            f"fid = flow_run({spec!r}, dict(item=list(range(10))))\n"
            "R['status'] = flow_wait(fid, timeout=120)\n"
            "R['reason'] = flow_status(fid)['reason']\n"
            "tr('after', lambda: rlm_query('trivial again'))",
        )
        runs = sup.store.runs(result.run_id)
        events = ledger(sup, flow_of(runs)["id"])
    assert got["child"] == "alive"
    assert got["status"] == "paused" and "max_children_per_run" in got["reason"], got
    assert len([e for e in events if e["kind"] == "spawned"]) == 1  # child + flow + 1 = 3
    refused(got["after"], "LimitExceeded")  # the flow's runs are the root's children too
    assert "max_children_per_run" in got["after"][2]
    assert len(runs) == 1 + 3


def test_a_flows_instances_start_children_only_as_the_runs_own_children_would(store):
    # max_depth=2: the root (depth 0) may start children; its children (depth 1) may not,
    # and neither may the instances of a flow the root started.
    instance = (
        "try:\n    flow_run('states: []')\n    FINAL('started a flow')\n"
        "except LimitExceeded as e:\n    FINAL('refused ' + e.kind)"
    )
    spec = {
        "states": [{"id": "s", "entry": True, "prompt": task(instance), "outputs": ["text"]}],
        "transitions": [],
    }
    with sup_of(store, limits(max_depth=2)) as sup:
        result, got = outcome(
            sup,
            f"fid = flow_run({json.dumps(spec)!r})\nR['status'] = flow_wait(fid, timeout=120)",
        )
        runs = sup.store.runs(result.run_id)
    assert got["status"] == "finished", got
    flow = flow_of(runs)
    (inst,) = [r for r in runs if r["parent_id"] == flow["id"]]
    assert (flow["depth"], inst["depth"]) == (0, 1)
    assert inst["answer"] == "refused max_depth"
    assert len(runs) == 3


def test_a_flow_the_user_starts_keeps_its_own_bounds(store):
    # The user is trusted: max_children bounds the trees of runs, not the user's own flows.
    with sup_of(store, limits(max_children=2)) as sup:
        flow = sup.flow_run(foreach_spec(), inputs={"item": list(range(5))})
        assert flow.wait(timeout=120) == "finished"
        runs = sup.store.runs(flow.id)
    assert len([r for r in runs if r["parent_id"] == flow.id]) == 5


def test_an_instance_answering_json_nested_past_what_python_parses_fails_the_instance(store):
    # An answer is model output too: read as an output, it fails the instance (the flow's
    # failure policy applies) instead of ending the executor's task and holding the flow.
    deep = "FINAL('[' * 100000 + ']' * 100000)"
    spec = {
        "run": {"failure_policy": "fail_fast"},
        "states": [
            {
                "id": "s",
                "entry": True,
                "prompt": task(deep),
                "outputs": [{"name": "v", "type": "json"}],
            }
        ],
        "transitions": [],
    }
    with sup_of(store) as sup:
        _, got = outcome(
            sup,
            f"fid = flow_run({json.dumps(spec)!r})\nR['status'] = flow_wait(fid, timeout=120)\n"
            "R['reason'] = flow_status(fid)['reason']",
        )
    assert got["status"] == "failed", got
    assert "output 'v' is not valid JSON" in got["reason"] and "nested deeper" in got["reason"]

"""Errors a person meets through `brood`: named in the words of the command line (its
flags, not the Python API's names), and naming what they are about."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

import brood
from brood.cli.main import app
from brood.cli.words import for_cli
from tests.util import FAST

BROOD = [sys.executable, "-m", "brood.cli.main"]
FENCE = "```"
API_WORDS = ("Supervisor(", "Limits.", "Limits(", "ray_address", "None", "chat_fn")


def cli(*args: str) -> tuple[int, str]:
    """`brood ARGS` in this process (nothing it refuses starts a worker): exit code and
    what it printed."""
    env = {"COLUMNS": "200", "BROOD_MODEL": None, "BROOD_STORE": None}
    out = CliRunner().invoke(app, list(args), env=env)  # type: ignore[arg-type]
    return out.exit_code, out.output


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (
            (),
            "no model: pass --model SPEC (e.g. openai:MODEL@URL; --model echo tries brood "
            "with no server), or set BROOD_MODEL",
        ),
        (("--model", "scripted:demo", "--max-depth", "0"), "--max-depth must be >= 1, got 0"),
        (
            ("--model", "scripted:demo", "--max-iterations", "0"),
            "--max-iterations must be >= 1, got 0",
        ),
        (("--model", "scripted:demo", "--child-timeout", "0"), "--child-timeout must be > 0"),
        (("--model", "scripted:demo", "--timeout", "-1"), "--timeout must be a number of seconds"),
        (("--model", "openai:m", "--model-timeout", "-1"), "--model-timeout (or ?timeout="),
        (("--model", "nonsense:x"), "unknown model spec 'nonsense:x'"),
        (("--model", "anthropic:"), "model spec 'anthropic:' names no model"),
        (
            ("--model", "foo:bar"),
            "the providers are anthropic, echo, gemini, local, openai, python, scripted",
        ),
    ],
)
def test_bad_options_of_brood_run_are_named_by_their_flags(tmp_path, args, said):
    code, output = cli("run", "a task", "--store", f"sqlite:///{tmp_path}/j.db", *args)
    assert code == 2, output
    assert said in output, output
    for word in API_WORDS:
        assert word not in output, (word, output)


def test_an_unreachable_ray_address_is_named_as_the_ray_flag(tmp_path):
    store = f"sqlite:///{tmp_path}/j.db"
    out = subprocess.run(
        [*BROOD, "run", "x", "--model", "scripted:demo", "--ray", "127.0.0.1:1", "--store", store],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "BROOD_MODEL"},
    )
    assert out.returncode == 2, out.stderr
    assert "no Ray cluster answers at --ray '127.0.0.1:1'" in out.stderr
    assert "pass --ray local (a bare --ray) to start a local Ray instance" in out.stderr
    assert "ray_address" not in out.stderr


def test_the_python_api_names_of_limits_become_flags_where_a_flag_sets_them():
    from brood.cluster import check_address

    with pytest.raises(brood.InvalidArgument) as bad_address:
        check_address("nowhere")
    assert for_cli(str(bad_address.value)).startswith("--ray must be HOST:PORT")
    exceeded = str(brood.LimitExceeded("max_children", 5, 4))
    assert for_cli(exceeded).endswith("; raise --max-children or do with fewer")
    assert for_cli("let the run read it from a file (Limits(fs_read=[PATH]))") == (
        "let the run read it from a file (--fs-read PATH)"
    )
    assert for_cli("e.g. Limits(fs_write=['/data'])") == "e.g. --fs-write /data"
    assert for_cli("model turn 22 is past Limits.max_iterations=20 (and the") == (
        "model turn 22 is past --max-iterations 20 (and the"
    )
    # A limit no flag sets keeps its Python name: there is nothing else to point at.
    kept = "a prompt over Limits.max_prompt_chars=400,000; raise Limits(max_chunks=...)"
    assert for_cli(kept) == kept


def test_answering_an_ask_whose_run_has_ended_names_the_ask_its_run_and_its_end(tmp_path):
    url = f"sqlite:///{tmp_path}/j.db"
    steps = [
        f"{FENCE}repl\na = ask_person('Deploy?', options=['yes', 'no'], blocking=False)\n"
        f"FINAL('done without waiting')\n{FENCE}"
    ]
    with brood.Supervisor(brood.ScriptedModel({"root": steps}), store=url, limits=FAST) as sup:
        h = sup.spawn("root")
        assert h.wait(timeout=60) == "done without waiting"
        sup.store.flush()
        (opened, *_) = [e["data"] for e in sup.store.events(h.id, "ask")]
        code, output = cli("answer", opened["ask"], "yes", "--store", url)
    assert code == 2, output
    said = " ".join(output.split())
    assert f"ask {opened['ask']} cannot be answered: run {h.id}" in said
    assert "has ended (completed)" in said


def test_brood_openenv_serve_without_the_extra_names_the_extra():
    """Where openenv-core is not installed (here: an interpreter that cannot import it), the
    command says which extra to install, and starts nothing."""
    code = (
        "import sys; sys.modules['openenv'] = None\n"
        "sys.argv = ['brood', 'openenv', 'serve', '--model', 'echo']\n"
        "from brood.cli.main import main\n"
        "main()"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("BROOD_MODEL", "BROOD_TOKEN")}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    )
    assert out.returncode == 2, out.stderr
    assert "needs the [openenv] extra" in out.stderr
    assert "pip install -e '.[openenv]'" in out.stderr

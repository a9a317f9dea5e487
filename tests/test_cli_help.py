"""What `brood` says about itself: its version, help on every command (`-h` or `--help`),
help text that reads in whole sentences, and shell completion."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import click
import typer
from typer.testing import CliRunner

import brood
from brood.cli.main import app

BROOD = [sys.executable, "-m", "brood.cli.main"]


def commands() -> list[tuple[list[str], click.Command]]:
    """Every command of `brood` (groups included) with the words that call it."""
    found: list[tuple[list[str], click.Command]] = []
    stack: list[tuple[list[str], click.Command]] = [([], typer.main.get_command(app))]
    while stack:
        words, command = stack.pop()
        found.append((words, command))
        if isinstance(command, click.Group):
            stack.extend(([*words, name], sub) for name, sub in command.commands.items())
    return found


def helped(*args: str, columns: int = 100) -> str:
    out = CliRunner().invoke(app, list(args), env={"COLUMNS": str(columns)}, prog_name="brood")
    assert out.exit_code == 0, (args, out.output)
    return out.output


def one_line(text: str) -> str:
    """A help text as it reads on screen: one line, no Markdown code marks."""
    return " ".join(text.replace("`", "").split())


def test_version_prints_the_package_version():
    out = subprocess.run([*BROOD, "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"brood {brood.__version__}\n"


def test_h_is_help_on_every_command():
    for words, _command in commands():
        short = helped(*words, "-h")
        assert short == helped(*words, "--help"), words
        assert f"Usage: brood {' '.join(words)}".rstrip() in short, (words, short)


def test_help_texts_are_reflowed_so_no_line_breaks_a_sentence():
    wide = 400  # wide enough for any paragraph of brood's help on one line
    for words, command in commands():
        listing = [
            " ".join(line.strip(" │").split())
            for line in helped(*words, "-h", columns=wide).splitlines()
        ]
        if isinstance(command, click.Group):
            for name, sub in command.commands.items():
                first = one_line(inspect.cleandoc(sub.help or "").split("\n\n")[0])
                assert f"{name} {first}" in listing, (words, name, listing)
        for paragraph in inspect.cleandoc(command.help or "").split("\n\n"):
            assert one_line(paragraph) in listing, (words, paragraph, listing)


def test_option_help_is_shown_as_written():
    # Rich markup would take `[ray]` for a style and drop it.
    text = helped("run", "-h", columns=400)
    assert "(the [ray] extra)" in text, text


def test_shell_completion_is_offered_and_completes_commands_and_options():
    env = {k: v for k, v in os.environ.items() if not k.startswith("_BROOD")}
    # Name the shell (bash) instead of detecting the one the suite was started from.
    env["_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION"] = "1"
    script = subprocess.run(
        [*BROOD, "--show-completion", "bash"], capture_output=True, text=True, timeout=60, env=env
    )
    assert script.returncode == 0, script.stderr
    assert "_BROOD_COMPLETE=complete_bash" in script.stdout
    assert "complete -o default -F _brood_completion brood" in script.stdout

    def complete(line: str) -> list[str]:
        words = line.split(" ")
        asked = env | {
            "_BROOD_COMPLETE": "complete_bash",
            "COMP_WORDS": line,
            "COMP_CWORD": str(len(words) - 1),
        }
        out = subprocess.run(BROOD, capture_output=True, text=True, timeout=60, env=asked)
        assert out.returncode == 0, out.stderr
        return out.stdout.split()

    assert complete("brood re") == ["resume"]
    assert complete("brood logs r-1 --a") == ["--all"]

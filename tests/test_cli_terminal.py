"""Model text reaches the terminal as text (DESIGN.md section 14): `brood show`, `logs`,
`tree`, `ps` and `asks` run under a real pty against a journal whose runs hold terminal
escape sequences in their prompts, model replies, code, output, answers, messages and
asks. The words around the sequences reach the terminal whole; the sequences do not.

The runs are real (a supervisor here, a scripted model, real workers); the commands run as
their own processes, each on a fresh pty whose output is read byte for byte (raw mode, so
the pty adds no carriage returns of its own).
"""

from __future__ import annotations

import json
import os
import pty
import re
import select
import subprocess
import sys
import tty
from collections.abc import Iterator
from pathlib import Path

import pytest

import brood
from brood.cli.terminal import clean
from brood.journal import Journal
from tests.test_serve import until
from tests.util import fast

BROOD = [sys.executable, "-m", "brood.cli.main"]
READ_TIMEOUT_S = 60  # bound on a command's silence; a failure, never a pace
FENCE = "```"

# What an attacker's model puts in its text: retitle the window, clear the screen, colour
# what follows, write the clipboard, query the terminal (DCS), the same in 8-bit form,
# reset it, ring the bell, and move back over what was shown (backspace, carriage return).
SEQUENCES = [
    "\x1b]0;pwned\x07",
    "\x1b[2J",
    "\x1b[31m",
    "\x1b]52;c;cHduZWQ=\x1b\\",
    "\x1bP+q544e\x1b\\",
    "\x9b2J",
    "\x1bc",
    "\x07",
    "\x08",
    "\r",
]
# Anything a terminal acts on rather than shows: ESC, C0 controls but \t and \n, DEL, C1.
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
SGR = re.compile(r"\x1b\[[0-9;]*m")  # rich's own styling, on a terminal that has colour


def hostile(word: str, *, code: bool = False) -> str:
    """`word` with one attacker sequence after each of its letters (no carriage return in
    `code`: Python reads one as the end of a line)."""
    seqs = [s for s in SEQUENCES if not (code and s == "\r")]
    assert len(word) > len(seqs)
    return "".join(c + (seqs[i] if i < len(seqs) else "") for i, c in enumerate(word))


def repl(code: str) -> str:
    return f"{FENCE}repl\n{code}\n{FENCE}"


ROOT = "hostile root " + hostile("rootpromptword")
ROOT_REPLY = f"I will {hostile('thoughtword')} now.\n" + repl(
    f"# {hostile('commentword', code=True)}\n"
    f"print({hostile('outputtextword')!r})\n"
    f"h = rlm_spawn('child task ' + {hostile('childpromptword')!r})\n"
    f"FINAL(rlm_wait(h) + ' ' + {hostile('answertextword')!r})"
)
ASKER_REPLY = repl(
    f"r = ask_person({hostile('questionword')!r}, options=[{hostile('optiontextword')!r}, 'no'])\n"
    "FINAL('asked')"
)
SCRIPT = {
    "hostile root": [ROOT_REPLY],
    "child task": [repl("FINAL('child')")],
    "asker": [ASKER_REPLY],
}


# rich markup in model text is shown as it is: never a hyperlink (OSC 8), nor an error.
MARKUP = "[link=https://evil.test]linkword[/link] [bold]notbold[/] [/]"


def on_a_terminal(args: list[str], term: str) -> bytes:
    """Run `brood ARGS` with its stdout and stderr on a new pty; every byte it wrote."""
    master, slave = pty.openpty()
    tty.setraw(slave)  # no output processing: the bytes read are the bytes written
    env = {**os.environ, "TERM": term, "COLUMNS": "400", "LINES": "50"}
    env.pop("NO_COLOR", None)
    env.pop("FORCE_COLOR", None)
    proc = subprocess.Popen([*BROOD, *args], stdout=slave, stderr=slave, env=env)
    os.close(slave)
    out = b""
    try:
        while True:
            ready, _, _ = select.select([master], [], [], READ_TIMEOUT_S)
            assert ready, f"brood {args[0]} was silent for {READ_TIMEOUT_S} s: {out[-2000:]!r}"
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the command ended and the pty closed
                chunk = b""
            if not chunk:
                break
            out += chunk
        assert proc.wait(READ_TIMEOUT_S) == 0, out.decode(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    return out


@pytest.fixture
def journal(tmp_path) -> Iterator[dict[str, str]]:
    """A journal holding a completed tree (root and child) and a live run waiting on an
    ask, with a message sent to it, every field of them written with the sequences in.
    The live run is cancelled, its worker's exit confirmed, when the test ends."""
    url = f"sqlite:///{tmp_path / 'j.db'}"
    model = brood.ScriptedModel(SCRIPT)
    with brood.Supervisor(model, limits=fast(max_iterations=2), store=url) as sup:
        root = sup.run(ROOT)
        assert root.state == "completed", root
        assert root.answer == "child " + hostile("answertextword")
        asker = sup.spawn("asker")
        until(lambda: sup.asks())
        asker.send(hostile("messageword") + " " + MARKUP)
        sup.store.flush()
        with Journal(url) as j:
            until(lambda: j.asks() and any(e["kind"] == "message" for e in j.events(asker.id)))
        yield {"url": url, "root": root.run_id, "asker": asker.id}


COMMANDS = {  # what each case runs, and the words it must show whole
    "show": (
        ["show", "ROOT"],
        ["rootpromptword", "commentword", "outputtextword", "answertextword"],
    ),
    "logs": (["logs", "ROOT"], ["thoughtword", "commentword", "outputtextword"]),
    "tree": (["tree", "ROOT"], ["rootpromptword", "childpromptword"]),
    "ps": (["ps"], ["rootpromptword", "asker"]),
    "asks": (["asks"], ["questionword", "optiontextword"]),
    "logs of the asker": (["logs", "ASKER"], ["messageword " + MARKUP]),  # its ask: JSON
}


def test_model_text_reaches_the_terminal_without_its_control_sequences(journal, subtests):
    ids = {"ROOT": journal["root"], "ASKER": journal["asker"]}
    for term in ("dumb", "xterm-256color"):
        for case, (args, words) in COMMANDS.items():
            with subtests.test(msg=f"{case} on {term}"):
                argv = [ids.get(a, a) for a in args] + ["--store", journal["url"]]
                raw = on_a_terminal(argv, term).decode("utf-8")
                # TERM=dumb: rich styles nothing, so nothing but text may arrive; on
                # xterm, rich's own colours and nothing else.
                shown = raw if term == "dumb" else SGR.sub("", raw)
                assert not CONTROL.search(shown), repr(raw)
                for word in words:
                    assert word in shown, (word, shown)

    # --json is exact: json.dumps writes each control character as a \u escape.
    raw = on_a_terminal(["show", journal["root"], "--store", journal["url"], "--json"], "xterm")
    text = raw.decode("utf-8")
    assert not CONTROL.search(text), repr(text)
    run = json.loads(text)
    assert run["prompt"] == ROOT and run["answer"] == "child " + hostile("answertextword")
    assert hostile("outputtextword") in run["steps"][0]["stdout"]


def test_clean_takes_out_each_sequence_whole_and_leaves_text_as_it_was():
    for seq in SEQUENCES:
        assert clean(f"before{seq}after") == "beforeafter", repr(seq)
    assert clean("\x1b]0;unterminated title\nnext line") == "\nnext line"
    assert clean("\x1b[38;2;255;0;0mtruecolour\x1b[0m") == "truecolour"
    assert clean("\x1b]8;;https://evil.test\x1b\\link\x1b]8;;\x1b\\") == "link"
    kept = "tabs\tand\nnewlines, [markup], é, 漢字, 🦉, a\u00a0no-break space"
    assert clean(kept) == kept


def test_every_printer_of_the_cli_goes_through_the_terminal_module():
    source = (Path(brood.__file__).parent / "cli" / "main.py").read_text()
    assert not re.search(r"(?<![\w.])print\(", source), "a bare print( in brood/cli/main.py"
    assert "Console(" not in source and "Text(" not in source

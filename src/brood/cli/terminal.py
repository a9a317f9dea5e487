"""What the `brood` CLI writes to a terminal, made safe to show (DESIGN.md section 14).

Prompts, answers, step code and output, errors, reasons, messages, ask questions and flow
states are written by model code, which is untrusted, and a terminal obeys what it is
sent: an escape sequence in an answer could retitle the window (OSC 0), clear the screen
(CSI 2J), rewrite the clipboard (OSC 52), answer back into the shell, or overwrite lines
already shown with a carriage return or a backspace. So every human-readable line the CLI
prints goes through this module, and `clean` takes such sequences out of model text:

- `Terminal`, the rich console of every command: it cleans each string before rich makes
  text of it (markup and table cells included), and, as a net for a `Text` built
  elsewhere, every segment of text it renders. rich's own styling and cursor moves are
  made after that, from styles and control segments, so they are untouched;
- `literal` for model text placed inside rich markup (cleaned, and its brackets escaped:
  `[link=...]` in an answer is shown, never made into a hyperlink);
- `plain` for a `Text` of model text; `echo` for a plain line.

`--json` output is not cleaned: `json.dumps` writes every control character as a `\\u`
escape (and every non-ASCII one, with `ensure_ascii`), so it is exact and safe as it is.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterable
from typing import Any

from rich.console import Console, ConsoleOptions, RenderableType
from rich.markup import escape
from rich.segment import Segment
from rich.text import Text

# What a terminal would act on rather than show. Sequences go whole, so that no parameter
# bytes are left behind as text; an unterminated string sequence goes to the end of its
# line (a terminal would swallow more; the rest is text again once the ESC is gone).
_UNSAFE = re.compile(
    r"""
      (?:\x1b\[|\x9b) [\x30-\x3f]* [\x20-\x2f]* [\x40-\x7e]?      # CSI: params, final
    | (?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f])                     # OSC, DCS, SOS, PM, APC
      [^\x07\x1b\x9c\n]* (?:\x07|\x1b\\|\x9c)?                    #   ... up to BEL or ST
    | \x1b [\x20-\x2f]* [\x30-\x7e]?                              # any other ESC sequence
    | [\x00-\x08\x0b-\x1f\x7f-\x9f]             # C0 (not \t, \n), DEL, C1: CR, BS, BEL...
    """,
    re.VERBOSE,
)


def clean(text: str) -> str:
    """`text` without terminal control sequences: ESC sequences (CSI, OSC, DCS, SOS, PM,
    APC and the rest, in their 7- and 8-bit forms) and every C0 and C1 control but newline
    and tab, carriage return and backspace included. The one function the CLI uses to
    make model text safe to show; clean text comes back as it was."""
    return _UNSAFE.sub("", text)


def literal(value: object) -> str:
    """Model text to place inside rich markup: cleaned, with its markup escaped."""
    return escape(clean(str(value)))


def plain(value: object) -> Text:
    """Model text as a rich `Text` (no markup read), cleaned."""
    return Text(clean(str(value)))


def echo(value: object, *, err: bool = False) -> None:
    """A plain line of text (no markup, no wrapping), cleaned, on stdout or stderr."""
    print(clean(str(value)), file=sys.stderr if err else sys.stdout, flush=True)


def print_json(value: Any) -> None:
    """One JSON document on a line of stdout, exact: control characters come out escaped."""
    print(json.dumps(value, default=str), flush=True)


class Terminal(Console):
    """The rich console of every `brood` command: whatever it is given to show, no
    control sequence of the text reaches the terminal (see the module's docstring)."""

    def render_str(self, text: str, *args: Any, **kwargs: Any) -> Text:
        return super().render_str(clean(text), *args, **kwargs)

    def render(
        self, renderable: RenderableType, options: ConsoleOptions | None = None
    ) -> Iterable[Segment]:
        for segment in super().render(renderable, options):
            if segment.control is None and _UNSAFE.search(segment.text):
                yield Segment(clean(segment.text), segment.style)
            else:
                yield segment

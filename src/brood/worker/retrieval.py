"""Text retrieval for the REPL: find, show around, outline and chunk a (very large) text.

Pure, deterministic functions of their arguments, standard library only. A line is what
ends at "\\n" (as for grep and `re.MULTILINE`), numbered from 1; a "\\n" at the very end
does not start another line, and a "\\r" before it is not shown.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import NamedTuple

from brood.errors import InvalidArgument

__all__ = ["grep_context", "outline", "search", "split_chunks"]

LINE_CLIP = 300  # characters of a line shown per hit: readable, yet a minified line is no flood
TITLE_CLIP = 200  # characters of an outline title
# Upper bounds: every result lands in the worker's memory and, printed, in a model's context.
# Counting is what text.count / len(re.findall(...)) are for.
MAX_HITS = 100_000
MAX_WINDOW = 1_000
MAX_ITEMS = 100_000


# ---- search ---------------------------------------------------------------------------


def search(pattern: str, text: str, *, regex: bool = False, max_hits: int = 50) -> list[dict]:
    """Find `pattern` in `text`: a list of {"line", "col" (both from 1), "text" (the line,
    clipped to 300 characters around the hit with "..."), "match"}, in order, at most
    `max_hits`. Plain, case-sensitive substring search unless regex=True (re.MULTILINE).
    Hits do not overlap."""
    _check_text(text, "search")
    spans = _spans(pattern, text, regex, "search")
    _check_int(max_hits, "search", "max_hits", 1, MAX_HITS)
    hits: list[dict] = []
    for hit in _hits(text, spans):
        line = text[hit.line_start : hit.line_end]
        hits.append(
            {
                "line": hit.line,
                "col": hit.start - hit.line_start + 1,
                "text": _clip_line(line, hit.start - hit.line_start, hit.end - hit.start),
                "match": text[hit.start : hit.end],
            }
        )
        if len(hits) == max_hits:
            break
    return hits


def grep_context(
    pattern: str, text: str, window: int = 3, *, regex: bool = False, max_hits: int = 50
) -> str:
    """Like `grep -n -C window`: each line with a hit (at most `max_hits` lines) and `window`
    lines before and after. Hit lines read "N> line", the others "N: line" (N from 1, each
    line clipped to 300 characters); groups that overlap or touch are merged, and "--"
    separates groups. "" if nothing matches."""
    _check_text(text, "grep_context")
    spans = _spans(pattern, text, regex, "grep_context")
    _check_int(window, "grep_context", "window", 0, MAX_WINDOW)
    _check_int(max_hits, "grep_context", "max_hits", 1, MAX_HITS)
    hit_lines: list[_Hit] = []  # the first hit of each line
    for hit in _hits(text, spans):
        if hit_lines and hit_lines[-1].line == hit.line:
            continue
        hit_lines.append(hit)
        if len(hit_lines) == max_hits:
            break
    groups: list[list[_Hit]] = []
    for hit in hit_lines:
        if groups and hit.line - groups[-1][-1].line <= 2 * window + 1:
            groups[-1].append(hit)
        else:
            groups.append([hit])
    return "\n--\n".join(_render_group(text, group, window) for group in groups)


class _Hit(NamedTuple):
    line: int  # from 1
    line_start: int  # offset of the line's first character
    line_end: int  # offset of the "\n" that ends it, or len(text)
    start: int  # the match, as offsets into the text
    end: int


def _spans(pattern: object, text: str, regex: object, where: str) -> Iterator[tuple[int, int]]:
    """The (start, end) of each match, in order, not overlapping. Checks the arguments (and
    compiles the regex) now, not when the iterator is first advanced."""
    if isinstance(pattern, bytes):
        raise InvalidArgument(
            f"{where}(pattern): pattern is bytes; decode it first, e.g. pattern.decode('utf-8')"
        )
    if not isinstance(pattern, str):
        raise InvalidArgument(
            f"{where}(pattern): pattern must be a non-empty str, got {type(pattern).__name__}"
        )
    if not pattern:
        raise InvalidArgument(f"{where}(pattern): pattern is empty; pass the text to look for")
    if not isinstance(regex, bool):
        raise InvalidArgument(f"{where}(regex=...) must be True or False, got {regex!r}")
    if not regex:
        return _plain_spans(pattern, text)
    try:
        compiled = re.compile(pattern, re.MULTILINE)
    except re.error as exc:
        position = "" if exc.pos is None else f" at position {exc.pos}"
        raise InvalidArgument(
            f"{where}(pattern, regex=True): {pattern!r} is not a valid regular expression: "
            f"{exc.msg}{position}; fix it, or pass regex=False to look for the text literally"
        ) from None
    return (m.span() for m in compiled.finditer(text))


def _plain_spans(pattern: str, text: str) -> Iterator[tuple[int, int]]:
    # The regex engine's literal search, not a loop of str.find: one C loop over the text.
    return (m.span() for m in re.finditer(re.escape(pattern), text))


def _hits(text: str, spans: Iterator[tuple[int, int]]) -> Iterator[_Hit]:
    """Place each match on its line. Line numbers are kept up incrementally (the newlines
    between successive hits are counted), so a 10 MB text is never split into lines."""
    line, counted, line_start, line_end = 1, 0, 0, -1
    for start, end in spans:
        if start == len(text) and (not text or text.endswith("\n")):
            break  # an empty regex match ($, ^) after the final "\n": there is no line there
        line += text.count("\n", counted, start)
        counted = start
        if start > line_end:  # a new line; searches stay within it, never back to the start
            newline = text.rfind("\n", line_start, start)
            if newline != -1:
                line_start = newline + 1
            line_end = text.find("\n", start)
            if line_end == -1:
                line_end = len(text)
        yield _Hit(line, line_start, line_end, start, end)


def _render_group(text: str, group: list[_Hit], window: int) -> str:
    first, last = group[0], group[-1]
    hits = {hit.line: hit for hit in group}
    line, start = first.line, first.line_start
    while line > 1 and line > first.line - window:
        start = text.rfind("\n", 0, start - 1) + 1
        line -= 1
    rows = []
    while line <= last.line + window and start < len(text):
        end = text.find("\n", start)
        if end == -1:
            end = len(text)
        hit = hits.get(line)
        if hit is None:
            rows.append(f"{line}: {_clip_line(text[start:end], 0, 0)}")
        else:
            at = hit.start - hit.line_start
            rows.append(f"{line}> {_clip_line(text[start:end], at, hit.end - hit.start)}")
        line, start = line + 1, end + 1
    return "\n".join(rows)


def _clip_line(line: str, at: int, length: int) -> str:
    """At most LINE_CLIP characters of `line`, centred on line[at : at + length] (or starting
    at `at` when that is longer), with "..." where it was cut."""
    if line.endswith("\r"):
        line = line[:-1]
    if len(line) <= LINE_CLIP:
        return line
    length = max(0, min(length, len(line) - at))
    slack = max(0, LINE_CLIP - length)
    begin = max(0, min(at - slack // 2, len(line) - LINE_CLIP))
    end = begin + LINE_CLIP
    return ("..." if begin else "") + line[begin:end] + ("..." if end < len(line) else "")


# ---- outline --------------------------------------------------------------------------

_ATX = re.compile(r" {0,3}(#{1,6})(?:[ \t]|$)")  # "## Title"
_SETEXT = re.compile(r" {0,3}(?:(={3,})|-{3,})[ \t]*$")  # a line of === or --- under a title
_FENCE = re.compile(r" {0,3}(`{3,}|~{3,})")
# "1. Title", "1.2 Title", "2.3.4. Title": a lone number needs its dot, and a title that
# starts with a letter, so that lines of data ("3 4 5", "1.5") are not taken for sections.
_NUMBERED = re.compile(r"(?:(\d{1,3})\.|(\d{1,3}(?:\.\d{1,3})+)\.?)[ \t]+[^\W\d_]")
_KEYWORD = re.compile(
    r"(?:Part|Chapter|Section|Article|Appendix|PART|CHAPTER|SECTION|ARTICLE|APPENDIX)[ \t]+"
    r"(\d{1,3}(?:\.\d{1,3})*|[IVXLCDM]+|[A-Z])(?!\w)"
)
_DEFINITION = re.compile(
    r"(?:export[ \t]+(?:default[ \t]+)?)?(?:async[ \t]+)?(?:def|class|function\*?)[ \t]+"
    r"(?:[^\W\d]|\$)"
)


def outline(text: str, *, max_items: int = 200) -> list[dict]:
    """The structure of `text`, to look before reading: a list of {"line" (from 1), "offset"
    (of the line's start in text), "level" (from 1), "kind", "title" (the line, stripped,
    clipped to 200 characters)} in order, at most `max_items`. Kinds: "heading" (markdown
    "#" to "######": level = number of #; a line underlined with === is level 1, with ---
    level 2); "section" (at line start: "1. Title", "1.2 Title", "Section 4", "Chapter IV",
    "Article 12", "Part", "Appendix": level = count of numbers, 2.3.4 is 3); "definition"
    (def, class, async def, function at column 0: level 1). Inside ``` fences only
    definitions count."""
    _check_text(text, "outline")
    _check_int(max_items, "outline", "max_items", 1, MAX_ITEMS)
    items: list[dict] = []
    fence = ""  # the opening ``` or ~~~ while inside a fenced block
    # The line before, while it could be the title of a setext heading: (line, offset, text).
    title_line: tuple[int, int, str] | None = None
    line_no, start = 0, 0
    while start < len(text) and len(items) < max_items:
        end = text.find("\n", start)
        if end == -1:
            end = len(text)
        line = text[start:end].removesuffix("\r")
        line_no += 1
        fence_mark = _FENCE.match(line)
        if fence:
            if fence_mark and _closes(fence, fence_mark.group(1), line[fence_mark.end() :]):
                fence = ""
            elif _DEFINITION.match(line):
                items.append(_item(line_no, start, 1, "definition", line))
            title_line = None
        elif fence_mark:
            fence, title_line = fence_mark.group(1), None
        elif underline := _SETEXT.match(line):
            if title_line is not None:
                title_no, title_start, title = title_line
                level = 1 if underline.group(1) else 2
                items.append(_item(title_no, title_start, level, "heading", title))
            title_line = None
        elif found := _classify(line):
            items.append(_item(line_no, start, *found, line))
            title_line = None
        elif line.strip() and not line.startswith(("    ", "\t")):  # text, not indented code
            title_line = (line_no, start, line)
        else:
            title_line = None
        start = end + 1
    return items


def _closes(fence: str, marks: str, rest: str) -> bool:
    """Whether a fence line closes the block `fence` opened (CommonMark: the same character,
    at least as many, nothing after)."""
    return marks[0] == fence[0] and len(marks) >= len(fence) and not rest.strip()


def _classify(line: str) -> tuple[int, str] | None:
    """The (level, kind) of an outline item on a line outside fences, or None."""
    if _DEFINITION.match(line):
        return 1, "definition"
    if (m := _ATX.match(line)) and line.strip(" \t#"):  # "#" alone is an empty heading
        return len(m.group(1)), "heading"
    if m := _NUMBERED.match(line):
        return (m.group(1) or m.group(2)).count(".") + 1, "section"
    if m := _KEYWORD.match(line):
        return m.group(1).count(".") + 1, "section"
    return None


def _item(line: int, offset: int, level: int, kind: str, title: str) -> dict:
    title = title.strip()
    if len(title) > TITLE_CLIP:
        title = title[:TITLE_CLIP] + "..."
    return {"line": line, "offset": offset, "level": level, "kind": kind, "title": title}


# ---- chunks ---------------------------------------------------------------------------


# The end of a blank line (whitespace only, after a "\n"): where a paragraph may be cut.
def _paragraph_cut(text: str, start: int, limit: int) -> int:
    """Just after the last blank line (only spaces, if anything) that ends before `limit`
    and begins after a newline at or after `start - 1`; 0 if there is none. Walks back line
    by line from the window's end, so a window costs its last paragraph, not its length."""
    end = text.rfind("\n", start, limit)
    floor = max(start - 1, 0)
    while end >= start:
        begin = text.rfind("\n", floor, end)
        if begin < 0 or begin < start - 1:
            return 0
        if not text[begin + 1 : end].strip():
            return end + 1
        end = begin
    return 0


def split_chunks(text: str, chunk_chars: int) -> list[str]:
    """Split `text` into chunks of at most `chunk_chars` characters that join back to the
    text exactly ("".join(chunks) == text), none empty. Each chunk ends after the last
    blank line that fits, else after the last line that fits, else is cut at chunk_chars."""
    _check_text(text, "split_chunks")
    _check_int(chunk_chars, "split_chunks", "chunk_chars", 1, None)
    chunks = []
    start = 0
    while len(text) - start > chunk_chars:
        limit = start + chunk_chars
        cut = _paragraph_cut(text, start, limit)
        if not cut:
            cut = text.rfind("\n", start, limit) + 1
        if cut <= start:
            cut = limit
        chunks.append(text[start:cut])
        start = cut
    if start < len(text):
        chunks.append(text[start:])
    return chunks


# ---- arguments ------------------------------------------------------------------------


def _check_text(text: object, where: str) -> None:
    if isinstance(text, str):
        return
    if text is None:
        raise InvalidArgument(
            f"{where}(text=None): there is no text: this run has no context (context is "
            "None); pass the text yourself as text=..."
        )
    if isinstance(text, bytes | bytearray):
        raise InvalidArgument(
            f"{where}(text=...): text is {type(text).__name__}; decode it first, e.g. "
            "text=data.decode('utf-8', errors='replace')"
        )
    if isinstance(text, list | tuple):
        raise InvalidArgument(
            f"{where}(text=...): text must be a str, got {type(text).__name__}; join the "
            "parts first, e.g. text='\\n'.join(parts), or look in each part"
        )
    raise InvalidArgument(
        f"{where}(text=...): text must be a str, got {type(text).__name__}; pass str(value)"
    )


def _check_int(value: object, where: str, name: str, low: int, high: int | None) -> None:
    if (
        isinstance(value, int)
        and not isinstance(value, bool)
        and low <= value
        and (high is None or value <= high)
    ):
        return
    bounds = f"from {low} to {high}" if high is not None else f"of at least {low}"
    raise InvalidArgument(f"{where}({name}=...) must be a whole number {bounds}, got {value!r}")

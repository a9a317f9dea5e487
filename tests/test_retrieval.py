"""The REPL's text retrieval functions: exact results on known documents, properties of
search and split_chunks against naive references, each bad argument, and a 10 MB text."""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from brood.errors import InvalidArgument
from brood.worker.retrieval import (
    LINE_CLIP,
    MAX_HITS,
    grep_context,
    outline,
    search,
    split_chunks,
)

DOC = """\
Project Guide
=============

An introduction that mentions # not at line start.

# Overview

1. Scope
1.1 Goals
2.3.4. Deep detail

## Usage
Section 4: Running
Chapter IV - Appendices

```python
# a comment, not a heading
def main():
    return 1
```

class Helper:
    pass

Details
-------
"""


def line_start(text: str, line: int) -> int:
    """The offset of line `line` (from 1), the naive way."""
    return sum(len(x) + 1 for x in text.split("\n")[: line - 1])


# ---- outline --------------------------------------------------------------------------


def test_outline_of_a_markdown_document() -> None:
    assert outline(DOC) == [
        {"line": 1, "offset": 0, "level": 1, "kind": "heading", "title": "Project Guide"},
        {"line": 6, "offset": 81, "level": 1, "kind": "heading", "title": "# Overview"},
        {"line": 8, "offset": 93, "level": 1, "kind": "section", "title": "1. Scope"},
        {"line": 9, "offset": 102, "level": 2, "kind": "section", "title": "1.1 Goals"},
        {"line": 10, "offset": 112, "level": 3, "kind": "section", "title": "2.3.4. Deep detail"},
        {"line": 12, "offset": 132, "level": 2, "kind": "heading", "title": "## Usage"},
        {"line": 13, "offset": 141, "level": 1, "kind": "section", "title": "Section 4: Running"},
        {
            "line": 14,
            "offset": 160,
            "level": 1,
            "kind": "section",
            "title": "Chapter IV - Appendices",
        },
        {"line": 18, "offset": 222, "level": 1, "kind": "definition", "title": "def main():"},
        {"line": 22, "offset": 252, "level": 1, "kind": "definition", "title": "class Helper:"},
        {"line": 25, "offset": 276, "level": 2, "kind": "heading", "title": "Details"},
    ]
    for item in outline(DOC):
        assert item["offset"] == line_start(DOC, item["line"])
        assert DOC[item["offset"] :].startswith(item["title"])


def test_outline_max_items_keeps_the_first() -> None:
    assert outline(DOC, max_items=3) == outline(DOC)[:3]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # ATX: one to six #, then a space or the end; up to three spaces of indent.
        ("###### Six\n####### Seven\n#hashtag\n#\n   ## Indented", [(1, 6), (5, 2)]),
        # Setext: only under a line of text, not after a blank line or another item.
        ("Title\n===\n\n---\n# H\n---\n    code\n---", [(1, 1), (5, 1)]),
        # Numbers: a lone number needs its dot, and a title must start with a letter.
        ("1.5\n3 4 5\n12 Monkeys\n2024. A year\n1.2.3 Sub\n4. a\n", [(5, 3), (6, 1)]),
        # Keywords: capitalised, then a number, a roman numeral or one letter.
        ("section 1\nSECTION 2.1\nChapter In time\nAppendix B\nPart II: more", [2, 4, 5]),
        # Definitions at column 0 only.
        ("  def f():\nasync def g():\nexport default function h() {}\nclassy", [2, 3]),
        # Fences: only definitions inside; ``` does not close a ~~~ fence.
        ("~~~\n# no\n```\n1. no\ndef yes():\n~~~~\n# Yes", [5, 7]),
    ],
)
def test_outline_rules(text: str, expected: list[Any]) -> None:
    items = outline(text)
    got = [(i["line"], i["level"]) if isinstance(expected[0], tuple) else i["line"] for i in items]
    assert got == expected


def test_outline_titles_are_stripped_and_clipped() -> None:
    long = "# " + "x" * 300
    assert outline(long + "\r\n## B  \r\n")[0]["title"] == long[:200] + "..."
    assert outline(long + "\r\n## B  \r\n")[1]["title"] == "## B"
    assert outline("") == []


# ---- search ---------------------------------------------------------------------------


def test_search_line_and_column_on_the_first_and_last_line() -> None:
    text = "alpha beta\ngamma\nbeta alpha"  # no newline at the end
    assert search("alpha", text) == [
        {"line": 1, "col": 1, "text": "alpha beta", "match": "alpha"},
        {"line": 3, "col": 6, "text": "beta alpha", "match": "alpha"},
    ]
    assert search("beta", text) == [
        {"line": 1, "col": 7, "text": "alpha beta", "match": "beta"},
        {"line": 3, "col": 1, "text": "beta alpha", "match": "beta"},
    ]
    assert search("a", text + "\n")[-1] == {
        "line": 3,
        "col": 10,
        "text": "beta alpha",
        "match": "a",
    }


def test_search_plain_takes_metacharacters_literally() -> None:
    text = "cost: $1.50 (a+b)*\ncost: $1x50"
    assert [h["line"] for h in search("$1.50 (a+b)*", text)] == [1]
    assert [h["match"] for h in search(r"\$1.50", text, regex=True)] == ["$1.50", "$1x50"]
    assert search("\\$1", text) == []


def test_search_regex_is_multiline_and_plain_is_case_sensitive() -> None:
    text = "Foo bar\nfoo\n  foo"
    assert [(h["line"], h["col"]) for h in search("^foo", text, regex=True)] == [(2, 1)]
    assert [h["line"] for h in search("foo$", text, regex=True)] == [2, 3]
    assert [h["line"] for h in search("foo", text)] == [2, 3]
    assert [h["line"] for h in search("(?i)foo", text, regex=True)] == [1, 2, 3]


def test_search_hits_do_not_overlap_and_stop_at_max_hits() -> None:
    assert [h["col"] for h in search("aa", "aaaaa")] == [1, 3]
    text = "x\n" * 100
    hits = search("x", text, max_hits=7)
    assert [h["line"] for h in hits] == [1, 2, 3, 4, 5, 6, 7]


def test_search_clips_long_lines_around_the_hit() -> None:
    line = "a" * 1000 + "NEEDLE" + "b" * 1000
    (hit,) = search("NEEDLE", "first\n" + line + "\nlast")
    assert (hit["line"], hit["col"], hit["match"]) == (2, 1001, "NEEDLE")
    assert hit["text"].startswith("...a") and hit["text"].endswith("b...")
    assert len(hit["text"]) == LINE_CLIP + 6 and "NEEDLE" in hit["text"]
    (start,) = search("^a", line, regex=True)
    assert start["text"] == line[:LINE_CLIP] + "..."
    (end,) = search("b$", line, regex=True)
    assert end["text"] == "..." + line[-LINE_CLIP:]


def test_search_match_across_lines_is_placed_on_its_first_line() -> None:
    text = "go\ntwo\nthree\r\n"
    assert search("o\nt", text) == [
        {"line": 1, "col": 2, "text": "go", "match": "o\nt"},
        {"line": 2, "col": 3, "text": "two", "match": "o\nt"},
    ]
    assert search("three", text)[0]["text"] == "three"  # the \r is not shown
    # An empty match after the final newline is on no line.
    assert [h["line"] for h in search("^", text, regex=True)] == [1, 2, 3]


def naive_search(pattern: str, text: str) -> list[dict[str, Any]]:
    lines = text.split("\n")
    hits = []
    for m in re.finditer(re.escape(pattern), text):
        line = text.count("\n", 0, m.start()) + 1
        col = m.start() - line_start(text, line) + 1
        hits.append({"line": line, "col": col, "text": lines[line - 1].removesuffix("\r")})
    return hits


@given(
    st.text(alphabet="ab\n\r ", max_size=80),
    st.text(alphabet="ab\n", min_size=1, max_size=3),
)
def test_search_agrees_with_a_naive_search(text: str, pattern: str) -> None:
    got = search(pattern, text, max_hits=MAX_HITS)
    assert [{k: h[k] for k in ("line", "col", "text")} for h in got] == naive_search(pattern, text)
    assert all(h["match"] == pattern for h in got)


def test_search_in_ten_megabytes_finds_hits_near_the_end() -> None:
    row = "lorem ipsum dolor sit amet, consectetur adipiscing elit\n"
    rows = 10_000_000 // len(row)
    text = row * rows + "the needle\n" + row * 3 + "a second needle"
    assert len(text) > 10_000_000
    hits = search("needle", text)
    assert [(h["line"], h["col"]) for h in hits] == [(rows + 1, 5), (rows + 5, 10)]
    assert search(r"needle\Z", text, regex=True)[0]["line"] == rows + 5
    assert grep_context("second", text, 1).splitlines()[-1] == f"{rows + 5}> a second needle"


# ---- grep_context ---------------------------------------------------------------------

LINES = "\n".join(f"line {n}" for n in range(1, 21)) + "\n"


def test_grep_context_merges_overlapping_windows() -> None:
    assert grep_context("line 5\n|line 7\n|line 16", LINES, 2, regex=True) == "\n".join(
        [
            "3: line 3",
            "4: line 4",
            "5> line 5",
            "6: line 6",
            "7> line 7",
            "8: line 8",
            "9: line 9",
            "--",
            "14: line 14",
            "15: line 15",
            "16> line 16",
            "17: line 17",
            "18: line 18",
        ]
    )


def test_grep_context_windows_that_touch_are_one_group() -> None:
    out = grep_context("line (2|7)$", LINES, 2, regex=True)
    assert "--" not in out
    assert [row.split(":")[0].split(">")[0] for row in out.splitlines()] == [
        str(n) for n in range(1, 10)
    ]
    assert grep_context("line (2|8)$", LINES, 2, regex=True).count("\n--\n") == 1


def test_grep_context_at_the_edges_and_without_context() -> None:
    assert grep_context("line 1\n", LINES, 3) == "1> line 1\n2: line 2\n3: line 3\n4: line 4"
    assert grep_context("20", LINES, 2) == "18: line 18\n19: line 19\n20> line 20"
    assert grep_context("line 1", LINES, 0, max_hits=3) == "1> line 1\n--\n10> line 10\n11> line 11"
    assert grep_context("z", "a\nb\nz", 9) == "1: a\n2: b\n3> z"  # no newline at the end
    assert grep_context("absent", LINES) == ""


def test_grep_context_counts_lines_not_hits() -> None:
    text = "x x x\ny\nx\n"
    assert grep_context("x", text, 0, max_hits=1) == "1> x x x"
    assert grep_context("x", text, 0) == "1> x x x\n--\n3> x"


# ---- split_chunks ---------------------------------------------------------------------


def test_split_chunks_prefers_paragraphs_then_lines_then_characters() -> None:
    text = "para one\nline two\n\npara two\n\n\npara three"
    assert split_chunks(text, 12) == ["para one\n", "line two\n\n", "para two\n\n\n", "para three"]
    assert split_chunks(text, 100) == [text]
    assert split_chunks("abcdefg", 3) == ["abc", "def", "g"]
    assert split_chunks("ab\ncdefgh\n", 4) == ["ab\n", "cdef", "gh\n"]
    assert split_chunks("a\n \t\nb c", 6) == ["a\n \t\n", "b c"]  # a blank line of spaces
    assert split_chunks("", 5) == []


@given(st.text(max_size=300), st.integers(min_value=1, max_value=50))
def test_split_chunks_round_trip_and_size(text: str, size: int) -> None:
    chunks = split_chunks(text, size)
    assert "".join(chunks) == text
    assert all(0 < len(c) <= size for c in chunks)


def cuts(chunks: list[str]) -> set[int]:
    """The offsets where one chunk ends and the next begins."""
    out, at = set(), 0
    for c in chunks[:-1]:
        at += len(c)
        out.add(at)
    return out


def inside(spans: list[tuple[int, int]], at: int) -> bool:
    return any(start < at < end for start, end in spans)


LINE = st.text(alphabet="ab .", max_size=12).map(lambda s: "w" + s)  # never blank


@given(st.lists(st.lists(LINE, min_size=1, max_size=4), min_size=1, max_size=12), st.data())
def test_split_chunks_never_cuts_a_paragraph_that_fits(
    paragraphs: list[list[str]], data: st.DataObject
) -> None:
    texts = ["\n".join(lines) for lines in paragraphs]
    size = data.draw(st.integers(min_value=max(len(t) for t in texts) + 1, max_value=200))
    text = "\n\n".join(texts)
    spans, at = [], 0
    for t in texts:
        spans.append((at, at + len(t)))
        at += len(t) + 2
    assert not any(inside(spans, cut) for cut in cuts(split_chunks(text, size)))


@given(st.lists(LINE, min_size=1, max_size=30), st.data())
def test_split_chunks_never_cuts_a_line_that_fits(lines: list[str], data: st.DataObject) -> None:
    size = data.draw(st.integers(min_value=max(len(x) for x in lines) + 1, max_value=100))
    text = "\n".join(lines)
    spans, at = [], 0
    for x in lines:
        spans.append((at, at + len(x)))
        at += len(x) + 1
    chunks = split_chunks(text, size)
    assert not any(inside(spans, cut) for cut in cuts(chunks))
    # Greedy: a chunk ends early only where the next line would not have fitted.
    for chunk, following in itertools.pairwise(chunks):
        assert len(chunk) + len(following.split("\n")[0]) + 1 > size


# ---- bad arguments --------------------------------------------------------------------

# (function, args, keyword args, what the message must say)
BAD: list[tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any], str]] = [
    (search, ("x", None), {}, r"search\(text=None\).*no context.*text=\.\.\."),
    (outline, (b"# x",), {}, r"outline\(text=\.\.\.\): text is bytes; decode it first"),
    (split_chunks, (["a"], 3), {}, r"got list; join the parts first"),
    (grep_context, ("x", 42), {}, r"text must be a str, got int"),
    (search, ("", "text"), {}, r"search\(pattern\): pattern is empty"),
    (search, (None, "text"), {}, r"pattern must be a non-empty str, got NoneType"),
    (grep_context, (b"x", "text"), {}, r"grep_context\(pattern\): pattern is bytes; decode"),
    (
        search,
        ("a(b", "text"),
        {"regex": True},
        r"'a\(b' is not a valid regular expression: missing \), unterminated subpattern at "
        r"position 1; fix it, or pass regex=False",
    ),
    (search, ("x", "text"), {"regex": "yes"}, r"search\(regex=\.\.\.\) must be True or False"),
    (
        search,
        ("x", "text"),
        {"max_hits": 0},
        r"search\(max_hits=\.\.\.\) must be a whole number from 1 to 100000, got 0",
    ),
    (search, ("x", "text"), {"max_hits": True}, r"max_hits=\.\.\.\) .* got True"),
    (grep_context, ("x", "t", -1), {}, r"grep_context\(window=\.\.\.\) .* from 0 to 1000"),
    (grep_context, ("x", "t", 2.0), {}, r"window=\.\.\.\) .* got 2\.0"),
    (grep_context, ("x", "t"), {"max_hits": MAX_HITS + 1}, r"got 100001"),
    (outline, ("t",), {"max_items": 0}, r"outline\(max_items=\.\.\.\) must be a whole number"),
    (outline, ("t",), {"max_items": "5"}, r"got '5'"),
    (split_chunks, ("t", 0), {}, r"split_chunks\(chunk_chars=\.\.\.\) .* at least 1, got 0"),
    (split_chunks, ("t", False), {}, r"chunk_chars=\.\.\.\) .* got False"),
]


@pytest.mark.parametrize(("fn", "args", "kwargs", "message"), BAD)
def test_bad_arguments_name_the_argument_and_the_fix(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidArgument, match=message):
        fn(*args, **kwargs)

"""The long-context toolkit: what `llm_query_chunked` and `search` add over their floors.

Both figures read one 10 MB text of paragraphs (seeded, so every run reads the same text).

1. `llm_query_chunked` in a real run. A supervisor (`max_prompt_chars=100_000`) runs one
   root whose `context` is the text. Its model (a `chat_fn`) answers the root's first turn
   with REPL code that, inside the worker, times `llm_query_chunked(context, PROMPT)`
   (about 100 chunks of 100,000 characters) against the floor: `llm_query_batched` of the
   very same prompts, built beforehand (untimed) the way the toolkit builds them, cut by
   `brood.worker.retrieval.split_chunks` and headed `[chunk i/N]`. Plain calls answer "ok"
   at once, so both sides pay the same gateway traffic (10 MB of prompts each) and the
   ratio is the toolkit's own work: finding the cuts and heading the chunks. That work is
   also timed on its own (the untimed build of the floor's prompts, timed once). The
   chat_fn counts each prompt it sees, so the run fails unless both sides sent the same.

2. `search` in this process, no supervisor: `brood.worker.retrieval.search(pattern,
   text, max_hits=1000)` against the floor, `re.finditer` over the same text collecting
   the same 1,000 match objects (and nothing more: no line numbers). Once for a plain word
   planted on exactly 1,000 lines, once for a regex with exactly 1,000 hits; both are
   spread over the whole text, so each side scans all of it. The hits are checked against
   the floor's matches, lines and columns included (outside the timed region); a
   mismatch exits with status 1, as a process left behind does.

Each series is the median of REPEATS, the order of the two sides alternating per repeat so
a drift of the machine touches both alike. No targets: the ratios are reported.
"""

from __future__ import annotations

import bisect
import itertools
import json
import random
import re
import sys
import threading
import time
from collections import Counter
from typing import Any

import brood
from _common import MIB, MS, Row, RunFailed, finish, median, no_leftovers, parse_args
from brood.worker.retrieval import search

BENCH = "toolkit"
TEXT_CHARS = 10_000_000  # the text's size before the planted words (about 0.1 MB more)
MAX_PROMPT_CHARS = 100_000  # Limits.max_prompt_chars: about 100 chunks of the text
PROMPT = "Count the words."
REPEATS = 5
MAX_HITS = 1_000
WORD = "zephyr"  # not in WORDS: it occurs only where planted
WORD_LINES = 1_000  # lines the word is planted on
REFS = 10_000  # "(see line K)" references, K = 1..REFS: exactly REFS / 10 end in 7
REGEX = r"\bline \d+7\b"
RUN_TIMEOUT_S = 120.0  # the root's wall clock; only stops a hung run (it takes seconds)
SEED = 20240611

# The words the text is drawn from (WORD and "line" are not among them).
WORDS = (
    "the of and to in a is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there been one all we their has would when "
    "river stone ledger harbour lantern meadow copper window quarrel engine"
)

# The root's one turn. Its first lines (set in `root_code`) give MAX_PROMPT_CHARS, PROMPT
# and REPEATS; the prompts are built as the toolkit builds them (toolkit.HEADER_ROOM = 40).
ROOT_BODY = r"""
import json, time
from brood.worker.retrieval import split_chunks

size = MAX_PROMPT_CHARS - len(PROMPT) - 40
t0 = time.perf_counter()
chunks = split_chunks(context, size)
n = len(chunks)
prompts = [f"{PROMPT}\n\n[chunk {i}/{n}]\n{chunk}" for i, chunk in enumerate(chunks, 1)]
cut = time.perf_counter() - t0
llm_query_batched(['warm-up'] * 16)
times = {'chunked': [], 'batched': []}
for r in range(REPEATS):
    for side in ('chunked', 'batched') if r % 2 == 0 else ('batched', 'chunked'):
        t0 = time.perf_counter()
        if side == 'chunked':
            replies = llm_query_chunked(context, PROMPT)
        else:
            replies = llm_query_batched(prompts)
        times[side].append(time.perf_counter() - t0)
        assert replies == ['ok'] * n, (side, len(replies), set(replies))
print('chunked', times['chunked'])
print('batched', times['batched'])
FINAL(json.dumps({'chunks': n, 'size': size, 'cut': cut, **times}))
"""


def root_code() -> str:
    head = f"MAX_PROMPT_CHARS = {MAX_PROMPT_CHARS}\nPROMPT = {PROMPT!r}\nREPEATS = {REPEATS}\n"
    return f"```repl\n{head}{ROOT_BODY.lstrip()}```"


def make_text() -> str:
    """About TEXT_CHARS of paragraphs (3 to 8 lines of 12 words, blank lines between), with
    WORD on WORD_LINES lines and REFS "(see line K)" references spread evenly over it."""
    rng = random.Random(SEED)
    vocab = WORDS.split()
    lines: list[str] = []
    size = 0
    while size < TEXT_CHARS:
        for _ in range(rng.randint(3, 8)):
            line = " ".join(rng.choices(vocab, k=12))
            lines.append(line)
            size += len(line) + 1
        lines.append("")
        size += 1
    words = [i for i, line in enumerate(lines) if line]
    for k in range(WORD_LINES):
        i = words[k * len(words) // WORD_LINES + len(words) // (2 * WORD_LINES)]
        lines[i] += f" {WORD}"
    for k in range(REFS):
        i = words[k * len(words) // REFS]
        lines[i] += f" (see line {k + 1})"
    return "\n".join(lines) + "\n"


class ChunkModel:
    """The scripted model: REPL code for the root's first turn, "ok" to every plain call.
    It counts the chunk prompts it is sent, so the two sides can be checked alike."""

    def __init__(self) -> None:
        self.code = root_code()
        self.lock = threading.Lock()
        self.seen: Counter[int] = Counter()

    def __call__(self, messages: list[dict[str, Any]], model: str | None = None) -> str:
        if messages[0]["role"] == "system":
            if len(messages) == 2:
                return self.code
            # A second turn means the code did not FINAL: fail the run, so its error shows.
            raise RuntimeError("the root's code did not FINAL; see its step's stderr")
        content = str(messages[-1]["content"])
        if content.startswith(f"{PROMPT}\n\n[chunk "):
            key = hash(content)
            with self.lock:
                self.seen[key] += 1
        return "ok"


def chunked_figures(text: str) -> dict[str, Any]:
    """The root's FINAL: chunk count and size, the cut's seconds, and per-side seconds of
    each repeat; checked against the prompts the model saw."""
    chat_fn = ChunkModel()
    limits = brood.Limits(
        shutdown_grace=0.3,
        term_grace=0.3,
        step_timeout=None,
        max_prompt_chars=MAX_PROMPT_CHARS,
        max_chunks=1_000,
        # Each model call journals its prompt, so the run journals the whole text once per
        # pass (2 x REPEATS of them), past the default bound of a run's journal bytes.
        journal_bytes_per_run=(2 * REPEATS + 2) * 16 * MIB,
    )
    with brood.Supervisor(chat_fn, limits=limits) as sup:
        res = sup.run(
            "toolkit: time llm_query_chunked against llm_query_batched",
            context=text,
            timeout=RUN_TIMEOUT_S,
        )
        if res.state != "completed":
            steps = sup.store.events(res.run_id, "step")
            last = steps[-1]["data"]["stderr"][-2000:] if steps else ""
            raise RunFailed(f"run {res.run_id} ended {res.state}: {res.error}\n{last}")
    got: dict[str, Any] = json.loads(res.answer or "")
    counts = set(chat_fn.seen.values())
    if len(chat_fn.seen) != got["chunks"] or counts != {2 * REPEATS}:
        raise RunFailed(
            f"the two sides sent different prompts: {len(chat_fn.seen)} distinct chunk "
            f"prompts (expected {got['chunks']}), seen {sorted(counts)} times each "
            f"(expected {2 * REPEATS}: {REPEATS} chunked + {REPEATS} batched)"
        )
    return got


def floor_finditer(pattern: str, text: str, regex: bool) -> list[re.Match[str]]:
    """The floor: the first MAX_HITS match objects of re.finditer, nothing more."""
    if regex:
        return list(itertools.islice(re.finditer(pattern, text, re.MULTILINE), MAX_HITS))
    return list(itertools.islice(re.finditer(re.escape(pattern), text), MAX_HITS))


def search_mismatch(hits: list[dict], matches: list[re.Match[str]], text: str) -> str:
    """Why `hits` are not `matches` placed on their lines, or "" if they are."""
    if len(hits) != len(matches):
        return f"{len(hits)} hits, {len(matches)} matches"
    newlines = [m.start() for m in re.finditer("\n", text)]
    for n, (hit, m) in enumerate(zip(hits, matches, strict=True)):
        line = bisect.bisect_left(newlines, m.start())  # newlines before the match
        col = m.start() - (newlines[line - 1] + 1 if line else 0) + 1
        want = {"line": line + 1, "col": col, "match": m.group()}
        have = {k: hit[k] for k in want}
        if have != want:
            return f"hit {n}: {have}, expected {want}"
    return ""


def search_figures(text: str, pattern: str, regex: bool) -> tuple[list[float], list[float]]:
    """Seconds of `search` and of the floor, REPEATS each, alternating; exits 1 if the
    hits are not the floor's matches."""
    hits = search(pattern, text, regex=regex, max_hits=MAX_HITS)  # warm-up, and checked
    matches = floor_finditer(pattern, text, regex)
    if why := search_mismatch(hits, matches, text):
        print(f"[{BENCH}] FAILED: search({pattern!r}, regex={regex}) differs from re: {why}")
        sys.exit(1)
    ours: list[float] = []
    floor: list[float] = []
    for r in range(REPEATS):
        for side in ("search", "re") if r % 2 == 0 else ("re", "search"):
            t0 = time.perf_counter()
            if side == "search":
                search(pattern, text, regex=regex, max_hits=MAX_HITS)
                ours.append(time.perf_counter() - t0)
            else:
                floor_finditer(pattern, text, regex)
                floor.append(time.perf_counter() - t0)
    return ours, floor


def main() -> None:
    args = parse_args(__doc__ or "")
    t0 = time.perf_counter()
    text = make_text()
    print(
        f"text: {len(text):,} characters, {text.count(chr(10)):,} lines "
        f"(made in {time.perf_counter() - t0:.1f} s)"
    )

    got = chunked_figures(text)
    left = no_leftovers(BENCH)
    n = got["chunks"]
    chunked = median(got["chunked"]) / n
    batched = median(got["batched"]) / n
    cut = got["cut"] / n
    print(f"{n} chunks of up to {got['size']:,} characters; per chunk, medians of {REPEATS}:")
    print(
        f"  llm_query_chunked          {chunked * MS:8.3f} ms  (all: "
        f"{', '.join(f'{t * MS:.0f}' for t in got['chunked'])} ms)"
    )
    print(
        f"  llm_query_batched (floor)  {batched * MS:8.3f} ms  (all: "
        f"{', '.join(f'{t * MS:.0f}' for t in got['batched'])} ms)"
    )
    print(f"  split_chunks + headings    {cut * MS:8.3f} ms  (once, in the worker)")
    print(f"  ratio chunked/batched      {chunked / batched:8.2f}x")

    rows = [
        Row(BENCH, "llm_query_chunked per chunk", chunked, "s", batched),
        Row(BENCH, "  floor: llm_query_batched per chunk", batched, "s"),
        Row(BENCH, "  split_chunks + headings per chunk", cut, "s"),
        Row(BENCH, "chunks of the 10 MB text", n, ""),
    ]
    for label, pattern, regex in (("plain word", WORD, False), ("regex", REGEX, True)):
        ours, floor = search_figures(text, pattern, regex)
        print(
            f"search {label} {pattern!r}, {MAX_HITS:,} hits: {median(ours) * MS:.3f} ms, "
            f"re.finditer {median(floor) * MS:.3f} ms = "
            f"{median(ours) / median(floor):.2f}x"
        )
        rows += [
            Row(BENCH, f"search {label}, {MAX_HITS:,} hits", median(ours), "s", median(floor)),
            Row(BENCH, f"  floor: re.finditer {label}", median(floor), "s"),
        ]
    finish(BENCH, rows, left, args.json)


if __name__ == "__main__":
    main()

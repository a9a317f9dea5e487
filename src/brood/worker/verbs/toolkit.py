"""The model's long-context toolkit in the REPL: delegation over texts too large for one
prompt (`llm_query_chunked`, `map_files`, `llm_map_reduce`) and deterministic retrieval
(`search`, `grep_context`, `outline`) over `context` or any text.

Every helper refuses misuse before it costs a model call: a text that is not text, a file
that cannot be read or is not text, a prompt that leaves too little room per chunk, more
chunks than `Limits.max_chunks`. Chunks are cut by `retrieval.split_chunks` (paragraph,
then line, then character boundaries) and each is headed `[chunk i/N]`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from brood.errors import InvalidArgument
from brood.worker import retrieval
from brood.worker.runtime import Runtime
from brood.worker.verbs import calls
from brood.worker.verbs.base import verb

MIN_CHUNK_CHARS = 1_000  # below this a chunk says too little to be worth a call
HEADER_ROOM = 40  # "[chunk i/N]" and the blank lines around it
MAX_FILE_BYTES = 50 * 2**20  # a file map_files reads whole into the worker's memory


def _text_of(rt: Runtime, text: object, where: str) -> str:
    if text is None:
        text = rt.namespace.get("context")
        if text is None:
            raise InvalidArgument(
                f"{where}: this run has no `context`; pass the text to read as text=..."
            )
        where = f"{where} (of `context`)"
    if isinstance(text, bytes | bytearray):
        raise InvalidArgument(f"{where}: text is bytes; decode it first, e.g. text.decode('utf-8')")
    if not isinstance(text, str):
        raise InvalidArgument(
            f"{where}: text must be str, got {type(text).__name__}; for a list of "
            "texts use llm_map_reduce or join them"
        )
    return text


def _chunks_of(
    rt: Runtime, text: str, prompt: str, chunk_chars: int | None, where: str
) -> list[str]:
    cap, max_chunks = rt.limits.max_prompt_chars, rt.limits.max_chunks
    _check_instruction(prompt, where)
    room = cap - len(prompt) - HEADER_ROOM
    if chunk_chars is None:
        size = room
    elif isinstance(chunk_chars, bool) or not isinstance(chunk_chars, int):
        raise InvalidArgument(
            f"{where}(chunk_chars=...) must be a whole number of characters, got {chunk_chars!r}"
        )
    elif chunk_chars > room:
        raise InvalidArgument(
            f"{where}(chunk_chars={chunk_chars:,}): with the prompt's {len(prompt):,} "
            f"characters a chunk would be over Limits.max_prompt_chars={cap:,}; use "
            f"chunk_chars <= {max(room, 0):,}"
        )
    else:
        size = chunk_chars
    if size < MIN_CHUNK_CHARS:
        raise InvalidArgument(
            f"{where}: the prompt ({len(prompt):,} characters) leaves {max(size, 0):,} "
            f"characters per chunk, under the {MIN_CHUNK_CHARS:,} a chunk needs "
            f"(Limits.max_prompt_chars={cap:,}); shorten the prompt"
            + ("" if chunk_chars is None else " or raise chunk_chars")
        )
    chunks = retrieval.split_chunks(text, size) if text else []
    if len(chunks) > max_chunks:
        raise InvalidArgument(
            f"{where}: {len(text):,} characters in chunks of {size:,} make {len(chunks):,} "
            f"chunks, over Limits.max_chunks={max_chunks:,}; search or grep_context the "
            "text for the part that matters, or raise Limits(max_chunks=...)"
        )
    return chunks


def _headed(prompt: str, chunks: list[str]) -> list[str]:
    n = len(chunks)
    return [f"{prompt}\n\n[chunk {i}/{n}]\n{c}" for i, c in enumerate(chunks, 1)]


@verb
def llm_query_chunked(
    text: str | None,
    prompt: str,
    *,
    chunk_chars: int | None = None,
    model: str | None = None,
    rt: Runtime,
) -> list[str]:
    """Split `text` (None: `context`) into chunks that fit the prompt cap (on
    paragraph, then line, then character boundaries), ask `prompt` of each, headed
    "[chunk i/N]", all at once (bounded like llm_query_batched); replies in order."""
    body = _text_of(rt, text, "llm_query_chunked")
    chunks = _chunks_of(rt, body, prompt, chunk_chars, "llm_query_chunked")
    return calls.llm_query_batched(_headed(prompt, chunks), model, rt=rt) if chunks else []


@verb
def map_files(
    paths_or_mapping: Any, prompt: str, *, model: str | None = None, rt: Runtime
) -> dict[str, str]:
    """One reply per file: a list of paths (read as UTF-8 text) or a {name: text}
    mapping. A file over the prompt cap is chunked and its replies joined in order.
    Returns {path or name: reply}."""
    _check_instruction(prompt, "map_files")
    cap, max_chunks = rt.limits.max_prompt_chars, rt.limits.max_chunks
    files = _files(paths_or_mapping)
    prompts: list[str] = []
    spans: dict[str, tuple[int, int]] = {}
    for name, body in files.items():
        start = len(prompts)
        if len(prompt) + len(body) + HEADER_ROOM <= cap:
            prompts.append(f"{prompt}\n\n[file {name}]\n{body}")
        else:
            chunks = _chunks_of(rt, body, prompt, None, f"map_files ({name})")
            prompts.extend(_headed(f"{prompt}\n\n[file {name}]", chunks))
        spans[name] = (start, len(prompts))
    if len(prompts) > max_chunks:
        raise InvalidArgument(
            f"map_files: {len(files):,} files make {len(prompts):,} model calls, over "
            f"Limits.max_chunks={max_chunks:,}; map fewer files at once"
        )
    replies = calls.llm_query_batched(prompts, model, rt=rt) if prompts else []
    return {name: "\n\n".join(replies[a:b]) for name, (a, b) in spans.items()}


@verb
def llm_map_reduce(
    items_or_text: Any,
    map_prompt: str,
    reduce_prompt: str,
    *,
    model: str | None = None,
    rt: Runtime,
) -> str:
    """Map `map_prompt` over the items (a list of texts) or over the chunks of a text,
    then one `reduce_prompt` call over the mapped replies, numbered; if those overflow
    the prompt cap they are reduced in chunks first, until they fit."""
    _check_instruction(map_prompt, "llm_map_reduce(map_prompt)")
    _check_instruction(reduce_prompt, "llm_map_reduce(reduce_prompt)")
    cap, max_chunks = rt.limits.max_prompt_chars, rt.limits.max_chunks
    if isinstance(items_or_text, list | tuple):
        prompts = []
        for i, item in enumerate(items_or_text):
            body = _text_of(rt, item, f"llm_map_reduce: items[{i}]")
            if len(map_prompt) + len(body) + HEADER_ROOM <= cap:
                prompts.append(f"{map_prompt}\n\n[item {i + 1}/{len(items_or_text)}]\n{body}")
            else:
                chunks = _chunks_of(rt, body, map_prompt, None, f"llm_map_reduce: items[{i}]")
                prompts.extend(_headed(map_prompt, chunks))
        if len(prompts) > max_chunks:
            raise InvalidArgument(
                f"llm_map_reduce: {len(prompts):,} map calls, over "
                f"Limits.max_chunks={max_chunks:,}; map fewer items"
            )
    else:
        body = _text_of(rt, items_or_text, "llm_map_reduce")
        prompts = _headed(map_prompt, _chunks_of(rt, body, map_prompt, None, "llm_map_reduce"))
    mapped = calls.llm_query_batched(prompts, model, rt=rt) if prompts else []
    while True:
        joined = "\n\n".join(f"[{i}] {m}" for i, m in enumerate(mapped, 1))
        if len(reduce_prompt) + len(joined) + HEADER_ROOM <= cap:
            return calls.llm_query(f"{reduce_prompt}\n\n{joined}", model, rt=rt)
        chunks = _chunks_of(rt, joined, reduce_prompt, None, "llm_map_reduce (reduce)")
        if len(chunks) >= len(mapped):  # no reply shorter than its input: it cannot fit
            raise InvalidArgument(
                f"llm_map_reduce: the mapped replies ({len(joined):,} characters) do not "
                f"shrink under reduce_prompt; ask for shorter replies in map_prompt"
            )
        mapped = calls.llm_query_batched(_headed(reduce_prompt, chunks), model, rt=rt)


@verb
def search(
    pattern: str,
    text: str | None = None,
    *,
    regex: bool = False,
    max_hits: int = 50,
    rt: Runtime,
) -> list[dict[str, Any]]:
    """Find `pattern` in `text` (None: `context`): [{"line", "col", "text", "match"}],
    at most `max_hits`; a plain substring unless regex=True. Look before you read."""
    return retrieval.search(pattern, _text_of(rt, text, "search"), regex=regex, max_hits=max_hits)


@verb
def grep_context(pattern: str, text: str | None = None, window: int = 3, *, rt: Runtime) -> str:
    """Like grep -n -C window over `text` (None: `context`): hit lines "N> …", lines
    around them "N: …", groups separated by "--"."""
    return retrieval.grep_context(pattern, _text_of(rt, text, "grep_context"), window)


@verb
def outline(text: str | None = None, *, rt: Runtime) -> list[dict[str, Any]]:
    """The structure of `text` (None: `context`): headings, numbered sections and
    top-level definitions, each {"line", "offset", "level", "kind", "title"}."""
    return retrieval.outline(_text_of(rt, text, "outline"))


def _check_instruction(prompt: object, where: str) -> None:
    if not isinstance(prompt, str):
        raise InvalidArgument(f"{where}: the prompt must be str, got {type(prompt).__name__}")
    if not prompt.strip():
        raise InvalidArgument(f"{where}: the prompt is empty; say what to do with each part")


def _files(paths_or_mapping: Any) -> dict[str, str]:
    """map_files' input as {name: text}: a mapping as it is, paths read as UTF-8 text."""
    if isinstance(paths_or_mapping, Mapping):
        out = {}
        for name, body in paths_or_mapping.items():
            if not isinstance(name, str) or not isinstance(body, str):
                raise InvalidArgument(
                    f"map_files: a mapping must be {{name: text}} of str, got {name!r}: "
                    f"{type(body).__name__}"
                )
            out[name] = body
        return out
    if isinstance(paths_or_mapping, str | os.PathLike) or not isinstance(
        paths_or_mapping, list | tuple
    ):
        raise InvalidArgument(
            "map_files takes a list of paths or a {name: text} mapping, got "
            f"{type(paths_or_mapping).__name__}; for one file pass [path]"
        )
    out = {}
    for p in paths_or_mapping:
        if not isinstance(p, str | os.PathLike):
            raise InvalidArgument(f"map_files: a path must be str, got {type(p).__name__}")
        path = os.fspath(p)
        try:
            size = os.path.getsize(path)
            if size > MAX_FILE_BYTES:
                raise InvalidArgument(
                    f"map_files: {path} has {size:,} bytes, over {MAX_FILE_BYTES:,}; "
                    "read the part that matters and pass it in a mapping"
                )
            with open(path, "rb") as f:
                raw = f.read()
        except OSError as exc:
            raise InvalidArgument(f"map_files: cannot read {path}: {exc.strerror}") from None
        if b"\0" in raw:
            raise InvalidArgument(f"map_files: {path} is binary (it holds NUL bytes), not text")
        try:
            out[path] = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidArgument(
                f"map_files: {path} is not UTF-8 text (byte {exc.start}); decode it yourself "
                "and pass a {name: text} mapping"
            ) from None
    return out

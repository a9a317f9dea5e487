"""The model's toolkit in the REPL, with real workers and scripted models: chunked calls,
map_files, map-reduce, retrieval over `context`, the prompt guards and the batched error
contract. Each refusal happens before any model call."""

from __future__ import annotations

import json
import re

import pytest

import brood
from tests.util import fast

FENCE = "```"
CHUNK = re.compile(r"\[chunk (\d+)/(\d+)\]\n")


def code(source: str) -> str:
    return f"{FENCE}repl\n{source}\n{FENCE}"


def run_root(source: str, reply=None, *, context=None, **limits):
    """Run a root whose one turn is `source`; plain calls are answered by `reply(prompt)`.
    Returns (RunResult, the plain prompts asked, in no set order)."""
    asked: list[str] = []

    def chat_fn(messages):
        prompt = messages[-1]["content"]
        if messages[0]["role"] == "system":
            return code(source) if len(messages) == 2 else code("FINAL('turn 2')")
        asked.append(prompt)
        return reply(prompt) if reply else "ok"

    with brood.Supervisor(chat_fn, limits=fast(**limits)) as sup:
        result = sup.run("root", context=context)
    return result, asked


def test_llm_query_chunked_cuts_on_paragraphs_heads_each_chunk_and_keeps_order():
    paragraphs = [f"para {i} " + "x" * 900 for i in range(7)]
    text = "\n\n".join(paragraphs)

    def reply(prompt):
        i, n = CHUNK.search(prompt).groups()
        return f"{i}/{n}:" + ",".join(re.findall(r"para (\d+)", prompt))

    source = "import json\nFINAL(json.dumps(llm_query_chunked(context, 'Summarize.')))"
    result, asked = run_root(source, reply, context=text, max_prompt_chars=2_100)
    replies = json.loads(result.answer)
    # 2,100 - len(prompt) - 40 leaves 2,049 characters: two paragraphs (1,810 with the blank
    # line) per chunk, never a paragraph cut in two.
    assert replies == ["1/4:0,1", "2/4:2,3", "3/4:4,5", "4/4:6"]
    assert all(p.startswith("Summarize.\n\n[chunk ") for p in asked)
    assert "".join(CHUNK.split(p)[-1] for p in sorted(asked, key=lambda p: p[18:20])) == text


def test_chunked_refusals_name_their_numbers_and_cost_no_call():
    source = (
        "out = []\n"
        "for call in (lambda: llm_query_chunked(context, 'p' * 1500),\n"
        "             lambda: llm_query_chunked(context, 'Sum.', chunk_chars=1200),\n"
        "             lambda: llm_query_chunked(b'bytes', 'Sum.'),\n"
        "             lambda: llm_query_chunked(context, '  ')):\n"
        "    try:\n        call()\n    except InvalidArgument as e:\n        out.append(str(e))\n"
        "FINAL('\\n'.join(out))"
    )
    result, asked = run_root(source, context="y" * 5_000, max_prompt_chars=2_500, max_chunks=3)
    lines = result.answer.splitlines()
    assert asked == []
    assert (
        "the prompt (1,500 characters) leaves 960 characters per chunk, under the 1,000" in lines[0]
    )
    assert "5,000 characters in chunks of 1,200 make 5 chunks, over Limits.max_chunks=3" in lines[1]
    assert "text is bytes; decode it first" in lines[2]
    assert "the prompt is empty" in lines[3]


def test_map_files_gives_one_reply_per_file_and_chunks_an_oversized_one(tmp_path):
    (tmp_path / "a.txt").write_text("alpha file")
    (tmp_path / "b.md").write_text("\n".join(f"line {i} " + "b" * 80 for i in range(60)))
    paths = [str(tmp_path / "a.txt"), str(tmp_path / "b.md")]

    def reply(prompt):
        m = CHUNK.search(prompt)
        return f"chunk {m.group(1)}" if m else "whole"

    source = f"import json\nFINAL(json.dumps(map_files({paths!r}, 'What is this?')))"
    result, asked = run_root(source, reply, max_prompt_chars=2_000)
    out = json.loads(result.answer)
    assert out[paths[0]] == "whole"
    chunks = out[paths[1]].split("\n\n")
    assert chunks == [f"chunk {i}" for i in range(1, len(chunks) + 1)] and len(chunks) >= 3
    assert len(asked) == 1 + len(chunks)


def test_map_files_refuses_unreadable_and_binary_files_naming_them(tmp_path):
    (tmp_path / "bin.dat").write_bytes(b"\x00\x01\x02")
    (tmp_path / "latin.txt").write_bytes("café".encode("latin-1"))
    missing, binary, latin = (str(tmp_path / n) for n in ("nope.txt", "bin.dat", "latin.txt"))
    source = (
        "out = []\n"
        f"for paths in ([{missing!r}], [{binary!r}], [{latin!r}], 'one.txt', {{'n': 3}}):\n"
        "    try:\n        map_files(paths, 'p')\n"
        "    except InvalidArgument as e:\n        out.append(str(e))\n"
        "FINAL('\\n'.join(out))"
    )
    result, asked = run_root(source)
    lines = result.answer.splitlines()
    assert asked == []
    assert lines[0] == f"map_files: cannot read {missing}: No such file or directory"
    assert lines[1] == f"map_files: {binary} is binary (it holds NUL bytes), not text"
    assert lines[2].startswith(f"map_files: {latin} is not UTF-8 text (byte 3)")
    assert "takes a list of paths or a {name: text} mapping, got str" in lines[3]
    assert "a mapping must be {name: text} of str" in lines[4]


def test_llm_map_reduce_over_items_and_over_a_text():
    def reply(prompt):
        if prompt.startswith("Combine"):
            return "reduced " + ",".join(re.findall(r"^\[(\d+)\] ", prompt, re.M))
        return "mapped"

    source = (
        "a = llm_map_reduce(['one', 'two', 'three'], 'Describe', 'Combine')\n"
        "b = llm_map_reduce(context, 'Describe', 'Combine')\n"
        "FINAL(a + '|' + b)"
    )
    text = "\n\n".join("z" * 1500 for _ in range(3))
    result, asked = run_root(source, reply, context=text, max_prompt_chars=2_000)
    assert result.answer == "reduced 1,2,3|reduced 1,2,3", result
    assert sum(p.startswith("Combine") for p in asked) == 2


def test_search_grep_and_outline_read_context_without_a_model_call():
    doc = "# Title\n\nIntro.\n\n## Part one\n\nThe needle is here.\n\n## Part two\n\nDone.\n"
    source = (
        "import json\n"
        "hits = search('needle')\n"
        "around = grep_context('needle', window=1)\n"
        "items = [(o['line'], o['level'], o['title']) for o in outline()]\n"
        "try:\n    search('(', regex=True)\nexcept InvalidArgument as e:\n    bad = str(e)\n"
        "FINAL(json.dumps([hits, around, items, bad]))"
    )
    result, asked = run_root(source, context=doc)
    hits, around, items, bad = json.loads(result.answer)
    assert asked == []
    assert hits == [{"line": 7, "col": 5, "text": "The needle is here.", "match": "needle"}]
    assert around == "6: \n7> The needle is here.\n8: "
    assert items == [[1, 1, "# Title"], [5, 2, "## Part one"], [9, 2, "## Part two"]]
    assert "search" in bad and "(" in bad


def test_prompt_guards_refuse_before_any_call():
    source = (
        "out = []\n"
        "for call in (lambda: llm_query(''), lambda: llm_query_batched(['ok', '  ']),\n"
        "             lambda: llm_query('q' * 3000), lambda: rlm_query('   ')):\n"
        "    try:\n        call()\n    except InvalidArgument as e:\n        out.append(str(e))\n"
        "FINAL('\\n'.join(out))"
    )
    result, asked = run_root(source, max_prompt_chars=2_000)
    lines = result.answer.splitlines()
    assert asked == []
    assert lines[0] == "llm_query: the prompt is empty; write what to ask"
    assert lines[1] == "llm_query_batched[1]: the prompt is empty; write what to ask"
    assert lines[2].startswith(
        "llm_query: the prompt has 3,000 characters, over Limits.max_prompt_chars=2,000; "
        "use llm_query_chunked(text, prompt)"
    )
    assert lines[3] == "rlm_query: the prompt is empty; write what to ask"


def test_a_batch_that_partly_fails_raises_model_error_keeping_every_reply():
    def reply(prompt):
        if prompt == "bad":
            raise RuntimeError("the endpoint fell over")
        return prompt.upper()

    source = (
        "import json\n"
        "try:\n    llm_query_batched(['a', 'bad', 'c'])\n"
        "except BroodError as e:\n"
        "    FINAL(json.dumps([type(e).__name__, e.failed, e.answers, str(e)]))"
    )
    result, _ = run_root(source, reply)
    name, failed, answers, message = json.loads(result.answer)
    assert (name, failed, answers) == ("ModelError", [1], ["A", None, "C"])
    assert message.startswith("1 of 3 calls failed: #1 ")


@pytest.mark.parametrize(("field", "value"), [("max_prompt_chars", 1_999), ("max_chunks", 0)])
def test_toolkit_limits_have_floors(field, value):
    with pytest.raises(brood.InvalidArgument, match=f"Limits.{field} must be >="):
        brood.Limits(**{field: value})


def test_the_system_prompt_and_budget_remaining_tell_a_run_its_place_and_budgets(tmp_path):
    systems: dict[str, str] = {}

    def chat_fn(messages):
        prompt = messages[1]["content"]
        systems.setdefault(prompt.split(":")[0], messages[0]["content"])
        if prompt.startswith("child"):
            return code("import json\nFINAL(json.dumps(budget_remaining()))")
        return code(
            "import json\n"
            "before = budget_remaining()\n"
            "child = json.loads(rlm_query('child: report'))\n"
            "FINAL(json.dumps([before, child, budget_remaining()]))"
        )

    url = f"sqlite:///{tmp_path}/j.db"
    limits = fast(max_depth=2, max_children=10, max_children_per_run=4, token_budget=10**6)
    with brood.Supervisor(chat_fn, store=url, limits=limits) as sup:
        result = sup.run("root: go")
    before, child, after = json.loads(result.answer)
    assert before == {
        "depth": 0,
        "max_depth": 2,
        "children_left": 10,
        "children_left_for_this_run": 4,
        "tokens_left": 10**6,
        "cost_left": None,
        "tokens_used": 0,
    }
    assert (child["depth"], child["children_left"], after["children_left_for_this_run"]) == (
        1,
        9,
        3,
    )
    assert systems["root"].endswith(
        "Your place in the tree: depth 0 of max_depth 2; you may start 4 more child runs "
        "(10 left in the whole tree); 1,000,000 tokens left in the tree. budget_remaining() "
        "gives these figures as they stand."
    )
    assert "depth 1 of max_depth 2; you cannot start child runs" in systems["child"]
    assert "Example: start a child, keep working, then collect it." in systems["root"]
    # The journal keeps the shared part once and each run's end with its calls.
    from brood.journal import Journal

    with Journal(url) as journal:
        exported = list(journal.export(result.run_id))
    assert exported[0]["messages"][0]["content"] == systems["root"]
    child_call = next(r for r in exported if r["depth"] == 1)
    assert child_call["messages"][0]["content"] == systems["child"]


def test_delegation_helpers_can_be_spawned_and_awaited_later():
    source = (
        "import json\n"
        "t = spawn(llm_query_chunked, context, 'Sum.')\n"
        "m = spawn(llm_map_reduce, ['a', 'b'], 'Map', 'Reduce')\n"
        "FINAL(json.dumps([rlm_await(t), rlm_await(m)]))"
    )
    result, _ = run_root(source, lambda p: p.split()[0], context="word " * 10)
    assert json.loads(result.answer) == [["Sum."], "Reduce"], result

"""Children without blocking: the root starts two children, works while they run, and
collects them; a third is cancelled (the call returns once its exit is confirmed). The
model is scripted, so the replies are fixed, but the code in them runs in real workers.

    python examples/children.py
"""

import brood

FENCE = "`" * 3


def repl(code: str) -> str:
    """A model reply that holds one repl block."""
    return f"{FENCE}repl\n{code}\n{FENCE}"


model = brood.ScriptedModel(
    {
        "Count all words": [
            repl(
                "hs = [rlm_spawn(f'Count words in part {i}', context=part)\n"
                "      for i, part in enumerate(context)]\n"
                "slow = rlm_spawn('Watch for late notes')\n"
                "print([rlm_status(h) for h in hs])"
            ),
            repl("longest = max(context, key=len)\nprint(len(longest))"),
            repl(
                "counts = rlm_wait_all(hs, timeout=60)\n"
                "print('watcher:', rlm_cancel(slow))\n"
                "FINAL(f'{sum(map(int, counts))} words; longest part {len(longest)} chars')"
            ),
        ],
        "Count words in part": [repl("FINAL(len(context.split()))")],
        "Watch for late notes": [repl("import time\ntime.sleep(30)\nFINAL('none')")],
    }
)

docs = ["the quick brown fox", "jumps over the lazy dog again"]
with brood.Supervisor(model, limits=brood.Limits(max_depth=2)) as sup:
    result = sup.run("Count all words in context", context=docs)
    print(result.state, result.answer)
    for run in sorted(sup.store.runs(result.run_id), key=lambda r: (r["depth"], r["prompt"])):
        print(run["depth"], run["state"], run["prompt"])

"""Retries and products: a flaky child fails its first attempt and is started again
(`retries=2`); the one that succeeds gives a JSON object beside its answer, which the parent
reads with `rlm_products`.

    python examples/retries.py
"""

import brood

FENCE = "`" * 3


def repl(code: str) -> str:
    """A model reply that holds one repl block."""
    return f"{FENCE}repl\n{code}\n{FENCE}"


tries = []


def count_sites(messages: list[dict]) -> str:
    """The child's model: down at the first attempt, then an answer with products."""
    tries.append(len(tries) + 1)
    if len(tries) == 1:
        raise brood.ModelError("the model endpoint was down")
    return repl("FINAL('3 sites', products={'sites': {'North marsh': 4, 'Oak wood': 6}})")


model = brood.ScriptedModel(
    {
        "Survey the birds": [
            repl(
                "h = rlm_spawn('Count the sites', retries=2)\n"
                "answer = rlm_wait(h, timeout=60)\n"
                "FINAL(f\"{answer}; busiest: Oak wood ({rlm_products(h)['sites']['Oak wood']})\")"
            )
        ],
        "Count the sites": [count_sites],
    }
)

with brood.Supervisor(model, limits=brood.Limits(max_depth=2)) as sup:
    result = sup.run("Survey the birds")
    print(result.state, result.answer)
    for run in sorted(sup.store.runs(result.run_id), key=lambda r: r["created_at"]):
        print(run["depth"], run["state"], run["reason"])

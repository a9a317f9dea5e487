"""A pool: three children each need the one deploy slot (`Limits(pools={"deploy": 1})`), so
they take it in turn, first come, first served; the journal's times show no overlap.

    python examples/pools.py
"""

import itertools

import brood

FENCE = "`" * 3


def repl(code: str) -> str:
    """A model reply that holds one repl block."""
    return f"{FENCE}repl\n{code}\n{FENCE}"


model = brood.ScriptedModel(
    {
        "Deploy the three services": [
            repl(
                "hs = [rlm_spawn(f'Deploy service {s}', pool='deploy') for s in 'abc']\n"
                "FINAL(', '.join(rlm_wait_all(hs, timeout=60)))"
            )
        ],
        "Deploy service": [repl("import time\ntime.sleep(0.2)\nFINAL(context or 'deployed')")],
    }
)

limits = brood.Limits(max_depth=2, pools={"deploy": 1})
with brood.Supervisor(model, limits=limits) as sup:
    result = sup.run("Deploy the three services")
    print(result.state, result.answer)
    children = [r for r in sup.store.runs(result.run_id) if r["depth"] == 1]
    spans = sorted((r["started_at"], r["ended_at"]) for r in children)
    print("overlap:", any(a[1] > b[0] for a, b in itertools.pairwise(spans)))

"""brood as an RL environment: a Session is a root run a trainer drives step by step; the
children its code starts run on their own, on the session's model.

    python examples/session.py
"""

import brood

FENCE = "`" * 3
child_model = brood.ScriptedModel(
    {"Count words in part": [f"{FENCE}repl\nFINAL(len(context.split()))\n{FENCE}"]}
)

with brood.Session(child_model, limits=brood.Limits(max_depth=2)) as env:
    env.reset(prompt="Count all words", context=["a b c", "d e"])
    obs = env.step(
        "hs = [rlm_spawn(f'Count words in part {i}', context=p)\n"
        "      for i, p in enumerate(context)]\n"
        "len(hs)"
    )
    print(obs.stdout.strip(), "children:", len(obs.children))
    obs = env.step("FINAL(sum(int(n) for n in rlm_wait_all(hs, timeout=30)))")
    print(obs.done, obs.answer)

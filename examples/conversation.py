"""A conversation: one root REPL and one model history across user turns, so a later turn
uses what an earlier one computed. A scripted model stands in for yours.

    python examples/conversation.py
"""

import brood

FENCE = "`" * 3


def chat(messages, model=None):
    """Answers each user turn with code; the second turn uses `x` from the first."""
    last = messages[-1]["content"]
    if "set x" in last:
        return f"{FENCE}repl\nx = 21\nFINAL('x is set')\n{FENCE}"
    return f"{FENCE}repl\nFINAL(f'x doubled is {{x * 2}}')\n{FENCE}"


with brood.Supervisor(chat) as sup, sup.conversation() as conv:
    for prompt in ("please set x", "now double x"):
        result = conv.send(prompt)
        print(result.state, result.answer)
    print("turns:", [t["prompt"] for t in conv.turns()])

"""A tool: a function of yours in every run's REPL, run on the supervisor's side (your code,
your rights), its calls checked against its signature and journaled.

    python examples/tools.py
"""

import brood

FENCE = "`" * 3


def forecast(city: str, days: int = 3) -> dict:
    """The weather in `city` for the next `days` days."""
    return {"city": city, "days": ["sun"] * days}


# The model's one reply: code that calls the tool like any function, then answers.
CODE = "f = forecast('Oslo', days=2)\nFINAL(f['city'] + ': ' + ', '.join(f['days']))"
model = brood.ScriptedModel([f"{FENCE}repl\n{CODE}\n{FENCE}"])

with brood.Supervisor(model, tools=[forecast]) as sup:
    result = sup.run("Plan a walk in Oslo this week")
    print(result.state, result.answer)

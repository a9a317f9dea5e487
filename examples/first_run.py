"""A first run: a root run over a few notes, one child per chunk, and the tree it left in the
journal. Runs with no model server on `echo`; pass a model spec to run it on yours:

    python examples/first_run.py [openai:MODEL@URL]
"""

import sys

import brood

MODEL = sys.argv[1] if len(sys.argv) > 1 else "echo"
notes = ["the owl hunts at dusk", "two owls nest in the oak\nthe oak is old", "no owls seen today"]

with brood.Supervisor(MODEL) as sup:
    result = sup.run("Count the words in each note", context=notes, timeout=600)
    print(result.state, result.answer)
    for run in sorted(sup.store.runs(result.run_id), key=lambda r: (r["depth"], r["prompt"])):
        print(run["depth"], run["state"], run["prompt"])

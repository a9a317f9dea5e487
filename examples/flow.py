"""A flow from YAML: a writer drafts, a reviewer judges, and a rejected draft goes back to the
writer (at most 3 entries each). The model is scripted: the first review rejects, the
second approves, so the flow visits draft → review → draft → review and finishes.

    python examples/flow.py
"""

import brood

SPEC = """
name: write-review
run: {max_parallel: 4, budget: 600, failure_policy: fail_fast, max_transitions: 50}
states:
  - id: draft
    entry: true
    prompt: "Write a paragraph about {topic}."
    inputs: [topic, {name: notes, from: review.notes, optional: true}]
    outputs: [text]
    max_entries: 3
  - id: review
    prompt: "Review this draft:\\n{text}"
    inputs: [{name: text, from: draft.text}]
    outputs: [{name: verdict, type: json}, notes]
    max_entries: 3
transitions:
  - {from: draft, to: review}
  - {from: review, to: draft, when: {output: verdict, path: approved, op: eq, value: false}}
"""
FENCE = "`" * 3


def final(text: str) -> str:
    """A model reply whose code ends the run with `text` as its answer."""
    return f"{FENCE}repl\nFINAL({text!r})\n{FENCE}"


REVIEW = '{{"verdict": {{"approved": {}}}, "notes": "{}"}}'
# Each review is a run of its own: the first rejects the draft, the second approves it.
reviews = iter([final(REVIEW.format("false", "say where")), final(REVIEW.format("true", "ok"))])
model = brood.ScriptedModel(
    {
        "Write a paragraph": [final("Owls hunt at dusk.")],
        "Review this draft": [lambda messages: next(reviews)],
    }
)

with brood.Supervisor(model) as sup:
    flow = sup.flow_run(SPEC, inputs={"topic": "owls"})
    print(flow.wait(timeout=120))
    status = flow.status()
    print({state: s["entries_used"] for state, s in status["states"].items()})
    print(flow.outputs()["review"]["verdict"])

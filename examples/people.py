"""A person in the loop: a run asks "Deploy to prod?" and waits; the answer comes from
elsewhere (here another thread, as `brood answer ASK yes` would from another terminal).

    python examples/people.py
"""

import threading

import brood

FENCE = "`" * 3
model = brood.ScriptedModel(
    [
        f"{FENCE}repl\n"
        "r = ask_person('Deploy to prod?', options=['yes', 'no'], deadline=60, default='no')\n"
        "FINAL(f\"{r['answer']['id']} (answered by {r['resolved_by']})\")\n"
        f"{FENCE}"
    ]
)


def answer_when_asked(sup: brood.Supervisor, done: threading.Event) -> None:
    """Answer the first open ask, as a person would."""
    while not done.wait(0.05):
        for ask in sup.asks():
            print("asked:", ask["question"], ask["options"])
            sup.answer(ask["id"], "yes", by="alice")
            return


with brood.Supervisor(model) as sup:
    done = threading.Event()
    person = threading.Thread(target=answer_when_asked, args=(sup, done))
    person.start()
    result = sup.run("Deploy the release")
    done.set()
    person.join()
    print(result.state, result.answer)

"""Training data: a tree's runs exported as OpenAI chat examples, with the reward a rubric
gave, streamed from the journal. The echo model needs no server.

    python examples/export.py
"""

import json
import tempfile
from pathlib import Path

import brood
from brood.journal import Journal

store = f"sqlite:///{Path(tempfile.mkdtemp()) / 'journal.db'}"
with brood.Supervisor("echo", store=store) as sup:
    handle = sup.spawn("Count the words", context=["a b c", "d e"])
    result = handle.wait_result()
    handle.record_reward(1.0 if result.state == "completed" else 0.0, {"rubric": "finished"})
    print(result.state, "reward recorded")

with Journal(store) as journal:
    for example in journal.export(handle.id, "openai-chat"):
        roles = [m["role"] for m in example["messages"]]
        meta = example["metadata"]
        print(meta["depth"], meta["state"], roles[:3], "reward:", meta["reward"])
        json.dumps(example)  # each is one JSON line of the training file

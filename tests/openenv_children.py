"""The children's model and the rubric of the OpenEnv tests, named by the server they start
(`--model python:tests.openenv_children:MODEL --rubric tests.openenv_children:reward`)."""

from __future__ import annotations

from typing import Any

import brood


def _repl(code: str) -> str:
    return f"```repl\n{code}\n```"


# A quick child answers at once with its worker's pid; a slow one computes until it is
# cancelled (or its episode ends).
MODEL = brood.ScriptedModel(
    {
        "quick": [_repl("import os\nFINAL(f'quick done by {os.getpid()}')")],
        "slow": [_repl("import time\nwhile True:\n    time.sleep(0.05)")],
    }
)


def reward(answer: str | None, trajectory: list[Any], expected_answer: Any = None) -> float:
    """1.0 for the expected answer, else 0.0; a rubric that fails on the data it is given
    (expected_answer "raise") raises, as a buggy one would."""
    if expected_answer == "raise":
        raise RuntimeError(f"no score for {answer!r} after {len(trajectory)} steps")
    return 1.0 if answer == expected_answer else 0.0

"""Every script of examples/ runs as it is, with no model server (the echo model, or a
scripted one), and prints what it says it does: no example goes stale. The how-to pages
include them whole (pymdownx.snippets), so the code a page shows is the code tested here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
EXPECTED = {
    "first_run.py": ["completed a list of 3 items, in 3 chunks", "0 completed Count the words"],
    "children.py": ["completed 10 words; longest part 29 chars", "1 cancelled Watch for late"],
    "session.py": ["2 children: 2", "True 5"],
    "conversation.py": ["completed x is set", "completed x doubled is 42"],
    "export.py": [
        "completed reward recorded",
        "0 completed ['system', 'user', 'assistant'] reward: 1.0",
    ],
    "tools.py": ["completed Oslo: sun, sun"],
    "tracing.py": ["runs: 3 children under the root's span: 2", "('brood.step', 5)"],
    "confinement.py": ["confined: refused: PermissionError", "with fs_read: read: the launch"],
    "flow.py": ["finished", "{'draft': 2, 'review': 2}", "{'approved': True}"],
    "pools.py": ["completed deployed, deployed, deployed", "overlap: False"],
    "people.py": ["asked: Deploy to prod?", "completed yes (answered by alice)"],
    "retries.py": [
        "completed 3 sites; busiest: Oak wood (6)",
        "1 failed model error: the model endpoint was down",
        "1 completed answer",
    ],
}


def test_every_example_is_checked():
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_an_example_runs(name, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "BROOD_MODEL"}
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / name)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    for line in EXPECTED[name]:
        assert line in out.stdout, out.stdout

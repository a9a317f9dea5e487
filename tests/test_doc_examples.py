"""Every Python block of the README and of the tutorial (docs/tutorial/), extracted and run
as it is printed, on the no-server model: a block that names a real model server
(`"openai:MODEL@URL"`) runs with `"echo"` in its place."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs" / "tutorial").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)
SERVER_SPEC = re.compile(r"\"(?:openai|anthropic|gemini):[^\"]*\"")


def blocks() -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        for n, match in enumerate(BLOCK.finditer(page.read_text()), 1):
            found.append((f"{page.relative_to(ROOT)}#{n}", match.group(1)))
    return found


def test_the_readme_and_the_tutorial_have_python_blocks():
    names = [name for name, _ in blocks()]
    assert "README.md#1" in names
    assert any(name.startswith("docs/tutorial/first-run.md") for name in names)


@pytest.mark.parametrize(("name", "code"), blocks(), ids=[name for name, _ in blocks()])
def test_a_python_block_runs_as_printed(name, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("BROOD_MODEL", raising=False)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(SERVER_SPEC.sub('"echo"', code), name, "exec"), {"__name__": "__main__"})
    assert "completed" in out.getvalue() or "True" in out.getvalue(), out.getvalue()

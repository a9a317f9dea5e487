"""The docs site's generation step and its link check, without building the site (make docs
builds it, in make test-all): the reference is generated from the code, a public object
without a docstring summary line is named, and the link check finds every broken link."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

import brood

DOCS = Path(__file__).resolve().parent.parent / "docs"


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"brood_docs_{name}", DOCS / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


hooks = load("hooks")
check_links = load("check_links")


def test_every_public_object_has_a_docstring_summary_line():
    assert hooks.missing_docstrings() == []


def test_a_public_object_without_a_docstring_is_named(monkeypatch):
    class Undocumented:
        def method(self) -> None:
            pass

    Undocumented.__module__ = "brood.fake"
    monkeypatch.setattr(brood, "Undocumented", Undocumented, raising=False)
    monkeypatch.setattr(brood, "__all__", [*brood.__all__, "Undocumented"])
    assert hooks.missing_docstrings() == ["brood.Undocumented", "brood.Undocumented.method"]


def test_the_limits_table_names_every_field_and_no_other():
    page = (DOCS / "reference" / "limits.md").read_text()
    assert hooks.limits_table_problems(page) == []
    assert hooks.limits_table_problems(page.replace("| `max_depth` |", "| `max_dept` |")) == [
        "the Limits table names `max_dept`, which Limits has no field of",
        "the Limits table leaves out the field `max_depth`",
    ]
    assert hooks.limits_table_problems(
        page.replace("| `max_depth` | `3` |", "| `max_depth` | `4` |")
    ) == ["the Limits table gives `max_depth` the default `4`; it is 3"]


def test_the_generated_pages_cover_the_code():
    python = hooks.python_page()
    for name in brood.__all__:
        assert f"::: brood.{name}\n" in python or name in brood.errors.__all__ or name == "Limits"
    repl = hooks.repl_page()
    for name in ("llm_query", "rlm_spawn", "rlm_wait_all", "ask_person", "FINAL", "remember"):
        assert f"## `{name}`" in repl
    cli = hooks.cli_page()
    for command in ("brood run", "brood flow validate", "brood serve", "brood doctor"):
        assert f"## `{command}`" in cli
    assert "Usage: brood run [OPTIONS]" in cli
    errors = hooks.errors_page()
    for name in brood.errors.__all__:
        assert f"{name} " in errors or f"{name}\n" in errors
    assert "\n        RateLimited " in errors  # under ModelError
    http = hooks.http_page()
    for endpoint in ("GET /v1/runs", "POST /v1/chat/completions", "POST /v1/flows"):
        assert f"## `{endpoint}`" in http


def test_the_link_check_finds_missing_pages_and_anchors(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "index.html").write_text(
        '<h1 id="top">t</h1><a href="a/">ok</a><a href="a/#here">ok</a><a href="#top">ok</a>'
        '<a href="https://example.org/x">external</a><a href="missing/">bad</a>'
        '<a href="a/#nowhere">bad</a><img src="img.png">'
    )
    (tmp_path / "a" / "index.html").write_text(
        '<p id="here">x</p><a href="../index.html#top">ok</a>'
    )
    assert check_links.broken_links(tmp_path) == [
        "index.html: missing/ (no such file)",
        "index.html: a/#nowhere (no anchor #nowhere in index.html)",
        "index.html: img.png (no such file)",
    ]


@pytest.mark.browser
def test_make_docs_images_photographs_the_demo_tree_in_the_dashboard(tmp_path):
    if shutil.which("chromium") is None:
        pytest.skip("no chromium on this machine: apt-get install chromium")
    out = subprocess.run(
        [sys.executable, str(DOCS / "images.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    png = (tmp_path / "dashboard.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 20_000

"""`brood serve`: a JSON API over a journal, and an OpenAI-compatible chat completion whose
answer is an RLM tree's (DESIGN.md section 10). Needs the optional extra
[serve] extra (`pip install -e '.[serve]'` in brood's clone)."""

from brood.errors import install_hint

try:
    from brood.serve.app import make_app
except ModuleNotFoundError as exc:  # the extra is missing: say which one
    if exc.name not in ("starlette", "uvicorn", "sse_starlette", "jinja2"):
        raise
    raise ModuleNotFoundError(
        f"brood serve needs {exc.name}: {install_hint('serve')}", name=exc.name
    ) from exc

__all__ = ["make_app"]

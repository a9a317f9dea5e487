"""The public surface (`brood.__all__`) and the layering rule of the worker side."""

from __future__ import annotations

import ast
import inspect
import pickle
import subprocess
import sys
import types
from pathlib import Path

import pytest

import brood
from brood import errors

SRC = Path(brood.__file__).parent
WORKER_SIDE = ("brood.worker", "brood.models")
SUPERVISOR_SIDE = (
    "brood.supervisor",
    "brood.store",
    "brood.api",
    "brood.session",
    "brood.cli",
    "brood.serve",
    "brood.backends",
)


def isort_key(name: str) -> tuple[int, str]:
    """ruff's RUF022 ("isort-style") order: CONSTANTS, then Classes, then functions."""
    if name.isupper():
        return (0, name)
    return (1, name) if name[0].isupper() else (2, name)


def test_all_is_sorted() -> None:
    assert brood.__all__ == sorted(brood.__all__, key=isort_key)
    assert len(set(brood.__all__)) == len(brood.__all__)


def test_every_name_in_all_resolves() -> None:
    for name in brood.__all__:
        assert getattr(brood, name, None) is not None, name


def test_every_public_object_of_the_package_is_in_all() -> None:
    public = {  # what dir() lists: the names imported so far and those imported on use
        name
        for name in dir(brood)
        if not name.startswith("_") and not isinstance(getattr(brood, name), types.ModuleType)
    }
    assert public == set(brood.__all__)


def test_every_error_of_the_tree_is_exported_and_is_a_brood_error() -> None:
    assert set(errors.__all__) <= set(brood.__all__)
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, brood.BroodError), name
        assert inspect.getdoc(cls), f"{name} has no docstring"


def test_the_design_names_are_exported() -> None:
    design = {
        "Supervisor",
        "Session",
        "Limits",
        "RunHandle",
        "RunResult",
        "RunState",
        "TRANSITIONS",
        "Model",
        "BroodError",
        "LimitExceeded",
        "ChildFailed",
        "ChildNotReady",
        "StaleHandle",
        "ChildCleanupError",
        "StoreError",
    }
    assert design <= set(brood.__all__)


def test_the_design_error_invalid_spec_exists() -> None:
    assert "InvalidSpec" in brood.__all__


# ---- layering -----------------------------------------------------------------------------
def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_in(source: str, module: str, *, is_package: bool = False) -> set[str]:
    """Every module that `source` (the text of `module`) imports, function bodies included."""
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source, module)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            # `from brood import api` imports the module brood.api
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def imports_of(path: Path) -> set[str]:
    return imports_in(path.read_text(), module_name(path), is_package=path.name == "__init__.py")


def worker_side_files() -> list[Path]:
    files = sorted((SRC / "worker").glob("*.py")) + sorted((SRC / "models").glob("*.py"))
    assert len(files) > 5
    return files


def forbidden(name: str) -> bool:
    return any(name == side or name.startswith(side + ".") for side in SUPERVISOR_SIDE)


def test_worker_side_modules_import_nothing_of_the_supervisor_side() -> None:
    bad = {
        f"{module_name(path)} imports {name}"
        for path in worker_side_files()
        for name in imports_of(path)
        if forbidden(name)
    }
    assert not bad


def reachable(modules: list[str]) -> set[str]:
    """Every brood module `modules` import, transitively (not through the package
    __init__, which re-exports the API)."""
    seen: set[str] = set()
    todo = list(modules)
    while todo:
        name = todo.pop()
        if name in seen or name == "brood":
            continue
        seen.add(name)
        rel = Path(*name.split("."))
        for candidate in (SRC.parent / rel.with_suffix(".py"), SRC.parent / rel / "__init__.py"):
            if candidate.exists():
                todo += [m for m in imports_of(candidate) if m.startswith("brood")]
                break
    return seen


def test_worker_side_modules_do_not_reach_the_supervisor_side_through_others() -> None:
    seen = reachable([module_name(p) for p in worker_side_files()])
    assert not [name for name in seen if forbidden(name)]
    assert "brood.protocol" in seen


def test_workers_never_import_models() -> None:
    """Model objects, clients and credentials stay in the supervisor (its model gateway):
    no worker module reaches brood.models, directly or through another module."""
    seen = reachable([module_name(p) for p in sorted((SRC / "worker").glob("*.py"))])
    assert not [name for name in seen if name.startswith("brood.models")]
    assert "brood.worker.confine" in seen


def test_the_import_parser_sees_relative_and_nested_imports() -> None:
    source = (
        "from ..supervisor import core\n"
        "from . import repl\n"
        "def f():\n"
        "    import brood.api\n"
        "    from brood.store.sqlite import SqliteStore\n"
    )
    found = imports_in(source, "brood.worker.probe")
    assert {"brood.supervisor.core", "brood.worker.repl", "brood.api", "brood.store.sqlite"} <= (
        found
    )
    assert all(forbidden(m) for m in ("brood.supervisor.core", "brood.api", "brood.store"))
    assert not forbidden("brood.apis") and not forbidden("brood.protocol")


def test_import_brood_leaves_flows_to_their_first_use() -> None:
    """Every supervisor's zygote and every CLI command imports brood: brood.flow (pydantic,
    PyYAML, about 0.2 s) is imported only where a flow is first used."""
    code = (
        "import sys, brood\n"
        "print(*[m for m in sys.modules if m.startswith(('brood.flow', 'pydantic', 'yaml'))])"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [], done.stdout


def test_the_zygote_imports_the_worker_side_alone() -> None:
    """Every worker is forked from the zygote, and a smaller zygote forks, copies on write
    and exits faster: it imports no supervisor-side module and no asyncio (nor the ssl and
    subprocess asyncio brings), while a public name of `brood` still imports on use."""
    code = (
        "import sys, brood.worker.zygote, brood.worker.main\n"
        "print(*[m for m in sys.modules if m.startswith(('asyncio', 'ssl', 'brood.'))])\n"
        "print(brood.Limits.__module__, brood.Supervisor.__module__)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    loaded, names = done.stdout.splitlines()
    modules = loaded.split()
    assert "brood.worker.confine" in modules and "brood.protocol" in modules
    assert not [m for m in modules if forbidden(m) or m.startswith(("asyncio", "ssl"))]
    assert names.split() == ["brood.limits", "brood.api"]


# ---- errors survive pickling (cloudpickle ships them between processes, e.g. on Ray) ----
ERROR_SAMPLES = [
    pytest.param(brood.BroodError("plain"), id="BroodError"),
    pytest.param(brood.InvalidArgument("prompt must be str, got int"), id="InvalidArgument"),
    pytest.param(brood.LimitExceeded("max_depth", 3, 2), id="LimitExceeded"),
    pytest.param(
        brood.ChildFailed("1 of 2 failed", status="failed", failed=[1], answers=["a", None]),
        id="ChildFailed",
    ),
    pytest.param(brood.StaleHandle("the session was reset"), id="StaleHandle"),
    pytest.param(
        brood.ChildCleanupError("1 process survived", pids=[4242], answer="42"),
        id="ChildCleanupError",
    ),
]


@pytest.mark.parametrize("exc", ERROR_SAMPLES)
def test_errors_survive_pickling(exc: BaseException) -> None:
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is type(exc)
    assert str(back) == str(exc)
    assert vars(back) == vars(exc)


def test_errors_moved_into_the_tree_are_still_importable_where_they_were() -> None:
    from brood.flow.render import OutputError
    from brood.lifecycle import IllegalTransition
    from brood.protocol import ProtocolError

    assert OutputError is errors.OutputError
    assert IllegalTransition is errors.IllegalTransition
    assert ProtocolError is errors.ProtocolError

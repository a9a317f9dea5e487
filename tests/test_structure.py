"""The shape of the package: small supervisor rooms, no import cycles, one error tree.

Read from the source (the AST of every module under src/brood), not from a running
supervisor: these are facts about the code a maintainer reads.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import brood
from brood import errors

SRC = Path(brood.__file__).resolve().parent.parent
SUPERVISOR_MAX_LINES = 600
# The lazy registries (a backend, a model or a store picked by name or URL) may import
# their implementations from inside a function; a cycle that stays inside one of these
# packages is theirs. None is needed today.
REGISTRIES = ("brood.backends", "brood.models", "brood.store")


def _modules() -> dict[str, Path]:
    found = {}
    for path in (SRC / "brood").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path, types: bool = True) -> set[str]:
    """The brood modules `name` imports at module level: its top-level statements, and
    those under a top-level `if` or `try` (a `TYPE_CHECKING` import counts unless `types`
    is False: a cycle of types is a cycle a reader follows). Imports inside functions are
    lazy: not counted."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If):
                if types or "TYPE_CHECKING" not in ast.unparse(node.test):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                visit(node.orelse)
                visit(node.finalbody)
                for handler in node.handlers:
                    visit(handler.body)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name in MODULES)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    module = ".".join([*base, node.module] if node.module else base)
                else:
                    module = node.module or ""
                for alias in node.names:
                    if f"{module}.{alias.name}" in MODULES:  # a submodule
                        found.add(f"{module}.{alias.name}")
                    elif module in MODULES:
                        found.add(module)

    visit(ast.parse(path.read_text()).body)
    found.discard(name)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def _registry_of(module: str) -> str | None:
    return next((r for r in REGISTRIES if module == r or module.startswith(r + ".")), None)


def _within_one_registry(cycle: list[str]) -> bool:
    registries = {_registry_of(m) for m in cycle}
    return len(registries) == 1 and None not in registries


def test_every_module_of_the_supervisor_is_under_600_lines() -> None:
    long = {
        name: n
        for name, path in MODULES.items()
        if name.startswith("brood.supervisor")
        and (n := len(path.read_text().splitlines())) > SUPERVISOR_MAX_LINES
    }
    assert not long, f"split these by reason to change (lines): {long}"


def _outside_registries(types: bool) -> list[list[str]]:
    graph = {name: _imports(name, path, types) for name, path in MODULES.items()}
    # A cycle is the registries' own only when every module in it is in one registry.
    return [c for c in _cycles(graph) if not _within_one_registry(c)]


def test_no_import_cycle_outside_the_registries() -> None:
    cycles = _outside_registries(types=False)
    assert not cycles, f"modules that import each other: {cycles}"


def test_no_cycle_of_types_either() -> None:
    cycles = _outside_registries(types=True)
    assert not cycles, f"modules that name each other's types: {cycles}"


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _brood_errors() -> list[type[errors.BroodError]]:
    """Every BroodError subclass defined in brood (every module that imports without an
    optional extra is imported first)."""
    for info in pkgutil.walk_packages(brood.__path__, "brood."):
        try:
            importlib.import_module(info.name)
        except ImportError:  # an optional extra (ray, a browser) that is not installed
            continue
    seen: list[type[errors.BroodError]] = []
    todo = [errors.BroodError]
    while todo:
        cls = todo.pop()
        if cls.__module__.startswith("brood") and cls not in seen:
            seen.append(cls)
        todo.extend(cls.__subclasses__())
    return seen


def _outside_the_tree(prefix: str) -> list[str]:
    return sorted(
        f"{cls.__module__}.{cls.__qualname__}"
        for cls in _brood_errors()
        if cls.__module__.startswith(prefix)
        and (cls.__module__ != "brood.errors" or cls.__name__ not in errors.__all__)
    )


def test_every_error_of_the_supervisor_is_in_the_error_tree() -> None:
    assert _outside_the_tree("brood.supervisor") == []


def test_every_brood_error_is_defined_in_errors_and_exported() -> None:
    assert _outside_the_tree("brood") == []


# Privates of the standard library (and of every namedtuple) that brood may use.
STDLIB_PRIVATES = frozenset({"os._exit", "sys._getframe"})
NAMEDTUPLE_PRIVATES = frozenset({"_asdict", "_replace", "_fields", "_make"})


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined_in(tree: ast.Module) -> set[str]:
    """The names a module defines at its top level: its functions and classes and the
    names it assigns (not the names it imports: those are another module's)."""
    found: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            found.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    return found


def _reaches(path: Path, where: str) -> list[str]:
    """Where the module at `path` reaches another module's private names: `x._name` with
    `x` neither `self`/`cls` nor a name this module defines, or an import of a private
    name. The standard library's few privates brood uses, and a namedtuple's, are allowed."""
    tree = ast.parse(path.read_text())
    defined = _defined_in(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            owner = node.value
            if isinstance(owner, ast.Name) and (owner.id in ("self", "cls") or owner.id in defined):
                continue
            text = ast.unparse(node)
            if node.attr not in NAMEDTUPLE_PRIVATES and text not in STDLIB_PRIVATES:
                found.append(f"{where}:{node.lineno} {text}")
        elif isinstance(node, ast.ImportFrom) and (
            node.level or (node.module or "").split(".")[0] == "brood"
        ):
            names = [a.name for a in node.names if _private(a.name)]
            found += [f"{where}:{node.lineno} from {node.module} import {n}" for n in names]
        elif isinstance(node, ast.Import):
            found += [
                f"{where}:{node.lineno} import {a.name}"
                for a in node.names
                if a.name.startswith("brood.") and any(map(_private, a.name.split(".")))
            ]
    return found


def test_no_module_reaches_another_modules_private_names() -> None:
    reached = [
        line
        for path in sorted(MODULES.values())
        for line in _reaches(path, str(path.relative_to(SRC)))
    ]
    assert not reached, "private names reached from another module:\n" + "\n".join(reached)


def test_the_private_name_finder_finds_a_reach(tmp_path: Path) -> None:
    module = tmp_path / "probe.py"
    code = (
        "from brood.api import _hidden\n"
        "from brood.api import Supervisor\n"
        "import os\n"
        "_TABLE = {}\n"
        "class A:\n"
        "    def __init__(self, other):\n"
        "        self._mine = 1\n"
        "        other._mine, self.peer._mine, super()._base, Supervisor._engine\n"
        "        os._exit, self._anything, A._table, _TABLE._x, other._asdict\n"
    )
    module.write_text(code)
    found = _reaches(module, "probe.py")
    assert [line.split(" ", 1)[1] for line in found] == [
        "from brood.api import _hidden",
        "other._mine",
        "self.peer._mine",
        "super()._base",
        "Supervisor._engine",
    ]

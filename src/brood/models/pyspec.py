"""`python:MODULE:NAME`: a user's own chat function (or model) named by a spec string.

The spec is what the command line takes (`brood run --model python:mychat:chat`) and what a
tree's journal keeps, so `brood resume` imports the same function again. It is resolved
only from specs the user gives (an argument, `BROOD_MODEL`, a journaled spec of the user's
tree), never from a name model code passes: model code names models of `Limits.models`,
and nothing it says is imported.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from types import ModuleType
from typing import Any

from brood.errors import InvalidArgument
from brood.models.base import CallableModel, Model

FORM = "python:MODULE:FUNCTION"
SHOWN_NAMES = 12  # names a "no such attribute" error lists


def from_spec(rest: str) -> Model:
    """The model `python:{rest}` names: `MODULE:NAME`, where MODULE is a dotted module
    name importable from sys.path or the current directory, and NAME (dotted for an
    attribute of an attribute) is a chat function `fn(messages, model=None) -> str`, a
    callable object, a `brood.Model` instance, or a `brood.Model` subclass that takes no
    arguments. Raises InvalidArgument naming what is wrong and how to write it."""
    spec = f"python:{rest}"
    module_name, _, attr = rest.partition(":")
    module_name, attr = module_name.strip(), attr.strip()
    if module_name.endswith(".py") or "/" in module_name or os.sep in module_name:
        stem = os.path.splitext(os.path.basename(module_name))[0] or "MODULE"
        raise InvalidArgument(
            f"model spec {spec!r} names a file; name the module as Python imports it: "
            f"python:{stem}:{attr or 'FUNCTION'}, run from its folder or with the folder on "
            "PYTHONPATH"
        )
    if not _dotted(module_name) or not _dotted(attr):
        raise InvalidArgument(
            f"model spec {spec!r} needs a module and a name in it; write {FORM}, e.g. "
            "python:mychat:chat for `def chat(messages, model=None)` in mychat.py"
        )
    module = _import(module_name, spec)
    found: Any = module
    for i, part in enumerate(attr.split(".")):
        if not hasattr(found, part):
            where = ".".join([module_name, *attr.split(".")[:i]])
            raise InvalidArgument(
                f"model spec {spec!r}: {where} ({_origin(module)}) has no attribute {part!r}"
                f"{_offer(found)}"
            )
        found = getattr(found, part)
    return _as_model(found, attr, spec)


def _dotted(name: str) -> bool:
    return bool(name) and all(part.isidentifier() for part in name.split("."))


def _import(name: str, spec: str) -> ModuleType:
    """The module, imported as `import name` would, with the current directory searched
    after sys.path (a console script's sys.path does not hold it). The directory stays on
    sys.path, so what the module imports later, when it is called, is found too."""
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.append(here)
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if name == missing or name.startswith(missing + "."):
            raise InvalidArgument(
                f"model spec {spec!r}: no module named {missing!r} in the current directory "
                f"({here}) or on sys.path; run from the folder that holds {missing}.py, or "
                "put that folder on PYTHONPATH"
            ) from None
        raise InvalidArgument(
            f"model spec {spec!r}: importing module {name!r} failed: {exc}; install what it "
            "imports, or fix the import"
        ) from exc
    except Exception as exc:  # the user's module ran and raised (a SyntaxError included)
        raise InvalidArgument(
            f"model spec {spec!r}: importing module {name!r} raised {type(exc).__name__}: "
            f"{exc}; fix the module, then try again"
        ) from exc


def _origin(module: ModuleType) -> str:
    return getattr(module, "__file__", None) or "a namespace package"


def _offer(found: Any) -> str:
    names = (
        sorted(n for n, v in vars(found).items() if not n.startswith("_") and callable(v))
        if hasattr(found, "__dict__")
        else []
    )
    if not names:
        return ""
    more = f", … ({len(names)} in all)" if len(names) > SHOWN_NAMES else ""
    return f"; its callables: {', '.join(names[:SHOWN_NAMES])}{more}"


def _as_model(found: Any, attr: str, spec: str) -> Model:
    if isinstance(found, Model):
        return found
    if isinstance(found, type):
        if not issubclass(found, Model):
            raise InvalidArgument(
                f"model spec {spec!r} names the class {found.__name__}, not a chat function; "
                "name a function (messages, model=None) -> str, an object of the class, or "
                "a brood.Model subclass"
            )
        try:
            return found()
        except TypeError as exc:
            raise InvalidArgument(
                f"model spec {spec!r}: {found.__name__}() cannot be made without arguments "
                f"({exc}); make one in the module (model = {found.__name__}(...)) and name it"
            ) from None
    if not callable(found):
        raise InvalidArgument(
            f"model spec {spec!r} names {attr}, of type {type(found).__name__}, which is not "
            "callable; "
            "name a chat function (messages, model=None) -> str"
        )
    try:
        signature = inspect.signature(found)
    except (TypeError, ValueError):  # a builtin without a signature: it is called and seen
        return CallableModel(found)
    try:
        signature.bind([])
    except TypeError:
        raise InvalidArgument(
            f"model spec {spec!r} names {_callable(found)}{signature}, which cannot be called "
            "with the messages alone; a chat function is called fn(messages) or "
            "fn(messages, model=NAME): give it the form (messages, model=None) -> str"
        ) from None
    return CallableModel(found)


def _callable(found: Any) -> str:
    return str(getattr(found, "__qualname__", None) or type(found).__name__)

"""Tools: the user's own functions, placed in every run's REPL.

`Supervisor(tools=[fn, ...])` describes each tool to the model from its signature and
docstring. A call from model code sends its arguments to the supervisor, which checks them
against the signature (`check_arguments`) and calls the function there, with the user's
rights, as it makes model calls; a tool made with `tool(fn, in_worker=True)` is shipped to
each worker instead and runs confined, beside model code.

Both sides import this module (the worker checks an in-worker tool's arguments with it):
it imports only the standard library, msgspec, cloudpickle, brood.errors and the protocol.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import math
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, overload

import cloudpickle
import msgspec
import msgspec.inspect

from brood.errors import InvalidArgument, ToolError
from brood.protocol import ToolInfo

DEFAULT_TOOL_TIMEOUT = 60.0  # seconds a supervisor-side call may take; Tool(timeout=) changes it
# JSON bytes of one call's arguments, and of its result: both are journaled with the call,
# and counted in Limits.journal_bytes_per_run.
MAX_TOOL_BYTES = 4 * 2**20
TOOL_DOC_CAP = 4_000  # characters of a tool's docstring shown in the system prompt
NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,99}$")


@dataclass(frozen=True)
class Tool:
    """A function placed in every run's REPL under `name` (by default its own).

    By default it runs in the supervisor's process, in a thread, with the user's rights,
    and its arguments (JSON-like values from model code) are checked against its
    annotations first; a call taking more than `timeout` seconds raises ToolError in the
    REPL (the thread is not killed: make a slow tool time out on its own). With
    `in_worker=True` it is pickled to each worker and runs there, confined like model
    code, with the same checks of its arguments. Either way its calls are journaled, and
    a resumed run gets the journaled results back instead of calling it again.
    """

    fn: Callable[..., Any]
    name: str = ""
    in_worker: bool = False
    timeout: float | None = DEFAULT_TOOL_TIMEOUT
    spec: ToolInfo = field(init=False, repr=False, compare=False)  # as Start sends it
    signature: inspect.Signature = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        fn = self.fn
        if not callable(fn):
            raise InvalidArgument(
                f"a tool must be a function, got {type(fn).__name__}; pass the function itself"
            )
        name = self.name or getattr(fn, "__name__", "")
        if not NAME.match(name) or name.startswith("_"):
            raise InvalidArgument(
                f"tool name {name!r} is not a plain Python name; name it with "
                "Tool(fn, name='my_tool')"
            )
        if self.timeout is not None and not (
            isinstance(self.timeout, int | float)
            and math.isfinite(self.timeout)
            and self.timeout > 0
        ):
            raise InvalidArgument(
                f"tool {name}: timeout={self.timeout!r}; pass seconds > 0, or None for no limit"
            )
        sig = signature_of(fn, name)
        if not self.in_worker:
            for p in sig.parameters.values():
                annotation = _annotation(p)
                if annotation is not None and not _checkable(annotation):
                    raise InvalidArgument(
                        f"tool {name}: parameter {p.name!r} is annotated {_type_text(annotation)}, "
                        "which model code cannot pass as JSON; annotate it with str, int, float, "
                        "bool, a list, a dict, a dataclass or a TypedDict, or make the tool "
                        "Tool(fn, in_worker=True)"
                    )
        doc = inspect.cleandoc(getattr(fn, "__doc__", None) or "")
        shapes = [line for p in sig.parameters.values() if (line := _shape_line(p))]
        doc = "\n".join([doc[:TOOL_DOC_CAP], *shapes]).strip()
        text = _sig_text(sig)
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "signature", sig)
        blob = _pickled(fn, name) if self.in_worker else None
        spec = ToolInfo(name=name, signature=text, doc=doc, fn=blob)
        object.__setattr__(self, "spec", spec)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the function itself (so a function decorated with `@tool` still works as one)."""
        return self.fn(*args, **kwargs)


@overload
def tool(
    fn: Callable[..., Any], *, name: str = "", in_worker: bool = False, timeout: float | None = ...
) -> Tool: ...
@overload
def tool(
    fn: None = None, *, name: str = "", in_worker: bool = False, timeout: float | None = ...
) -> Callable[[Callable[..., Any]], Tool]: ...
def tool(
    fn: Callable[..., Any] | None = None,
    *,
    name: str = "",
    in_worker: bool = False,
    timeout: float | None = DEFAULT_TOOL_TIMEOUT,
) -> Tool | Callable[[Callable[..., Any]], Tool]:
    """Make `fn` a `Tool`: `tool(fn, in_worker=True)`, or as a decorator, `@tool` or
    `@tool(timeout=10)`."""
    if fn is None:
        return lambda f: Tool(f, name=name, in_worker=in_worker, timeout=timeout)
    return Tool(fn, name=name, in_worker=in_worker, timeout=timeout)


def as_tools(tools: Iterable[Any] | None, reserved: Iterable[str] = ()) -> tuple[Tool, ...]:
    """`tools` as Tools: each a Tool, a function, or "module:function" (imported here).
    Refused with InvalidArgument: a name used twice or by a REPL helper (`reserved`), a
    value that is none of these, a function that cannot be imported or pickled."""
    if tools is None:
        return ()
    if isinstance(tools, str | Tool) or callable(tools):
        tools = [tools]
    found: dict[str, Tool] = {}
    taken = set(reserved)
    for item in tools:
        t = (
            item
            if isinstance(item, Tool)
            else Tool(import_tool(item) if isinstance(item, str) else item)
        )
        if t.name in taken:
            raise InvalidArgument(
                f"tool name {t.name!r} is the name of a REPL helper or another tool; name it "
                "otherwise with Tool(fn, name='...')"
            )
        taken.add(t.name)
        found[t.name] = t
    return tuple(found.values())


def import_tool(ref: str) -> Callable[..., Any]:
    """The function `ref` ("module:function", or "module.function") names."""
    module, sep, attr = ref.partition(":")
    if not sep:
        module, _, attr = ref.rpartition(".")
    if not module or not attr:
        raise InvalidArgument(f"tool {ref!r}: name it as module:function, e.g. mytools:lookup")
    try:
        mod = importlib.import_module(module)
    except Exception as exc:
        raise InvalidArgument(
            f"tool {ref!r}: module {module!r} cannot be imported ({type(exc).__name__}: {exc}); "
            "put it on PYTHONPATH or fix it"
        ) from exc
    fn: Any = mod
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise InvalidArgument(f"tool {ref!r}: module {module!r} has no {attr!r}")
    if not callable(fn):
        raise InvalidArgument(f"tool {ref!r} is a {type(fn).__name__}, not a function")
    return fn


def _pickled(fn: Callable[..., Any], name: str) -> bytes:
    """`fn` pickled by value, with its module's functions and classes it uses: a confined
    worker may not be able to import (read) the module it comes from."""
    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    by_value = module is not None and module.__name__ not in ("__main__", "builtins")
    try:
        if by_value:
            cloudpickle.register_pickle_by_value(module)
        return cloudpickle.dumps(fn)
    except Exception as exc:
        raise InvalidArgument(
            f"tool {name} (in_worker=True) cannot be pickled to be sent to workers: {exc}; "
            "make it a plain function, or run it in the supervisor (in_worker=False)"
        ) from exc
    finally:
        if by_value:
            with contextlib.suppress(ValueError):
                cloudpickle.unregister_pickle_by_value(module)


def signature_of(fn: Callable[..., Any], name: str, *, loose: bool = False) -> inspect.Signature:
    """`fn`'s signature with its annotations evaluated. `loose` (a function pickled by
    value, whose globals hold only the names its body uses): an annotation that cannot be
    evaluated stays text, and its parameter is not checked."""
    if loose:
        try:
            return inspect.signature(fn, eval_str=True)
        except Exception:
            return inspect.signature(fn)
    try:
        return inspect.signature(fn, eval_str=True)
    except (ValueError, TypeError) as exc:
        raise InvalidArgument(f"tool {name}: its signature cannot be read ({exc})") from exc
    except Exception as exc:  # an annotation that names what is not defined
        raise InvalidArgument(
            f"tool {name}: its annotations cannot be evaluated ({type(exc).__name__}: {exc}); "
            "import what they name at the module's top level"
        ) from exc


def check_arguments(
    name: str, sig: inspect.Signature, args: list[Any], kwargs: dict[str, Any]
) -> inspect.BoundArguments:
    """The arguments of a call of tool `name`, bound to `sig` and converted to its
    annotations (a dict becomes the dataclass a parameter names). InvalidArgument names
    the tool, the parameter and the type it takes."""
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as exc:
        raise InvalidArgument(f"tool {name}{_sig_text(sig)}: {exc}") from None
    for pname, value in bound.arguments.items():
        p = sig.parameters[pname]
        annotation = _annotation(p)
        if annotation is None or not _checkable(annotation):
            continue
        if p.kind is p.VAR_POSITIONAL:
            bound.arguments[pname] = tuple(
                _convert(name, f"{pname}[{i}]", v, annotation) for i, v in enumerate(value)
            )
        elif p.kind is p.VAR_KEYWORD:
            bound.arguments[pname] = {k: _convert(name, k, v, annotation) for k, v in value.items()}
        else:
            bound.arguments[pname] = _convert(name, pname, value, annotation)
    return bound


def json_result(name: str, value: Any) -> Any:
    """A tool's result as JSON-like values (a dataclass becomes a dict), within
    MAX_TOOL_BYTES; ToolError naming the tool otherwise."""
    try:
        data = msgspec.json.encode(value)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ToolError(
            f"tool {name} returned a {type(value).__name__}, which is not JSON ({exc}); make "
            "it return str, numbers, bools, None, lists, dicts or dataclasses",
            tool=name,
        ) from None
    if len(data) > MAX_TOOL_BYTES:
        raise ToolError(
            f"tool {name} returned {len(data):,} bytes of JSON, over the {MAX_TOOL_BYTES:,} "
            "one result may hold; make it return less (a summary, or a page of it)",
            tool=name,
        )
    return msgspec.json.decode(data)


def call_key(name: str, args: list[Any], kwargs: dict[str, Any]) -> str:
    """The journal's key of a call: the tool and its arguments, as canonical JSON (a
    resumed run's call with the same key gets the journaled result)."""
    try:
        return msgspec.json.encode([name, args, kwargs], order="sorted").decode()
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidArgument(
            f"tool {name}: its arguments are not JSON ({exc}); pass str, numbers, bools, "
            "None, lists and dicts"
        ) from None


def _annotation(p: inspect.Parameter) -> Any:
    return None if p.annotation is inspect.Parameter.empty else p.annotation


def _checkable(annotation: Any) -> bool:
    """Whether msgspec can check a JSON-like value against `annotation` (every type in it
    is one msgspec knows: no class of the user's own but dataclasses and the like)."""
    try:
        info = msgspec.inspect.type_info(annotation)
    except (TypeError, ValueError):
        return False
    return not _holds_custom(info, set())


def _holds_custom(info: Any, seen: set[int]) -> bool:
    if isinstance(info, msgspec.inspect.CustomType):
        return True
    if id(info) in seen:  # a recursive type
        return False
    seen.add(id(info))
    parts = [getattr(info, a, None) for a in ("item_type", "key_type", "value_type")]
    parts += list(getattr(info, "types", ()) or ()) + list(getattr(info, "item_types", ()) or ())
    parts += [f.type for f in getattr(info, "fields", ()) or ()]
    return any(p is not None and _holds_custom(p, seen) for p in parts)


def _convert(name: str, param: str, value: Any, annotation: Any) -> Any:
    try:
        return msgspec.convert(value, annotation, strict=True)
    except msgspec.ValidationError as exc:
        raise InvalidArgument(
            f"tool {name}: argument {param!r} must be {_type_text(annotation)}, got "
            f"{type(value).__name__} {_short(value)} ({exc}); pass a value of that type"
        ) from None


def _type_text(annotation: Any) -> str:
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def _sig_text(sig: inspect.Signature) -> str:
    """The signature as the model reads it: types by their short names (`Point`, not
    `mymodule.Point`)."""
    params = [
        p.replace(annotation=_type_text(p.annotation)) if p.annotation is not p.empty else p
        for p in sig.parameters.values()
    ]
    ret = sig.return_annotation
    shown = sig.replace(
        parameters=params,
        return_annotation=_type_text(ret) if ret is not sig.empty else sig.empty,
    )
    return str(shown).replace("'", "")


def _shape_line(p: inspect.Parameter) -> str:
    """For a parameter that takes an object of named fields (a dataclass, a TypedDict, a
    msgspec Struct), a line that shows the model what to pass: `p: {"x": int, "y": int}`."""
    annotation = _annotation(p)
    if annotation is None or not _checkable(annotation):
        return ""
    info = msgspec.inspect.type_info(annotation)
    fields = getattr(info, "fields", None)
    if not fields:
        return ""
    parts = ", ".join(f'"{f.encode_name}": {_info_text(f.type)}' for f in fields)
    return f"{p.name} ({_type_text(annotation)}) is an object: {{{parts}}}"


def _info_text(info: Any) -> str:
    names = {
        "IntType": "int",
        "FloatType": "float",
        "StrType": "str",
        "BoolType": "bool",
        "NoneType": "None",
        "ListType": "list",
        "DictType": "dict",
        "AnyType": "Any",
    }
    return names.get(type(info).__name__, type(info).__name__.removesuffix("Type").lower())


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


__all__ = [
    "DEFAULT_TOOL_TIMEOUT",
    "MAX_TOOL_BYTES",
    "Tool",
    "as_tools",
    "call_key",
    "check_arguments",
    "import_tool",
    "json_result",
    "tool",
]

"""MCP servers' tools, called for model code through the official `mcp` SDK.

`Supervisor(mcp_servers=[...])` connects to each server once, on the supervisor's loop (a
stdio command it starts, or a streamable-HTTP URL), lists its tools, and places each in
every run's REPL as `<server>_<tool>`, described from the tool's JSON schema (its
signature) and description (its docstring). A call's arguments are checked against the
schema here, before the server sees them; calls are journaled and replayed by the
ToolBox (tools.py) as any tool's are.

A server found gone at a call (its process died, its connection closed) is started again
and the call is sent once more; if that fails too, the call raises ToolError naming the
server. Every connection is closed, and every process it started is stopped, at close.

Imported only when a supervisor has MCP servers (the `[mcp]` extra).
"""

from __future__ import annotations

import asyncio
import re
import shlex
from dataclasses import dataclass, field
from typing import Any

from brood.errors import BroodError, InvalidArgument, ToolError, install_hint
from brood.protocol import ToolInfo
from brood.tools import DEFAULT_TOOL_TIMEOUT

try:
    import mcp
    from mcp.shared.exceptions import MCPError
except ImportError as exc:  # pragma: no cover - the extra is missing
    raise BroodError(f"MCP servers need the official mcp SDK: {install_hint('mcp')}") from exc

MCP_START_TIMEOUT = 30.0  # seconds for a server to start and list its tools
MCP_STOP_TIMEOUT = 10.0  # seconds to close one (the SDK stops a stdio process within ~6 s)
CONNECTION_CLOSED = -32000  # the SDK's error code for a connection that closed
WORD = re.compile(r"[^A-Za-z0-9_]+")
JSON_TYPES = {
    "string": "str",
    "integer": "int",
    "number": "float",
    "boolean": "bool",
    "array": "list",
    "object": "dict",
    "null": "None",
}


@dataclass(frozen=True)
class ServerSpec:
    """One entry of mcp_servers: "CMD ARGS", "URL", or either after "NAME="."""

    text: str
    name: str | None
    url: str | None
    argv: list[str] = field(default_factory=list)

    @classmethod
    def parse(cls, text: str) -> ServerSpec:
        if not isinstance(text, str) or not text.strip():
            raise InvalidArgument(
                f"mcp_servers: {text!r} is not a server; pass a command ('python server.py'), "
                "a URL ('http://127.0.0.1:8000/mcp'), either after 'NAME='"
            )
        name = None
        head, sep, rest = text.partition("=")
        if sep and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", head.strip()):
            name, text = head.strip(), rest.strip()
        if text.startswith(("http://", "https://")):
            return cls(text=text, name=name, url=text)
        try:
            argv = shlex.split(text)
        except ValueError as exc:
            raise InvalidArgument(f"mcp_servers: the command {text!r} cannot be split ({exc})")
        if not argv:
            raise InvalidArgument(f"mcp_servers: {text!r} holds no command")
        return cls(text=text, name=name, url=None, argv=argv)

    def target(self, env: dict[str, str] | None) -> Any:
        if self.url is not None:
            return self.url
        from mcp.client.stdio import stdio_client

        # The transport itself, which every mcp 2.x Client takes (later ones also take the
        # parameters alone).
        params = mcp.StdioServerParameters(command=self.argv[0], args=self.argv[1:], env=env)
        return stdio_client(params)


class Server:
    """One server's connection: a task of its own holds the SDK's client (whose context
    must be entered and left in one task), and calls are made on it from any task."""

    def __init__(self, spec: ServerSpec, env: dict[str, str] | None = None) -> None:
        self.spec = spec
        self.env = env
        self.name = spec.name or ""
        self.client: Any = None  # mcp.Client, while connected
        self.generation = 0  # connections made so far: a restart is made once per loss
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._lock = asyncio.Lock()

    async def start(self) -> list[Any]:
        """Connect, and list the server's tools; BroodError naming the server otherwise."""
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[list[Any]] = loop.create_future()
        self._stop = asyncio.Event()
        self._task = asyncio.ensure_future(self._hold(ready))
        try:
            return await asyncio.wait_for(asyncio.shield(ready), MCP_START_TIMEOUT)
        except BaseException as exc:
            await self.stop()
            if isinstance(exc, TimeoutError):
                raise BroodError(
                    f"MCP server {self.spec.text!r} did not answer within {MCP_START_TIMEOUT:g} s "
                    "of its start; check that it speaks MCP (stdio or streamable HTTP)"
                ) from None
            if isinstance(exc, Exception):
                raise BroodError(
                    f"MCP server {self.spec.text!r} did not start: {_leaf(exc)}; check the "
                    "command or URL (mcp_servers=[...], --mcp CMD|URL)"
                ) from None
            raise

    async def _hold(self, ready: asyncio.Future[list[Any]]) -> None:
        try:
            async with mcp.Client(self.spec.target(self.env)) as client:
                tools: list[Any] = []
                cursor = None
                while True:
                    page = await client.list_tools(cursor=cursor)
                    tools += page.tools
                    cursor = getattr(page, "next_cursor", None)
                    if not cursor:
                        break
                if not self.name:
                    info = client.server_info
                    self.name = _word(getattr(info, "name", "") or _fallback_name(self.spec))
                self.client = client
                self.generation += 1
                ready.set_result(tools)
                await self._stop.wait()
        except Exception as exc:
            if not ready.done():
                ready.set_exception(exc)
        finally:
            self.client = None
            if not ready.done():
                ready.set_exception(BroodError("the connection ended before it was ready"))

    async def stop(self) -> None:
        """Close the connection (the SDK stops the process it started: stdin closed, then
        SIGTERM, then SIGKILL), or cancel it after MCP_STOP_TIMEOUT. How it ended is not
        raised here: it is stopped either way."""
        self._stop.set()
        task, self._task = self._task, None
        if task is None:
            return
        done, _ = await asyncio.wait({task}, timeout=MCP_STOP_TIMEOUT)
        if not done:
            task.cancel()
            await asyncio.wait({task}, timeout=MCP_STOP_TIMEOUT)
        if task.done() and not task.cancelled():
            task.exception()  # retrieved, so asyncio does not log it as lost

    async def restart(self, lost: int) -> None:
        """Connect again, once for the connection numbered `lost` (calls that found it
        gone together restart it once)."""
        async with self._lock:
            if self.generation != lost and self.client is not None:
                return  # another call restarted it meanwhile
            await self.stop()
            try:
                await self.start()
            except BroodError as exc:
                raise ToolError(
                    f"the MCP server {self.name} was gone and could not be started again: {exc}",
                    tool=self.name,
                ) from None


@dataclass(frozen=True)
class RemoteTool:
    server: Server
    remote: str  # the tool's name on its server
    schema: dict[str, Any]
    info: ToolInfo


class McpServers:
    """The MCP servers of one supervisor and their tools (a ToolBox's `RemoteTools`)."""

    def __init__(
        self,
        specs: list[str],
        *,
        env: dict[str, str] | None = None,
        timeout: float = DEFAULT_TOOL_TIMEOUT,
    ) -> None:
        """`env` is added to the environment of the commands it starts (the SDK's default:
        HOME, PATH, USER and a few more, never this process's whole environment)."""
        self.servers = [Server(ServerSpec.parse(s), env) for s in specs]
        self.timeout = timeout
        self.tools: dict[str, RemoteTool] = {}
        self.infos: list[ToolInfo] = []

    async def start(self, reserved: frozenset[str]) -> None:
        """Connect to every server and list its tools; on a failure, close those
        connected and raise BroodError naming the server."""
        try:
            for server in self.servers:
                for t in await server.start():
                    self._add(server, t, reserved)
        except BaseException:
            await self.aclose()
            raise
        names = [s.name for s in self.servers]
        if len(set(names)) != len(names):
            await self.aclose()
            raise InvalidArgument(
                f"MCP servers share a name ({names}); name them: mcp_servers=['NAME=CMD', ...]"
            )

    def _add(self, server: Server, t: Any, reserved: frozenset[str]) -> None:
        name = _word(f"{server.name}_{t.name}")
        if name in self.tools or name in reserved:
            raise InvalidArgument(
                f"MCP tool {t.name!r} of server {server.name!r} would be {name!r}, a name the "
                "REPL already has; name the server otherwise (mcp_servers=['NAME=CMD'])"
            )
        schema = dict(getattr(t, "input_schema", None) or {"type": "object"})
        doc = (getattr(t, "description", None) or "").strip()
        info = ToolInfo(name=name, signature=signature_text(schema), doc=doc[:4000])
        self.tools[name] = RemoteTool(server, t.name, schema, info)
        self.infos.append(info)

    def arguments(self, name: str, args: list[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
        """Positional arguments by the schema's order of properties, then checked against
        the schema (InvalidArgument names the tool and the argument)."""
        t = self.tools[name]
        props = list((t.schema.get("properties") or {}).keys())
        if len(args) > len(props):
            raise InvalidArgument(
                f"tool {name}{t.info.signature}: takes {len(props)} arguments, {len(args)} "
                "were given"
            )
        arguments = dict(zip(props, args, strict=False))
        for k, v in kwargs.items():
            if k in arguments:
                raise InvalidArgument(f"tool {name}{t.info.signature}: {k!r} is given twice")
            arguments[k] = v
        check_schema(name, t, arguments)
        return arguments

    async def call(self, name: str, arguments: dict[str, Any]) -> Any:
        t = self.tools[name]
        server = t.server
        for attempt in (1, 2):
            seen = server.generation
            client = server.client
            try:
                if client is None:
                    raise MCPError(CONNECTION_CLOSED, "not connected")
                result = await client.call_tool(
                    t.remote, arguments, read_timeout_seconds=self.timeout
                )
            except MCPError as exc:
                if exc.code != CONNECTION_CLOSED:
                    raise ToolError(
                        f"tool {name}: the MCP server {server.name} answered an error: "
                        f"{exc.message}",
                        tool=name,
                    ) from None
                if attempt == 2:
                    raise ToolError(
                        f"tool {name}: the MCP server {server.name} ({server.spec.text}) was "
                        "gone again after it was started again; check the server (its log "
                        "is on the supervisor's stderr)",
                        tool=name,
                    ) from None
                await server.restart(seen)
                continue
            return _result(name, result)
        raise AssertionError("unreachable")  # pragma: no cover

    async def aclose(self) -> None:
        for server in self.servers:
            await server.stop()


def signature_text(schema: dict[str, Any]) -> str:
    """A JSON schema of arguments as a Python signature: "(city: str, days: int = 3)"."""
    props: dict[str, Any] = schema.get("properties") or {}
    required = set(schema.get("required") or ())
    parts = []
    for pname, sub in props.items():
        text = f"{pname}: {_type_of(sub)}"
        if pname not in required:
            text += f" = {sub.get('default')!r}" if isinstance(sub, dict) else " = None"
        parts.append(text)
    return f"({', '.join(parts)})"


def check_schema(name: str, t: RemoteTool, arguments: dict[str, Any]) -> None:
    """The arguments against the tool's schema: required ones, unknown ones, and types."""
    props: dict[str, Any] = t.schema.get("properties") or {}
    missing = [p for p in t.schema.get("required") or () if p not in arguments]
    if missing:
        raise InvalidArgument(f"tool {name}{t.info.signature}: missing the argument {missing[0]!r}")
    if t.schema.get("additionalProperties") is not True:
        unknown = [k for k in arguments if k not in props]
        if unknown:
            raise InvalidArgument(f"tool {name}{t.info.signature}: no argument {unknown[0]!r}")
    try:
        import jsonschema
    except ImportError:  # the server checks them too
        return
    validator = jsonschema.Draft202012Validator(t.schema)
    error = next(iter(validator.iter_errors(arguments)), None)
    if error is not None:
        where = ".".join(str(p) for p in error.absolute_path) or "its arguments"
        raise InvalidArgument(
            f"tool {name}{t.info.signature}: argument {where!r}: {error.message}; pass a "
            "value of that type"
        )


def _result(name: str, result: Any) -> Any:
    """A tool's result as JSON: its structured content (unwrapped from {"result": ...}),
    else its text; ToolError when the server says the tool failed."""
    texts = []
    for block in getattr(result, "content", None) or ():
        text = getattr(block, "text", None)
        if text is not None:
            texts.append(text)
        else:
            kind = getattr(block, "mime_type", None) or getattr(block, "type", "content")
            texts.append(f"[{kind}]")
    if getattr(result, "is_error", False):
        raise ToolError(f"tool {name} failed: {' '.join(texts) or 'no reason given'}", tool=name)
    structured = getattr(result, "structured_content", None)
    if structured is not None:
        if isinstance(structured, dict) and structured.keys() == {"result"}:
            return structured["result"]
        return structured
    return "\n".join(texts)


def _type_of(sub: Any) -> str:
    if not isinstance(sub, dict):
        return "Any"
    if "anyOf" in sub or "oneOf" in sub:
        return " | ".join(_type_of(s) for s in sub.get("anyOf") or sub.get("oneOf") or ())
    kind = sub.get("type")
    if isinstance(kind, list):
        return " | ".join(JSON_TYPES.get(k, "Any") for k in kind)
    text = JSON_TYPES.get(str(kind), "Any")
    if text == "list" and isinstance(sub.get("items"), dict):
        text = f"list[{_type_of(sub['items'])}]"
    return text


def _word(text: str) -> str:
    word = WORD.sub("_", text).strip("_").lower() or "mcp"
    return word if not word[0].isdigit() else f"mcp_{word}"


def _fallback_name(spec: ServerSpec) -> str:
    if spec.url is not None:
        return spec.url.split("//", 1)[1].split("/", 1)[0].split(":", 1)[0]
    last = spec.argv[-1].rsplit("/", 1)[-1]
    return last.rsplit(".", 1)[0]


def _leaf(exc: BaseException) -> str:
    """The first error an exception group holds, as text."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"


__all__ = ["McpServers", "ServerSpec", "signature_text"]

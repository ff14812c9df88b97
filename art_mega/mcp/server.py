"""Connections to an MCP server, over stdio (a command art-mega starts) or streamable HTTP (a URL),
through the `mcp` SDK (the `mcp` extra, imported at the first connection): list its tools and
resources, call its tools.

`StdioServer` / `HttpServer` say where the server is (frozen, validated); `connect(server)` opens
one session (`McpSession`) for as long as its `async with` block runs; `list_tools(server)` and
`list_resources(server)` open one for a single listing.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, field_validator

from art_mega.errors import MCPServerError, MissingExtraError, UserError
from art_mega.mcp.types import MCPResource, MCPTool

NonEmpty = Annotated[str, StringConstraints(min_length=1)]


class StdioServer(BaseModel):
    """An MCP server that art-mega starts as a child process and talks to on its stdin/stdout.

    Attributes:
        command: the program, e.g. "npx" or "/usr/bin/python3" (looked up on PATH).
        args: its arguments.
        env: variables set for it on top of the MCP SDK's safe default environment (HOME, PATH,
            ...; the rest of this process's environment is not passed on).
        cwd: its working directory (None: this process's).
        timeout_s: seconds a start, a listing or a tool call may take, > 0.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    command: NonEmpty
    args: tuple[str, ...] = ()
    env: dict[str, str] | None = None
    cwd: str | None = None
    timeout_s: float = Field(default=60.0, gt=0, allow_inf_nan=False)

    def describe(self) -> str:
        """The command line, shell-quoted."""
        return shlex.join([self.command, *self.args])


class HttpServer(BaseModel):
    """An MCP server already running behind a streamable-HTTP endpoint.

    Attributes:
        url: the endpoint, e.g. "http://127.0.0.1:8000/mcp" (http or https).
        headers: sent with every request (e.g. {"Authorization": "Bearer ..."}).
        timeout_s: seconds a connection, a listing or a tool call may take, > 0.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    url: NonEmpty
    headers: dict[str, str] = Field(default_factory=dict)
    timeout_s: float = Field(default=60.0, gt=0, allow_inf_nan=False)

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError(
                f"{value!r} is not an http:// or https:// URL; use e.g. 'http://127.0.0.1:8000/mcp'"
            )
        return value

    def describe(self) -> str:
        return self.url


McpServer = StdioServer | HttpServer
"""Where an MCP server is: a command to start, or a URL to reach."""


@dataclass(frozen=True)
class ToolResult:
    """What one tool call returned.

    Attributes:
        text: the result as the policy reads it (see `result_text`).
        is_error: the server reported the call as failed (unknown tool, bad arguments, the
            tool raised); `text` then holds the server's reason.
    """

    text: str
    is_error: bool


def check_server(where: str, server: Any) -> McpServer:
    """`server` when it is a `StdioServer` or an `HttpServer`.

    Raises:
        UserError: anything else (a URL string, a dict, an SDK object), named with `where`.
    """
    if not isinstance(server, StdioServer | HttpServer):
        raise UserError(
            f"{where}(server={server!r}) is a {type(server).__name__}; pass "
            "art_mega.mcp.StdioServer(command=..., args=[...]) or art_mega.mcp.HttpServer(url=...)"
        )
    return server


def _sdk(feature: str) -> Any:
    try:
        import mcp
    except ImportError:
        raise MissingExtraError(feature, "mcp", "mcp") from None
    return mcp


def result_text(result: Any) -> str:
    """An MCP `CallToolResult` as one text: its text blocks joined by newlines; a block that is
    not text (an image, audio, an embedded resource, a resource link) as a one-line JSON note of
    its type and size, so the policy sees that it was there; the structured content as JSON
    when there are no blocks at all."""
    parts = []
    for block in result.content:
        kind = getattr(block, "type", type(block).__name__)
        if kind == "text":
            parts.append(block.text)
        elif kind in ("image", "audio"):
            parts.append(
                json.dumps({"type": kind, "mime_type": block.mime_type, "base64_chars": len(block.data)})
            )
        elif kind == "resource":
            contents = block.resource
            text = getattr(contents, "text", None)
            parts.append(
                text
                if isinstance(text, str)
                else json.dumps(
                    {"type": "resource", "uri": str(contents.uri), "mime_type": contents.mime_type}
                )
            )
        elif kind == "resource_link":
            parts.append(json.dumps({"type": "resource_link", "uri": str(block.uri), "name": block.name}))
        else:
            parts.append(json.dumps({"type": kind}))
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content))
    return "\n".join(parts)


class McpSession:
    """One open session with an MCP server (made by `connect`), usable while its `async with`
    block runs.

    Attributes:
        server: the server it talks to.
    """

    def __init__(self, server: McpServer, session: Any) -> None:
        self.server = server
        self._session = session

    async def _ask(self, action: str, call: Any) -> Any:
        import anyio

        try:
            with anyio.fail_after(self.server.timeout_s):
                return await call
        except TimeoutError:
            raise MCPServerError(
                self.server.describe(), action, f"no answer in {self.server.timeout_s:g} s"
            ) from None
        except Exception as exc:  # the SDK's McpError, a broken stream, a refused connection
            raise MCPServerError(self.server.describe(), action, _reason(exc)) from exc

    async def list_tools(self) -> list[MCPTool]:
        """Every tool the server lists (all pages), in its order.

        Raises:
            MCPServerError: the server failed, did not answer within `timeout_s`, or listed a
                tool without a name.
        """
        tools: list[MCPTool] = []
        cursor = None
        while True:
            page = await self._ask("listing its tools", self._session.list_tools(params=self._page(cursor)))
            for tool in page.tools:
                if not tool.name:
                    raise MCPServerError(self.server.describe(), "listing its tools", "a tool has no name")
                try:
                    listed = MCPTool(
                        name=tool.name, description=tool.description or "", parameters=dict(tool.input_schema)
                    )
                except ValidationError as exc:  # e.g. an inputSchema that is not an object schema
                    detail = f"tool {tool.name!r}: {exc.errors()[0]['msg']}"
                    raise MCPServerError(self.server.describe(), "listing its tools", detail) from None
                tools.append(listed)
            cursor = page.next_cursor
            if cursor is None:
                return tools

    async def list_resources(self) -> list[MCPResource]:
        """Every resource the server lists (all pages). A server without resources lists none.

        Raises:
            MCPServerError: the server failed or did not answer within `timeout_s`.
        """
        resources: list[MCPResource] = []
        cursor = None
        while True:
            page = await self._ask(
                "listing its resources", self._session.list_resources(params=self._page(cursor))
            )
            resources.extend(
                MCPResource(
                    uri=str(r.uri), name=r.name, description=r.description or "", mime_type=r.mime_type
                )
                for r in page.resources
            )
            cursor = page.next_cursor
            if cursor is None:
                return resources

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        """Call tool `name` with `arguments`. A failure the server reports (an unknown tool,
        arguments its schema refuses, the tool raising) is a `ToolResult` with `is_error`.

        Raises:
            MCPServerError: the session failed (the server exited, the connection broke) or the
                call took more than `timeout_s`.
        """
        from mcp.shared.exceptions import MCPError
        from mcp.types import INVALID_PARAMS

        try:
            result = await self._ask(f"calling tool {name!r}", self._session.call_tool(name, arguments))
        except MCPServerError as exc:
            cause = exc.__cause__
            # MCP answers an unknown tool or refused arguments with a JSON-RPC "invalid params"
            # error (some servers with an is_error result instead): the policy's mistake, which
            # it reads as the tool's answer; any other error is the server's
            if isinstance(cause, MCPError) and cause.code == INVALID_PARAMS:
                return ToolResult(cause.message, True)
            raise
        return ToolResult(result_text(result), bool(result.is_error))

    def _page(self, cursor: str | None) -> Any:
        if cursor is None:
            return None
        from mcp.types import PaginatedRequestParams

        return PaginatedRequestParams(cursor=cursor)


def _reason(exc: BaseException) -> str:
    """One line for `exc`; an exception group (anyio's) by its first leaf."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


@asynccontextmanager
async def connect(server: McpServer) -> AsyncIterator[McpSession]:
    """Open a session with `server` (start its process, or reach its URL, and initialize MCP);
    closed, and a started process stopped, when the block ends.

    Raises:
        MissingExtraError: the `mcp` package is not installed.
        MCPServerError: the server could not be started or reached, or did not initialize
            within `timeout_s`.
        UserError: `server` is not a `StdioServer` or an `HttpServer`.
    """
    check_server("art_mega.mcp.connect", server)
    _sdk("art_mega.mcp.connect")
    import anyio
    from mcp import ClientSession

    opened = False
    raised: BaseException | None = None  # by the caller's block
    try:
        async with AsyncExitStack() as stack:
            if isinstance(server, StdioServer):
                from mcp import StdioServerParameters
                from mcp.client.stdio import stdio_client

                parameters = StdioServerParameters(
                    command=server.command, args=list(server.args), env=server.env, cwd=server.cwd
                )
                read, write = await stack.enter_async_context(stdio_client(parameters))
            else:
                import httpx2
                from mcp.client.streamable_http import streamable_http_client

                http = await stack.enter_async_context(
                    httpx2.AsyncClient(headers=server.headers, timeout=server.timeout_s)
                )
                read, write = await stack.enter_async_context(
                    streamable_http_client(server.url, http_client=http)
                )
            session = await stack.enter_async_context(ClientSession(read, write))
            # only the handshake is timed: a cancel scope around the transports' task groups,
            # which stay open after it, would not nest (anyio refuses that)
            with anyio.fail_after(server.timeout_s):
                await session.initialize()
            opened = True
            try:
                yield McpSession(server, session)
            except BaseException as exc:
                raised = exc
                raise
    except Exception as exc:
        # The transports' task groups wrap what crosses them in an ExceptionGroup: the
        # caller's own exception (re-raised as it was: the transport errors met while unwinding
        # follow from it), or a transport task's failure (a refused connection, a server that
        # exited), which cancels the code awaiting it: before the session opened the
        # connection failed, after it the session did.
        if raised is exc:
            raise
        if raised is not None:
            raise raised  # noqa: B904 (its own cause and traceback stay as the caller made them)
        if not opened and isinstance(exc, TimeoutError):
            raise MCPServerError(
                server.describe(), "connecting", f"not initialized in {server.timeout_s:g} s"
            ) from None
        action = "closing the session" if opened else "connecting"
        raise MCPServerError(server.describe(), action, _reason(exc)) from exc


async def list_tools(server: McpServer) -> list[MCPTool]:
    """`server`'s tools, through a session opened for this listing (see `connect`).

    Raises:
        MissingExtraError, MCPServerError: see `connect` and `McpSession.list_tools`.
    """
    async with connect(server) as session:
        return await session.list_tools()


async def list_resources(server: McpServer) -> list[MCPResource]:
    """`server`'s resources, through a session opened for this listing (see `connect`).

    Raises:
        MissingExtraError, MCPServerError: see `connect` and `McpSession.list_resources`.
    """
    async with connect(server) as session:
        return await session.list_resources()

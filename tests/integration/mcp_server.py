"""A small MCP server for the tests, written with the `mcp` SDK: two tools and one resource.

The numbers `add` takes are bounded (0-99), so a random model whose arguments are constrained
to the schema (a strict tool) writes them in a few tokens.

Run it as `python -m tests.integration.mcp_server stdio` (the MCP session on stdin/stdout) or
`python -m tests.integration.mcp_server http PORT` (streamable HTTP on 127.0.0.1:PORT/mcp).
Every tool call is appended as one JSON line to the file named by `$MCP_TEST_CALLS` (when set),
so a test can see which calls reached the server and with what arguments.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Annotated

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import Field

CAPITALS = {"france": "Paris", "japan": "Tokyo", "kenya": "Nairobi"}

server = MCPServer("art-mega-test", log_level="WARNING")


def _record(tool: str, arguments: dict) -> None:
    path = os.environ.get("MCP_TEST_CALLS")
    if path:
        with open(path, "a") as calls:
            calls.write(json.dumps({"tool": tool, "arguments": arguments}) + "\n")


@server.tool()
def add(a: Annotated[int, Field(ge=0, le=99)], b: Annotated[int, Field(ge=0, le=99)]) -> int:
    """Add two whole numbers from 0 to 99 and return their sum."""
    _record("add", {"a": a, "b": b})
    return a + b


@server.tool()
def capital(country: str) -> str:
    """The capital city of a country (France, Japan or Kenya)."""
    _record("capital", {"country": country})
    try:
        return CAPITALS[country.strip().lower()]
    except KeyError:
        raise ToolError(f"no capital known for {country!r}") from None


@server.resource("notes://countries", name="countries", description="The countries capital() knows.")
def countries() -> str:
    return ", ".join(sorted(CAPITALS))


if __name__ == "__main__":
    if sys.argv[1:] == ["stdio"]:
        server.run("stdio")
    elif len(sys.argv) == 3 and sys.argv[1] == "http":
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        sys.exit("usage: python -m tests.integration.mcp_server stdio | http PORT")

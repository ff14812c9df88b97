"""MCP•RL: train a policy to use the tools of an MCP (Model Context Protocol) server.

ART's `art.mcp` names (`MCPTool`, `MCPResource`, `GeneratedScenario`,
`GeneratedScenarioCollection`, `complete_task_tool`, `generate_scenarios`) plus art-mega's
connection and rollout helpers: `StdioServer` / `HttpServer` (where the server is), `connect`
(an `McpSession`), `list_tools` / `list_resources`, and `rollout_with_tools` (a multi-turn,
tool-using rollout recorded as a `Trajectory`). Connections need the `mcp` extra; it is imported
at the first one, so importing this package does not need it.
"""

from art_mega.mcp.default_tools import complete_task_tool
from art_mega.mcp.generate_scenarios import generate_scenarios
from art_mega.mcp.rollout import rollout_with_tools
from art_mega.mcp.server import (
    HttpServer,
    McpServer,
    McpSession,
    StdioServer,
    ToolResult,
    connect,
    list_resources,
    list_tools,
)
from art_mega.mcp.types import GeneratedScenario, GeneratedScenarioCollection, MCPResource, MCPTool

__all__ = [
    "GeneratedScenario",
    "GeneratedScenarioCollection",
    "HttpServer",
    "MCPResource",
    "MCPTool",
    "McpServer",
    "McpSession",
    "StdioServer",
    "ToolResult",
    "complete_task_tool",
    "connect",
    "generate_scenarios",
    "list_resources",
    "list_tools",
    "rollout_with_tools",
]

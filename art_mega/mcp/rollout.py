"""A rollout of a policy on an MCP server: the server's tools offered as OpenAI tools, the
policy's tool calls executed on the server, the whole exchange kept in a `Trajectory`.

Each turn is one chat completion through `model.openai_client()`; its `Choice` (token ids and
logprobs, so `backend.train` trains it as sampled) is appended, then one `tool` message per tool
call with what the server answered. A call the policy gets wrong (a tool not offered, arguments
that are not a JSON object, arguments the server refuses, a tool that fails) is answered with the
error text, as a tool result the policy reads, and counted in `metrics["tool_errors"]`; a server
that fails is `MCPServerError`. The rollout ends at a turn without tool calls, after a turn that
calls `complete_task`, or after `max_turns` turns. The reward is left at 0.0 for the caller (or
RULER) to set.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from art_mega.errors import UserError
from art_mega.hyperparams import bool_problem, check, json_finite_problem, whole_problem
from art_mega.inference.replies import checked_reply
from art_mega.mcp.default_tools import complete_task_tool
from art_mega.mcp.server import HttpServer, McpSession, StdioServer, check_server, connect
from art_mega.mcp.types import GeneratedScenario, MCPTool
from art_mega.trajectories import Trajectory

SYSTEM_PROMPT = (
    "You are an agent with tools. Work on the user's task by calling the tools; read each "
    "result before your next step. When the task is done, call complete_task with a short "
    "report of what you did and what you found."
)
"""The default system message (art-mega's own text); `system_prompt=None` sends none."""

RESERVED_OPTIONS = ("model", "messages", "tools", "tool_choice", "n", "stream")
"""Request fields the rollout sets itself (one choice per turn, not streamed), refused in
`completion_options`."""


def _task(scenario: Any) -> tuple[str, dict[str, Any]]:
    if isinstance(scenario, GeneratedScenario):
        return scenario.task, {"task": scenario.task, "difficulty": scenario.difficulty}
    if isinstance(scenario, str) and scenario.strip():
        return scenario, {"task": scenario}
    raise UserError(
        f"rollout_with_tools(scenario={scenario!r}) is a {type(scenario).__name__}; pass a "
        "GeneratedScenario or the task as a non-empty string"
    )


def _check(max_turns: Any, completion_options: Any, tools: Any) -> dict[str, Any]:
    check("rollout_with_tools", "max_turns", max_turns, whole_problem(1), "10")
    if not isinstance(completion_options, dict | None):
        raise UserError(
            f"rollout_with_tools(completion_options={completion_options!r}) is a "
            f"{type(completion_options).__name__}; pass a dict such as {{'max_tokens': 256}}"
        )
    options = dict(completion_options or {})
    check("rollout_with_tools", "completion_options", options, json_finite_problem, "{'temperature': 1.0}")
    reserved = [key for key in RESERVED_OPTIONS if key in options]
    if reserved:
        raise UserError(
            f"rollout_with_tools(completion_options=...) sets {reserved[0]!r}, which the rollout "
            "sets itself; leave it out (tool_choice is an argument of its own)"
        )
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, MCPTool) for t in tools)):
        raise UserError(
            "rollout_with_tools(tools=...) must be a list of MCPTool (e.g. from "
            "art_mega.mcp.list_tools), or None for every tool the server lists"
        )
    return options


def _check_tool_choice(tool_choice: Any) -> None:
    """Refuse a tool_choice the chat API does not take (the server would answer HTTP 400 on the
    first turn, after the MCP session was opened)."""
    if tool_choice in ("auto", "required", "none"):
        return
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        function = tool_choice.get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str) and function["name"]:
            return
    raise UserError(
        f"rollout_with_tools(tool_choice={tool_choice!r}) is not a tool choice; pass 'auto', "
        "'required', 'none' or {'type': 'function', 'function': {'name': '<tool>'}}"
    )


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


async def rollout_with_tools(
    model: Any,
    server: StdioServer | HttpServer | McpSession,
    scenario: GeneratedScenario | str,
    *,
    max_turns: int = 10,
    system_prompt: str | None = SYSTEM_PROMPT,
    tools: list[MCPTool] | None = None,
    offer_complete_task: bool = True,
    tool_choice: str | dict[str, Any] = "auto",
    strict_tools: bool = False,
    completion_options: dict[str, Any] | None = None,
) -> Trajectory:
    """Run `model` on `scenario`'s task with the tools of an MCP server.

    Args:
        model: an `art_mega.Model` or `TrainableModel` (registered): its `openai_client()` and
            `get_inference_name()` serve every turn.
        server: a `StdioServer` / `HttpServer` (a session is opened for this rollout and closed
            after it) or an open `McpSession` (shared, left open).
        scenario: a `GeneratedScenario` or the task text; the user message.
        max_turns: chat completions at most, >= 1.
        system_prompt: the system message, None for none.
        tools: the tools offered (None: every tool the server lists).
        offer_complete_task: also offer `complete_task_tool`; a call to it ends the rollout and
            its summary becomes `metadata["summary"]`.
        tool_choice: the requests' tool_choice ("auto", "required", "none", or
            {"type": "function", "function": {"name": ...}}).
        strict_tools: mark every offered tool `strict` (OpenAI's flag: the server constrains a
            call's arguments to the tool's schema; vLLM does so by guided decoding).
        completion_options: more request fields (max_tokens, temperature, extra_body, ...), not
            the ones in `RESERVED_OPTIONS`.

    Returns:
        The trajectory: messages_and_choices (system, user, then per turn the Choice and its
        tool results), `tools` (the OpenAI schemas offered), metadata `task` (and `difficulty`,
        `summary`), metrics `turns`, `tool_calls`, `tool_errors` and `completed` (1 when
        complete_task was called, else 0), reward 0.0.

    Raises:
        UserError, HyperParameterError: an argument out of range or of the wrong type.
        MCPServerError: the server could not be reached or failed during the rollout.
        ReplicaRequestError, NoReplicaUpError: a turn's request failed (trainable models).
        CompletionReplyError: a turn's reply has no choices, or a choice without its message
            (or with content or tool calls not of their types).
    """
    task, metadata = _task(scenario)
    options = _check(max_turns, completion_options, tools)
    check("rollout_with_tools", "strict_tools", strict_tools, bool_problem, "True")
    check("rollout_with_tools", "offer_complete_task", offer_complete_task, bool_problem, "True")
    _check_tool_choice(tool_choice)
    if system_prompt is not None and not isinstance(system_prompt, str):
        raise UserError(
            f"rollout_with_tools(system_prompt={system_prompt!r}) is a {type(system_prompt).__name__}; "
            "pass the system message as a string, or None for none"
        )
    turns = _Turns(max_turns, system_prompt, tools, offer_complete_task, tool_choice, strict_tools, options)
    if isinstance(server, McpSession):
        _check_model(model)
        return await turns.run(model, server, task, metadata)
    checked = check_server("rollout_with_tools", server)
    _check_model(model)  # before the server starts: without it the first turn fails after the start
    async with connect(checked) as session:
        return await turns.run(model, session, task, metadata)


def _check_model(model: Any) -> None:
    from art_mega.model import Model

    if not isinstance(model, Model):
        raise UserError(
            f"rollout_with_tools(model=...) is a {type(model).__name__}, not an art.Model; pass the "
            "(registered) model whose policy runs the rollout"
        )


@dataclass(frozen=True)
class _Turns:
    """The checked settings of one `rollout_with_tools` call."""

    max_turns: int
    system_prompt: str | None
    tools: list[MCPTool] | None
    offer_complete_task: bool
    tool_choice: str | dict[str, Any]
    strict_tools: bool
    options: dict[str, Any]

    def schemas(self, offered: list[MCPTool]) -> list[dict[str, Any]]:
        schemas = [tool.to_tool_schema() for tool in offered]
        if self.strict_tools:
            for schema in schemas:
                schema["function"]["strict"] = True
        return schemas

    async def run(self, model: Any, session: McpSession, task: str, metadata: dict[str, Any]) -> Trajectory:
        offered = list(self.tools) if self.tools is not None else await session.list_tools()
        if self.offer_complete_task and all(t.name != complete_task_tool.name for t in offered):
            offered.append(complete_task_tool)
        by_name = {tool.name: tool for tool in offered}
        schemas = self.schemas(offered)
        messages: list[Any] = []
        if self.system_prompt is not None:
            messages.append({"role": "system", "content": self.system_prompt})
        messages.append({"role": "user", "content": task})
        trajectory = Trajectory(messages_and_choices=messages, tools=schemas, metadata=metadata)
        counts = {"turns": 0, "tool_calls": 0, "tool_errors": 0, "completed": 0}
        client = model.openai_client()
        name = model.get_inference_name()
        for _ in range(self.max_turns):
            reply = await client.chat.completions.create(
                model=name,
                messages=trajectory.messages(),
                tools=schemas,
                tool_choice=self.tool_choice,
                **self.options,
            )
            choice = checked_reply(reply, f"server {client.base_url}", name).choices[0]
            trajectory.messages_and_choices.append(choice)
            counts["turns"] += 1
            calls = choice.message.tool_calls or []
            for call in calls:
                counts["tool_calls"] += 1
                text, failed = await _answer(session, by_name, call, trajectory)
                counts["tool_errors"] += failed
                trajectory.messages_and_choices.append(
                    {"role": "tool", "tool_call_id": call.id, "content": text}
                )
            if not calls or "summary" in trajectory.metadata:
                break
        counts["completed"] = int("summary" in trajectory.metadata)
        trajectory.metrics.update(counts)
        return trajectory


async def _answer(
    session: McpSession, tools: dict[str, MCPTool], call: Any, trajectory: Trajectory
) -> tuple[str, bool]:
    """(the tool message's text, whether the call failed) for one of the policy's tool calls."""
    function = getattr(call, "function", None)
    name = getattr(function, "name", None)
    if name not in tools:
        return f"error: there is no tool named {name!r}; the tools are {', '.join(sorted(tools))}", True
    raw = function.arguments or "{}"
    try:
        # parse_constant: Python's json reads NaN/Infinity, which JSON (and a tool's schema) has not
        arguments = json.loads(raw, parse_constant=_no_constant)
    except ValueError as exc:
        return f"error: the arguments of {name} are not JSON ({exc})", True
    if not isinstance(arguments, dict):
        return f"error: the arguments of {name} must be a JSON object, not {raw}", True
    if name == complete_task_tool.name:
        summary = arguments.get("summary")
        if not isinstance(summary, str):
            return "error: complete_task needs a 'summary' string", True
        trajectory.metadata["summary"] = summary
        return "The task is marked complete.", False
    result = await session.call_tool(name, arguments)
    return result.text, result.is_error

"""ART's `generate_scenarios`: ask an LLM for training tasks that an MCP server's tools can solve.

The generator is any OpenAI-compatible chat endpoint (OpenRouter by default, as in ART; the run's
own replica through `model.inference_base_url`, or any vLLM server). The reply is constrained to a
JSON schema (`response_format` json_schema: exactly `num_scenarios` objects of a task and a
difficulty 1-5), so even a small local model's reply parses; a reply that still does not fit is
refused with one sentence (`ScenarioGenerationError`), never repaired or padded.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

from pydantic import ValidationError

from art_mega.errors import ScenarioGenerationError, UserError, format_validation_error
from art_mega.hyperparams import bool_problem, check, json_finite_problem, optional, whole_problem
from art_mega.inference.replies import reply_problem
from art_mega.mcp.types import GeneratedScenario, GeneratedScenarioCollection, MCPResource, MCPTool

logger = logging.getLogger(__name__)

PROMPT = """You write practice tasks for an AI agent that works through the tools of an MCP \
(Model Context Protocol) server.

The server offers these tools:
{tools}

and these resources:
{resources}

Write {n} different tasks a real user could hand this agent. Rules:
- The tools above must be enough to finish every task; do not name the tools in the task.
- Mix easy tasks (one tool call) with harder ones (several calls whose results build on each other).
- Cover different tools and different combinations of them.
- Each task asks the agent to finish with a short report of what it did and what it found.
- Rate each task's difficulty from 1 (a single call) to 5 (long multi-step work).

Answer with a JSON object {{"scenarios": [...]}} holding exactly {n} objects, each with a "task" \
(string) and a "difficulty" (integer 1-5)."""
"""The generator's prompt (art-mega's own text): `tools` and `resources` are JSON lists, `n` the
number of scenarios; `custom_instructions` follow it in a paragraph of their own."""


def response_schema(num_scenarios: int, task_max_length: int | None = None) -> dict[str, Any]:
    """The JSON schema the reply is constrained to: {"scenarios": exactly `num_scenarios` objects
    {"task": string (of at most `task_max_length` characters when set), "difficulty": 1-5}}."""
    task: dict[str, Any] = {"type": "string", "minLength": 1}
    if task_max_length is not None:
        task["maxLength"] = task_max_length
    return {
        "type": "object",
        "properties": {
            "scenarios": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "task": task,
                        "difficulty": {"type": "integer", "minimum": 1, "maximum": 5},
                    },
                    "required": ["task", "difficulty"],
                    "additionalProperties": False,
                },
                "minItems": num_scenarios,
                "maxItems": num_scenarios,
            }
        },
        "required": ["scenarios"],
        "additionalProperties": False,
    }


def _tool_dicts(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise UserError(
            f"generate_scenarios(tools=...) is a {type(tools).__name__}; pass a list of MCPTool "
            "(from art_mega.mcp.list_tools) or of {'name', 'description', 'parameters'} dicts"
        )
    return [_tool(tool, i).to_dict() for i, tool in enumerate(tools)]


def _tool(tool: Any, index: int) -> MCPTool:
    """An `MCPTool`, its dict, or the `mcp` SDK's own `Tool` (what `ClientSession.list_tools()`
    lists: `name`, `description`, `input_schema`) as an `MCPTool`."""
    if isinstance(tool, MCPTool):
        return tool
    if not isinstance(tool, dict) and hasattr(tool, "name") and hasattr(tool, "input_schema"):
        tool = {
            "name": tool.name,
            "description": getattr(tool, "description", None) or "",
            "parameters": tool.input_schema,
        }
    return _validated(MCPTool, tool, "tools", index)


def _resource_dicts(resources: Any) -> list[dict[str, Any]]:
    if resources is None:
        return []
    if not isinstance(resources, list):
        raise UserError(
            f"generate_scenarios(resources=...) is a {type(resources).__name__}; pass a list of "
            "MCPResource (from art_mega.mcp.list_resources) or of {'uri', 'name', ...} dicts"
        )
    return [
        (r if isinstance(r, MCPResource) else _validated(MCPResource, r, "resources", i)).to_dict()
        for i, r in enumerate(resources)
    ]


def _validated(cls: Any, item: Any, argument: str, index: int) -> Any:
    if not isinstance(item, dict):
        raise UserError(
            f"generate_scenarios({argument}[{index}]) is a {type(item).__name__}; pass a "
            f"{cls.__name__} or a dict of its fields"
        )
    try:
        return cls.from_dict(item)
    except ValidationError as exc:
        raise UserError(f"generate_scenarios({argument}[{index}]): {format_validation_error(exc)}") from None


async def generate_scenarios(
    tools: list[MCPTool] | list[dict[str, Any]],
    resources: list[MCPResource] | list[dict[str, Any]] | None = None,
    num_scenarios: int = 24,
    show_preview: bool = True,
    custom_instructions: str | None = None,
    generator_model: str = "openai/gpt-4.1-mini",
    generator_api_key: str | None = None,
    generator_base_url: str = "https://openrouter.ai/api/v1",
    *,
    max_completion_tokens: int = 8000,
    task_max_length: int | None = None,
    extra_body: dict[str, Any] | None = None,
) -> GeneratedScenarioCollection:
    """`num_scenarios` training tasks for the tools (and resources) of an MCP server, written by
    `generator_model` in one chat completion (ART's arguments and defaults).

    Args:
        tools: the server's tools (`MCPTool`s, their dicts or the `mcp` SDK's `Tool`s); with
            `resources`, at least one.
        resources: its resources (`MCPResource`s or their dicts), None or [] for none.
        num_scenarios: how many tasks, >= 1.
        show_preview: print the difficulty distribution and the first 5 tasks.
        custom_instructions: more instructions appended to the prompt.
        generator_model, generator_base_url: the chat model and its OpenAI-compatible endpoint.
        generator_api_key: its key; None reads OPENROUTER_API_KEY.
        max_completion_tokens: the reply's token budget, >= 1 (ART's 8000; lower it for a model
            whose context is short: the prompt and the budget must fit in it).
        task_max_length: when set (>= 1), the schema caps each task at that many characters
            (for a small model whose strings would otherwise run to the token budget).
        extra_body: extra request fields for the endpoint (e.g. vLLM's
            {"structured_outputs": {...}} options); None sends none.

    Returns:
        The tasks in the generator's order.

    Raises:
        UserError: no tools and no resources, a tool or resource that is not one, no API key.
        HyperParameterError: `num_scenarios`, `max_completion_tokens` or `task_max_length` out of range.
        ScenarioGenerationError: the request failed, or the reply is empty, not JSON, not
            exactly `num_scenarios` scenarios, or holds a scenario that is not a task with a
            difficulty 1-5.
    """
    from openai import AsyncOpenAI

    started = time.perf_counter()
    check("generate_scenarios", "num_scenarios", num_scenarios, whole_problem(1), "24")
    check("generate_scenarios", "max_completion_tokens", max_completion_tokens, whole_problem(1), "8000")
    check("generate_scenarios", "task_max_length", task_max_length, optional(whole_problem(1)), "200")
    check("generate_scenarios", "show_preview", show_preview, bool_problem, "False")
    check("generate_scenarios", "extra_body", extra_body, json_finite_problem, "{'top_k': 20}")
    tools_info = _tool_dicts(tools)
    resources_info = _resource_dicts(resources)
    if not tools_info and not resources_info:
        raise UserError(
            "generate_scenarios needs at least one tool or resource; pass tools=await "
            "art_mega.mcp.list_tools(server)"
        )
    if generator_api_key is None:
        generator_api_key = os.environ.get("OPENROUTER_API_KEY")
        if not generator_api_key:
            raise UserError(
                "generate_scenarios(generator_api_key=None) reads OPENROUTER_API_KEY, which is not "
                "set; pass generator_api_key='...' or set OPENROUTER_API_KEY"
            )

    prompt = PROMPT.format(
        tools=json.dumps(tools_info, indent=2),
        resources=json.dumps(resources_info, indent=2) if resources_info else "(none)",
        n=num_scenarios,
    )
    if custom_instructions:
        prompt += f"\n\nFollow these instructions as well:\n\n{custom_instructions}"
    logger.info(
        "generating %d scenarios for %d tool(s) and %d resource(s) with %s",
        num_scenarios,
        len(tools_info),
        len(resources_info),
        generator_model,
    )
    client = AsyncOpenAI(api_key=generator_api_key, base_url=generator_base_url, max_retries=0)
    try:
        response = await client.chat.completions.create(
            model=generator_model,
            messages=[{"role": "user", "content": prompt}],
            max_completion_tokens=max_completion_tokens,
            response_format={
                "type": "json_schema",
                "json_schema": {
                    "name": "scenario_list",
                    "schema": response_schema(num_scenarios, task_max_length),
                },
            },
            extra_body=extra_body,
        )
    except Exception as exc:  # the openai SDK's APIError family and connection errors
        raise ScenarioGenerationError(
            generator_model, f"the request to {generator_base_url} failed ({type(exc).__name__}: {exc})"
        ) from exc
    finally:
        await client.close()
    collection = parse_scenarios(response, generator_model, num_scenarios)
    if show_preview:
        collection.print_difficulty_distribution()
        collection.preview(n=min(5, num_scenarios))
    logger.info("generated %d scenarios in %.2f s", len(collection), time.perf_counter() - started)
    return collection


def parse_scenarios(response: Any, model: str, num_scenarios: int) -> GeneratedScenarioCollection:
    """The scenarios of a chat completion `response` whose content is {"scenarios": [...]}.

    Raises:
        ScenarioGenerationError: no choice, a choice without its message
            (`inference.replies.reply_problem`) or without content, a reply cut at the token
            budget, text that is not that JSON object, not exactly `num_scenarios` scenarios, or a scenario
            that is not {"task": non-empty string, "difficulty": integer 1-5}.
    """
    from pydantic import ValidationError

    problem = reply_problem(response)
    if problem is not None:
        raise ScenarioGenerationError(model, f"the generator answered with {problem}")
    choice = response.choices[0]
    content = choice.message.content
    if not content:
        raise ScenarioGenerationError(model, "the reply has no content")
    if choice.finish_reason == "length":
        raise ScenarioGenerationError(
            model,
            f"the reply was cut at the token budget after {len(content)} characters; raise "
            "max_completion_tokens, lower num_scenarios or set task_max_length",
        )
    try:
        # strict=False: a control character (a tab, a newline) inside a string is kept; guided
        # decoding lets a small model write one there, and the task text is still the task
        data = json.loads(content, strict=False)
    except ValueError as exc:
        raise ScenarioGenerationError(model, f"the reply is not JSON ({exc}): {content[:200]!r}") from None
    scenarios = data.get("scenarios") if isinstance(data, dict) else None
    if not isinstance(scenarios, list):
        raise ScenarioGenerationError(
            model, f'the reply is not a JSON object {{"scenarios": [...]}}: {content[:200]!r}'
        )
    if len(scenarios) != num_scenarios:
        raise ScenarioGenerationError(model, f"the reply has {len(scenarios)} scenarios, not {num_scenarios}")
    parsed = []
    for i, item in enumerate(scenarios):
        try:
            parsed.append(GeneratedScenario.model_validate(item))
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "the scenario"
            raise ScenarioGenerationError(
                model, f"scenario {i} ({json.dumps(item)[:200]}): {where}: {first['msg']}"
            ) from None
    return GeneratedScenarioCollection(parsed)

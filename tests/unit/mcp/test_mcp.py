"""`art_mega.mcp` without a server or a model: ART's types, the scenario reply's parsing (real
openai `ChatCompletion` objects), the tool-result text, and every refused argument (one sentence
naming it)."""

from __future__ import annotations

import json

import pytest
from openai.types.chat import ChatCompletion
from pydantic import ValidationError

from art_mega.agent.ports import free_port
from art_mega.errors import HyperParameterError, ScenarioGenerationError, UserError
from art_mega.mcp import (
    GeneratedScenario,
    GeneratedScenarioCollection,
    MCPResource,
    MCPTool,
    complete_task_tool,
    generate_scenarios,
    rollout_with_tools,
)
from art_mega.mcp.generate_scenarios import parse_scenarios, response_schema

TOOL = MCPTool(name="add", description="Add.", parameters={"type": "object", "properties": {}})


def completion(content: str | None, finish_reason: str = "stop") -> ChatCompletion:
    return ChatCompletion.model_validate(
        {
            "id": "c",
            "object": "chat.completion",
            "created": 0,
            "model": "gen",
            "choices": [
                {
                    "index": 0,
                    "finish_reason": finish_reason,
                    "message": {"role": "assistant", "content": content},
                }
            ],
        }
    )


def test_tools_and_resources_take_arts_dicts() -> None:
    tool = MCPTool.from_dict({"name": "add", "description": "Add.", "parameters": {"type": "object"}})
    assert tool.to_tool_schema() == {
        "type": "function",
        "function": {"name": "add", "description": "Add.", "parameters": {"type": "object"}},
    }
    assert MCPTool.from_dict({"name": "x"}).to_dict() == {"name": "x", "description": "", "parameters": {}}
    with pytest.raises(ValidationError, match="name"):
        MCPTool.from_dict({"description": "no name"})
    resource = MCPResource.from_dict({"uri": "notes://a", "name": "a", "mimeType": "text/plain"})
    assert resource.mime_type == "text/plain"
    assert resource.to_dict() == {
        "uri": "notes://a",
        "name": "a",
        "description": "",
        "mimeType": "text/plain",
    }
    assert MCPResource.from_dict({"uri": "u", "name": "n", "mime_type": "x"}).mime_type == "x"
    assert complete_task_tool.to_tool_schema()["function"]["parameters"]["required"] == ["summary"]


@pytest.mark.parametrize("difficulty", [0, 6, True, "3", 2.0])
def test_a_difficulty_outside_1_to_5_is_refused(difficulty: object) -> None:
    with pytest.raises(ValidationError, match="difficulty"):
        GeneratedScenario(task="t", difficulty=difficulty)


def test_collection_helpers() -> None:
    collection = GeneratedScenarioCollection.from_dicts(
        [{"task": "a" * 130, "difficulty": 1}, {"task": "b", "difficulty": 5}, {"task": "c", "difficulty": 5}]
    )
    assert collection[0].preview() == "a" * 120 + "…" and collection[1].preview() == "b"
    assert GeneratedScenarioCollection.from_json(collection.to_json()).to_dicts() == collection.to_dicts()
    assert len(GeneratedScenarioCollection.from_json(json.dumps(collection.to_dicts()))) == 3
    train, val = collection.split(2)
    assert [s.task for s in val] == ["c"] and len(train) == 2
    assert [s.task for s in collection.filter_by_difficulty(5, 5)] == ["b", "c"]
    assert collection.get_difficulty_distribution() == {1: 1, 5: 2}
    assert collection.get_summary() == {
        "total_scenarios": 3,
        "difficulty_distribution": {1: 1, 5: 2},
        "avg_difficulty": 11 / 3,
        "avg_task_length": 44.0,
    }
    assert [s.task for s in collection.shuffle(seed=3)] == [s.task for s in collection.shuffle(seed=3)]
    assert sorted(s.task for s in collection.shuffle()) == sorted(s.task for s in collection)
    assert GeneratedScenarioCollection([]).get_summary()["avg_difficulty"] == 0


def test_collection_refusals() -> None:
    collection = GeneratedScenarioCollection([GeneratedScenario(task="t", difficulty=1)])
    with pytest.raises(HyperParameterError, match=r"split\(train_size=2\) is more than the 1 scenarios"):
        collection.split(2)
    with pytest.raises(HyperParameterError, match=r"split\(train_size=-1\) must be a whole number"):
        collection.split(-1)
    with pytest.raises(UserError, match="the text is not JSON"):
        GeneratedScenarioCollection.from_json("{")
    with pytest.raises(
        UserError, match=r"expected \{\"scenarios\": \[...\]\} or a JSON list of scenarios, got a JSON dict"
    ):
        GeneratedScenarioCollection.from_json('{"tasks": []}')


def test_the_reply_schema_asks_for_exactly_n_bounded_scenarios() -> None:
    schema = response_schema(3, task_max_length=40)["properties"]["scenarios"]
    assert (schema["minItems"], schema["maxItems"]) == (3, 3)
    assert schema["items"]["properties"]["task"] == {"type": "string", "minLength": 1, "maxLength": 40}
    assert "maxLength" not in response_schema(3)["properties"]["scenarios"]["items"]["properties"]["task"]


def test_a_reply_with_the_scenarios_parses() -> None:
    reply = completion(json.dumps({"scenarios": [{"task": "sum 2 and 3", "difficulty": 1}]}))
    (scenario,) = parse_scenarios(reply, "gen", 1)
    assert (scenario.task, scenario.difficulty) == ("sum 2 and 3", 1)


@pytest.mark.parametrize(
    ("content", "finish", "sentence"),
    [
        (None, "stop", "scenario generator gen: the reply has no content"),
        ('{"scenarios": [', "length", "the reply was cut at the token budget after 15 characters; raise"),
        ("not json", "stop", "the reply is not JSON (Expecting value"),
        ('[{"task": "t", "difficulty": 1}]', "stop", 'the reply is not a JSON object {"scenarios": [...]}'),
        ('{"scenarios": []}', "stop", "the reply has 0 scenarios, not 1"),
        ('{"scenarios": [{"task": "t", "difficulty": 9}]}', "stop", "scenario 0 ("),
        (
            '{"scenarios": [{"task": "", "difficulty": 1}]}',
            "stop",
            ": task: String should have at least 1 character",
        ),
    ],
)
def test_a_reply_that_does_not_fit_is_one_sentence(content: str | None, finish: str, sentence: str) -> None:
    with pytest.raises(ScenarioGenerationError) as info:
        parse_scenarios(completion(content, finish), "gen", 1)
    assert sentence in str(info.value) and "\n" not in str(info.value)
    assert info.value.model == "gen" and info.value.exit_code == 1


async def test_generate_scenarios_refusals(monkeypatch: pytest.MonkeyPatch) -> None:
    args = {"generator_api_key": "k", "generator_base_url": "http://127.0.0.1:9/v1"}
    with pytest.raises(
        HyperParameterError, match=r"generate_scenarios\(num_scenarios=0\) must be a whole number"
    ):
        await generate_scenarios([TOOL], num_scenarios=0, **args)
    with pytest.raises(HyperParameterError, match=r"max_completion_tokens=0"):
        await generate_scenarios([TOOL], max_completion_tokens=0, **args)
    with pytest.raises(HyperParameterError, match=r"task_max_length=0"):
        await generate_scenarios([TOOL], task_max_length=0, **args)
    with pytest.raises(UserError, match="needs at least one tool or resource"):
        await generate_scenarios([], [], **args)
    with pytest.raises(UserError, match=r"generate_scenarios\(tools=...\) is a MCPTool; pass a list"):
        await generate_scenarios(TOOL, **args)  # type: ignore[arg-type]
    with pytest.raises(UserError, match=r"generate_scenarios\(tools\[0\]\): .*name"):
        await generate_scenarios([{"description": "no name"}], **args)
    with pytest.raises(UserError, match=r"generate_scenarios\(resources\[0\]\) is a str"):
        await generate_scenarios([TOOL], ["notes://a"], **args)  # type: ignore[list-item]
    monkeypatch.delenv("OPENROUTER_API_KEY", raising=False)
    with pytest.raises(UserError, match="reads OPENROUTER_API_KEY, which is not set"):
        await generate_scenarios([TOOL], generator_base_url="http://127.0.0.1:9/v1")


async def test_a_generator_that_is_down_is_one_sentence() -> None:
    url = f"http://127.0.0.1:{free_port()}/v1"
    with pytest.raises(
        ScenarioGenerationError, match=rf"gen: the request to {url} failed \(APIConnectionError"
    ):
        await generate_scenarios([TOOL], generator_model="gen", generator_api_key="k", generator_base_url=url)


@pytest.mark.parametrize(
    ("kwargs", "sentence"),
    [
        ({"scenario": ""}, "rollout_with_tools(scenario='') is a str; pass a GeneratedScenario"),
        ({"max_turns": 0}, "rollout_with_tools(max_turns=0) must be a whole number of at least 1"),
        ({"completion_options": {"tools": []}}, "sets 'tools', which the rollout sets itself"),
        (
            {"completion_options": "fast"},
            "rollout_with_tools(completion_options='fast') is a str; pass a dict",
        ),
        ({"tools": [{"name": "add"}]}, "rollout_with_tools(tools=...) must be a list of MCPTool"),
        ({"strict_tools": "yes"}, "rollout_with_tools(strict_tools='yes') must be True or False"),
        ({"system_prompt": ["be brief"]}, "rollout_with_tools(system_prompt=['be brief']) is a list; pass"),
        (
            {"server": "http://127.0.0.1:1/mcp"},
            "rollout_with_tools(server='http://127.0.0.1:1/mcp') is a str",
        ),
    ],
)
async def test_rollout_refusals(kwargs: dict, sentence: str) -> None:
    arguments = {"model": None, "server": None, "scenario": "add 1 and 2", **kwargs}
    if "server" not in kwargs:
        from art_mega.mcp import StdioServer

        arguments["server"] = StdioServer(command="never-started")
    with pytest.raises(UserError) as info:
        await rollout_with_tools(**arguments)
    assert sentence in str(info.value)


def test_tool_results_become_one_text() -> None:
    pytest.importorskip("mcp", reason="needs the mcp extra")
    from mcp.types import CallToolResult, ImageContent, TextContent

    from art_mega.mcp.server import result_text

    both = CallToolResult(
        content=[TextContent(text="42"), ImageContent(data="QUJD", mime_type="image/png")], is_error=False
    )
    assert result_text(both) == '42\n{"type": "image", "mime_type": "image/png", "base64_chars": 4}'
    assert result_text(CallToolResult(content=[], structured_content={"result": 5})) == '{"result": 5}'


def test_generate_scenarios_takes_the_sdks_own_tools() -> None:
    pytest.importorskip("mcp", reason="needs the mcp extra")
    from mcp.types import Tool

    from art_mega.mcp.generate_scenarios import _tool_dicts

    sdk = Tool(name="add", description=None, input_schema={"type": "object", "required": ["a"]})
    assert _tool_dicts([sdk, TOOL]) == [
        {"name": "add", "description": "", "parameters": {"type": "object", "required": ["a"]}},
        TOOL.to_dict(),
    ]

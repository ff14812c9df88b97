"""Hostile inputs to art_mega.mcp (no server or policy runs): tool schemas that are not object
schemas, a tool_choice the chat API does not take, tool-call arguments with NaN/Infinity (not
JSON), and switches that are not bools."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from art_mega.errors import HyperParameterError, UserError
from art_mega.mcp import MCPTool, generate_scenarios, rollout_with_tools
from art_mega.mcp.rollout import _answer
from art_mega.trajectories import Trajectory

ADD = MCPTool(name="add", description="Add.", parameters={"type": "object", "properties": {}})


@pytest.mark.parametrize(
    "schema", [{"type": "string"}, {"type": "array", "items": {}}, {"type": ["object", "null"]}]
)
def test_a_tool_whose_arguments_are_not_an_object_schema_is_refused(schema):
    with pytest.raises(ValidationError, match="a tool's parameters must be an object schema"):
        MCPTool(name="odd", parameters=schema)


def test_odd_but_object_schemas_are_kept_as_given():
    nested = {
        "type": "object",
        "properties": {"point": {"type": "object", "properties": {"x": {"type": "number"}}}},
        "required": ["point"],
    }
    for schema in ({}, {"type": "object"}, {"properties": {"a": {"type": "string"}}}, nested):
        assert MCPTool(name="t", parameters=schema).to_tool_schema()["function"]["parameters"] == schema


@pytest.mark.parametrize(
    ("tool", "said"),
    [
        (SimpleNamespace(name="scalar", description=None, input_schema={"type": "string"}), "object schema"),
        (SimpleNamespace(name="none", description=None, input_schema=None), "parameters"),
    ],
)
def test_generate_scenarios_refuses_an_sdk_tool_with_an_odd_schema_in_one_sentence(tool, said):
    with pytest.raises(UserError) as caught:
        asyncio.run(generate_scenarios([tool], generator_api_key="k"))
    message = str(caught.value)
    assert message.startswith("generate_scenarios(tools[0]): ") and said in message and "\n" not in message


def test_generate_scenarios_refuses_a_show_preview_that_is_not_a_bool():
    with pytest.raises(HyperParameterError) as caught:
        asyncio.run(generate_scenarios([ADD], show_preview="no", generator_api_key="k"))
    assert str(caught.value) == (
        "generate_scenarios(show_preview='no') must be True or False (a str); pass e.g. show_preview=False"
    )


@pytest.mark.parametrize(
    "tool_choice",
    [
        "any",
        "",
        None,
        1,
        {"type": "function"},
        {"type": "function", "function": {}},
        {"function": {"name": "add"}},
    ],
)
def test_rollout_with_tools_refuses_a_tool_choice_before_it_opens_the_server(tool_choice):
    # server=None: the refusal comes before any connection is made
    with pytest.raises(UserError) as caught:
        asyncio.run(rollout_with_tools(None, None, "add 1 and 2", tool_choice=tool_choice))
    assert str(caught.value) == (
        f"rollout_with_tools(tool_choice={tool_choice!r}) is not a tool choice; pass 'auto', 'required', "
        "'none' or {'type': 'function', 'function': {'name': '<tool>'}}"
    )


@pytest.mark.parametrize("raw", ['{"a": NaN}', '{"a": Infinity}', '{"a": [-Infinity]}'])
def test_tool_call_arguments_with_non_finite_numbers_are_answered_as_not_json(raw):
    call = SimpleNamespace(id="c1", function=SimpleNamespace(name="add", arguments=raw))
    # the session is never reached: the arguments are refused first
    text, failed = asyncio.run(_answer(None, {"add": ADD}, call, Trajectory(messages_and_choices=[])))
    assert failed is True
    assert text.startswith("error: the arguments of add are not JSON (") and "is not a JSON number" in text


def test_completion_options_and_extra_body_with_nan_never_reach_a_server():
    with pytest.raises(HyperParameterError) as caught:
        asyncio.run(rollout_with_tools(None, None, "add", completion_options={"temperature": float("nan")}))
    assert str(caught.value) == (
        "rollout_with_tools(completion_options={'temperature': nan}) holds a NaN or infinity, which a JSON "
        "request cannot carry; pass e.g. completion_options={'temperature': 1.0}"
    )
    with pytest.raises(HyperParameterError) as caught:
        asyncio.run(generate_scenarios([ADD], extra_body={"x": [1.0, float("inf")]}, generator_api_key="k"))
    assert str(caught.value).startswith(
        "generate_scenarios(extra_body={'x': [1.0, inf]}) holds a NaN or infinity"
    )


def test_scenario_helpers_refuse_bounds_that_would_slice_or_filter_silently():
    from art_mega.mcp import GeneratedScenario, GeneratedScenarioCollection

    collection = GeneratedScenarioCollection(
        [GeneratedScenario(task="t" * 10, difficulty=d) for d in (1, 3, 5)]
    )
    cases = [
        (
            lambda: collection.preview(n=-1),
            "GeneratedScenarioCollection.preview(n=-1) must be a whole number of at least 0 (below 0)",
        ),
        (
            lambda: collection.preview(max_task_length=0),
            "GeneratedScenarioCollection.preview(max_task_length=0) must be",
        ),
        (lambda: collection[0].preview(max_length=-5), "GeneratedScenario.preview(max_length=-5) must be"),
        (
            lambda: collection.filter_by_difficulty("1"),
            "GeneratedScenarioCollection.filter_by_difficulty(min_difficulty='1') must be",
        ),
        (
            lambda: collection.filter_by_difficulty(True),
            "GeneratedScenarioCollection.filter_by_difficulty(min_difficulty=True) must be",
        ),
        (
            lambda: collection.filter_by_difficulty(1, 6),
            "filter_by_difficulty(max_difficulty=6) is above the highest difficulty 5; pass max_difficulty from 1 to 5",
        ),
        (
            lambda: collection.filter_by_difficulty(4, 2),
            "filter_by_difficulty(min_difficulty=4) is above max_difficulty=2; pass min_difficulty <= max_difficulty",
        ),
    ]
    for call, says in cases:
        with pytest.raises(HyperParameterError) as caught:
            call()
        assert says in str(caught.value) and "\n" not in str(caught.value)
    assert [s.difficulty for s in collection.filter_by_difficulty(3, 5)] == [3, 5]
    assert collection[0].preview(max_length=4) == "tttt…"


def test_rollout_with_tools_refuses_a_model_that_is_not_an_art_model_before_the_server_starts():
    from art_mega.mcp import StdioServer

    server = StdioServer(command="/nonexistent/never-started")
    for model in (None, "policy", object()):
        with pytest.raises(UserError) as caught:
            asyncio.run(rollout_with_tools(model, server, "add 1 and 2"))
        assert str(caught.value) == (
            f"rollout_with_tools(model=...) is a {type(model).__name__}, not an art.Model; pass the "
            "(registered) model whose policy runs the rollout"
        )

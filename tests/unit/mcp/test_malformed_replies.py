"""Completion replies that are not one (no choices, a choice without its message, a body of
another shape), answered with HTTP 200 by a real loopback server this test starts (starlette on
uvicorn): every place art-mega reads a reply (the replicas' policy client, rollout_with_tools,
RULER's judge, the scenario generator, capture_auto_trajectory, wrap_rollout) says so in one
sentence naming the server or model, never an IndexError/AttributeError traceback."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

import art_mega as art
from art_mega.errors import (
    CompletionReplyError,
    LangGraphUsageError,
    RulerJudgeError,
    ScenarioGenerationError,
)
from art_mega.inference.policy_client import policy_client
from art_mega.inference.router import PolicyRouter, ReplicaEndpoint
from art_mega.mcp import MCPTool, StdioServer, generate_scenarios, rollout_with_tools
from art_mega.mcp.server import McpSession
from art_mega.rewards import ruler
from tests.helpers import serve_in_thread

MESSAGE = {"role": "assistant", "content": "fine"}
GOOD_CHOICE = {"index": 0, "finish_reason": "stop", "message": MESSAGE}
NO_CHOICES = "no choices (choices={}) where a list of at least one choice was expected"
NO_MESSAGE = "choices[{}].message={} where the sampled assistant message was expected"

BODIES: dict[str, Any] = {
    "ok": {"choices": [GOOD_CHOICE]},
    "empty": {"choices": []},
    "absent": {"id": "x", "object": "chat.completion"},
    "null": {"choices": None},
    "text-choices": {"choices": "abc"},
    "no-message": {"choices": [{"index": 0, "finish_reason": "stop"}]},
    "null-message": {"choices": [{"index": 0, "finish_reason": "stop", "message": None}]},
    "text-message": {"choices": [{"index": 0, "finish_reason": "stop", "message": "hi"}]},
    "second-without-message": {"choices": [GOOD_CHOICE, {"index": 1, "finish_reason": "stop"}]},
    "number-content": {"choices": [{"index": 0, "message": {"role": "assistant", "content": 7}}]},
    "text-tool-calls": {
        "choices": [{"index": 0, "message": {"role": "assistant", "content": None, "tool_calls": "call"}}]
    },
    "list": [1, 2],
    "plain": "proxy error",  # served as text/plain
    "no-text": {"choices": [{"index": 0, "finish_reason": "stop"}]},  # for /v1/completions
    "odd-finish": {"choices": [{"index": 0, "finish_reason": "exploded", "message": MESSAGE}]},
}
"""Each reply body by the model name a request asks for."""

CHAT_PROBLEMS = {
    "empty": NO_CHOICES.format("[]"),
    "absent": NO_CHOICES.format("None"),
    "null": NO_CHOICES.format("None"),
    "text-choices": NO_CHOICES.format("'abc'"),
    "no-message": NO_MESSAGE.format(0, "None"),
    "null-message": NO_MESSAGE.format(0, "None"),
    "text-message": NO_MESSAGE.format(0, "'hi'"),
    "second-without-message": NO_MESSAGE.format(1, "None"),
    "number-content": "choices[0].message.content=7 where a string (or null beside tool calls) was expected",
    "text-tool-calls": (
        "choices[0].message.tool_calls='call' where a list of tool calls, each with its id and "
        "function, was expected"
    ),
    "list": "a list ([1, 2]) where a chat completion with choices was expected",
    "plain": "a str ('proxy error') where a chat completion with choices was expected",
}


async def _answer(request: Request) -> Response:
    body = await request.json()
    shape = BODIES[body["model"]]
    if isinstance(shape, str):
        return PlainTextResponse(shape)
    if isinstance(shape, dict):
        shape = {"id": "r", "object": "chat.completion", "created": 0, "model": body["model"], **shape}
    return JSONResponse(shape)


async def _anthropic_messages(request: Request) -> Response:
    # the shape of Anthropic's /v1/messages reply: a messages-list request, no choices
    return JSONResponse(
        {"id": "m", "type": "message", "role": "assistant", "content": [{"type": "text", "text": "hi"}]}
    )


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    """The loopback server's base URL, http://127.0.0.1:PORT/v1."""
    app = Starlette(
        routes=[
            Route("/v1/chat/completions", _answer, methods=["POST"]),
            Route("/v1/completions", _answer, methods=["POST"]),
            Route("/v1/messages", _anthropic_messages, methods=["POST"]),
        ]
    )
    with serve_in_thread(app) as url:
        yield f"{url}/v1"


def prompted(base_url: str, served_name: str) -> art.Model:
    return art.Model(
        name="policy",
        project="replies",
        inference_base_url=base_url,
        inference_api_key="k",
        inference_model_name=served_name,
    )


USER = [{"role": "user", "content": "hello"}]


@pytest.mark.parametrize("shape", sorted(CHAT_PROBLEMS))
async def test_a_replica_answering_no_chat_completion_is_named_with_what_came_back(server, shape) -> None:
    replica = server.removesuffix("/v1")
    client = policy_client(PolicyRouter("tiny", [ReplicaEndpoint("vllm-0", replica)]), max_retries=0)
    with pytest.raises(CompletionReplyError) as caught:
        await client.chat.completions.create(model=shape, messages=USER)
    assert str(caught.value) == (
        f"replica vllm-0 ({replica}) answered a completion request for model {shape} with {CHAT_PROBLEMS[shape]}"
    )
    assert (caught.value.server, caught.value.model) == (f"replica vllm-0 ({replica})", shape)
    assert caught.value.exit_code == 1 and art.errors.describe(caught.value) == str(caught.value)
    reply = await client.chat.completions.create(model="ok", messages=USER)
    assert reply.choices[0].message.content == "fine" and reply.choices[0].policy_step is None


async def test_a_completions_reply_needs_each_choices_text(server) -> None:
    replica = server.removesuffix("/v1")
    client = policy_client(PolicyRouter("tiny", [ReplicaEndpoint("vllm-0", replica)]), max_retries=0)
    with pytest.raises(CompletionReplyError) as caught:
        await client.completions.create(model="no-text", prompt="hi")
    assert caught.value.detail == "choices[0].text=None where the sampled text (a string) was expected"
    with pytest.raises(CompletionReplyError, match=r"for model empty with no choices \(choices=\[\]\)"):
        await client.completions.create(model="empty", prompt="hi")


@pytest.mark.parametrize("shape", ["empty", "null-message", "plain"])
async def test_rollout_with_tools_names_the_server_of_a_reply_without_choices(server, shape) -> None:
    # the reply is read before any tool call: the session is never asked, so none is opened
    session = McpSession(StdioServer(command="never-started"), None)
    tool = MCPTool(name="add", description="Add.", parameters={"type": "object", "properties": {}})
    with pytest.raises(CompletionReplyError) as caught:
        await rollout_with_tools(prompted(server, shape), session, "add 2 and 3", tools=[tool])
    assert str(caught.value) == (
        f"server {server}/ answered a completion request for model {shape} with {CHAT_PROBLEMS[shape]}"
    )


CONVERSATIONS = [[*USER, {"role": "assistant", "content": f"hi {k}"}] for k in range(2)]


@pytest.mark.parametrize("shape", ["empty", "no-message", "text-choices"])
async def test_ruler_names_the_judge_of_a_reply_without_choices(server, shape) -> None:
    with pytest.raises(RulerJudgeError) as caught:
        await ruler(CONVERSATIONS, prompted(server, shape), cache=False)
    assert str(caught.value) == (
        f"RULER judge {shape} (model 'policy'): the judge answered with {CHAT_PROBLEMS[shape]}"
    )
    assert caught.value.attempts == 1


async def test_a_litellm_judge_is_named_in_one_line(server) -> None:
    pytest.importorskip("litellm")
    params = {"api_base": server, "api_key": "k", "max_retries": 0}
    with pytest.raises(RulerJudgeError) as caught:
        await ruler(CONVERSATIONS, "hosted_vllm/empty", params, cache=False)
    assert (
        str(caught.value)
        == f"RULER judge hosted_vllm/empty: the judge answered with {CHAT_PROBLEMS['empty']}"
    )
    with pytest.raises(RulerJudgeError) as caught:  # LiteLLM's own refusal carries its traceback
        await ruler(CONVERSATIONS, "hosted_vllm/no-message", params, cache=False)
    assert "\n" not in str(caught.value) and "APIConnectionError" in caught.value.detail


@pytest.mark.parametrize("shape", ["absent", "text-message"])
async def test_the_scenario_generator_names_its_model(server, shape) -> None:
    with pytest.raises(ScenarioGenerationError) as caught:
        await generate_scenarios(
            [{"name": "add", "description": "Add.", "parameters": {"type": "object"}}],
            num_scenarios=1,
            show_preview=False,
            generator_model=shape,
            generator_api_key="k",
            generator_base_url=server,
        )
    assert (
        str(caught.value) == f"scenario generator {shape}: the generator answered with {CHAT_PROBLEMS[shape]}"
    )


@pytest.mark.parametrize("shape", ["empty", "no-message", "list"])
async def test_capture_auto_trajectory_refuses_a_turn_it_cannot_read(server, shape) -> None:
    model = prompted(server, shape)

    async def rollout() -> None:
        await model.openai_client().chat.completions.create(model=shape, messages=USER)

    with pytest.raises(CompletionReplyError) as caught:
        await art.capture_auto_trajectory(rollout())
    assert str(caught.value) == (
        f"server {server}/chat/completions answered a completion request for model {shape} with "
        f"{CHAT_PROBLEMS[shape]}"
    )


async def test_capture_auto_trajectory_skips_another_api_that_sends_a_messages_list(server) -> None:
    """A rollout that also calls a non-OpenAI chat API (Anthropic's /v1/messages shape) over httpx
    keeps its chat completions and is not failed by the other API's reply (ART skips it too)."""
    import httpx

    async def rollout() -> None:
        async with httpx.AsyncClient() as client:
            reply = await client.post(f"{server}/messages", json={"model": "claude", "messages": USER})
            assert reply.status_code == 200
        await prompted(server, "ok").openai_client().chat.completions.create(model="ok", messages=USER)

    trajectory = await art.capture_auto_trajectory(rollout())
    assert [type(item).__name__ for item in trajectory.messages_and_choices] == ["dict", "Choice"]
    assert trajectory.additional_histories == []


async def test_capture_auto_trajectory_records_a_readable_turn_and_refuses_a_choice_it_cannot_keep(
    server,
) -> None:
    async def rollout(shape: str) -> None:
        await prompted(server, shape).openai_client().chat.completions.create(model=shape, messages=USER)

    trajectory = await art.capture_auto_trajectory(rollout("ok"))
    assert [type(item).__name__ for item in trajectory.messages_and_choices] == ["dict", "Choice"]
    with pytest.raises(CompletionReplyError) as caught:
        await art.capture_auto_trajectory(rollout("odd-finish"))
    assert caught.value.detail.startswith(
        "choices[0] that is not an OpenAI Choice (finish_reason: Input should be 'stop'"
    )


@pytest.mark.parametrize(("shape", "cause"), [("empty", IndexError), ("no-message", AttributeError)])
async def test_wrap_rollout_names_the_server_where_langchain_fails_on_the_reply(server, shape, cause) -> None:
    pytest.importorskip("langchain_openai", reason="the langgraph extra is not installed")
    from art_mega.langgraph import init_chat_model, wrap_rollout

    async def rollout() -> art.Trajectory:
        await init_chat_model(max_retries=0).ainvoke("hi")
        return art.Trajectory()

    with pytest.raises(LangGraphUsageError) as caught:
        await wrap_rollout(prompted(server, shape), rollout)()
    assert (
        f"(server {server}/chat/completions answered model {shape} with {CHAT_PROBLEMS[shape]}); serve "
        in str(caught.value)
    )
    assert isinstance(caught.value.__cause__, cause)


async def test_a_choice_without_its_message_in_a_trajectory_is_refused_before_training(server) -> None:
    from art_mega.errors import TrainInputError
    from art_mega.trajectories import check_train_groups

    reply = (
        await prompted(server, "null-message")
        .openai_client()
        .chat.completions.create(model="null-message", messages=USER)
    )  # the caller's own client: nothing of art-mega read this reply
    trajectory = art.Trajectory(messages_and_choices=[*USER, reply.choices[0]], reward=1.0)
    with pytest.raises(TrainInputError) as caught:
        check_train_groups([art.TrajectoryGroup([trajectory])])
    assert str(caught.value) == (
        "backend.train(trajectory_groups): trajectory 0 of group 0: messages_and_choices[1] is a "
        "Choice without its message (message=None); append the choice of a reply whose choices "
        "hold their messages"
    )

"""art_mega.langgraph without a server: how recorded completions join into conversations of
sampled Choices, what `wrap_rollout` does with the trajectory a rollout returns, the ChatOpenAI
`init_chat_model` builds, and every refusal (one sentence, exit code 2).

The recording through a real vLLM replica and a GRPO step on it: tests/inference/test_langgraph.py.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest
from openai.types.chat.chat_completion import Choice

import art_mega as art
from art_mega.errors import LangGraphUsageError, MissingExtraError
from art_mega.langgraph import init_chat_model, wrap_rollout
from art_mega.langgraph.rollout import Completion, conversations, current
from art_mega.trajectories import History

pytest.importorskip("langchain_openai", reason="the langgraph extra is not installed")

SYSTEM = {"role": "system", "content": "You look up cities."}
USER = {"role": "user", "content": "Weather in Rome?"}
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]


def choice(content: str | None, call_id: str | None = None, token_ids: tuple[int, ...] = (5, 6)) -> Choice:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if call_id is not None:
        message["tool_calls"] = [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": "lookup", "arguments": '{"city":"rome"}'},
            }
        ]
    return Choice.model_validate(
        {
            "index": 0,
            "message": message,
            "finish_reason": "tool_calls" if call_id else "stop",
            "token_ids": list(token_ids),
            "logprobs": {
                "content": [{"token": str(t), "logprob": -0.5, "top_logprobs": []} for t in token_ids]
            },
        }
    )


def echo(sampled: Choice) -> dict[str, Any]:
    """`sampled` as LangChain sends it back (content None beside tool calls, arguments
    re-serialized from the parsed object)."""
    message: dict[str, Any] = {"role": "assistant", "content": sampled.message.content}
    if sampled.message.tool_calls:
        message["tool_calls"] = [
            {
                "type": "function",
                "id": c.id,
                "function": {"name": c.function.name, "arguments": '{"city": "rome"}'},
            }
            for c in sampled.message.tool_calls
        ]
    return message


def test_a_react_exchange_is_one_conversation_of_sampled_choices() -> None:
    call, answer = choice(None, "call_1"), choice("sunny", token_ids=(7, 8, 9))
    tool_result = {"role": "tool", "content": "rome: sunny", "tool_call_id": "call_1"}
    (history,) = conversations(
        [
            Completion([SYSTEM, USER], TOOLS, [call]),
            Completion([SYSTEM, USER, echo(call), tool_result], TOOLS, [answer]),
        ]
    )
    assert history.messages_and_choices == [SYSTEM, USER, call, tool_result, answer]
    assert history.messages_and_choices[2] is call and history.messages_and_choices[4] is answer
    assert history.tools == TOOLS


def test_other_tools_an_edited_echo_and_extra_choices_start_their_own_conversations() -> None:
    first, second, third = (
        choice("a", token_ids=(1,)),
        choice("b", token_ids=(2,)),
        choice("c", token_ids=(3,)),
    )
    follow_up = {"role": "user", "content": "and Paris?"}
    edited = {"role": "assistant", "content": "a (edited)"}
    structured = choice('{"answer": "x"}', token_ids=(4,))
    extra = choice("d", token_ids=(9,))
    histories = conversations(
        [
            Completion([USER], TOOLS, [first]),
            Completion([USER, echo(first), follow_up], TOOLS, [second, extra]),  # continues; n = 2
            Completion([USER, echo(first), follow_up, edited], TOOLS, [third]),  # not the sampled turn
            Completion([USER, echo(first), follow_up, echo(second)], None, [structured]),  # no tools
        ]
    )
    assert [h.messages_and_choices for h in histories] == [
        [USER, first, follow_up, second],
        [USER, echo(first), follow_up, extra],
        [USER, echo(first), follow_up, edited, third],
        [USER, echo(first), follow_up, echo(second), structured],
    ]
    assert [h.tools for h in histories] == [TOOLS, TOOLS, TOOLS, None]


def prompted_model() -> Any:
    return art.Model(
        name="policy",
        project="langgraph",
        inference_base_url="http://127.0.0.1:9/v1",
        inference_api_key="key-1",
        inference_model_name="served-name",
    )


async def test_wrap_rollout_puts_the_first_conversation_first_and_keeps_the_rest() -> None:
    model = prompted_model()
    call, answer, other = choice(None, "call_1"), choice("done"), choice("aside")
    before = History(messages_and_choices=[{"role": "user", "content": "kept"}])

    async def rollout(question: str) -> art.Trajectory:
        recorder = current("test")
        for messages, tools, sampled in (
            ([USER], TOOLS, call),
            ([USER, echo(call), {"role": "tool", "content": "r", "tool_call_id": "call_1"}], TOOLS, answer),
            ([{"role": "user", "content": question}], None, other),
        ):
            reply = {"id": "x", "object": "chat.completion", "created": 0, "model": "served-name"}
            recorder.record(
                json.dumps({"messages": messages, **({"tools": tools} if tools else {})}).encode(),
                json.dumps({**reply, "choices": [sampled.model_dump(mode="json")]}).encode(),
            )
        return art.Trajectory(
            messages_and_choices=[{"role": "assistant", "content": "replaced"}],
            reward=0.5,
            additional_histories=[before],
        )

    trajectory = await wrap_rollout(model, rollout)("summarise")
    assert trajectory.reward == 0.5 and trajectory.tools == TOOLS
    assert [type(m).__name__ for m in trajectory.messages_and_choices] == ["dict", "Choice", "dict", "Choice"]
    assert [m.message.content for m in trajectory.messages_and_choices if isinstance(m, Choice)] == [
        None,
        "done",
    ]
    assert trajectory.messages_and_choices[1].token_ids == [5, 6]
    assert [h.messages_and_choices[-1].message.content for h in trajectory.additional_histories[1:]] == [
        "aside"
    ]
    assert trajectory.additional_histories[0] == before
    assert "policy_step" not in (
        trajectory.messages_and_choices[1].model_extra or {}
    )  # no backend, no router


async def test_a_rollout_without_completions_returns_its_trajectory_as_it_is() -> None:
    async def rollout() -> art.Trajectory:
        return art.Trajectory(messages_and_choices=[USER], reward=1.0)

    trajectory = await wrap_rollout(prompted_model(), rollout)()
    assert trajectory.messages_and_choices == [USER] and trajectory.additional_histories == []


async def test_init_chat_model_serves_the_wrapped_model_with_what_training_needs() -> None:
    model = prompted_model()

    built: list[Any] = []

    async def rollout() -> art.Trajectory:
        built.extend(
            [init_chat_model(), init_chat_model("other-name", temperature=0.3, max_tokens=8, seed=3)]
        )
        return art.Trajectory()

    await wrap_rollout(model, rollout)()
    default, chosen = built
    assert (default.model_name, default.openai_api_base, default.openai_api_key.get_secret_value()) == (
        "served-name",
        "http://127.0.0.1:9/v1",
        "key-1",
    )
    assert (default.temperature, default.logprobs, default.streaming, default.use_responses_api) == (
        1.0,
        True,
        False,
        False,
    )
    assert default.extra_body == {}  # not a replica: vLLM's return_token_ids is not sent
    assert (chosen.model_name, chosen.temperature, chosen.max_tokens, chosen.seed) == (
        "other-name",
        0.3,
        8,
        3,
    )
    assert default.http_async_client is chosen.http_async_client  # one recording pool per loop


def test_init_chat_model_outside_a_wrapped_rollout_is_refused() -> None:
    with pytest.raises(LangGraphUsageError) as refused:
        init_chat_model()
    assert str(refused.value) == (
        "init_chat_model() was called outside a wrapped rollout; call it inside the rollout you run as "
        "art_mega.langgraph.wrap_rollout(model, rollout)(...), which gives it the model to serve"
    )
    assert refused.value.exit_code == 2 and refused.value.field == "context"


@pytest.mark.parametrize(
    ("args", "kwargs", "field", "says"),
    [
        ((7,), {}, "model", "give the served model name"),
        ((), {"model_provider": "anthropic"}, "model_provider", "served over OpenAI's API"),
        ((), {"configurable_fields": "any"}, "configurable_fields", "no configurable fields"),
        ((), {"config_prefix": "agent"}, "config_prefix", "which this chat model has none of"),
        ((), {"top_k": 20}, "top_k", "extra_body={'top_k': ...}"),
        ((), {"base_url": "http://elsewhere/v1"}, "base_url", "sets it itself"),
        ((), {"http_async_client": None}, "http_async_client", "sets it itself"),
        ((), {"streaming": True}, "streaming", "a streamed reply carries no token ids"),
        ((), {"logprobs": False}, "logprobs", "training needs the sampling logprobs"),
        ((), {"use_responses_api": True}, "use_responses_api", "the Responses API does not"),
        ((), {"extra_body": {"return_token_ids": False}}, "extra_body", "leave return_token_ids out"),
        ((), {"extra_body": "top_k=2"}, "extra_body", "give a dict of server options"),
    ],
)
async def test_init_chat_model_refuses_what_it_cannot_honour(
    args: tuple[Any, ...], kwargs: dict[str, Any], field: str, says: str
) -> None:
    async def rollout() -> art.Trajectory:
        init_chat_model(*args, **kwargs)
        return art.Trajectory()

    with pytest.raises(LangGraphUsageError) as refused:
        await wrap_rollout(prompted_model(), rollout)()
    message = str(refused.value)
    assert message.startswith(f"init_chat_model: {field}=") and says in message, message
    assert "\n" not in message and refused.value.field == field and refused.value.exit_code == 2


async def test_a_model_without_an_endpoint_is_refused() -> None:
    async def rollout() -> art.Trajectory:
        init_chat_model()
        return art.Trajectory()

    unregistered = art.TrainableModel(name="agent", project="langgraph", base_model="tiny-llama")
    with pytest.raises(LangGraphUsageError, match=r"model 'agent' has no endpoint; register it"):
        await wrap_rollout(unregistered, rollout)()


async def test_wrap_rollout_refusals() -> None:
    model = prompted_model()
    with pytest.raises(LangGraphUsageError, match=r"^wrap_rollout's model is a str, not an art.Model"):
        wrap_rollout("policy", lambda: None)
    with pytest.raises(LangGraphUsageError, match=r"^wrap_rollout's fn is a int, not a function"):
        wrap_rollout(model, 3)

    def not_async() -> art.Trajectory:
        return art.Trajectory()

    with pytest.raises(LangGraphUsageError, match=r"not_async returned a Trajectory, not an awaitable"):
        await wrap_rollout(model, not_async)()

    async def returns_a_dict() -> dict[str, Any]:
        return {"reward": 1.0}

    with pytest.raises(LangGraphUsageError, match=r"returns_a_dict returned a dict, not an art.Trajectory"):
        await wrap_rollout(model, returns_a_dict)()

    async def streams() -> art.Trajectory:
        current("test").streamed += 2
        return art.Trajectory()

    with pytest.raises(LangGraphUsageError, match=r"streams streamed 2 chat completion\(s\), whose replies"):
        await wrap_rollout(model, streams)()

    async def unreadable() -> art.Trajectory:
        current("test").record(b'{"messages": []}', b"<html>proxy error</html>")
        return art.Trajectory()

    with pytest.raises(
        LangGraphUsageError, match=r"unreadable got 1 chat completion repl\(ies\) that are not"
    ):
        await wrap_rollout(model, unreadable)()


async def test_a_missing_extra_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "langchain_openai", None)  # what `import` meets without the package

    async def rollout() -> art.Trajectory:
        init_chat_model()
        return art.Trajectory()

    with pytest.raises(MissingExtraError) as missing:
        await wrap_rollout(prompted_model(), rollout)()
    assert str(missing.value) == (
        "art_mega.langgraph.init_chat_model needs the 'langchain-openai' package, which is not installed; "
        "pip install 'art-mega[langgraph]'"
    )

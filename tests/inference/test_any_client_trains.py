"""Any OpenAI-compatible client's completions train: a plain `openai.AsyncOpenAI` at the model's
`inference_base_url`, asking for neither token ids nor logprobs, gets choices that carry both,
the policy step that served them and the sampling settings (the replica's middleware,
art_mega/inference/vllm_plugin/art_mega_vllm_serve.py), under the model's own name (the latest
step), `<name>@<step>` and the base model's name; `backend.train` takes them unchanged.

Uses the session's shared `policy` (tests/inference/conftest.py) and needs it at step 0: this
module sorts before the other modules that train it (LangGraph, MCP, the pipeline, RULER).
"""

from __future__ import annotations

from typing import Any

import pytest

from art_mega.errors import UserError
from art_mega.trajectories import SamplingRecord
from tests.inference.conftest import Policy

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(900)]

MESSAGES = [{"role": "user", "content": "Count: one two three"}]


def plain_client(model: Any) -> Any:
    import openai

    return openai.AsyncOpenAI(
        base_url=model.inference_base_url, api_key=model.inference_api_key, max_retries=0
    )


def check_trainable(choice: Any, step: int | None) -> list[int]:
    """Assert the chat `choice` carries what training reads; its sampled token ids."""
    extra = choice.model_extra
    assert extra["token_ids"] and extra["prompt_token_ids"], extra.keys()
    assert len(choice.logprobs.content) == len(extra["token_ids"])
    assert all(entry.logprob <= 0 for entry in choice.logprobs.content)
    assert extra["policy_step"] == step
    return list(extra["token_ids"])


async def sampled_groups(client: Any, name: str, seed: int) -> tuple[Any, int]:
    """Two groups of two chat completions of `name` (rewards 0 and 1 in each); their sampled tokens."""
    import art_mega as art

    groups, tokens = [], 0
    for g in range(2):
        trajectories = []
        for k in range(2):
            reply = await client.chat.completions.create(
                model=name, messages=MESSAGES, max_tokens=6, temperature=1.0, seed=seed + 10 * g + k
            )
            choice = reply.choices[0]
            tokens += len(choice.model_extra["token_ids"])
            trajectories.append(art.Trajectory(messages_and_choices=[*MESSAGES, choice], reward=float(k)))
        groups.append(art.TrajectoryGroup(trajectories))
    return groups, tokens


async def test_a_plain_client_at_step_0_gets_trainable_choices_under_every_name(policy: Policy) -> None:
    import openai

    backend, model = policy.backend, policy.model
    assert await model.get_step() == 0, "this module must train the shared policy first (see its docstring)"
    client = plain_client(model)

    latest = await client.chat.completions.create(
        model=model.name, messages=MESSAGES, max_tokens=8, temperature=0.7, top_p=0.9, seed=1
    )
    assert latest.model == "policy@0"
    check_trainable(latest.choices[0], 0)
    assert latest.choices[0].model_extra["prompt_token_ids"] == latest.prompt_token_ids
    assert SamplingRecord.of(latest.choices[0]) == SamplingRecord(
        temperature=0.7, top_p=0.9, top_k=0, min_p=0.0, constrained=False, processed=False
    )
    base = await client.chat.completions.create(
        model=model.base_model, messages=MESSAGES, max_tokens=8, seed=1
    )
    check_trainable(base.choices[0], None)
    assert SamplingRecord.of(
        base.choices[0]
    ) == SamplingRecord(  # vLLM's defaults (`--generation-config vllm`)
        temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, constrained=False, processed=False
    )
    greedy = await client.chat.completions.create(
        model=f"{model.name}@0",
        messages=MESSAGES,
        max_tokens=4,
        temperature=0.0,
        frequency_penalty=0.5,
        extra_body={"top_k": 5},
    )
    check_trainable(greedy.choices[0], 0)
    assert SamplingRecord.of(greedy.choices[0]) == SamplingRecord(
        temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, constrained=False, processed=True
    )
    chosen = await client.chat.completions.create(
        model=model.name,
        messages=MESSAGES,
        max_tokens=4,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert chosen.choices[0].message.content in ("yes", "no")
    assert SamplingRecord.of(chosen.choices[0]).constrained is True  # type: ignore[union-attr]

    # the legacy completions API, and a stream: the same fields
    completion = await client.completions.create(model=model.name, prompt="Count: one two", max_tokens=4)
    extra = completion.choices[0].model_extra
    assert extra["token_ids"] and extra["prompt_token_ids"] and extra["policy_step"] == 0
    assert len(completion.choices[0].logprobs.token_logprobs) == len(extra["token_ids"])
    assert SamplingRecord.of(completion.choices[0]).temperature == 1.0  # type: ignore[union-attr]
    stream = await client.chat.completions.create(
        model=model.name, messages=MESSAGES, max_tokens=6, stream=True
    )
    chunks = [chunk async for chunk in stream if chunk.choices]
    streamed = [t for c in chunks for t in c.choices[0].model_extra.get("token_ids") or []]
    assert {c.choices[0].model_extra["policy_step"] for c in chunks} == {0}
    assert chunks[0].choices[0].model_extra["prompt_token_ids"] == latest.prompt_token_ids
    assert (
        len(streamed) == sum(len(c.choices[0].logprobs.content) for c in chunks if c.choices[0].logprobs) > 0
    )

    with pytest.raises(openai.NotFoundError) as info:
        await client.chat.completions.create(model="policy-001@0", messages=MESSAGES, max_tokens=2)
    assert info.value.body["message"] == (  # type: ignore[index]
        "The model `policy-001@0` does not exist on this replica; it serves `policy` (the latest step, "
        "now `policy@0`), `policy@0`, `tiny-llama` (the base model)."
    )

    # step 0 is a fresh LoRA (B = 0): the base model's samples are on-policy, as the bare name's
    named, named_tokens = await sampled_groups(client, model.name, seed=100)
    based, based_tokens = await sampled_groups(client, model.base_model, seed=200)
    result = await backend.train(model, [*named, *based], learning_rate=1e-3)
    print(f"\ntrained {result.metrics['data/step_trainer_tokens']} tokens of {named_tokens} + {based_tokens}")
    assert (
        result.step == 1
        and result.metrics["data/step_trainer_tokens"] == float(named_tokens + based_tokens) > 0
    )


async def test_after_a_step_the_bare_name_serves_it_and_the_base_model_is_stale(policy: Policy) -> None:
    backend, model = policy.backend, policy.model
    step = await model.get_step()
    assert step >= 1
    client = plain_client(model)
    reply = await client.chat.completions.create(model=model.name, messages=MESSAGES, max_tokens=4, seed=3)
    assert reply.model == f"policy@{step}"
    check_trainable(reply.choices[0], step)
    routed = await model.openai_client(max_retries=0).chat.completions.create(
        model=model.get_inference_name(), messages=MESSAGES, max_tokens=4, seed=3
    )  # the client's tag (from the reply's model) and the server's agree
    assert routed.model == reply.model and routed.choices[0].policy_step == step
    assert routed.choices[0].model_extra["token_ids"] == reply.choices[0].model_extra["token_ids"]

    based, _ = await sampled_groups(client, model.base_model, seed=300)
    with pytest.raises(UserError) as info:
        await backend.train(model, based)
    assert f"sampled by the base model, but backend.train expects step {step}" in str(info.value)
    named, tokens = await sampled_groups(client, model.name, seed=400)
    result = await backend.train(model, named, learning_rate=1e-3)
    assert result.step == step + 1 and result.metrics["data/step_trainer_tokens"] == float(tokens)

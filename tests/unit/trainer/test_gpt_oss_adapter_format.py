"""The GPT-OSS adapter's on-disk format (`families/gpt_oss.py` GptOssLoraNames): the experts as
PEFT's `target_parameters` LoRA on transformers' fused `mlp.experts.gate_up_proj` [E, h, 2I]
(gate/up interleaved columns) and `down_proj` [E, I, h], which PEFT 0.21 loads onto
GptOssForCausalLM and vLLM 0.32 reads for its 3-D MoE models
(tests/trainer/test_gpt_oss_family.py loads a trained one in PEFT). Here, without Megatron: the
per-expert tensors the trainer's layers give pack into that layout value by value and unpack back
bit-exactly, the register-time checks (`adapter_layout`, `check_warm_start`,
`check_adapter_config`) take the packed adapter, and partial expert targets are refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from art_mega.basemodels.tiny_gpt_oss import GPT_OSS_TINY
from art_mega.errors import AdapterMismatchError, UserError
from art_mega.trainer import checkpoint as ckpt
from art_mega.trainer.families.gpt_oss import SPEC
from art_mega.trainer.peft_config import check_adapter_config
from art_mega.trainer.peft_io import adapter_config, adapter_layout
from art_mega.trainer.protocol import LoraConfig

torch = pytest.importorskip("torch")

PREFIX = "base_model.model.model.layers"
CONFIG = {**GPT_OSS_TINY, "model_type": "gpt_oss"}
RANK, EXPERTS, HIDDEN, FFN = 4, 4, 64, 32
LORA = LoraConfig(rank=RANK, alpha=8.0, targets=("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"))


def per_expert_tensors() -> dict[str, torch.Tensor]:
    """Seeded per-module tensors as `LoraNames.to_peft` writes them (one A for q/k/v, one for gate/up)."""
    generator = torch.Generator().manual_seed(0)
    out = {}
    for i in range(2):
        attention = {"q_proj": (128, 64), "k_proj": (64, 64), "v_proj": (64, 64), "o_proj": (64, 128)}
        qkv_a = torch.randn(RANK, HIDDEN, generator=generator)  # linear_qkv's one A
        for module, (fan_out, fan_in) in attention.items():
            a = qkv_a if module != "o_proj" else torch.randn(RANK, fan_in, generator=generator)
            out[f"{PREFIX}.{i}.self_attn.{module}.lora_A.weight"] = a
            out[f"{PREFIX}.{i}.self_attn.{module}.lora_B.weight"] = torch.randn(
                fan_out, RANK, generator=generator
            )
        for e in range(EXPERTS):
            expert = f"{PREFIX}.{i}.mlp.experts.{e}"
            shared = torch.randn(RANK, HIDDEN, generator=generator)
            for module in ("gate_proj", "up_proj"):
                out[f"{expert}.{module}.lora_A.weight"] = shared
                out[f"{expert}.{module}.lora_B.weight"] = torch.randn(FFN, RANK, generator=generator)
            out[f"{expert}.down_proj.lora_A.weight"] = torch.randn(RANK, FFN, generator=generator)
            out[f"{expert}.down_proj.lora_B.weight"] = torch.randn(HIDDEN, RANK, generator=generator)
    return out


def test_experts_pack_into_peft_target_parameters_and_back_bit_exactly() -> None:
    names = SPEC.lora
    per_expert = per_expert_tensors()
    packed = names.pack(dict(per_expert))
    layer = f"{PREFIX}.1.mlp.experts"
    gate_up_a, gate_up_b = (
        packed[f"{layer}.base_layer.lora_A.weight"],
        packed[f"{layer}.base_layer.lora_B.weight"],
    )
    down_a, down_b = packed[f"{layer}.lora_A.weight"], packed[f"{layer}.lora_B.weight"]
    assert gate_up_a.shape == (EXPERTS * RANK, HIDDEN) and gate_up_b.shape == (2 * FFN, RANK * EXPERTS)
    assert down_a.shape == (EXPERTS * RANK, FFN) and down_b.shape == (HIDDEN, RANK * EXPERTS)
    # expert 2's delta on HF's gate_up_proj[2] [h, 2I] is (B_2 A_2)^T with B_2 = lora_B columns
    # k * E + 2 (PEFT's ParamWrapper.get_delta_weight); its even columns are gate_proj's, odd up_proj's
    b_2 = gate_up_b[:, 2::EXPERTS]
    delta = (b_2 @ gate_up_a[2 * RANK : 3 * RANK]).t()
    expert = f"{layer}.2"
    gate = per_expert[f"{expert}.gate_proj.lora_B.weight"] @ per_expert[f"{expert}.gate_proj.lora_A.weight"]
    up = per_expert[f"{expert}.up_proj.lora_B.weight"] @ per_expert[f"{expert}.up_proj.lora_A.weight"]
    assert torch.equal(delta[:, 0::2], gate.t()) and torch.equal(delta[:, 1::2], up.t())
    down = per_expert[f"{expert}.down_proj.lora_B.weight"] @ per_expert[f"{expert}.down_proj.lora_A.weight"]
    assert torch.equal(down_b[:, 2::EXPERTS] @ down_a[2 * RANK : 3 * RANK], down)
    config = adapter_config(LORA, "base", names)
    assert config["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    back = names.unpack(packed, config)
    assert back.keys() == per_expert.keys()
    assert all(torch.equal(back[key], value) for key, value in per_expert.items())
    layout = adapter_layout(CONFIG, RANK, config["target_modules"], config["target_parameters"])
    assert layout.shapes == {key: tuple(value.shape) for key, value in packed.items()}
    assert len(layout.shared_a) == 2  # q/k/v's per layer; the experts' A is one packed tensor


def test_register_checks_take_the_packed_adapter(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(CONFIG))
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    packed = SPEC.lora.pack(per_expert_tensors())
    save_file({key: value.clone() for key, value in packed.items()}, adapter / "adapter_model.safetensors")
    config = adapter_config(LORA, str(model), SPEC.lora)
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    ckpt.check_warm_start(adapter, model, str(adapter))
    check_adapter_config(config, adapter, rank=RANK, alpha=8.0, **SPEC.lora.peft_targets(LORA.targets))
    # the per-expert layout (art-mega's earlier GPT-OSS export) names no target_parameters
    old = {
        **config,
        "target_modules": sorted([*config["target_modules"], "gate_proj", "up_proj", "down_proj"]),
    }
    del old["target_parameters"]
    with pytest.raises(AdapterMismatchError) as caught:
        check_adapter_config(old, adapter, rank=RANK, alpha=8.0, **SPEC.lora.peft_targets(LORA.targets))
    assert "target_parameters=[] where the backend's LoRA covers ['mlp.experts.gate_up_proj'" in str(
        caught.value
    )


def test_one_of_the_experts_two_targets_is_refused() -> None:
    with pytest.raises(UserError) as caught:
        SPEC.lora.normalise(["linear_qkv", "linear_fc1"])
    assert str(caught.value) == (
        "LoRA target linear_fc1 needs linear_fc1 and linear_fc2 together on GPT-OSS (vLLM serves its "
        "experts' adapter only as the gate_up_proj / down_proj pair); name both or neither."
    )
    assert SPEC.lora.peft_targets(SPEC.lora.normalise(["q_proj", "k_proj", "v_proj"])) == {
        "target_modules": ["k_proj", "q_proj", "v_proj"]
    }

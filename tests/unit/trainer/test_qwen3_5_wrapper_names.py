"""The LoRA names of Qwen3.5 / Qwen3.6 by checkpoint class (torch-free): the Hub's multimodal
wrappers (model_type "qwen3_5" / "qwen3_5_moe") export under the wrapper's PEFT names
(`base_model.model.model.language_model.layers`, what PEFT on Qwen3_5*ForConditionalGeneration
and vLLM 0.32's classes of that name read), the wrapper MoE's routed experts packed as PEFT's
`target_parameters` tensors (vLLM's 3-D MoE LoRA layout); text-only configs keep
`base_model.model.model.layers` and per-expert names. tests/trainer/test_qwen3_5_wrapper_adapter.py
loads such adapters in PEFT."""

import pytest

from art_mega.errors import UserError
from art_mega.trainer.families import family_for, qwen3_5, qwen3_5_moe
from art_mega.trainer.peft_io import adapter_layout
from tests.trainer.qwen3_5_configs import QWEN3_5_35B_A3B, QWEN3_6_27B

WRAPPER = "base_model.model.model.language_model.layers"
TEXT = "base_model.model.model.layers"
EXPERT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _text_only(config: dict) -> dict:
    """A wrapper config as the text-only model's config.json (transformers' *ForCausalLM save)."""
    return {**config["text_config"], "tie_word_embeddings": config["tie_word_embeddings"]}


@pytest.mark.parametrize("config", [QWEN3_6_27B, QWEN3_5_35B_A3B], ids=["dense", "moe"])
def test_the_prefix_follows_the_checkpoint_class(config: dict) -> None:
    spec = family_for(config)
    wrapper = spec.lora_names(spec.model_args(config))
    text = spec.lora_names(spec.model_args(_text_only(config)))
    assert (wrapper.layer_prefix, text.layer_prefix) == (WRAPPER, TEXT)
    assert (
        wrapper.peft_key("3.self_attn", "q_proj", "lora_A") == f"{WRAPPER}.3.self_attn.q_proj.lora_A.weight"
    )
    assert wrapper.targets == text.targets and wrapper.output_gate and text.output_gate
    layout = adapter_layout(config, 4, ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv"])
    assert layout.shapes and all(key.startswith(WRAPPER + ".") for key in layout.shapes)
    # Qwen3.6-27B: 64 layers, hidden 5120, 24 heads of 256 (q_proj doubled by its output gate)
    if spec is qwen3_5.SPEC:
        assert layout.shapes[f"{WRAPPER}.3.self_attn.q_proj.lora_B.weight"] == (2 * 24 * 256, 4)


def test_the_wrapper_moe_writes_its_experts_packed() -> None:
    spec = family_for(QWEN3_5_35B_A3B)
    names = spec.lora_names(spec.model_args(QWEN3_5_35B_A3B))
    assert names is qwen3_5_moe.WRAPPER_LORA_NAMES and not names.interleave and not names.fused_experts
    targets = names.normalise(EXPERT_TARGETS)
    fields = names.peft_targets(targets)
    assert fields == {
        "target_modules": sorted(EXPERT_TARGETS),
        "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    }
    layout = adapter_layout(QWEN3_5_35B_A3B, 8, **fields)
    # 256 experts of width 512 over hidden 2048, rank 8: gate_up A [E r, h], B [2 I, E r] (PEFT's,
    # vLLM's 3-D layout), down A [E r, I], B [h, E r]; the shared expert (512) per module
    assert layout.shapes[f"{WRAPPER}.0.mlp.experts.base_layer.lora_A.weight"] == (256 * 8, 2048)
    assert layout.shapes[f"{WRAPPER}.0.mlp.experts.base_layer.lora_B.weight"] == (2 * 512, 256 * 8)
    assert layout.shapes[f"{WRAPPER}.39.mlp.experts.lora_A.weight"] == (256 * 8, 512)
    assert layout.shapes[f"{WRAPPER}.39.mlp.experts.lora_B.weight"] == (2048, 256 * 8)
    assert layout.shapes[f"{WRAPPER}.0.mlp.shared_expert.gate_proj.lora_B.weight"] == (512, 8)
    assert not any(".mlp.experts.0." in key for key in layout.shapes)
    assert names.config_modules(fields["target_modules"], fields["target_parameters"]) == [
        *sorted(EXPERT_TARGETS),
        "gate_proj",
        "up_proj",
        "down_proj",
    ]


def test_the_text_moe_keeps_per_expert_names() -> None:
    config = _text_only(QWEN3_5_35B_A3B)
    spec = family_for(config)
    names = spec.lora_names(spec.model_args(config))
    assert names is qwen3_5_moe.TEXT_LORA_NAMES and names.fused_experts == "mlp.experts"
    fields = names.peft_targets(names.normalise(EXPERT_TARGETS))
    assert fields == {"target_modules": sorted(EXPERT_TARGETS)}
    layout = adapter_layout(config, 8, **fields)
    assert layout.shapes[f"{TEXT}.0.mlp.experts.255.gate_proj.lora_A.weight"] == (8, 2048)
    assert not any(".mlp.experts.lora_" in key for key in layout.shapes)


def test_the_wrapper_moe_needs_both_expert_targets() -> None:
    with pytest.raises(UserError, match="needs linear_fc1 and linear_fc2 together on Qwen3.5 MoE"):
        qwen3_5_moe.WRAPPER_LORA_NAMES.normalise(["q_proj", "k_proj", "v_proj", "linear_fc1"])
    with pytest.raises(UserError, match="is not a Qwen3.5 MoE expert parameter"):
        qwen3_5_moe.WRAPPER_LORA_NAMES.config_modules([], ["mlp.experts.up_proj"])

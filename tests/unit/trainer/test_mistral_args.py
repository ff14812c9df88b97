"""HF Mistral config -> the Mistral family's arguments and refusals; the family registry (no torch)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from art_mega.errors import UserError
from art_mega.trainer.families import (
    FAMILIES,
    LORA_NAMES,
    _by_model_type,
    deepseek_v3,
    family_for,
    gemma3,
    gemma4,
    gpt_oss,
    llama,
    mistral,
    qwen3_5,
    qwen3_5_moe,
    qwen3_moe,
)
from art_mega.trainer.families.spec import ParallelLayout

MISTRAL_7B_V03 = {
    "model_type": "mistral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 32,
    "vocab_size": 32768,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 32768,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}
MISTRAL_NEMO = {
    **MISTRAL_7B_V03,
    "hidden_size": 5120,
    "head_dim": 128,
    "num_hidden_layers": 40,
    "vocab_size": 131072,
    "max_position_embeddings": 1024000,
}


def test_mistral_7b_v03_reads_as_a_llama_decoder() -> None:
    args = mistral.model_args(MISTRAL_7B_V03)
    assert family_for(MISTRAL_7B_V03) is mistral.SPEC
    assert args.model_type == "mistral"
    assert (args.num_heads, args.num_query_groups, args.head_dim) == (32, 8, 128)
    assert (args.ffn_hidden_size, args.rope_theta, args.max_position_embeddings) == (14336, 1e6, 32768)
    assert not (args.qkv_bias or args.qk_norm or args.tie_word_embeddings)
    assert args.norm_eps == 1e-5 and args.rope_scaling_factor is None


def test_mistral_nemo_head_dim_is_its_own() -> None:
    args = mistral.model_args(MISTRAL_NEMO)
    assert (args.hidden_size, args.num_heads, args.head_dim) == (5120, 32, 128)


def test_mistral_v01_window_is_on_every_layer() -> None:
    v01 = mistral.model_args({**MISTRAL_7B_V03, "sliding_window": 4096})
    assert v01.sliding_window == 4096 and v01.window_layers == (True,) * 32
    assert dataclasses.replace(v01, sliding_window=None, window_layers=()) == mistral.model_args(
        MISTRAL_7B_V03
    )
    assert mistral.model_args(MISTRAL_7B_V03).window_layers == ()


def test_llama_only_fields_do_not_apply_to_mistral() -> None:
    """HF's Mistral has no attention_bias / mlp_bias / use_sliding_window: stray copies change nothing there."""
    stray = {**MISTRAL_7B_V03, "attention_bias": True, "mlp_bias": True, "use_sliding_window": True}
    assert mistral.model_args(stray) == mistral.model_args(MISTRAL_7B_V03)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported; Llama-family models use 'silu'."),
        (
            {"rope_parameters": {"rope_type": "longrope", "factor": 4.0}},
            "rope_type='longrope' is not supported because it switches between short and long frequency "
            "factors by sequence length; use a checkpoint with rope_type 'default', 'linear', 'llama3' or 'yarn'.",
        ),
        ({"model_type": "llama"}, "model_type='llama' is not a Mistral model (mistral)."),
    ],
)
def test_what_megatron_cannot_express_is_refused(change: dict, message: str) -> None:
    with pytest.raises(UserError) as caught:
        mistral.model_args({**MISTRAL_7B_V03, **change})
    assert str(caught.value) == message


def test_parallel_limits_come_from_the_spec() -> None:
    spec = family_for(MISTRAL_7B_V03)
    args = spec.model_args(MISTRAL_7B_V03)
    assert not spec.expert_parallel
    assert spec.valid_tp_sizes(args) == [1, 2, 4, 8, 16, 32]
    spec.check_parallel(args, ParallelLayout(tp=8))
    with pytest.raises(UserError) as caught:
        spec.check_parallel(args, ParallelLayout(tp=3))
    assert str(caught.value) == (
        "tp=3 cannot split this mistral model (32 attention heads, 8 KV heads, FFN size 14336); "
        "use tp in {1, 2, 4, 8, 16, 32}."
    )


def test_registry_maps_every_model_type_to_its_spec() -> None:
    assert FAMILIES == {
        "llama": llama.SPEC,
        "qwen2": llama.SPEC,
        "qwen3": llama.SPEC,
        "qwen3_moe": qwen3_moe.SPEC,
        "mistral": mistral.SPEC,
        "gemma3_text": gemma3.SPEC,
        "gemma3": gemma3.SPEC,
        "gpt_oss": gpt_oss.SPEC,
        "qwen3_5": qwen3_5.SPEC,
        "qwen3_5_text": qwen3_5.SPEC,
        "qwen3_5_moe": qwen3_5_moe.SPEC,
        "qwen3_5_moe_text": qwen3_5_moe.SPEC,
        "deepseek_v3": deepseek_v3.SPEC,
        "kimi_k2": deepseek_v3.SPEC,
        "gemma4_text": gemma4.SPEC,
        "gemma4": gemma4.SPEC,
    }
    assert qwen3_moe.SPEC.expert_parallel and not llama.SPEC.expert_parallel
    twice = dataclasses.replace(mistral.SPEC, name="copy")
    with pytest.raises(RuntimeError, match="model_type 'mistral' is claimed by mistral and copy"):
        _by_model_type((mistral.SPEC, twice))


def test_shared_lora_names_cover_every_family() -> None:
    assert LORA_NAMES.default_targets == ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
    # Qwen3.5's delta-net projections and DeepSeek-V3's MLA projections: optional (not defaults anywhere)
    assert set(LORA_NAMES.optional) == {
        "in_proj_qkv",
        "in_proj_z",
        "out_proj",
        "linear_q_down_proj",
        "linear_q_up_proj",
        "linear_kv_down_proj",
    }
    assert LORA_NAMES.targets == LORA_NAMES.default_targets + LORA_NAMES.optional
    assert LORA_NAMES.expert_targets == ("linear_fc1", "linear_fc2")
    assert LORA_NAMES.normalise(["out_proj", "q_proj", "k_proj", "v_proj"]) == ("linear_qkv", "out_proj")
    assert mistral.SPEC.lora.hf_target_modules(mistral.SPEC.lora.targets) == [
        "down_proj",
        "gate_proj",
        "k_proj",
        "o_proj",
        "q_proj",
        "up_proj",
        "v_proj",
    ]
    assert mistral.SPEC.lora.parse("decoder.layers.1.self_attention.linear_qkv") == (
        "1.self_attn",
        "linear_qkv",
    )
    with pytest.raises(ValueError, match="this family has no experts' linear_fc1"):
        mistral.SPEC.lora.parse("decoder.layers.1.mlp.experts.3.linear_fc1")
    assert qwen3_moe.SPEC.lora.parse("decoder.layers.1.mlp.experts.3.linear_fc1") == (
        "1.mlp.experts.3",
        "linear_fc1",
    )
    with pytest.raises(ValueError, match="this family has no shared expert's linear_fc1"):
        qwen3_moe.SPEC.lora.parse("decoder.layers.1.mlp.shared_experts.linear_fc1")
    assert qwen3_5_moe.SPEC.lora.parse("decoder.layers.1.mlp.shared_experts.linear_fc2") == (
        "1.mlp.shared_expert",
        "linear_fc2",
    )
    assert qwen3_5.SPEC.lora.parse("decoder.layers.0.self_attention.in_proj_qkv") == (
        "0.linear_attn",
        "in_proj_qkv",
    )
    # DeepSeek-V3's MLA targets are named explicitly (not defaults); its shared experts map like an MLP
    assert {"linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj"} <= set(LORA_NAMES.optional)
    assert "linear_qkv" not in LORA_NAMES.optional
    assert LORA_NAMES.normalise(("kv_a_proj_with_mqa", "o_proj")) == ("linear_proj", "linear_kv_down_proj")
    assert deepseek_v3.SPEC.lora.parse("decoder.layers.3.mlp.shared_experts.linear_fc2") == (
        "3.mlp.shared_experts",
        "linear_fc2",
    )


def test_a_layout_outside_its_sizes_is_a_bug() -> None:
    with pytest.raises(ValueError, match="invalid parallel layout"):
        ParallelLayout(tp=2, tp_rank=2)


def test_register_accepts_the_window_from_config_json_alone(tmp_path) -> None:
    from art_mega.trainer.model_builder import check_model_fits

    (tmp_path / "config.json").write_text(json.dumps({**MISTRAL_7B_V03, "sliding_window": 4096}))
    check_model_fits(tmp_path, 8)

"""Real sizes without memory: published full-size config.json values of the existing families, built
on torch's `meta` device by transformers and by megatron-core (`tests.trainer.meta_mapping_worker`,
the session's one `meta_mapper` process, a fake 8-rank world).

For each: the family's own HF -> Megatron mapping (`FamilySpec.megatron_state_dict`), run for every
TP (and EP) rank, reads every HF tensor name and nothing else, and gives each rank exactly the
Megatron model's parameter names with its shapes at TP=8 (EP=8 for the MoE models; Qwen2.5-7B's 28
heads refuse TP=8, so TP=4, as Qwen2.5-1.5B's 12); Megatron's parameter count (its TP=1 model) equals transformers' and the
published one; and every layer `apply_lora` wraps names HF modules that exist (transformers 5 keeps an
MoE layer's experts fused: expert e is row e of `mlp.experts.gate_up_proj` / `down_proj`).
"""

from __future__ import annotations

import pytest

from tests.real_size_configs import (
    CONFIGS,
    GEMMA3_4B_IT,
    GEMMA3_4B_IT_TEXT_PARAMETERS,
    GEMMA4_31B_TEXT,
    PUBLISHED,
)
from tests.trainer.common import MetaMapper, require_trainer_deps
from tests.trainer.qwen3_5_configs import QWEN3_5_0_8B

require_trainer_deps()

PARALLEL = {"Qwen3-30B-A3B": (8, 8), "Qwen3-235B-A22B": (8, 8), "Qwen2.5-7B": (4, 1), "Qwen2.5-1.5B": (4, 1)}
PARALLEL["Qwen2.5-7B-Instruct-YaRN"] = PARALLEL["Qwen2.5-7B"]
"""(tp, ep) where not (8, 1)."""

RANK0_SHAPES = {
    "Qwen3-8B": {
        "decoder.layers.0.self_attention.linear_qkv.weight": [(32 + 2 * 8) * 128 // 8, 4096],
        "decoder.layers.0.self_attention.linear_proj.weight": [4096, 32 * 128 // 8],
        "decoder.layers.0.mlp.linear_fc1.weight": [2 * 12288 // 8, 4096],
        "output_layer.weight": [151936 // 8, 4096],
    },
    "Qwen3-235B-A22B": {
        # 4 KV heads < TP 8: each rank holds 8 query heads and a copy of its group's K and V head
        "decoder.layers.0.self_attention.linear_qkv.weight": [(64 + 2 * 4) * 128 // 8, 4096],
        "decoder.layers.0.mlp.router.weight": [128, 4096],
        "decoder.layers.0.mlp.experts.local_experts.15.linear_fc1.weight": [2 * 1536, 4096],
    },
    "Qwen2.5-7B": {"decoder.layers.0.self_attention.linear_qkv.bias": [(28 + 2 * 4) * 128 // 4]},
}
"""A few rank-0 Megatron shapes written out from the architecture (the rest are compared with the model)."""


def _check(name: str, meta_mapper: MetaMapper, config: dict | None = None) -> dict:
    """The meta-mapping worker's result for `CONFIGS[name]` (or `config`) at `PARALLEL`'s sizes."""
    tp, ep = PARALLEL.get(name, (8, 1))
    return meta_mapper.map(config or CONFIGS[name], tp, ep)


# Every published config maps in `.ci/run`: in the session's one mapping worker (`meta_mapper`)
# a dense map takes under 1 s and Qwen3-235B-A22B's 9-12 s on 2 loaded cores, all 13 tests 51 s
# (30-45 s a map when each started its own process, when 6 of them were gated).


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_full_size_mapping_on_meta(name: str, meta_mapper: MetaMapper) -> None:
    got = _check(name, meta_mapper)
    print(
        f"{name} ({got['hf_class']}, family {got['family']}): {got['hf_names']} HF tensors -> "
        f"{got['megatron_keys']} Megatron tensors per rank, {got['megatron_params']:,} parameters, "
        f"{got['lora_layers']} LoRA layers on rank 0"
    )
    assert got["unread"] == [] and got["unknown_reads"] == []
    assert got["missing"] == [] and got["unexpected"] == [] and got["mismatched"] == []
    assert got["hf_params"] == got["megatron_params"] == PUBLISHED[name]
    assert got["lora_layers"] > 0 and got["lora_unmatched"] == []
    for key, shape in RANK0_SHAPES.get(name, {}).items():
        assert got["rank0_shapes"][key] == shape, key


def test_tp8_refusal_names_the_valid_sizes() -> None:
    from art_mega.errors import UserError
    from art_mega.trainer.families import family_for
    from art_mega.trainer.families.spec import ParallelLayout

    config = CONFIGS["Qwen2.5-7B"]
    family = family_for(config)
    with pytest.raises(UserError) as caught:
        family.check_parallel(family.model_args(config), ParallelLayout(tp=8))
    assert str(caught.value) == (
        "tp=8 cannot split this qwen2 model (28 attention heads, 4 KV heads, FFN size 18944); use tp in {1, 2, 4}."
    )
    yarn = family.model_args(CONFIGS["Qwen2.5-7B-Instruct-YaRN"]).rope_scaling
    assert (yarn.rope_type, yarn.factor, yarn.original_max_position_embeddings) == ("yarn", 4.0, 32768)


@pytest.mark.timeout(900)
def test_gemma4_31b_maps_every_tensor_at_tp8(meta_mapper: MetaMapper) -> None:
    """google/gemma-4-31B's text config at TP=8: the 10 global layers' 4 KV heads (fewer than the
    ranks: each rank holds a copy of its group's key) and 512-wide heads, the k_eq_v projection
    without v rows, and the 60 layer scalars (buffers) all map; parameter counts equal."""
    got = meta_mapper.map(GEMMA4_31B_TEXT, 8, 1)
    print(f"gemma-4-31B text: {got['hf_names']} HF tensors, {got['megatron_params']:,} parameters")
    assert got["family"] == "gemma4" and got["hf_class"] == "Gemma4ForCausalLM"
    assert got["unread"] == [] and got["unknown_reads"] == [] and got["hf_buffers"] == 60
    assert got["missing"] == [] and got["unexpected"] == [] and got["mismatched"] == []
    # transformers' Gemma4ForCausalLM of this config on the meta device (the text decoder only)
    assert got["hf_params"] == got["megatron_params"] == 30_697_345_280
    assert got["lora_layers"] == 60 * 4 and got["lora_unmatched"] == []
    shapes = got["rank0_shapes"]
    assert shapes["decoder.layers.0.self_attention.linear_qkv.weight"] == [(32 + 2 * 16) * 256 // 8, 5376]
    assert shapes["decoder.layers.5.self_attention.linear_qkv.weight"] == [(32 + 4) * 512 // 8, 5376]
    assert shapes["decoder.layers.5.self_attention.linear_proj.weight"] == [5376, 32 * 512 // 8]


@pytest.mark.timeout(900)
def test_gemma3_4b_wrapper_maps_its_decoder_at_tp8(meta_mapper: MetaMapper) -> None:
    """google/gemma-3-4b-it as published (the multimodal wrapper, its text_config leaving heads,
    KV heads and head_dim to Gemma3TextConfig's defaults) at TP=8: every text-decoder tensor of
    transformers' Gemma3ForConditionalGeneration maps, only the vision tower and projector are
    not read, the decoder's parameters equal Megatron's, and every LoRA layer names a module
    under the wrapper's `model.language_model.layers`."""
    got = meta_mapper.map(GEMMA3_4B_IT, 8, 1)
    assert got["family"] == "gemma3" and got["hf_class"] == "Gemma3ForConditionalGeneration"
    assert got["unread"] and all(
        name.startswith(("model.vision_tower.", "model.multi_modal_projector.")) for name in got["unread"]
    )
    assert got["unknown_reads"] == [] and got["missing"] == [] and got["unexpected"] == []
    assert got["mismatched"] == []
    assert got["megatron_params"] == GEMMA3_4B_IT_TEXT_PARAMETERS
    assert got["lora_layers"] == 34 * 4 and got["lora_unmatched"] == []
    # 8 query heads and 4 KV heads of 256 (the defaults), one query head and half a KV group a rank
    qkv = got["rank0_shapes"]["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert qkv == [(8 + 2 * 4) * 256 // 8, 2560]


@pytest.mark.timeout(900)
def test_qwen3_5_tied_wrapper_maps_at_tp8(meta_mapper: MetaMapper) -> None:
    """Qwen3.5-0.8B as published (the multimodal wrapper, tied embeddings): no lm_head is read or
    built (Megatron shares the embedding), every other text tensor maps at TP=8 (2 KV heads: each
    rank a copy of its group's), parameter counts equal."""
    got = meta_mapper.map(QWEN3_5_0_8B, 8, 1)
    assert (got["family"], got["hf_class"]) == ("qwen3_5", "Qwen3_5ForCausalLM")
    assert (
        got["unread"] == []
        and got["unknown_reads"] == []
        and got["missing"] == []
        and got["unexpected"] == []
    )
    assert got["mismatched"] == [] and "output_layer.weight" not in got["rank0_shapes"]
    # transformers' Qwen3_5ForCausalLM of this config on the meta device (the text decoder)
    assert got["hf_params"] == got["megatron_params"] == 752_393_024
    assert got["lora_layers"] > 0 and got["lora_unmatched"] == []

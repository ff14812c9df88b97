"""Gemma 4 text in the config mapping (no model built): gemma-4-31B's published text config's
arguments and valid TP sizes, the published multimodal wrapper (model_type "gemma4") read as
that text config, the one-sentence refusals, the LoRA names of a global k_eq_v layer
(q_proj and k_proj only) and their adapter layout, and the proportional RoPE frequencies against
transformers'."""

from __future__ import annotations

import pytest

from art_mega.errors import UserError
from art_mega.trainer.families import family_for, gemma4
from art_mega.trainer.families.spec import ParallelLayout
from tests.real_size_configs import GEMMA4_31B_IT, GEMMA4_31B_TEXT


def test_the_published_wrapper_reads_as_its_text_config(tmp_path) -> None:
    """google/gemma-4-31B's config.json is the wrapper: `register` reads its decoder (its sizes
    in `text_config`), with the wrapper's model_type (weights under model.language_model.) and
    PEFT names under the wrapper's decoder."""
    import dataclasses
    import json

    from art_mega.trainer.families import decoder_config
    from art_mega.trainer.model_builder import check_model_fits

    assert family_for(GEMMA4_31B_IT) is gemma4.SPEC
    args = gemma4.model_args(GEMMA4_31B_IT)
    assert args.model_type == "gemma4"
    assert dataclasses.replace(args, model_type="gemma4_text") == gemma4.model_args(GEMMA4_31B_TEXT)
    assert decoder_config(GEMMA4_31B_IT) == {**GEMMA4_31B_TEXT, "model_type": "gemma4"}
    assert gemma4.SPEC.lora_names(args).layer_prefix == "base_model.model.model.language_model.layers"
    assert (
        gemma4.SPEC.lora_names(gemma4.model_args(GEMMA4_31B_TEXT)).layer_prefix
        == "base_model.model.model.layers"
    )
    (tmp_path / "config.json").write_text(json.dumps(GEMMA4_31B_IT))
    check_model_fits(tmp_path, 8)
    with pytest.raises(UserError, match="text_config of a gemma4 config.json must be an object"):
        gemma4.model_args({**GEMMA4_31B_IT, "text_config": None})


def test_gemma_4_31b_arguments() -> None:
    args = gemma4.model_args(GEMMA4_31B_TEXT)
    assert family_for(GEMMA4_31B_TEXT) is gemma4.SPEC
    assert args.window_layers == ((True,) * 5 + (False,)) * 10
    assert (args.head_dim, args.num_query_groups, args.global_head_dim, args.global_query_groups) == (
        256,
        16,
        512,
        4,
    )
    assert (args.k_eq_v, args.sliding_window, args.final_logit_softcapping) == (True, 1024, 30.0)
    assert (args.rope_theta, args.global_rope_theta, args.global_rope_partial) == (1e4, 1e6, 0.25)
    assert args.attention(0) == (256, 16, False) and args.attention(5) == (512, 4, True)
    assert gemma4.valid_tp_sizes(args) == [1, 2, 4, 8, 16, 32]


def test_transformers_serialised_per_layer_config_reads_the_same() -> None:
    """transformers writes `per_layer_config` (layer -> head_dim, num_key_value_heads) in place of
    global_head_dim / num_global_key_value_heads when it saves a Gemma 4 config."""
    config = {
        k: v for k, v in GEMMA4_31B_TEXT.items() if k not in ("global_head_dim", "num_global_key_value_heads")
    }
    config["per_layer_config"] = {
        str(i): {"head_dim": 512, "num_key_value_heads": 4} for i in range(5, 60, 6)
    }
    assert gemma4.model_args(config) == gemma4.model_args(GEMMA4_31B_TEXT)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"hidden_size_per_layer_input": 256},
            "hidden_size_per_layer_input=256 (per-layer input embeddings, Gemma 4 E2B/E4B) is not implemented by the "
            "Megatron trainer; use a Gemma 4 model without them (31B, 0).",
        ),
        (
            {"num_kv_shared_layers": 20},
            "num_kv_shared_layers=20 (layers reusing earlier layers' keys and values) is not implemented by the "
            "Megatron trainer; use a Gemma 4 model without KV sharing (31B, 0).",
        ),
        (
            {"enable_moe_block": True},
            "enable_moe_block=true needs num_experts; use the model's own config.json.",
        ),
        (
            {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 5, "moe_intermediate_size": 8},
            "top_k_experts=5 must be between 1 and num_experts=4.",
        ),
        (
            {"use_bidirectional_attention": "all"},
            "use_bidirectional_attention='all' is not supported; the trainer's attention is causal.",
        ),
        (
            {"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 4.0}}},
            "rope_parameters.full_attention.rope_type='yarn' is not supported for Gemma 4; use 'default' or "
            "'proportional'.",
        ),
        (
            {"hidden_activation": "silu"},
            "hidden_activation='silu' is not supported; Gemma 4 uses 'gelu_pytorch_tanh'.",
        ),
    ],
)
def test_refusals_are_one_sentence(change: dict, message: str) -> None:
    with pytest.raises(UserError) as caught:
        gemma4.model_args({**GEMMA4_31B_TEXT, **change})
    assert str(caught.value) == message


def test_tp_refusal_names_both_layer_kinds() -> None:
    args = gemma4.model_args({**GEMMA4_31B_TEXT, "num_attention_heads": 24, "num_key_value_heads": 8})
    with pytest.raises(UserError) as caught:
        gemma4.SPEC.check_parallel(args, ParallelLayout(tp=16))
    assert str(caught.value) == (
        "tp=16 cannot split this gemma4_text model (24 attention heads, 8 local and 4 global KV heads, "
        "FFN size 21504); use tp in {1, 2, 4, 8}."
    )


def test_lora_names_of_a_global_k_eq_v_layer() -> None:
    args = gemma4.model_args(GEMMA4_31B_TEXT)
    names = gemma4.SPEC.lora_names(args)
    assert names.hf_modules("decoder.layers.5.self_attention.linear_qkv") == ("q_proj", "k_proj")
    assert names.hf_modules("decoder.layers.4.self_attention.linear_qkv") == ("q_proj", "k_proj", "v_proj")
    assert names.hf_modules("decoder.layers.5.mlp.linear_fc1") == ("gate_proj", "up_proj")


def test_adapter_layout_has_the_global_layers_shapes() -> None:
    from art_mega.trainer.peft_io import adapter_layout

    layout = adapter_layout(GEMMA4_31B_TEXT, 8, ["q_proj", "k_proj", "v_proj", "o_proj"])
    key = "base_model.model.model.layers.{}.self_attn.{}.lora_{}.weight".format
    assert layout.shapes[key(4, "q_proj", "B")] == (32 * 256, 8)
    assert layout.shapes[key(4, "v_proj", "B")] == (16 * 256, 8)
    assert layout.shapes[key(5, "q_proj", "B")] == (32 * 512, 8)
    assert layout.shapes[key(5, "k_proj", "B")] == (4 * 512, 8)
    assert layout.shapes[key(5, "o_proj", "A")] == (8, 32 * 512)
    assert layout.shapes[key(5, "v_proj", "B")] == (4 * 512, 8), "k_proj's copy, for vLLM"


def test_proportional_rope_equals_transformers() -> None:
    torch = pytest.importorskip("torch")
    from transformers import Gemma4TextConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = Gemma4TextConfig(**{k: v for k, v in GEMMA4_31B_TEXT.items() if k != "model_type"})
    expected, _ = ROPE_INIT_FUNCTIONS["proportional"](config, "cpu", layer_type="full_attention")
    got = gemma4.global_inv_freq(gemma4.model_args(GEMMA4_31B_TEXT))
    assert got.shape == (256,) and int((got == 0).sum()) == 256 - 64
    assert torch.equal(got, expected)


def test_memory_plan_counts_the_global_layers() -> None:
    from art_mega.trainer.prepare.memory_plan import ModelShape

    shape = ModelShape.from_args(gemma4.model_args(GEMMA4_31B_TEXT))
    # transformers' Gemma4ForCausalLM of this config on the meta device (test_real_size_mapping)
    assert (shape.norms_per_layer, shape.global_layers) == (4, 10)
    assert shape.parameters() == 30_697_345_280
    local_qkv, global_qkv = (32 + 2 * 16) * 256 + 32 * 256, (32 + 4) * 512 + 32 * 512
    assert shape.lora_parameters(8, ("linear_qkv", "linear_proj")) == 8 * (
        50 * (2 * 5376 + local_qkv) + 10 * (2 * 5376 + global_qkv)
    )


def test_k_eq_v_adapter_round_trip_and_refusal() -> None:
    """A global k_eq_v layer's fused [q; k] B (2 TP shards) exports q_proj, k_proj and k_proj's copy
    as v_proj, imports back to each rank's shard, and an adapter whose v_proj differs is refused."""
    torch = pytest.importorskip("torch")
    config = {
        **GEMMA4_31B_TEXT,
        "num_hidden_layers": 2,
        "layer_types": ["sliding_attention", "full_attention"],
    }
    args = gemma4.model_args(config)
    names = gemma4.SPEC.lora_names(args)
    name = "decoder.layers.1.self_attention.linear_qkv"
    a, b = torch.randn(4, 5376), torch.randn((32 + 4) * 512, 4)
    tensors = names.to_peft(name, a, list(b.chunk(2)), args.num_heads, args.num_query_groups)
    key = "base_model.model.model.layers.1.self_attn.{}_proj.lora_{}.weight".format
    assert tensors[key("q", "B")].shape == (32 * 512, 4) and tensors[key("k", "B")].shape == (4 * 512, 4)
    assert torch.equal(tensors[key("v", "B")], tensors[key("k", "B")])
    for rank, shard in enumerate(b.chunk(2)):
        got_a, got_b = names.from_peft(name, tensors, args.num_heads, args.num_query_groups, 2, rank)
        assert torch.equal(got_a, a) and torch.equal(got_b, shard)
    tensors[key("v", "B")] = tensors[key("v", "B")] + 1
    with pytest.raises(UserError) as caught:
        names.from_peft(name, tensors, args.num_heads, args.num_query_groups, 1, 0)
    assert str(caught.value) == (
        "layer 1's v_proj lora_B differs from its k_proj lora_B; its values are its keys (attention_k_eq_v), "
        "so the two adapters must be equal."
    )

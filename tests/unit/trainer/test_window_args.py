"""Sliding windows and Gemma 3 in the config mapping (no torch): which layers slide for Mistral
v0.1, Qwen2 (`max_window_layers`, `layer_types`) and Gemma 3 (`sliding_window_pattern`), the
published gemma-3-27b text config's arguments, and the one-sentence refusals."""

from __future__ import annotations

import pytest

from art_mega.errors import UserError
from art_mega.trainer.families import family_for, gemma3, llama, mistral
from art_mega.trainer.families.spec import ParallelLayout
from tests.trainer.gemma3_configs import GEMMA3_27B_TEXT

MISTRAL_7B_V01 = {
    "model_type": "mistral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 32,
    "vocab_size": 32000,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 32768,
    "sliding_window": 4096,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}
"""mistralai/Mistral-7B-v0.1's config.json (the fields the trainer reads)."""

QWEN25_7B = {
    "model_type": "qwen2",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "num_hidden_layers": 28,
    "vocab_size": 152064,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 32768,
    "sliding_window": 131072,
    "max_window_layers": 28,
    "use_sliding_window": False,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}
"""Qwen/Qwen2.5-7B-Instruct's config.json (the fields the trainer reads)."""



def test_mistral_v01_slides_on_every_layer_and_qwen2_from_max_window_layers() -> None:
    v01 = mistral.model_args(MISTRAL_7B_V01)
    assert (v01.sliding_window, v01.window_layers) == (4096, (True,) * 32)
    assert llama.model_args(QWEN25_7B).window_layers == ()
    assert llama.model_args(QWEN25_7B).sliding_window is None
    windowed = llama.model_args({**QWEN25_7B, "use_sliding_window": True, "max_window_layers": 20})
    assert windowed.sliding_window == 131072
    assert windowed.window_layers == (False,) * 20 + (True,) * 8
    types = ["full_attention", "sliding_attention"] * 14
    listed = llama.model_args({**QWEN25_7B, "use_sliding_window": True, "layer_types": types})
    assert listed.window_layers == (False, True) * 14
    qwen3 = llama.model_args({**QWEN25_7B, "model_type": "qwen3", "use_sliding_window": True})
    assert qwen3.window_layers == () and qwen3.sliding_window is None, "layers >= 28 of 28 slide: none"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"use_sliding_window": True, "layer_types": ["full_attention"] * 3},
            "layer_types=['full_attention', 'full_attention', 'full_attention'] must name 28 layers, each "
            "one of sliding_attention, full_attention; use the model's own config.json.",
        ),
        (
            {"use_sliding_window": True, "sliding_window": 0},
            "sliding_window=0 is not a whole number of tokens >= 1; use the model's own config.json.",
        ),
        (
            {"model_type": "llama", "use_sliding_window": True},
            "use_sliding_window=true is not a Llama setting; use the model's own config.json.",
        ),
    ],
)
def test_window_refusals_are_one_sentence(change: dict, message: str) -> None:
    with pytest.raises(UserError) as caught:
        llama.model_args({**QWEN25_7B, **change})
    assert str(caught.value) == message


def test_gemma3_27b_arguments() -> None:
    args = gemma3.model_args(GEMMA3_27B_TEXT)
    assert family_for(GEMMA3_27B_TEXT) is gemma3.SPEC
    assert (args.hidden_size, args.num_layers, args.num_heads, args.num_query_groups) == (5376, 62, 32, 16)
    assert (args.head_dim, args.ffn_hidden_size, args.vocab_size) == (128, 21504, 262208)
    assert args.sliding_window == 1024
    global_layers = [i for i, local in enumerate(args.window_layers) if not local]
    assert global_layers == [5, 11, 17, 23, 29, 35, 41, 47, 53, 59]
    assert (args.rope_theta, args.global_rope_factor) == (1e6, 8.0)
    assert (args.local_rope_theta, args.local_rope_factor) == (1e4, None)
    assert args.query_pre_attn_scalar == 168 and args.qk_norm and args.tie_word_embeddings
    assert gemma3.SPEC.valid_tp_sizes(args) == [1, 2, 4, 8, 16, 32]
    gemma3.SPEC.check_parallel(args, ParallelLayout(tp=8))
    # transformers 5's per-layer-type rope_parameters and an explicit layer_types read the same.
    saved = {
        **GEMMA3_27B_TEXT,
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
        "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(62)],
    }
    assert gemma3.model_args(saved) == args


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"final_logit_softcapping": 30.0},
            "final_logit_softcapping=30.0 is not implemented by the Megatron trainer; use a Gemma 3 config "
            "with final_logit_softcapping null (as the published ones).",
        ),
        (
            {"attn_logit_softcapping": 50.0},
            "attn_logit_softcapping=50.0 is not implemented by the Megatron trainer; use a Gemma 3 config "
            "with attn_logit_softcapping null (as the published ones).",
        ),
        (
            {"hidden_activation": "gelu"},
            "hidden_activation='gelu' is not supported; Gemma 3 uses 'gelu_pytorch_tanh'.",
        ),
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 8.0}},
            "rope_type='yarn' on Gemma 3's full_attention layers is not supported; use 'default' or 'linear'.",
        ),
        (
            {"use_bidirectional_attention": True},
            "use_bidirectional_attention=true is not supported; the trainer's attention is causal.",
        ),
        (
            {"sliding_window": None},
            "sliding_window=null is not supported for Gemma 3; use the model's own config.json.",
        ),
        ({"attention_bias": True}, "attention_bias=true is not supported by the Megatron Gemma 3 model."),
    ],
)
def test_gemma3_refusals_are_one_sentence(change: dict, message: str) -> None:
    with pytest.raises(UserError) as caught:
        gemma3.model_args({**GEMMA3_27B_TEXT, **change})
    assert str(caught.value) == message

"""HF config -> Megatron dense architecture, and the TP divisibility check (no torch needed)."""

from __future__ import annotations

import pytest

from art_mega.errors import UserError
from art_mega.trainer.families import family_for, llama
from art_mega.trainer.families.llama import DenseArgs, check_parallel, padded_vocab_size, valid_tp_sizes

SMOLLM2_135M = {
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "num_hidden_layers": 30,
    "vocab_size": 49152,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
}


def test_smollm2_config() -> None:
    args = DenseArgs.from_hf_config(SMOLLM2_135M)
    assert (args.head_dim, args.num_query_groups, args.rope_theta) == (64, 3, 100000.0)
    assert args.tie_word_embeddings and not args.qkv_bias and not args.qk_norm
    assert args.rope_scaling_factor is None
    assert valid_tp_sizes(args) == [1, 3]


def test_qwen_variants() -> None:
    qwen2 = DenseArgs.from_hf_config({**SMOLLM2_135M, "model_type": "qwen2", "head_dim": 16})
    assert qwen2.qkv_bias and qwen2.head_dim == 64, "qwen2 derives head_dim from hidden_size"
    qwen3 = DenseArgs.from_hf_config(
        {**SMOLLM2_135M, "model_type": "qwen3", "head_dim": 128, "rope_parameters": {"rope_theta": 1e6}}
    )
    assert qwen3.qk_norm and qwen3.head_dim == 128 and qwen3.rope_theta == 1e6


def test_llama3_rope_scaling() -> None:
    rope = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    args = DenseArgs.from_hf_config({**SMOLLM2_135M, "rope_scaling": {**rope, "rope_theta": 5e5}})
    assert (args.rope_scaling_factor, args.rope_theta) == (32.0, 5e5)
    with pytest.raises(UserError, match="high_freq_factor=2.0 is not supported"):
        DenseArgs.from_hf_config({**SMOLLM2_135M, "rope_scaling": {**rope, "high_freq_factor": 2.0}})
    with pytest.raises(UserError, match="rope_type='su' is not supported; use 'default', 'linear', 'llama3'"):
        DenseArgs.from_hf_config({**SMOLLM2_135M, "rope_parameters": {"rope_type": "su"}})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
        ({"mlp_bias": True}, "mlp_bias=true is not supported"),
        ({"attention_bias": True}, "attention_bias=true on llama biases o_proj"),
        ({"use_sliding_window": True}, "use_sliding_window=true is not a Llama setting"),
        ({"model_type": "gpt2"}, "model_type='gpt2' is not a Llama-family model"),
    ],
)
def test_unsupported_features(change: dict, message: str) -> None:
    with pytest.raises(UserError, match=message):
        DenseArgs.from_hf_config({**SMOLLM2_135M, **change})


def test_divisibility_error_is_one_sentence_with_the_fix() -> None:
    args = DenseArgs.from_hf_config(SMOLLM2_135M)
    check_parallel(args, 3)
    with pytest.raises(UserError) as caught:
        check_parallel(args, 2)
    assert str(caught.value) == (
        "tp=2 cannot split this llama model (9 attention heads, 3 KV heads, FFN size 1536); use tp in {1, 3}."
    )


def test_tp_may_exceed_kv_heads_when_a_multiple() -> None:
    args = DenseArgs.from_hf_config({**SMOLLM2_135M, "num_attention_heads": 8, "num_key_value_heads": 2})
    assert valid_tp_sizes(args) == [1, 2, 4, 8]
    args = DenseArgs.from_hf_config({**SMOLLM2_135M, "num_attention_heads": 12, "num_key_value_heads": 4})
    assert 6 not in valid_tp_sizes(args), "6 neither divides 4 KV heads nor is a multiple of them"


def test_vocab_padding_and_family_lookup() -> None:
    args = DenseArgs.from_hf_config({**SMOLLM2_135M, "vocab_size": 151643})
    assert padded_vocab_size(args, 2) == 151644
    assert family_for({"model_type": "qwen3"}) is llama.SPEC
    with pytest.raises(UserError, match="model_type='mamba' is not supported by the Megatron trainer"):
        family_for({"model_type": "mamba"})

"""GPT-OSS config parsing, its refusals and the MXFP4 expert dequantization, from config dicts and
small tensors (no Megatron)."""

from __future__ import annotations

import pytest

from art_mega.errors import UserError
from art_mega.trainer.families import family_for, gpt_oss
from art_mega.trainer.families.spec import ParallelLayout
from tests.trainer.gpt_oss_configs import GPT_OSS_20B, GPT_OSS_120B


def test_published_configs_are_parsed() -> None:
    assert family_for(GPT_OSS_20B) is gpt_oss.SPEC
    args = gpt_oss.model_args(GPT_OSS_20B)
    assert (args.num_experts, args.top_k, args.expert_ffn_hidden_size, args.norm_topk_prob) == (
        32,
        4,
        2880,
        True,
    )
    assert (args.num_heads, args.num_query_groups, args.head_dim, args.qkv_bias, args.qk_norm) == (
        64,
        8,
        64,
        True,
        False,
    )
    assert args.sliding_window == 128 and args.window_layers == (True, False) * 12
    assert (args.rope_theta, args.tie_word_embeddings, args.mxfp4, args.aux_loss_coeff) == (
        150000.0,
        False,
        True,
        0.0,
    )
    yarn = args.rope_scaling
    assert (yarn.rope_type, yarn.factor, yarn.original_max_position_embeddings, yarn.truncate) == (
        "yarn",
        32.0,
        4096,
        False,
    )
    big = gpt_oss.model_args(GPT_OSS_120B)
    assert (big.num_layers, big.num_experts) == (36, 128)
    gpt_oss.SPEC.check_parallel(big, ParallelLayout(tp=8, ep=8))
    with pytest.raises(UserError, match=r"^etp=2 cannot split this gpt_oss model: .* use etp=1"):
        gpt_oss.SPEC.check_parallel(big, ParallelLayout(tp=8, ep=8, etp=2))
    assert gpt_oss.SPEC.valid_tp_sizes(args) == [1, 2, 4, 8, 16, 32, 64]


def test_defaults_are_transformers() -> None:
    """A config without RoPE or window fields reads as GptOssConfig fills it: YaRN factor 32 over
    4096 positions (truncate false), window 128 on the even layers."""
    sizes = {
        key: GPT_OSS_20B[key]
        for key in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size")
    }
    args = gpt_oss.model_args(sizes)
    assert (args.rope_scaling.factor, args.rope_scaling.truncate, args.rope_theta) == (32.0, False, 150000.0)
    assert args.window_layers == (True, False) * 12 and (args.num_experts, args.top_k) == (128, 4)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"attention_bias": False},
            "attention_bias=false is not supported for GPT-OSS; use the model's own config.json (attention_bias true).",
        ),
        (
            {"swiglu_limit": 10.0},
            "swiglu_limit=10.0 is not supported; transformers' GPT-OSS experts clamp at 7.0, so use that.",
        ),
        (
            {"quantization_config": {"quant_method": "bitsandbytes"}},
            "quantization_config.quant_method='bitsandbytes' is not supported for GPT-OSS; use the bf16 or mxfp4 checkpoint.",
        ),
        (
            {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
            "rope_type='llama3' is not supported for GPT-OSS; use 'default', 'linear' or 'yarn'.",
        ),
        ({"num_experts_per_tok": 40}, "num_experts_per_tok=40 must be between 1 and num_local_experts=32."),
        (
            {"layer_types": ["sliding_attention"]},
            "layer_types=['sliding_attention'] must name 24 layers, each one of sliding_attention, full_attention; "
            "use the model's own config.json.",
        ),
    ],
)
def test_what_cannot_be_expressed_is_refused(change: dict, message: str) -> None:
    with pytest.raises(UserError) as caught:
        gpt_oss.model_args({**GPT_OSS_20B, **change})
    assert str(caught.value) == message


def test_mxfp4_experts_are_dequantized_as_transformers() -> None:
    torch = pytest.importorskip("torch")
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (2, 6, 4, 16), generator=generator, dtype=torch.uint8)  # [E, 2I, h/32, 16]
    scales = torch.randint(120, 134, (2, 6, 4), generator=generator, dtype=torch.uint8)
    expected = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, h, 2I]
    tensors = {"w_blocks": blocks, "w_scales": scales}
    got = gpt_oss.read_experts(tensors.__getitem__, "w", range(2))
    assert got.shape == (2, 128, 6) and torch.equal(got, expected)
    assert torch.equal(gpt_oss.read_experts(tensors.__getitem__, "w", range(1, 2)), expected[1:])
    # the first byte's low nibble is the first value
    one = gpt_oss.dequantize_mxfp4(
        torch.tensor([[0x53] + [0] * 15], dtype=torch.uint8), torch.tensor([128], dtype=torch.uint8)
    )
    assert one[:2].tolist() == [3.0, 6.0]  # codes 0x3 = 1.5 and 0x5 = 3.0, times 2^(128 - 127)

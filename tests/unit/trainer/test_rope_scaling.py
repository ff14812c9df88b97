"""Linear and YaRN RoPE (`trainer/rope_scaling.py`) against transformers' own RoPE functions: the
inverse frequencies are bit-identical in fp32 and the attention factor equal, for the published
long-context configs (Qwen3 / Qwen2.5 YaRN, GPT-OSS's untruncated YaRN with its betas, DeepSeek-V3's
mscale pair) and a linear config; megatron-core's own YaRN ramp is checked against the same numbers;
the rope types that change with the sequence length are refused in one sentence."""

from __future__ import annotations

import math

import pytest

from art_mega.errors import UserError
from art_mega.trainer import rope_scaling
from art_mega.trainer.families.llama import DenseArgs

QWEN3_8B_YARN = {
    "model_type": "qwen3",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "vocab_size": 151936,
    "max_position_embeddings": 131072,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 1000000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 32768,
    },
}
"""Qwen3-8B's config.json with the YaRN block its model card gives for 131072 tokens."""

CASES = {
    "qwen3-yarn": QWEN3_8B_YARN,
    "gpt-oss-yarn": {
        **QWEN3_8B_YARN,
        "head_dim": 64,
        "max_position_embeddings": 131072,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": 4096,
            "truncate": False,
        },
    },
    "deepseek-mscale": {
        **QWEN3_8B_YARN,
        "head_dim": 64,
        "max_position_embeddings": 163840,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 40.0,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
        },
    },
    "tiny-yarn": {
        **QWEN3_8B_YARN,
        "head_dim": 32,
        "max_position_embeddings": 64,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    },
    "linear": {**QWEN3_8B_YARN, "rope_parameters": {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.5}},
}


@pytest.mark.parametrize("name", CASES)
def test_inverse_frequencies_are_transformers_bit_for_bit(name: str) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = CASES[name]
    hf_config = transformers.Qwen3Config(**{k: v for k, v in config.items() if k != "model_type"})
    kind = config["rope_parameters"]["rope_type"]
    expected, attention_factor = ROPE_INIT_FUNCTIONS[kind](hf_config, "cpu")
    args = DenseArgs.from_hf_config(config)
    assert args.rope_scaling_factor is None and args.rope_scaling is not None
    got = args.rope_scaling.inv_freq(args.head_dim, args.rope_theta)
    assert got.dtype == expected.dtype == torch.float32 and got.shape == (args.head_dim // 2,)
    assert torch.equal(got, expected)
    assert args.rope_scaling.attention_factor == attention_factor
    plain = 1.0 / args.rope_theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.float32) / args.head_dim)
    assert (got != plain).sum().item() >= args.head_dim // 4, "the factor changes the frequencies"


def test_yarn_parameters_as_read() -> None:
    scaling = DenseArgs.from_hf_config(CASES["gpt-oss-yarn"]).rope_scaling
    assert scaling == rope_scaling.RopeScaling("yarn", 32.0, 4096, 32.0, 1.0, truncate=False)
    assert scaling.correction_range(64, 150000.0) == pytest.approx((8.09278, 17.39802), abs=1e-5)
    assert scaling.attention_factor == pytest.approx(0.1 * math.log(32) + 1)
    qwen = DenseArgs.from_hf_config(QWEN3_8B_YARN).rope_scaling
    assert qwen.correction_range(128, 1e6) == (23, 40) and qwen.attention_factor == pytest.approx(
        1.138629, abs=1e-6
    )
    deepseek = DenseArgs.from_hf_config(CASES["deepseek-mscale"]).rope_scaling
    assert (deepseek.mscale, deepseek.mscale_all_dim, deepseek.attention_factor) == (1.0, 1.0, 1.0)
    # Phi-3 style: a top-level original_max_position_embeddings wins; factor None -> max / original
    implicit = {
        **QWEN3_8B_YARN,
        "original_max_position_embeddings": 16384,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": None},
    }
    scaling = DenseArgs.from_hf_config(implicit).rope_scaling
    assert (scaling.factor, scaling.original_max_position_embeddings) == (8.0, 16384)


def test_megatron_core_yarn_ramp_agrees() -> None:
    """megatron-core's YaRN helpers (not used: see the module docstring) give the same bounds and factor."""
    pytest.importorskip("megatron.core")
    from megatron.core.models.common.embeddings import yarn_rotary_pos_embedding as yarn

    scaling = DenseArgs.from_hf_config(QWEN3_8B_YARN).rope_scaling
    assert yarn._yarn_find_correction_range(32, 1, 128, 1e6, 32768, True) == scaling.correction_range(
        128, 1e6
    )
    assert yarn._yarn_get_concentration_factor(4.0, None, None) == scaling.attention_factor


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        (
            {"rope_type": "dynamic", "factor": 2.0},
            "rope_type='dynamic' is not supported because its frequencies change with each batch's sequence "
            "length (dynamic NTK); use a checkpoint with rope_type 'default', 'linear', 'llama3' or 'yarn'.",
        ),
        (
            {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]},
            "rope_type='longrope' is not supported because it switches between short and long frequency "
            "factors by sequence length; use a checkpoint with rope_type 'default', 'linear', 'llama3' or 'yarn'.",
        ),
        (
            {"rope_type": "yarn", "factor": 4.0, "attention_factor": 1.2},
            "YaRN attention_factor=1.2 is not supported; megatron-core derives the factor from factor, mscale "
            "and mscale_all_dim, so remove attention_factor from the config.",
        ),
        (
            {"rope_type": "linear"},
            "linear RoPE factor=None is not supported; it must be a number above 0.",
        ),
        (
            {"rope_type": "proportional", "factor": 2.0},
            "rope_type='proportional' is not supported; use 'default', 'linear', 'llama3' or 'yarn'.",
        ),
    ],
)
def test_refused_rope_types_are_one_sentence(parameters: dict, message: str) -> None:
    with pytest.raises(UserError) as caught:
        DenseArgs.from_hf_config({**QWEN3_8B_YARN, "rope_parameters": parameters})
    assert str(caught.value) == message

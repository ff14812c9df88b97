"""Qwen3-MoE config parsing and its parallel-size checks, from config dicts alone (no torch)."""

from __future__ import annotations

import pytest

from art_mega.errors import UserError
from art_mega.trainer.families import family_for, qwen3_moe
from tests.trainer.moe_worker import MOE_SIZES

CONFIG = {
    "model_type": "qwen3_moe",
    **{key: value for key, value in MOE_SIZES.items() if key != "num_experts"},
    "num_local_experts": MOE_SIZES["num_experts"],
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "router_aux_loss_coef": 0.001,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
}
"""What transformers 5.17's Qwen3MoeConfig.save_pretrained writes (num_experts as num_local_experts)."""


def test_config_is_parsed() -> None:
    assert family_for(CONFIG) is qwen3_moe.SPEC
    args = qwen3_moe.model_args(CONFIG)
    assert (args.num_experts, args.top_k, args.expert_ffn_hidden_size, args.norm_topk_prob) == (
        4,
        2,
        32,
        True,
    )
    assert args.aux_loss_coeff == 0.0, "HF's router_aux_loss_coef does not enter the RL loss"
    assert (args.num_heads, args.num_query_groups, args.head_dim, args.qk_norm) == (4, 2, 32, True)
    assert args.model_type == "qwen3_moe" and args.rope_theta == 1000000.0
    assert qwen3_moe.model_args({**CONFIG, "num_experts": 8}).num_experts == 8
    assert list(qwen3_moe.local_experts(args, 2, 1)) == [2, 3]


def test_parallel_sizes_are_checked_before_allocating() -> None:
    args = qwen3_moe.model_args(CONFIG)
    qwen3_moe.check_parallel(args, 2, ep=4, etp=2)
    with pytest.raises(UserError) as caught:
        qwen3_moe.check_parallel(args, 1, ep=3)
    assert str(caught.value) == "ep=3 cannot split this qwen3_moe model's 4 experts; use ep in {1, 2, 4}."
    with pytest.raises(UserError) as caught:
        qwen3_moe.check_parallel(args, 1, etp=3)
    assert str(caught.value) == (
        "etp=3 cannot split this qwen3_moe model's expert FFN size 32; use an etp that divides it."
    )
    with pytest.raises(UserError, match=r"tp=3 cannot split this qwen3_moe model \(4 attention heads"):
        qwen3_moe.check_parallel(args, 3)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"mlp_only_layers": [1]},
            "mlp_only_layers=[1] is not supported; use a checkpoint whose layers are all MoE layers.",
        ),
        ({"decoder_sparse_step": 2}, "decoder_sparse_step=2 is not supported; use 1 (every layer MoE)."),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok=5 must be between 1 and num_experts=4."),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported; Llama-family models use 'silu'."),
    ],
)
def test_unsupported_configs_are_refused(change: dict, message: str) -> None:
    with pytest.raises(UserError) as caught:
        qwen3_moe.model_args({**CONFIG, **change})
    assert str(caught.value) == message

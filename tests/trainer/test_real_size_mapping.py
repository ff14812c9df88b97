"""Real sizes without memory: published full-size config.json values of the existing families, built
on torch's `meta` device by transformers and by megatron-core (`tests.trainer.meta_mapping_worker`,
one process each, a fake 8-rank world).

For each: the family's own HF -> Megatron mapping (`FamilySpec.megatron_state_dict`), run for every
TP (and EP) rank, reads every HF tensor name and nothing else, and gives each rank exactly the
Megatron model's parameter names with its shapes at TP=8 (EP=8 for the MoE models; Qwen2.5-7B's 28
heads refuse TP=8, so TP=4); Megatron's parameter count (its TP=1 model) equals transformers' and the
published one; and every layer `apply_lora` wraps names HF modules that exist (transformers 5 keeps an
MoE layer's experts fused: expert e is row e of `mlp.experts.gate_up_proj` / `down_proj`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.trainer.common import require_trainer_deps

require_trainer_deps()

REPO = Path(__file__).resolve().parents[2]

_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "use_sliding_window": False,
    "vocab_size": 151936,
    "torch_dtype": "bfloat16",
}
_LLAMA31 = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "attention_bias": False,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "vocab_size": 128256,
    "torch_dtype": "bfloat16",
}
_QWEN25_7B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_act": "silu",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "max_position_embeddings": 131072,
    "max_window_layers": 28,
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 131072,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "vocab_size": 152064,
    "torch_dtype": "bfloat16",
}
_QWEN3_MOE = {
    **_QWEN3,
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
    "tie_word_embeddings": False,
}

CONFIGS = {
    "Qwen3-4B": {
        **_QWEN3,
        "hidden_size": 2560,
        "intermediate_size": 9728,
        "num_attention_heads": 32,
        "num_hidden_layers": 36,
        "num_key_value_heads": 8,
        "tie_word_embeddings": True,
    },
    "Qwen3-8B": {
        **_QWEN3,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_attention_heads": 32,
        "num_hidden_layers": 36,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
    },
    "Qwen3-32B": {
        **_QWEN3,
        "hidden_size": 5120,
        "intermediate_size": 25600,
        "num_attention_heads": 64,
        "num_hidden_layers": 64,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
    },
    "Qwen3-30B-A3B": {
        **_QWEN3_MOE,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_attention_heads": 32,
        "num_hidden_layers": 48,
        "num_key_value_heads": 4,
    },
    "Qwen3-235B-A22B": {
        **_QWEN3_MOE,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "moe_intermediate_size": 1536,
        "num_attention_heads": 64,
        "num_hidden_layers": 94,
        "num_key_value_heads": 4,
    },
    "Llama-3.1-8B": {
        **_LLAMA31,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
    },
    "Llama-3.1-70B": {
        **_LLAMA31,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_attention_heads": 64,
        "num_hidden_layers": 80,
        "num_key_value_heads": 8,
    },
    "Mistral-7B-v0.3": {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "attention_dropout": 0.0,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "max_position_embeddings": 32768,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "vocab_size": 32768,
        "torch_dtype": "bfloat16",
    },
    "Qwen2.5-7B": _QWEN25_7B,
}
CONFIGS["Qwen3-8B-YaRN"] = {
    **CONFIGS["Qwen3-8B"],
    "max_position_embeddings": 131072,
    "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
}
CONFIGS["Qwen2.5-7B-Instruct-YaRN"] = {
    **_QWEN25_7B,
    "max_position_embeddings": 32768,
    "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"},
}
"""config.json of each model on the Hugging Face Hub (Qwen/*, meta-llama/*, mistralai/*); the -YaRN
variants add the rope_scaling block their model cards give for 131072-token contexts."""

PUBLISHED = {
    "Qwen3-4B": 4_022_468_096,
    "Qwen3-8B": 8_190_735_360,
    "Qwen3-8B-YaRN": 8_190_735_360,
    "Qwen3-32B": 32_762_123_264,
    "Qwen3-30B-A3B": 30_532_122_624,
    "Qwen3-235B-A22B": 235_093_634_560,
    "Llama-3.1-8B": 8_030_261_248,
    "Llama-3.1-70B": 70_553_706_496,
    "Mistral-7B-v0.3": 7_248_023_552,
    "Qwen2.5-7B": 7_615_616_512,
    "Qwen2.5-7B-Instruct-YaRN": 7_615_616_512,
}
"""Parameter counts of the published safetensors checkpoints (the Hub's model pages)."""

PARALLEL = {"Qwen3-30B-A3B": (8, 8), "Qwen3-235B-A22B": (8, 8), "Qwen2.5-7B": (4, 1)}
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


def _check(name: str, tmp_path: Path, config: dict | None = None) -> dict:
    """The worker's result for `CONFIGS[name]` (or `config`) at `PARALLEL`'s sizes."""
    tp, ep = PARALLEL.get(name, (8, 1))
    spec = tmp_path / "in.json"
    spec.write_text(json.dumps({"config": config or CONFIGS[name], "tp": tp, "ep": ep}))
    out = tmp_path / "out.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.trainer.meta_mapping_worker", str(spec), str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", CONFIGS)
def test_full_size_mapping_on_meta(name: str, tmp_path: Path) -> None:
    got = _check(name, tmp_path)
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

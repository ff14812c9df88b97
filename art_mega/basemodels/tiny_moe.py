"""A tiny Qwen3-MoE Hugging Face model for tests and benchmarks (seeded, no tokenizer).

Shares `art_mega.basemodels.tiny`'s seeded weight fill; transformers and torch are imported lazily.
"""

from __future__ import annotations

import json
from pathlib import Path

MOE_SIZES = {
    "vocab_size": 768,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_experts": 4,
    "num_experts_per_tok": 2,
}
"""2 layers of 4 experts (top-2, expert FFN 32), hidden 64, 4 heads / 2 KV heads of 32."""


def build_tiny_moe(out_dir: Path, *, fused: bool = False, norm_topk_prob: bool = True, seed: int = 0) -> Path:
    """A tiny Qwen3-MoE HF directory (config.json, model.safetensors; no tokenizer) in `out_dir`.

    Weights are `art_mega.basemodels.tiny`'s seeded fill. `fused` writes the expert weights as the
    3-D `mlp.experts.gate_up_proj` / `down_proj` tensors of transformers 5's module instead of
    the per-expert names `save_pretrained` writes. Idempotent per directory.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from art_mega.basemodels.tiny import _fill_weights

    if (out_dir / "model.safetensors").exists():
        return out_dir
    config = Qwen3MoeConfig(
        **MOE_SIZES,
        norm_topk_prob=norm_topk_prob,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=2048,
        architectures=["Qwen3MoeForCausalLM"],
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _fill_weights(model, seed, config.hidden_size)
    model.save_pretrained(out_dir, safe_serialization=True)
    if fused:
        state = {name: p.detach().contiguous() for name, p in model.state_dict().items()}
        save_file(state, out_dir / "model.safetensors", metadata={"format": "pt"})
    (out_dir / "art_mega_tiny_moe.json").write_text(json.dumps({"fused": fused, "seed": seed}))
    return out_dir

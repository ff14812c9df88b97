"""A tiny Gemma 4 MoE Hugging Face model for tests (seeded weights, the tiny models' tokenizer).

The tiny Gemma 4 of `art_mega.basemodels.tiny` (`GEMMA4_TINY`: a local layer, then a global layer
whose values are its keys, proportional RoPE, value norms, layer scalars, a logit cap) with the MoE
block of gemma-4-26B-A4B on both layers (transformers `Gemma4TextDecoderLayer`,
`enable_moe_block`): a dense GeGLU MLP of width 48 beside 4 routed experts of width 32 (top 2),
three more norms, and a router with its own input scale and a per-expert output scale, all filled
so that each shows in the logits. transformers and torch are imported lazily.
"""

from __future__ import annotations

import json
from pathlib import Path

GEMMA4_MOE_TINY = {
    "vocab_size": 768,
    "hidden_size": 64,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "sliding_window": 6,
    "enable_moe_block": True,
    "num_experts": 4,
    "top_k_experts": 2,
    "moe_intermediate_size": 32,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}
"""The sizes besides `tiny.GEMMA4_TINY`'s features: hidden 64, 4 heads / 2 KV heads of 32 on the
local layer, a dense MLP of 48 and 4 experts of 32 (top 2), tied embeddings."""

ROUTER_SCALE = 4.0
"""The router's projection is filled at 4x the linears' scale, so its softmax is far from uniform
and the top 2 (and their renormalised weights) depend on the router's maths."""

PER_EXPERT_SCALE = (0.5, 0.9, 1.3, 1.7)
"""`router.per_expert_scale`: far from 1 and different per expert, so a missing or misplaced
scale shows."""


def build_tiny_gemma4_moe(out_dir: Path, *, seed: int = 0) -> Path:
    """A tiny Gemma4ForCausalLM directory with the MoE block (config.json, model.safetensors with
    HF's fused experts `layers.{i}.experts.gate_up_proj` [4, 64, 64] / `down_proj` [4, 64, 32],
    the tiny tokenizer) in `out_dir`: `tiny._fill_weights`' seeded fill (norms around 1: Gemma 4
    scales by w), `router.scale` 1 + N(0, 0.3^2), the router projection times `ROUTER_SCALE`,
    `PER_EXPERT_SCALE`, layer scalars 0.9 / 1.1. Idempotent per directory."""
    import torch
    from transformers import AutoModelForCausalLM, Gemma4TextConfig

    from art_mega.basemodels.tiny import (
        GEMMA4_TINY,
        IM_END,
        PAD_TOKEN,
        SPECIAL_TOKENS,
        _fill_weights,
        _write_tokenizer,
    )

    out_dir = Path(out_dir)
    if (out_dir / "art_mega_tiny_gemma4_moe.json").exists():
        return out_dir
    config = Gemma4TextConfig(
        **GEMMA4_TINY,
        **GEMMA4_MOE_TINY,
        hidden_activation="gelu_pytorch_tanh",
        architectures=["Gemma4ForCausalLM"],
        bos_token_id=None,
        eos_token_id=SPECIAL_TOKENS.index(IM_END),
        pad_token_id=SPECIAL_TOKENS.index(PAD_TOKEN),
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _fill_weights(model, seed, config.hidden_size, 1.0)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            layer.layer_scalar.fill_(0.9 + 0.2 * i)
            layer.router.proj.weight.mul_(ROUTER_SCALE)
            noise = torch.randn(layer.router.scale.shape, generator=generator)
            layer.router.scale.copy_(1.0 + 0.3 * noise)
            layer.router.per_expert_scale.copy_(torch.tensor(PER_EXPERT_SCALE))
    model.generation_config.do_sample = True
    model.save_pretrained(out_dir, safe_serialization=True)
    _write_tokenizer(
        out_dir,
        {
            "vocab_size": config.vocab_size,
            "seed": seed,
            "max_position_embeddings": config.max_position_embeddings,
        },
    )
    (out_dir / "art_mega_tiny_gemma4_moe.json").write_text(json.dumps({"seed": seed}))
    return out_dir

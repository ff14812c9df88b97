"""A tiny Qwen3.5 MoE Hugging Face model for tests (seeded weights, the tiny models' tokenizer).

Every distinctive feature is live at this size: a gated delta-net layer (2 key heads shared by 4
value heads) then a gated full-attention layer (RoPE on a quarter of each head, QK norm), Qwen's
1 + w norms, and on both layers the sparse MoE block: a softmax top-2 router over 4 experts
(renormalised) plus a shared expert of another width behind its sigmoid gate. transformers and
torch are imported lazily.
"""

from __future__ import annotations

import json
from pathlib import Path

QWEN3_5_MOE_TINY = {
    "vocab_size": 768,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "layer_types": ["linear_attention", "full_attention"],
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
"""2 layers (gated delta-net, then gated full attention), hidden 64, 4 heads / 2 KV heads of 32,
4 experts of width 32 (top 2) and a shared expert of width 48, untied LM head."""

SHARED_GATE_SCALE = 4.0
"""The shared expert's gate is filled at 4x the linears' scale, so sigmoid(x w_g) spreads over
(0, 1) instead of sitting near 0.5 and a missing or misplaced gate shows in the logits."""


def build_tiny_qwen3_5_moe(out_dir: Path, *, seed: int = 0) -> Path:
    """A tiny Qwen3_5MoeForCausalLM directory (config.json, model.safetensors, the tiny tokenizer)
    in `out_dir`: `art_mega.basemodels.tiny`'s seeded fill with zero-centred norms (the delta-net's
    gated norm around 1), the shared expert gate times `SHARED_GATE_SCALE`. Idempotent per
    directory."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3_5MoeTextConfig

    from art_mega.basemodels.tiny import (
        IM_END,
        PAD_TOKEN,
        SPECIAL_TOKENS,
        _fill_weights,
        _plain_gated_norms,
        _write_tokenizer,
    )

    out_dir = Path(out_dir)
    if (out_dir / "art_mega_tiny_qwen3_5_moe.json").exists():
        return out_dir
    config = Qwen3_5MoeTextConfig(
        **QWEN3_5_MOE_TINY,
        architectures=["Qwen3_5MoeForCausalLM"],
        bos_token_id=None,
        eos_token_id=SPECIAL_TOKENS.index(IM_END),
        pad_token_id=SPECIAL_TOKENS.index(PAD_TOKEN),
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _fill_weights(model, seed, config.hidden_size, 0.0)
    _plain_gated_norms(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.shared_expert_gate.weight"):
                param.mul_(SHARED_GATE_SCALE)
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
    (out_dir / "art_mega_tiny_qwen3_5_moe.json").write_text(json.dumps({"seed": seed}))
    return out_dir

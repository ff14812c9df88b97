"""A tiny GPT-OSS Hugging Face model for tests (seeded weights, the tiny models' tokenizer).

Every distinctive GPT-OSS feature is live at this size: attention sinks large enough to matter,
a sliding layer (window 6) and a full layer, YaRN RoPE, biases everywhere, a biased top-2 router
over 4 experts, and expert gate/up values that reach the SwiGLU clamp (|x| > 7). transformers and
torch are imported lazily.
"""

from __future__ import annotations

import json
from pathlib import Path

GPT_OSS_TINY = {
    "vocab_size": 768,
    "hidden_size": 64,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "sliding_window": 6,
    "layer_types": ["sliding_attention", "full_attention"],
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 4.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 512,
    },
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "attention_bias": True,
    "tie_word_embeddings": False,
}
"""2 layers (sliding window 6, then full), hidden 64, 4 heads / 2 KV heads of 32, 4 experts of
width 32 (top 2), YaRN factor 4 over 512 positions (truncate false, as the published configs)."""

GATE_UP_SCALE = 4.0
"""The experts' gate_up_proj is filled at 4x the other linears' scale, so about 8% of gate and up
values pass the clamp at 7 and a missing or misplaced clamp shows in the logits."""

SINK_SCALE = 2.0
"""Sinks ~ N(0, 2^2): a sink takes a visible share of each softmax."""


def build_tiny_gpt_oss(out_dir: Path, *, seed: int = 0) -> Path:
    """A tiny GPT-OSS HF directory (config.json, model.safetensors, the tiny tokenizer) in `out_dir`.

    Weights are `art_mega.basemodels.tiny`'s seeded fill, then gate_up_proj times
    `GATE_UP_SCALE` and sinks times `SINK_SCALE` / their fill scale. Idempotent per directory.
    """
    import torch
    from transformers import AutoModelForCausalLM, GptOssConfig

    from art_mega.basemodels.tiny import IM_END, PAD_TOKEN, SPECIAL_TOKENS, _fill_weights, _write_tokenizer

    out_dir = Path(out_dir)
    if (out_dir / "art_mega_tiny_gpt_oss.json").exists():
        return out_dir
    config = GptOssConfig(
        **GPT_OSS_TINY,
        architectures=["GptOssForCausalLM"],
        bos_token_id=None,
        eos_token_id=SPECIAL_TOKENS.index(IM_END),
        pad_token_id=SPECIAL_TOKENS.index(PAD_TOKEN),
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _fill_weights(model, seed, config.hidden_size)
    heads = config.num_attention_heads
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("experts.gate_up_proj"):
                param.mul_(GATE_UP_SCALE)
            elif name.endswith("self_attn.sinks"):
                param.mul_(SINK_SCALE * heads**0.5)
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
    (out_dir / "art_mega_tiny_gpt_oss.json").write_text(json.dumps({"seed": seed}))
    return out_dir

"""A tiny DeepSeek-V3 Hugging Face model for tests (seeded weights, the tiny models' tokenizer).

Every distinctive DeepSeek-V3 feature is live at this size: multi-head latent attention with both
latent projections and their norms, YaRN RoPE on the rope part with mscale != mscale_all_dim (so
both the cos/sin factor and the softmax scale differ from 1), a dense first layer, then an MoE layer
of 8 routed experts (top 4 in 2 of 4 groups, sigmoid router with a correction bias that changes
the choice, scaling 2.5) and 2 shared experts. transformers and torch are imported lazily.
"""

from __future__ import annotations

import json
from pathlib import Path

DEEPSEEK_V3_TINY = {
    "vocab_size": 768,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "first_k_dense_replace": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_routed_experts": 8,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "n_shared_experts": 2,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 0.8,
        "original_max_position_embeddings": 512,
    },
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
"""2 layers (dense, then MoE), hidden 64, 4 MLA heads (q latent 32, kv latent 16, nope 16 + rope
8, v 16), 8 experts of width 32 (top 4 of 2 of 4 groups) + 2 shared, YaRN factor 4 over 512.
`scoring_func` / `topk_method` as the published config.json has them: transformers ignores them,
vLLM reads them (without "noaux_tc" it has no e_score_correction_bias and refuses the checkpoint's)."""

VLLM_MLA_SIZES = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128}
"""DeepSeek-V3's own latent and head sizes, for a tiny model vLLM serves: its MLA kernels are built
for a 576-wide latent cache (kv_lora_rank 512 + rope 64; vLLM 0.32's CPU_MLA supports only that,
`v1/attention/backends/mla/cpu_mla.py` get_supported_head_sizes)."""

BIAS_SCALE = 0.3
"""e_score_correction_bias ~ N(0, 0.3^2): about the spread of the sigmoid scores, so it moves the
chosen experts (a missing bias changes the logits)."""


def build_tiny_deepseek_v3(out_dir: Path, *, seed: int = 0, **sizes: int) -> Path:
    """A tiny DeepSeek-V3 HF directory (config.json, model.safetensors, the tiny tokenizer) in
    `out_dir`: `DEEPSEEK_V3_TINY` with `sizes` (config fields) over it, `art_mega.basemodels.tiny`'s
    seeded fill, then the routers' correction bias ~ N(0, BIAS_SCALE^2). Idempotent per directory."""
    import torch
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    from art_mega.basemodels.tiny import IM_END, PAD_TOKEN, SPECIAL_TOKENS, _fill_weights, _write_tokenizer

    out_dir = Path(out_dir)
    if (out_dir / "art_mega_tiny_deepseek_v3.json").exists():
        return out_dir
    config = DeepseekV3Config(
        **{**DEEPSEEK_V3_TINY, **sizes},
        architectures=["DeepseekV3ForCausalLM"],
        bos_token_id=None,
        eos_token_id=SPECIAL_TOKENS.index(IM_END),
        pad_token_id=SPECIAL_TOKENS.index(PAD_TOKEN),
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _fill_weights(model, seed, config.hidden_size)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buffer in sorted(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(BIAS_SCALE * torch.randn(buffer.shape, generator=generator))
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
    (out_dir / "art_mega_tiny_deepseek_v3.json").write_text(json.dumps({"seed": seed}))
    return out_dir

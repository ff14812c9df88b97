"""The published Qwen3.5 / Qwen3.6 config.json values: Qwen3.6-27B (dense), Qwen3.5-35B-A3B and
Qwen3.6-35B-A3B (MoE).

The Qwen3.6-27B config.json (Hugging Face Hub Qwen/Qwen3.6-27B, the same text
architecture as Qwen/Qwen3.5-27B): `Qwen3_5ForConditionalGeneration`, the text decoder in
`text_config` (its vision tower's config is left out: the trainer reads the text decoder only)."""

from __future__ import annotations

_LAYER_TYPES = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(64)]

QWEN3_6_27B = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "model_type": "qwen3_5",
    "image_token_id": 248056,
    "video_token_id": 248057,
    "vision_start_token_id": 248053,
    "vision_end_token_id": 248054,
    "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen3_5_text",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "bos_token_id": None,
        "dtype": "bfloat16",
        "eos_token_id": 248044,
        "full_attention_interval": 4,
        "head_dim": 256,
        "hidden_act": "silu",
        "hidden_size": 5120,
        "initializer_range": 0.02,
        "intermediate_size": 17408,
        "layer_types": _LAYER_TYPES,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 48,
        "linear_value_head_dim": 128,
        "mamba_ssm_dtype": "float32",
        "max_position_embeddings": 262144,
        "mlp_only_layers": [],
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "num_attention_heads": 24,
        "num_hidden_layers": 64,
        "num_key_value_heads": 4,
        "pad_token_id": None,
        "partial_rotary_factor": 0.25,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": [11, 11, 10],
            "partial_rotary_factor": 0.25,
            "rope_theta": 10000000,
            "rope_type": "default",
        },
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": 248320,
    },
}
"""Qwen3.6-27B: 64 layers (every 4th full attention: 24 query heads, 4 KV heads of width 256 with
the output gate, RoPE base 1e7 on a quarter of each head), 48 gated delta-net layers (16 key
heads, 48 value heads, widths 128, conv kernel 4), hidden 5120, FFN 17408, vocabulary 248320,
untied LM head."""

_MOE_LAYER_TYPES = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(40)]

QWEN3_5_35B_A3B = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"],
    "model_type": "qwen3_5_moe",
    "image_token_id": 248056,
    "video_token_id": 248057,
    "vision_start_token_id": 248053,
    "vision_end_token_id": 248054,
    "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen3_5_moe_text",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "dtype": "bfloat16",
        "eos_token_id": 248044,
        "full_attention_interval": 4,
        "head_dim": 256,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "layer_types": _MOE_LAYER_TYPES,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_value_head_dim": 128,
        "mamba_ssm_dtype": "float32",
        "max_position_embeddings": 262144,
        "mlp_only_layers": [],
        "moe_intermediate_size": 512,
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "num_attention_heads": 16,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 40,
        "num_key_value_heads": 2,
        "output_router_logits": False,
        "partial_rotary_factor": 0.25,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": [11, 11, 10],
            "partial_rotary_factor": 0.25,
            "rope_theta": 10000000,
            "rope_type": "default",
        },
        "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": 512,
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": 248320,
    },
}
"""Qwen3.5-35B-A3B (Hub Qwen/Qwen3.5-35B-A3B): 40 layers (every 4th gated full attention: 16
query heads, 2 KV heads of width 256, RoPE base 1e7 on a quarter of each head), 30 gated delta-net
layers (16 key heads, 32 value heads, widths 128, conv kernel 4), every layer an MoE block of 256
experts of width 512 (top 8) plus a gated shared expert of width 512; hidden 2048, vocabulary
248320, untied LM head. Its checkpoint keeps the experts fused (`mlp.experts.gate_up_proj`)."""

QWEN3_6_35B_A3B = {
    **QWEN3_5_35B_A3B,
    "text_config": {**QWEN3_5_35B_A3B["text_config"], "bos_token_id": 248044},
}
"""Qwen3.6-35B-A3B (Hub Qwen/Qwen3.6-35B-A3B): the same text architecture as Qwen3.5-35B-A3B;
its config.json differs in the text config's bos_token_id only."""

QWEN3_5_0_8B = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "model_type": "qwen3_5",
    "tie_word_embeddings": True,
    "text_config": {
        **QWEN3_6_27B["text_config"],
        "hidden_size": 1024,
        "intermediate_size": 3584,
        "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 6,
        "linear_num_value_heads": 16,
        "num_attention_heads": 8,
        "num_hidden_layers": 24,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
    },
}
"""Qwen3.5-0.8B (Hub Qwen/Qwen3.5-0.8B, as a public repository's test quotes its config.json at
revision 2fc06364; the vision config left out): Qwen3.6-27B's text architecture at hidden 1024, 24
layers (8 heads, 2 KV heads; 16 key and 16 value delta-net heads), FFN 3584, and tied embeddings
(no lm_head: the LM head is the embedding)."""

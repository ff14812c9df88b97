"""Published GPT-OSS configs the tests read (no imports: the unit tests use them without torch)."""

_GPT_OSS = {
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "eos_token_id": 200002,
    "experts_per_token": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "initial_context_length": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 2880,
    "max_position_embeddings": 131072,
    "model_type": "gpt_oss",
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_key_value_heads": 8,
    "output_router_logits": False,
    "pad_token_id": 199999,
    "quantization_config": {
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
        "quant_method": "mxfp4",
    },
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "router_aux_loss_coef": 0.9,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 201088,
}

GPT_OSS_20B = {
    **_GPT_OSS,
    "num_hidden_layers": 24,
    "num_local_experts": 32,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
}
GPT_OSS_120B = {
    **_GPT_OSS,
    "num_hidden_layers": 36,
    "num_local_experts": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 18,
}
"""openai/gpt-oss-20b and openai/gpt-oss-120b config.json (the Hub's, transformers 4.55 era)."""

GPT_OSS_PARAMETERS = {"gpt-oss-20b": 20_914_757_184, "gpt-oss-120b": 116_829_156_672}
"""Parameter counts of the bf16 architecture (MXFP4 experts dequantized): embeddings and LM head
2 x 201088 x 2880, per layer q/k/v/o with biases, 64 sinks, 2 norms, the biased router and the
experts' gate_up [E, 2880, 5760] + bias and down [E, 2880, 2880] + bias; the model cards' 21B and 117B."""

"""Published Gemma 3 configs the tests read (no imports: the unit tests use them without torch)."""

GEMMA3_27B_TEXT = {
    "model_type": "gemma3_text",
    "head_dim": 128,
    "hidden_size": 5376,
    "intermediate_size": 21504,
    "num_attention_heads": 32,
    "num_hidden_layers": 62,
    "num_key_value_heads": 16,
    "query_pre_attn_scalar": 168,
    "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
    "sliding_window": 1024,
    # Gemma3TextConfig's defaults, which the published text_config leaves out:
    "vocab_size": 262208,
    "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0,
    "sliding_window_pattern": 6,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "hidden_activation": "gelu_pytorch_tanh",
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
    "tie_word_embeddings": True,
}
"""google/gemma-3-27b-it's config.json `text_config` with Gemma3TextConfig's defaults (transformers 5.19)."""

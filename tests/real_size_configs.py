"""Published full-size config.json values of the existing families and their parameter counts:
built on the meta device by `tests/trainer/test_real_size_mapping.py`, sized analytically by
`tests/unit/trainer/test_memory_plan.py`."""

from __future__ import annotations

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

CONFIGS["Llama-3.2-1B"] = {
    **_LLAMA31,
    "head_dim": 64,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_attention_heads": 32,
    "num_hidden_layers": 16,
    "num_key_value_heads": 8,
    "rope_scaling": {**_LLAMA31["rope_scaling"], "factor": 32.0},
    "tie_word_embeddings": True,
}
CONFIGS["Mistral-7B-v0.1"] = {
    "architectures": ["MistralForCausalLM"],
    "model_type": "mistral",
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "tie_word_embeddings": False,
    "vocab_size": 32000,
    "torch_dtype": "bfloat16",
}
CONFIGS["Qwen2.5-1.5B"] = {
    **_QWEN25_7B,
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "tie_word_embeddings": True,
    "vocab_size": 151936,
}
"""Configs not in the families' own tests, each with a feature the others lack: Llama-3.2-1B's tied
embeddings on a llama model, its explicit head_dim and llama3 RoPE factor 32; Mistral-7B-v0.1's
4096-token sliding window on every layer; Qwen2.5-1.5B's tied embeddings on qwen2 and 2 KV heads
(TP=4 at most). The Hub was not reachable from here: the values are those public repositories
quote from the Hub's config.json (meta-llama/Llama-3.2-1B-Instruct's in a model-blocks repo's
`hf_llama/llama_config.py`, with its commit hash; Mistral-7B-v0.1's and Qwen2.5-1.5B's as the
Hub's files, cross-checked against their published parameter counts in `PUBLISHED`)."""

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
    "Llama-3.2-1B": 1_235_814_400,
    "Mistral-7B-v0.1": 7_241_732_096,
    "Qwen2.5-1.5B": 1_543_714_304,
}
"""Parameter counts of the published safetensors checkpoints (the Hub's model pages)."""

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

GEMMA3_27B_IT = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "boi_token_index": 255999,
    "eoi_token_index": 256000,
    "eos_token_id": [1, 106],
    "image_token_index": 262144,
    "initializer_range": 0.02,
    "mm_tokens_per_image": 256,
    "model_type": "gemma3",
    "text_config": {
        "head_dim": 128,
        "hidden_size": 5376,
        "intermediate_size": 21504,
        "model_type": "gemma3_text",
        "num_attention_heads": 32,
        "num_hidden_layers": 62,
        "num_key_value_heads": 16,
        "query_pre_attn_scalar": 168,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
    "torch_dtype": "bfloat16",
    "transformers_version": "4.50.0.dev0",
    "vision_config": {
        "hidden_size": 1152,
        "image_size": 896,
        "intermediate_size": 4304,
        "model_type": "siglip_vision_model",
        "num_attention_heads": 16,
        "num_hidden_layers": 27,
        "patch_size": 14,
        "vision_use_head": False,
    },
}
"""google/gemma-3-27b-it's config.json as published (the multimodal wrapper, its sparse text_config)."""

GEMMA4_31B_TEXT = {
    "model_type": "gemma4_text",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attention_k_eq_v": True,
    "enable_moe_block": False,
    "final_logit_softcapping": 30.0,
    "global_head_dim": 512,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 5376,
    "hidden_size_per_layer_input": 0,
    "intermediate_size": 21504,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 10,
    "max_position_embeddings": 262144,
    "num_attention_heads": 32,
    "num_experts": None,
    "num_global_key_value_heads": 4,
    "num_hidden_layers": 60,
    "num_key_value_heads": 16,
    "num_kv_shared_layers": 0,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {
        "full_attention": {
            "partial_rotary_factor": 0.25,
            "rope_theta": 1000000.0,
            "rope_type": "proportional",
        },
        "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
    },
    "sliding_window": 1024,
    "tie_word_embeddings": True,
    "top_k_experts": None,
    "use_bidirectional_attention": "vision",
    "use_cache": True,
    "use_double_wide_mlp": False,
    "vocab_size": 262144,
    "vocab_size_per_layer_input": 262144,
}
"""google/gemma-4-31B's config.json `text_config` (60 layers, every 6th global: head 512, 4 KV
heads whose values are their keys; local layers head 256, 16 KV heads, window 1024). Not in
`CONFIGS`: the memory plan's `ModelShape` has one head shape for every layer."""
GEMMA4_31B_IT = {
    "architectures": ["Gemma4ForConditionalGeneration"],
    "model_type": "gemma4",
    "tie_word_embeddings": True,
    "text_config": GEMMA4_31B_TEXT,
}
"""google/gemma-4-31B's config.json as published: the multimodal wrapper (model_type "gemma4") with
the decoder in `text_config`; its vision_config is left out (transformers then builds no vision
tower; the published one the trainer would not read)."""
GEMMA4_26B_A4B_TEXT = {
    "model_type": "gemma4_text",
    "attention_bias": False,
    "attention_k_eq_v": True,
    "enable_moe_block": True,
    "final_logit_softcapping": 30.0,
    "global_head_dim": 512,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 2816,
    "hidden_size_per_layer_input": 0,
    "intermediate_size": 2112,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 5,
    "max_position_embeddings": 262144,
    "moe_intermediate_size": 704,
    "num_attention_heads": 16,
    "num_experts": 128,
    "num_global_key_value_heads": 2,
    "num_hidden_layers": 30,
    "num_key_value_heads": 8,
    "num_kv_shared_layers": 0,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {
        "full_attention": {
            "partial_rotary_factor": 0.25,
            "rope_theta": 1000000.0,
            "rope_type": "proportional",
        },
        "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
    },
    "sliding_window": 1024,
    "tie_word_embeddings": True,
    "top_k_experts": 8,
    "use_double_wide_mlp": False,
    "vocab_size": 262144,
}
"""google/gemma-4-26B-A4B's config.json `text_config` (30 layers, every 6th global: head 512, 2 KV
heads whose values are their keys; local layers head 256, 8 KV heads, window 1024; on every layer
a dense GeGLU MLP of 2112 beside 128 experts of 704, top 8). The Hub was not reachable from here:
the values are those quoted, identically, by several public repositories' tests of the published
config (a Go `TestParseTextConfig26B`, a Rust Gemma4Config `SAMPLE` with all these keys, a Rust
`test_gemma4_config_parse`, found with the library's code search), and agree with the model card's
30 layers, 128 experts, top 8, window 1024 and 256K context; fields they do not quote are left to
transformers' Gemma4TextConfig defaults."""

DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "pretraining_tp": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 129280,
}
"""deepseek-ai/DeepSeek-V3's config.json on the Hugging Face Hub (FP8 weights with 128x128 block
scales; its 62nd layer, index 61, is the multi-token-prediction module). Kept out of `CONFIGS`:
`trainer.memory_plan` has no MLA shape (tests/trainer/test_deepseek_v3_family.py uses it)."""

DEEPSEEK_V3_PARAMETERS = 671_026_404_352
"""DeepSeek-V3's parameters without the MTP module (the "671B" of its model card; the Hub's 685B
counts the 14B MTP layer too): embeddings 2 x 129280 x 7168, 3 dense and 58 MoE layers of MLA
(187,107,328 each) + norms, dense MLP 3 x 7168 x 18432, MoE 256 + 1 shared experts of 3 x 7168 x
2048 and a 256 x 7168 router, final norm. The routers' e_score_correction_bias are buffers, not
parameters, in both transformers and megatron-core."""

KIMI_K2 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModel": "modeling_deepseek.DeepseekV3Model",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
    },
    "aux_loss_alpha": 0.001,
    "bos_token_id": 163584,
    "eos_token_id": 163585,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 131072,
    "model_type": "kimi_k2",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 1,
    "n_routed_experts": 384,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 64,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 64,
    "num_nextn_predict_layers": 0,
    "pretraining_tp": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 50000.0,
    "routed_scaling_factor": 2.827,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.48.3",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 163840,
}
"""moonshotai/Kimi-K2-Instruct's config.json on the Hugging Face Hub: model_type "kimi_k2" with
DeepSeek-V3's architecture and remote code (`auto_map`), 384 routed experts of which 8 per token
without group limits (n_group = topk_group = 1), one dense layer, 64 MLA heads, YaRN factor 32
with beta_fast 1, FP8 128x128 block scales and no MTP layer. The deepseek_v3 family reads it
(`families/deepseek_v3.py`); kept out of `CONFIGS` like `DEEPSEEK_V3`."""

KIMI_K2_PARAMETERS = 1_026_408_209_408
"""Kimi-K2's parameters (the "1T" of its model card; transformers' DeepseekV3ForCausalLM on the
meta device from `KIMI_K2`): embeddings 2 x 163840 x 7168, 61 layers of MLA (101,124,096 each
with 64 heads) + 2 norms, 1 dense MLP 3 x 7168 x 18432, 60 MoE layers of 384 + 1 shared experts
of 3 x 7168 x 2048 and a 384 x 7168 router, final norm."""

GEMMA3_4B_IT = {
    **GEMMA3_27B_IT,
    "text_config": {
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "model_type": "gemma3_text",
        "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
}
"""google/gemma-3-4b-it's config.json: gemma-3-27b-it's wrapper and vision tower with a sparser
`text_config` that leaves heads (8), KV heads (4), head_dim and query_pre_attn_scalar (256) to
Gemma3TextConfig's defaults (`gemma3.TEXT_DEFAULTS`), as quoted by public repositories' tests."""

GEMMA3_4B_IT_TEXT_PARAMETERS = 3_880_263_168
"""gemma-3-4b-it's text decoder (keras-hub's gemma3_4b_text preset, 3,880,099,328, counts a
vocabulary of 262144; transformers' 262208 adds 64 x 2560)."""

KIMI_K2_THINKING_QUANTIZATION = {
    "config_groups": {
        "group_0": {
            "input_activations": None,
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {
                "dynamic": False,
                "group_size": 32,
                "num_bits": 4,
                "strategy": "group",
                "symmetric": True,
                "type": "int",
            },
        }
    },
    "format": "pack-quantized",
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}
"""moonshotai/Kimi-K2-Thinking's `quantization_config` (abridged: its `ignore` list left out): the
routed experts as int4 in groups of 32 (compressed-tensors), the rest of the config Kimi-K2's."""

_MOONLIGHT = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "first_k_dense_replace": 1,
    "hidden_size": 2048,
    "intermediate_size": 11264,
    "kv_lora_rank": 512,
    "max_position_embeddings": 8192,
    "moe_intermediate_size": 1408,
    "n_group": 1,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "num_attention_heads": 16,
    "num_experts_per_tok": 6,
    "num_hidden_layers": 27,
    "num_key_value_heads": 16,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rope_theta": 50000.0,
    "routed_scaling_factor": 2.446,
    "scoring_func": "sigmoid",
    "topk_group": 1,
    "v_head_dim": 128,
    "vocab_size": 163840,
}
_GEMMA4_E2B = {
    "architectures": ["Gemma4ForConditionalGeneration"],
    "model_type": "gemma4",
    "text_config": {
        "model_type": "gemma4_text",
        "hidden_size": 1536,
        "hidden_size_per_layer_input": 256,
        "intermediate_size": 6144,
        "num_attention_heads": 8,
        "num_hidden_layers": 35,
        "num_key_value_heads": 1,
        "num_kv_shared_layers": 20,
        "vocab_size": 262144,
    },
}
_SUPPORTED = (
    "deepseek_v3, gemma3, gemma3_text, gemma4, gemma4_text, gpt_oss, kimi_k2, llama, mistral, qwen2, qwen3, "
    "qwen3_5, qwen3_5_moe, qwen3_5_moe_text, qwen3_5_text, qwen3_moe"
)
REFUSED = {
    "Moonlight-16B-A3B": (
        _MOONLIGHT,
        "q_lora_rank=null (a query without its low-rank projection) is not supported; "
        "use a DeepSeek-V3 checkpoint with q_lora_rank set.",
    ),
    "Kimi-K2-Thinking": (
        {**KIMI_K2, "quantization_config": KIMI_K2_THINKING_QUANTIZATION},
        "quantization_config (quant_method='compressed-tensors') is not supported for DeepSeek-V3; "
        "use DeepSeek's block-scaled e4m3 fp8 checkpoint or a bf16 one.",
    ),
    "DeepSeek-V2-Lite": (
        {
            **_MOONLIGHT,
            "architectures": ["DeepseekV2ForCausalLM"],
            "model_type": "deepseek_v2",
            "intermediate_size": 10944,
            "norm_topk_prob": False,
            "rope_theta": 10000.0,
            "routed_scaling_factor": 1.0,
            "vocab_size": 102400,
        },
        f"model_type='deepseek_v2' is not supported by the Megatron trainer; supported: {_SUPPORTED}.",
    ),
    "gemma-4-E2B": (
        _GEMMA4_E2B,
        "hidden_size_per_layer_input=256 (per-layer input embeddings, Gemma 4 E2B/E4B) is not implemented "
        "by the Megatron trainer; use a Gemma 4 model without them (31B, 0).",
    ),
    "gemma-4-E2B-text": (
        _GEMMA4_E2B["text_config"],
        "hidden_size_per_layer_input=256 (per-layer input embeddings, Gemma 4 E2B/E4B) is not implemented "
        "by the Megatron trainer; use a Gemma 4 model without them (31B, 0).",
    ),
    "Mistral-Small-3.1-24B-Instruct-2503": (
        {
            "architectures": ["Mistral3ForConditionalGeneration"],
            "model_type": "mistral3",
            "text_config": {**CONFIGS["Mistral-7B-v0.3"], "hidden_size": 5120, "intermediate_size": 32768},
        },
        f"model_type='mistral3' is not supported by the Megatron trainer; supported: {_SUPPORTED}.",
    ),
}
"""Published configs the trainer refuses at `register` (`check_model_fits`), each with its one
sentence: moonshotai/Moonlight-16B-A3B (DeepSeek-V3's architecture with a full-rank query),
Kimi-K2-Thinking (int4 experts), deepseek-ai/DeepSeek-V2-Lite (deepseek_v2: Moonlight's MLA and
expert sizes with a softmax router), google/gemma-4-E2B as published (the multimodal "gemma4"
wrapper) and its text_config alone (per-layer inputs, both), and
mistralai/Mistral-Small-3.1-24B-Instruct-2503 (the multimodal "mistral3" wrapper, not read; its
text_config abridged). Abridged to the fields that decide; values as public repositories' tests
quote the Hub's files (the Hub was not reachable from here)."""

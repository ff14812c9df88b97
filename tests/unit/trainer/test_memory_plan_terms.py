"""The memory plan's family-specific terms (`trainer.prepare.model_shape`, `memory_plan`), each
checked against values computed by hand here from published configs: GPT-OSS's explicit sink
scores, Qwen3.5's gradient-free first delta-net layer and its masks on softmax layers only, Gemma 4's
logit cap and its MoE block (dense MLP, router scales, block norms), shared experts' LoRA and
activations. The tiny models' measured peaks against these terms are benchmarks/RESULTS.md's
`benchmarks/memory_plan.py --quick` rows."""

from __future__ import annotations

from art_mega.trainer.families import family_for
from art_mega.trainer.prepare.memory_plan import ModelShape, logits_bytes, rank_terms
from tests.real_size_configs import CONFIGS, DEEPSEEK_V3, GEMMA4_26B_A4B_TEXT, GEMMA4_31B_TEXT
from tests.trainer.gpt_oss_configs import GPT_OSS_20B
from tests.trainer.qwen3_5_configs import QWEN3_5_35B_A3B, QWEN3_6_27B

TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def shape_of(config: dict) -> ModelShape:
    return ModelShape.from_args(family_for(config).model_args(config))


def test_gemma4_moe_counts_its_dense_mlp_router_scales_and_block_norms() -> None:
    shape = shape_of(GEMMA4_26B_A4B_TEXT)
    assert (shape.shared_expert_ffn_hidden_size, shape.norms_per_layer, shape.router_scales) == (
        2112,
        7,
        True,
    )
    # transformers' Gemma4ForCausalLM of this config on the meta device: 25,233,141,760 parameters;
    # beyond the experts, each of the 30 layers holds the dense GeGLU MLP 3 x 2816 x 2112, three
    # more norms of 2816, the router's input scale [2816] and per-expert scale [128]
    assert shape.parameters() == 25_233_141_760
    without = shape.model_copy(
        update={"shared_expert_ffn_hidden_size": 0, "norms_per_layer": 4, "router_scales": False}
    )
    assert shape.parameters() - without.parameters() == 30 * (3 * 2816 * 2112 + 3 * 2816 + 2816 + 128)


def test_gpt_oss_sinks_keep_float32_scores_and_peak_in_the_forward() -> None:
    shape = shape_of(GPT_OSS_20B)
    assert shape.attention_sinks
    # 64 heads, 1024 tokens, bfloat16: the softmax's float32 output [64, 1024, 1025], the bf16
    # probabilities [64, 1024, 1024] and float32 q and repeated k [64, 1024, 64] are kept; the
    # masked scores and their concatenation with the sink column are held while the softmax runs
    scores = 64 * 1024 * 1025 * 4
    assert scores == 268_697_600
    assert shape.scores_bytes(1, 2, 1, 1024) == (scores + 64 * 1024 * (1024 * 2 + 2 * 64 * 4), 2 * scores)
    assert shape.scores_bytes(2, 4, 1, 1024) == (scores // 2, scores)  # float32: no copies; 32 heads
    assert shape.model_copy(update={"attention_sinks": False}).scores_bytes(1, 2, 1, 1024) == (0, 0)
    common = {"tp": 1, "dtype": "bfloat16", "lora_rank": 8, "row_tokens": 1024}
    sinks = rank_terms(shape, **common)
    sdpa = rank_terms(shape.model_copy(update={"attention_sinks": False}), **common)
    # every layer keeps the scores instead of SDPA's additive mask [1024, 1024] in 2 bytes; the
    # transient (537 MB) is under the logits' working set (201088 x 1024 x 27 bytes), so no more
    assert sinks["logits"] == 201088 * 1024 * 27 > 2 * scores
    assert sinks["activations"] - sdpa["activations"] == 24 * (436_469_760 - 1024 * 1024 * 2)
    # a first pipeline stage has no logits: the transient counts, less one layer's MLP activations
    # (not yet allocated when the last layer's softmax runs): 4 routed copies, fc1 outputs and
    # SwiGLU (4 x (2880 + 5 x 2880)), 32 router logits and 4 x 2 LoRA x A^T of rank 8
    mlp = 4 * (2880 + 5 * 2880) + 32 + 8 * 8
    assert mlp == 69_216
    staged = {**common, "pp": 2, "stage": 0, "microbatches": 1}
    assert (
        rank_terms(shape, **staged)["activations"]
        - rank_terms(shape.model_copy(update={"attention_sinks": False}), **staged)["activations"]
        == 12 * (436_469_760 - 1024 * 1024 * 2) + 2 * scores - mlp * 1024 * 2
    )


def test_qwen3_5_first_delta_layer_keeps_nothing_and_only_softmax_layers_keep_a_mask() -> None:
    shape = shape_of(QWEN3_6_27B)
    assert (shape.first_layer_delta, shape.delta_layers, shape.num_layers) == (True, 48, 64)
    # layer 0: its input norm's input, 1/rms and output, the pre-MLP norm's input and 1/rms
    # (3 x 5120 + 2), and the delta-net mixer's own: 3 x conv channels (2 x 16 x 128 + 48 x 128)
    # + 3 x value heads x width (48 x 128) + 2 x 48
    assert shape.first_layer_unkept_elements(1) == 3 * 5120 + 2 + 3 * 10240 + 3 * 6144 + 2 * 48 == 64_610
    assert shape.first_layer_unkept_elements(2) == 3 * 5120 + 2 + (3 * 10240 + 3 * 6144 + 2 * 48) // 2
    terms = rank_terms(shape, tp=1, dtype="bfloat16", lora_rank=8, row_tokens=1024)
    elements = shape.layers_activation_elements(1, 8, TARGETS)
    # the 16 softmax-attention layers' additive masks in 2 bytes (not 64), the bool mask, the
    # final norm's input and 1/rms, less layer 0's
    assert terms["activations"] == (
        elements * 1024 * 2 + 16 * 1024 * 1024 * 2 + 1024 * 1024 + (5121 - 64_610) * 1024 * 2
    )
    # with full recomputation layer 0 is rebuilt like the others: nothing is taken off
    full = rank_terms(shape, tp=1, dtype="bfloat16", lora_rank=8, row_tokens=1024, recompute="full")
    assert full["activations"] == (
        64 * 5120 * 1024 * 2
        + (elements * 1024 * 2 + 16 * 1024 * 1024 * 2) // 64
        + 1024 * 1024
        + 5121 * 1024 * 2
    )


def test_gemma4_logit_cap_keeps_the_tanh_of_the_logits() -> None:
    shape = shape_of(GEMMA4_31B_TEXT)
    assert shape.logit_softcapping
    # capped logits and tanh(logits / cap) in 2 bytes each, the float32 copy, the entropy's 21
    common = {"tp": 2, "cp": 1, "row_tokens": 1024, "micro_batch_rows": 1, "logprob_chunk": None}
    assert logits_bytes(shape, dtype="bfloat16", **common) == 131072 * 1024 * (2 * 2 + 4 + 21)
    assert logits_bytes(
        shape.model_copy(update={"logit_softcapping": False}), dtype="bfloat16", **common
    ) == (131072 * 1024 * (2 + 4 + 21))


def test_shared_expert_has_lora_and_keeps_its_mlp_activations() -> None:
    shape = shape_of(QWEN3_5_35B_A3B)
    # 10 softmax layers' qkv (2048 + (16 + 16 + 2 x 2) x 256) and proj (16 x 256 + 2048); on all
    # 40 layers 256 experts' fc1 (2048 + 2 x 512) and fc2 (512 + 2048) and the shared expert's
    assert shape.lora_parameters(8, TARGETS) == 8 * (
        10 * ((2048 + 9216) + (4096 + 2048)) + 40 * (256 * (3072 + 2560) + 3072 + 2560)
    )
    assert shape.lora_parameters(8, TARGETS, tp=2) == 8 * (
        10 * ((2048 + 4608) + (2048 + 2048)) + 40 * (256 * (3072 + 2560) + (2048 + 512) + (256 + 2048))
    )
    alone = shape.model_copy(update={"shared_expert_ffn_hidden_size": 0})
    # the shared expert's fc1 output, GLU halves and product (5 x 512) and its two LoRA x A^T (2 x 8)
    assert shape.layers_activation_elements(1, 8, TARGETS) - alone.layers_activation_elements(
        1, 8, TARGETS
    ) == (40 * (5 * 512 + 2 * 8))


def test_mla_on_cpu_keeps_the_math_kernels_probabilities_and_a_frozen_first_layer_keeps_none() -> None:
    shape = shape_of(DEEPSEEK_V3)
    assert (shape.num_heads, shape.head_dim, shape.v_head_dim) == (128, 192, 128)
    # 16 heads a rank at tp=8, 1024 tokens, 2 bytes: CPU SDPA's math path for q/k width 192 and
    # v width 128 keeps the probabilities; its backward holds their gradient and the softmax's
    assert shape.scores_bytes(8, 2, 1, 1024, cpu=True) == (16 * 1024 * 1024 * 2, 2 * 16 * 1024 * 1024 * 2)
    assert shape.scores_bytes(8, 2, 1, 1024) == (0, 0)  # a GPU's memory-efficient kernel keeps none
    # the default targets wrap no MLA projection: the first layer's q, k, v need no gradient
    assert shape.mla_frozen_first_layer(TARGETS)
    assert not shape.mla_frozen_first_layer((*TARGETS, "linear_q_down_proj"))
    # its norm's input, 1/rms and output (2 x 7168/8 + 1, sequence parallel), q, k, v and the
    # log-sum-exp ((3 x 128 x 192 + 128)/8) and RoPE's cos and sin (4 x 192)
    assert shape.first_layer_unkept_elements(8, TARGETS) == 2 * 896 + 1 + (3 * 128 * 192 + 128) // 8 + 4 * 192
    common = {"tp": 8, "ep": 8, "dtype": "bfloat16", "lora_rank": 8, "row_tokens": 1024}
    cpu, gpu = rank_terms(shape, cpu=True, **common), rank_terms(shape, **common)
    # 60 of 61 layers keep probabilities instead of the additive mask; the transient is under the
    # logits' working set (129280/8 x 1024 x 27 bytes)
    assert cpu["activations"] - gpu["activations"] == 60 * (16 * 1024 * 1024 * 2 - 1024 * 1024 * 2)


def _adapter_elements(config: dict, rank: int) -> int:
    """The trainer's LoRA parameters on one rank at TP=1, counted from the other side: the PEFT
    adapter's tensors (`peft_io.adapter_layout`, every target of the family) less the copies of
    each fused layer's one lora_A (q/k/v_proj, gate/up_proj share it)."""
    from art_mega.trainer.peft_io import adapter_layout

    spec = family_for(config)
    names = spec.lora_names(spec.model_args(config))
    layout = adapter_layout(config, rank, names.hf_target_modules(names.targets))
    total = sum(a * b for a, b in layout.shapes.values())
    return total - sum((len(group) - 1) * rank * layout.shapes[group[0]][1] for group in layout.shared_a)


def test_lora_parameters_count_every_target_the_families_train() -> None:
    """Qwen3.5's delta-net projections and DeepSeek-V3's MLA projections are in their default
    LoRA (ART's): the plan counted neither (Qwen3.6-27B: 14.5M parameters at r=8, 233 MB with
    their gradient and Adam moments; DeepSeek-V3: 20.8M), nor DeepSeek-V3's first 3 dense layers'
    MLP LoRA as dense (it counted experts there: 124.6M more). (Gemma 4's adapter also holds a copy
    of k_proj's B as v_proj on its k_eq_v layers, for vLLM, which the trainer does not.)"""
    for config in (QWEN3_6_27B, QWEN3_5_35B_A3B, DEEPSEEK_V3, GPT_OSS_20B, CONFIGS["Llama-3.1-8B"]):
        spec = family_for(config)
        targets = spec.lora_names(spec.model_args(config)).targets
        assert shape_of(config).lora_parameters(8, targets) == _adapter_elements(config, 8), config["model_type"]

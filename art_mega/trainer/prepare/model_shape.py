"""The sizes of a model that its memory depends on (`ModelShape`), from the family's architecture
arguments alone, and the analytic parameter, LoRA, activation and KV-cache counts over them: the
formulas of `memory_plan` (its module docstring gives each term and its source).

Torch-free, like `memory_plan`, which builds the per-rank and per-replica plan from them.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict

_ATTENTION_TARGETS = ("linear_qkv", "linear_proj", "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj")
"""The LoRA targets of a self-attention (or MLA) mixer, Megatron names."""
_LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


class _Plan(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelShape(_Plan):
    """The sizes of a model that its memory depends on, from the family's `model_args`.

    `num_experts` 0: a dense MLP of `ffn_hidden_size`; else every layer is an MoE layer of
    `num_experts` experts of `expert_ffn_hidden_size`, `top_k` routed a token, and a router.
    `norms_per_layer`: RMSNorms of width hidden a layer (2; Gemma 3 and 4: 4). Gemma 4's
    `global_layers` have their own fused-QKV rows and query width (`global_qkv_rows`,
    `global_head_dim`); the activation estimate uses the other layers' shape for them.
    MoE extras: the first `dense_layers` layers have a dense MLP of `ffn_hidden_size` instead
    (DeepSeek-V3's first_k_dense_replace); every MoE layer's shared expert of
    `shared_expert_ffn_hidden_size` (0: none; DeepSeek-V3's n_shared_experts x its expert width)
    and, with `shared_expert_gate`, its [1, hidden] gate (Qwen3.5 MoE). `kv_lora_rank` > 0:
    multi-head latent attention (DeepSeek-V3: `q_lora_rank`, `kv_lora_rank`, `qk_rope_head_dim`,
    `v_head_dim`, head_dim = nope + rope), counted by `_mla_parameters`; its LoRA has no
    linear_qkv and a linear_proj of heads x v_head_dim, its activation estimate the GQA shape
    (with `scores_bytes`' CPU math kernel and `mla_frozen_first_layer`). Gemma 4's MoE block
    (`router_scales`): the dense MLP beside the experts is its shared expert of `ffn_hidden_size`
    (`gemma4_moe`), the router has an input scale [h] and a per-expert scale [E], and the block
    adds 3 norms a layer (7 in all).

    Activation-only facts: `attention_sinks` (GPT-OSS: the scores are computed explicitly,
    `sdpa_attention._attention_with_sinks`), `first_layer_delta` (layer 0 is a gated delta-net
    layer: with the embedding frozen and its projections not LoRA-wrapped it keeps nothing) and
    `logit_softcapping` (Gemma 4's final cap keeps the tanh of the logits for its backward).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    norms_per_layer: int = 2
    num_experts: int = 0
    top_k: int = 0
    expert_ffn_hidden_size: int = 0
    attention_output_gate: bool = False
    delta_layers: int = 0
    delta_key_heads: int = 0
    delta_value_heads: int = 0
    delta_key_dim: int = 0
    delta_value_dim: int = 0
    delta_conv_kernel: int = 0
    gpt_oss_biases: bool = False
    mxfp4_experts: bool = False
    global_layers: int = 0
    global_head_dim: int = 0
    global_qkv_rows: int = 0
    dense_layers: int = 0
    shared_expert_ffn_hidden_size: int = 0
    shared_expert_gate: bool = False
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    router_scales: bool = False
    attention_sinks: bool = False
    first_layer_delta: bool = False
    logit_softcapping: bool = False

    @classmethod
    def from_args(cls, args: Any) -> ModelShape:
        """From a family's architecture arguments (`llama.DenseArgs`, `qwen3_moe.MoeArgs`,
        `gemma3.Gemma3Args`, `qwen3_5.Qwen35Args`, `gpt_oss.GptOssArgs`)."""
        from art_mega.trainer.families.gemma3 import Gemma3Args
        from art_mega.trainer.families.gpt_oss import GptOssArgs
        from art_mega.trainer.families.qwen3_5 import Qwen35Args

        hybrid: dict[str, Any] = {}
        if isinstance(args, Qwen35Args):
            hybrid = {
                "attention_output_gate": True,
                "delta_layers": sum(1 for linear in args.linear_layers if linear),
                "delta_key_heads": args.linear_num_key_heads,
                "delta_value_heads": args.linear_num_value_heads,
                "delta_key_dim": args.linear_key_head_dim,
                "delta_value_dim": args.linear_value_head_dim,
                "delta_conv_kernel": args.linear_conv_kernel_dim,
                "first_layer_delta": bool(args.linear_layers and args.linear_layers[0]),
            }
        if isinstance(args, GptOssArgs):
            hybrid = {"gpt_oss_biases": True, "mxfp4_experts": bool(args.mxfp4), "attention_sinks": True}
        from art_mega.trainer.families.deepseek_v3 import DeepseekV3Args
        from art_mega.trainer.families.qwen3_5_moe import Qwen35MoeArgs

        if isinstance(args, Qwen35MoeArgs):
            hybrid["shared_expert_ffn_hidden_size"] = args.shared_expert_ffn_hidden_size
            hybrid["shared_expert_gate"] = True
        if isinstance(args, DeepseekV3Args):
            hybrid = {
                "dense_layers": args.first_k_dense,
                "shared_expert_ffn_hidden_size": args.num_shared_experts * args.expert_ffn_hidden_size,
                "q_lora_rank": args.q_lora_rank,
                "kv_lora_rank": args.kv_lora_rank,
                "qk_rope_head_dim": args.qk_rope_head_dim,
                "v_head_dim": args.v_head_dim,
            }
        from art_mega.trainer.families.gemma4 import Gemma4Args

        global_layers = global_head_dim = global_qkv_rows = 0
        norms = 4 if isinstance(args, (Gemma3Args, Gemma4Args)) else 2
        if isinstance(args, Gemma4Args):
            hybrid["logit_softcapping"] = args.final_logit_softcapping is not None
            if args.num_experts:  # the dense MLP is the MoE block's shared expert (gemma4_moe)
                hybrid.update(shared_expert_ffn_hidden_size=args.ffn_hidden_size, router_scales=True)
                norms += 3
            global_layers = sum(not local for local in args.window_layers)
            global_head_dim = args.global_head_dim
            kv_heads = args.global_query_groups * (1 if args.k_eq_v else 2)
            global_qkv_rows = (args.num_heads + kv_heads) * global_head_dim
        return cls(
            **hybrid,
            model_type=args.model_type,
            vocab_size=args.vocab_size,
            hidden_size=args.hidden_size,
            num_layers=args.num_layers,
            num_heads=args.num_heads,
            num_query_groups=args.num_query_groups,
            head_dim=args.head_dim,
            ffn_hidden_size=args.ffn_hidden_size,
            tie_word_embeddings=args.tie_word_embeddings,
            qkv_bias=args.qkv_bias,
            qk_norm=args.qk_norm,
            norms_per_layer=norms,
            num_experts=getattr(args, "num_experts", 0),
            top_k=getattr(args, "top_k", 0),
            expert_ffn_hidden_size=getattr(args, "expert_ffn_hidden_size", 0),
            global_layers=global_layers,
            global_head_dim=global_head_dim,
            global_qkv_rows=global_qkv_rows,
        )

    @classmethod
    def from_model_dir(cls, model_dir: str | os.PathLike[str]) -> tuple[ModelShape, list[int]]:
        """The shape of an HF model directory's config.json and the tp sizes its family allows
        (no torch). Raises `UserError` as `model_builder.check_model_fits` does for a config it
        cannot read."""
        from art_mega.trainer.model_builder import read_model_args

        family, args = read_model_args(model_dir)
        return cls.from_args(args), list(family.valid_tp_sizes(args))

    @property
    def qkv_rows(self) -> int:
        """Output width of the fused QKV projection: (heads + 2 KV heads) x head_dim, plus the
        heads' output gates (Qwen3.5: q_proj is [query; gate] a head)."""
        gates = self.num_heads if self.attention_output_gate else 0
        return (self.num_heads + gates + 2 * self.num_query_groups) * self.head_dim

    @property
    def delta_conv_channels(self) -> int:
        """Channels of a gated delta-net layer's causal conv (its [q; k; v]): 2 Kh dk + Vh dv."""
        return 2 * self.delta_key_heads * self.delta_key_dim + self.delta_value_heads * self.delta_value_dim

    def _attention_parameters(self, tp: int) -> int:
        """One softmax-attention mixer's parameters on a rank: fused QKV (+ bias), proj (+ its bias
        and the per-head sinks on GPT-OSS), Q/K norms."""
        h = self.hidden_size
        return (
            h * self.qkv_rows // tp
            + (self.qkv_rows // tp if self.qkv_bias else 0)
            + self.num_heads * self.head_dim // tp * h
            + (h + self.num_heads // tp if self.gpt_oss_biases else 0)
            + (2 * self.head_dim if self.qk_norm else 0)
        )

    def _mla_parameters(self, tp: int) -> int:
        """One multi-head latent attention mixer's parameters on a rank (HF `DeepseekV3Attention`,
        megatron-core's `MLASelfAttention`): q_a_proj h x q_lora, q_b_proj q_lora x heads (nope +
        rope), kv_a_proj_with_mqa h x (kv_lora + rope), kv_b_proj kv_lora x heads (nope + v), o_proj
        heads v x h, all split tp ways (the local spec's down projections are column-parallel),
        and the q / kv latent RMSNorms (whole)."""
        h, heads = self.hidden_size, self.num_heads
        nope = self.head_dim - self.qk_rope_head_dim
        split = (
            h * self.q_lora_rank
            + self.q_lora_rank * heads * self.head_dim
            + h * (self.kv_lora_rank + self.qk_rope_head_dim)
            + self.kv_lora_rank * heads * (nope + self.v_head_dim)
            + heads * self.v_head_dim * h
        )
        return split // tp + self.q_lora_rank + self.kv_lora_rank

    def _delta_parameters(self, tp: int) -> int:
        """One gated delta-net mixer's parameters on a rank (HF `Qwen3_5GatedDeltaNet`, kept as
        four projections by `qwen3_5.GatedDeltaNetMixer`): in_proj_qkv h x conv channels,
        in_proj_z h x Vh dv, in_proj_b and in_proj_a h x Vh, the depthwise conv (channels x
        kernel), dt_bias and A_log (Vh each), the gated norm (dv) and out_proj Vh dv x h; all
        split tp ways but the norm."""
        h, vd = self.hidden_size, self.delta_value_heads * self.delta_value_dim
        split = (
            h * self.delta_conv_channels
            + h * vd
            + 2 * h * self.delta_value_heads
            + self.delta_conv_channels * self.delta_conv_kernel
            + 2 * self.delta_value_heads
            + vd * h
        )
        return split // tp + self.delta_value_dim

    def expert_parameters(self, ep: int = 1) -> int:
        """The routed experts' weights (and GPT-OSS's expert biases) on a rank at expert parallel
        `ep`: what vLLM keeps in MXFP4 for an MXFP4 checkpoint."""
        if not self.num_experts:
            return 0
        h, i = self.hidden_size, self.expert_ffn_hidden_size
        per_expert = 3 * h * i + ((2 * i + h) if self.gpt_oss_biases else 0)
        return (self.num_layers - self.dense_layers) * (self.num_experts // ep) * per_expert

    def parameters(self, tp: int = 1, ep: int = 1) -> int:
        """Parameters one rank holds at tensor parallel `tp` and expert parallel `ep` (1, 1: the
        whole model, the published count)."""
        h, layers = self.hidden_size, self.num_layers
        vocab = math.ceil(self.vocab_size / tp) * h
        attention = self._mla_parameters(tp) if self.kv_lora_rank else self._attention_parameters(tp)
        mixers = (layers - self.delta_layers) * attention
        mixers += self.delta_layers * self._delta_parameters(tp)
        dense = 3 * h * self.ffn_hidden_size // tp
        mlps = layers * dense
        if self.num_experts:
            moe = self.num_experts * h + (self.num_experts if self.gpt_oss_biases else 0)
            moe += 3 * h * self.shared_expert_ffn_hidden_size // tp + (h if self.shared_expert_gate else 0)
            moe += h + self.num_experts if self.router_scales else 0
            mlps = self.dense_layers * dense + (layers - self.dense_layers) * moe
        return (
            vocab * (1 if self.tie_word_embeddings else 2)
            + mixers
            + layers * self.norms_per_layer * h
            + mlps
            + self.expert_parameters(ep)
            + h
            + self._global_extra(tp)
        )

    def stage_parameters(self, tp: int = 1, ep: int = 1, pp: int = 1, stage: int = 0) -> int:
        """Parameters the rank of pipeline stage `stage` of `pp` holds: its `stage_layers` share of
        the layers' (an average over Qwen3.5's mixed layers and Gemma 4's global ones), the
        embedding on the first stage, the final norm and the LM head on the last; with tied
        embeddings and pp > 1 the last stage keeps its own copy of the embedding matrix as the
        output layer (megatron-core `LanguageModule.setup_embeddings_and_output_layer`)."""
        whole = self.parameters(tp, ep)
        if pp == 1:
            return whole
        vocab = math.ceil(self.vocab_size / tp) * self.hidden_size
        outside = vocab * (1 if self.tie_word_embeddings else 2) + self.hidden_size
        layers = (whole - outside) * self.stage_layers(pp) // self.num_layers
        return layers + (vocab if stage == 0 else 0) + (vocab + self.hidden_size if stage == pp - 1 else 0)

    def stage_layers(self, pp: int) -> int:
        """Layers on each of `pp` stages: megatron-core's even split (`get_num_layers_to_build`;
        `model_builder.check_pipeline` refuses a count pp does not divide)."""
        return -(-self.num_layers // pp)

    def _global_extra(self, tp: int) -> int:
        """Parameters a rank holds in the global layers beyond what the local shape counts."""
        if not self.global_layers:
            return 0
        h, q = self.hidden_size, self.num_heads
        extra = (
            h * (self.global_qkv_rows - self.qkv_rows) // tp
            + q * (self.global_head_dim - self.head_dim) // tp * h
        )
        extra += 2 * (self.global_head_dim - self.head_dim) if self.qk_norm else 0
        return self.global_layers * extra

    def lora_parameters(
        self, rank: int, targets: Sequence[str] = _LORA_TARGETS, tp: int = 1, ep: int = 1
    ) -> int:
        """LoRA parameters one rank holds: r x (in + out) of every wrapped linear (Megatron names
        in `targets`), the TP-split factor split `tp` ways (column-parallel B, row-parallel A),
        an MoE layer's fc1/fc2 once per local expert (`num_experts / ep`, not split by TP) and once
        for its shared expert (split `tp` ways as a dense MLP's); the first `dense_layers` layers'
        dense MLP as a dense model's. An MLA layer has no linear_qkv
        (its down / up projections are other targets: linear_q_down_proj h -> q_lora,
        linear_q_up_proj q_lora -> heads (nope + rope), linear_kv_down_proj h -> kv_lora + rope, all
        column-parallel) and its linear_proj reads heads x v_head_dim. A gated delta-net layer has
        in_proj_qkv h -> conv channels and in_proj_z h -> Vh dv (column-parallel) and out_proj
        Vh dv -> h (row-parallel) instead of self-attention."""
        h, q = self.hidden_size, self.num_heads * (self.v_head_dim if self.kv_lora_rank else self.head_dim)
        f = self.ffn_hidden_size
        dense_fc1, dense_fc2 = h + 2 * f // tp, f // tp + h  # a dense MLP's (the first `dense_layers`)
        if self.num_experts:
            i, shared = self.expert_ffn_hidden_size, self.shared_expert_ffn_hidden_size
            fc1, fc2 = (h + 2 * i) * self.num_experts // ep, (i + h) * self.num_experts // ep
            if shared:
                fc1, fc2 = fc1 + h + 2 * shared // tp, fc2 + shared // tp + h
        else:
            fc1, fc2 = dense_fc1, dense_fc2
        vd = self.delta_value_heads * self.delta_value_dim
        widths = {
            "linear_qkv": 0 if self.kv_lora_rank else h + self.qkv_rows // tp,
            "linear_proj": q // tp + h,
            "linear_q_down_proj": h + self.q_lora_rank // tp,
            "linear_q_up_proj": self.q_lora_rank + self.num_heads * self.head_dim // tp,
            "linear_kv_down_proj": h + (self.kv_lora_rank + self.qk_rope_head_dim) // tp,
            "linear_fc1": fc1,
            "linear_fc2": fc2,
            "in_proj_qkv": h + self.delta_conv_channels // tp,
            "in_proj_z": h + vd // tp,
            "out_proj": vd // tp + h,
        }
        attention = sum(widths[name] for name in targets if name in _ATTENTION_TARGETS)
        delta = sum(widths[name] for name in targets if name in ("in_proj_qkv", "in_proj_z", "out_proj"))
        mlp = sum(widths[name] for name in targets if name in ("linear_fc1", "linear_fc2"))
        dense = sum({"linear_fc1": dense_fc1, "linear_fc2": dense_fc2}.get(name, 0) for name in targets)
        mixers = (self.num_layers - self.delta_layers) * attention + self.delta_layers * delta
        mlps = (self.num_layers - self.dense_layers) * mlp + self.dense_layers * dense
        total = rank * (mixers + mlps)
        if self.global_layers:
            q_extra = self.num_heads * (self.global_head_dim - self.head_dim) // tp
            extra = {"linear_qkv": (self.global_qkv_rows - self.qkv_rows) // tp, "linear_proj": q_extra}
            total += rank * self.global_layers * sum(extra.get(name, 0) for name in targets)
        return total

    def activation_elements(
        self, tp: int, lora_rank: int, targets: Sequence[str], recompute_modules: Sequence[str] = ()
    ) -> int:
        """Elements autograd keeps a token a layer without recomputation (the module docstring's
        count; the s x s mask is `activation_bytes`'), averaged over the layers where they differ
        (Qwen3.5's delta-net layers); divided by hidden it is the plan's `activation_factor`."""
        total = self.layers_activation_elements(tp, lora_rank, targets, recompute_modules)
        return -(-total // self.num_layers)

    def layers_activation_elements(
        self, tp: int, lora_rank: int, targets: Sequence[str], recompute_modules: Sequence[str] = ()
    ) -> int:
        """Elements autograd keeps a token over all layers, counted from the graph of this
        trainer's layer (`torch.autograd.graph.saved_tensors_hooks` census of SmolLM2's layer,
        benchmarks/RESULTS.md): the two RMSNorms' inputs and reciprocal RMS (h + 1 each) and
        outputs (h each, the inputs of linear_qkv and linear_fc1), RoPE's cos and sin for q and k
        (4 k, not split), the SDPA's q, repeated k and v, output and log-sum-exp (4 a k + a, split
        tp ways), Qwen3's q/k-norm inputs ((a + g) k / tp), the MLP's fc1 output, its two SwiGLU
        halves and their product (5 f / tp; an MoE layer: top_k x (h + 5 i), the routed copy and
        the expert's, plus E router logits), and r per LoRA-wrapped linear (its x A^T). The norms'
        h terms are split tp ways under sequence parallelism (the MoE family at tp > 1).

        `recompute_modules` (selective recomputation, `TrainerSpec.recompute_modules`):
        "core_attn" keeps the checkpoint's inputs q, k, v (a k + 2 g k) instead of the SDPA's
        saved q, repeated k and v and log-sum-exp (the output stays: linear_proj keeps it);
        "mlp" keeps none of the MLP's own (its input is the norm's output, counted already).

        A gated delta-net mixer keeps its four projections' outputs (conv channels + Vh dv +
        2 Vh), the conv's input and output after SiLU (2 x conv channels), the delta rule's
        output and the gated norm's (2 Vh dv), all split tp ways: an estimate from
        `qwen3_5.GatedDeltaNetMixer`'s graph."""
        h, k, a, g = self.hidden_size, self.head_dim, self.num_heads, self.num_query_groups
        sequence_parallel = self.num_experts > 0 and tp > 1
        norms = 4 * h // (tp if sequence_parallel else 1) + 2
        if "core_attn" in recompute_modules:
            attention = (2 * a * k + 2 * g * k) // tp + 4 * k
        else:
            attention = (4 * a * k + a) // tp + 4 * k
        if self.attention_output_gate:  # the gate and the gated output
            attention += 2 * a * k // tp
        if self.qk_norm:
            attention += (a + g) * k // tp
        attention_lora = sum(1 for name in targets if name in ("linear_qkv", "linear_proj"))
        mlp_lora = len(targets) - attention_lora
        dense_mlp = 5 * self.ffn_hidden_size // tp
        if self.num_experts:
            shared = self.shared_expert_ffn_hidden_size
            mlp = self.top_k * (h + 5 * self.expert_ffn_hidden_size) + self.num_experts + 5 * shared // tp
            mlp_lora *= self.top_k + (1 if shared else 0)
        else:
            mlp = dense_mlp
        if self.router_scales:  # Gemma 4's MoE block: 3 more norms' inputs, 1/rms and outputs
            norms += 3 * (2 * h // (tp if sequence_parallel else 1) + 1)
        if "mlp" in recompute_modules:
            mlp, mlp_lora, dense_mlp = 0, 0, 0
        vd = self.delta_value_heads * self.delta_value_dim
        delta = (3 * self.delta_conv_channels + 3 * vd + 2 * self.delta_value_heads) // tp
        full = self.num_layers - self.delta_layers
        dense_lora = lora_rank * (len(targets) - attention_lora) if dense_mlp else 0
        moe_layers = self.num_layers - self.dense_layers
        return (
            self.num_layers * norms
            + moe_layers * (mlp + lora_rank * mlp_lora)
            + self.dense_layers * (dense_mlp + dense_lora)
            + full * (attention + lora_rank * attention_lora)
            + self.delta_layers * delta
        )

    def first_layer_unkept_elements(self, tp: int, targets: Sequence[str] = _LORA_TARGETS) -> int:
        """Elements a token that the first layer does not keep although `layers_activation_elements`
        counts them: its input is the frozen embedding's output, which needs no gradient, so its
        input norm keeps neither input nor 1/rms (h + 1; autograd saves for a backward only what
        a gradient needs), and a first gated delta-net mixer (`first_layer_delta`: frozen
        projections, not LoRA-wrapped) keeps nothing: not its norm's output (h), its own
        elements, nor the pre-MLP norm's input and 1/rms (h + 1), whose input is still gradient-free
        (the census of benchmarks/RESULTS.md, tiny Qwen3.5: no tensor of layer 0's mixer is live);
        a first MLA layer whose projections `targets` leave frozen (`mla_frozen_first_layer`)
        keeps neither its norm's output nor the attention's q, k, v and log-sum-exp ((3 a k + a) /
        tp) and RoPE's cos and sin (4 k): only linear_proj's LoRA keeps its input."""
        h = self.hidden_size // (tp if self.num_experts > 0 and tp > 1 else 1)
        if self.mla_frozen_first_layer(targets):
            k, a = self.head_dim, self.num_heads
            return 2 * h + 1 + (3 * a * k + a) // tp + 4 * k
        if not self.first_layer_delta:
            return h + 1
        vd = self.delta_value_heads * self.delta_value_dim
        delta = (3 * self.delta_conv_channels + 3 * vd + 2 * self.delta_value_heads) // tp
        return 3 * h + 2 + delta

    def scores_bytes(
        self, tp: int, dtype_bytes: int, rows: int, tokens: int, cpu: bool = False
    ) -> tuple[int, int]:
        """(kept, transient) bytes a softmax-attention layer of `rows` rows of `tokens` tokens
        (one rank, `num_heads / tp` heads) holds for explicitly computed scores, (0, 0) where a
        fused SDPA kernel runs (it keeps no scores):

        - GPT-OSS's sinks (`attention_sinks`, `sdpa_attention._attention_with_sinks`) compute
          [heads, s, s + 1] float32 scores, keep the softmax's output for its backward (plus a
          dtype copy of the probabilities [heads, s, s] and float32 copies of q and the repeated
          k for the matmuls when the dtype is not float32) and hold two more score tensors, the
          masked scores and their concatenation with the sink column, while the softmax runs
          (the census of benchmarks/RESULTS.md, tiny GPT-OSS: the step's peak is the last
          layer's softmax in the forward);
        - MLA on CPU (`cpu`, `kv_lora_rank`): PyTorch's CPU SDPA has a fused (flash) kernel only
          for equal q/k and v head widths (`sdp_utils_cpp.cpp` check_head_dim_size_cpp), so MLA's
          nope + rope queries against v_head_dim values run the math path, which keeps the
          probabilities [heads, s, s] in dtype bytes; its backward holds their gradient and the
          softmax's (census, tiny DeepSeek-V3: the step's peak is there). On a GPU the
          memory-efficient kernel takes unequal widths.

        `transient` is held once at a time, by the layer being computed."""
        heads = self.num_heads // tp
        if self.attention_sinks:
            scores = rows * heads * tokens * (tokens + 1) * 4
            kept = scores
            if dtype_bytes != 4:
                kept += rows * heads * tokens * (tokens * dtype_bytes + 2 * self.head_dim * 4)
            return kept, 2 * scores
        if cpu and self.kv_lora_rank:
            probabilities = rows * heads * tokens * tokens * dtype_bytes
            return probabilities, 2 * probabilities
        return 0, 0

    def scores_transient(
        self,
        tp: int,
        dtype_bytes: int,
        rows: int,
        tokens: int,
        lora_rank: int,
        targets: Sequence[str],
        cpu: bool = False,
    ) -> int:
        """Bytes explicit attention scores (`scores_bytes`) hold beyond the kept activations while
        the last layer's attention runs (forward) or is differentiated (backward): their
        transient less one layer's MLP activations (average elements, not yet allocated in the
        forward, freed before the attention's backward). `memory_plan.rank_terms` adds what of it
        the logits' working set, the step's other peak, does not cover."""
        transient = self.scores_bytes(tp, dtype_bytes, rows, tokens, cpu)[1]
        if not transient:
            return 0
        mlp = self.layers_activation_elements(tp, lora_rank, targets)
        mlp -= self.layers_activation_elements(tp, lora_rank, targets, ("mlp",))
        return max(transient - mlp // self.num_layers * rows * tokens * dtype_bytes, 0)

    def mla_frozen_first_layer(self, targets: Sequence[str]) -> bool:
        """Whether the first layer's MLA keeps nothing but linear_proj's input: `targets` wrap
        none of its down / up projections, so its q, k and v need no gradient (the embedding
        is frozen) and neither the latent path nor the attention keeps a tensor."""
        mla = ("linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj")
        return bool(self.kv_lora_rank) and not any(name in mla for name in targets)

    def layer_input_elements(self, tp: int) -> int:
        """Elements a fully recomputed layer keeps a token: its input (h, split tp ways under
        sequence parallelism), the checkpoint's saved input (Korthikanti et al. 2022, section 5:
        full recomputation stores only each layer's input, 2sbh bytes in 16 bits)."""
        return self.hidden_size // (tp if self.num_experts > 0 and tp > 1 else 1)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """vLLM's KV cache a token, over all of a replica's GPUs: 2 x layers x KV heads x
        head_dim x `dtype_bytes`."""
        return 2 * (self.num_layers - self.delta_layers) * self.num_query_groups * self.head_dim * dtype_bytes

    def delta_state_bytes(self, dtype_bytes: int) -> int:
        """A sequence's recurrent state over a replica's delta-net layers (vLLM's mamba-style
        cache: the conv's last kernel - 1 inputs and the Vh x dk x dv delta state a layer)."""
        state = self.delta_value_heads * self.delta_key_dim * self.delta_value_dim
        conv = self.delta_conv_channels * max(self.delta_conv_kernel - 1, 0)
        return self.delta_layers * (state + conv) * dtype_bytes

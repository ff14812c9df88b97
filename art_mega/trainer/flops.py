"""FLOPs of one GRPO + LoRA train step of art-mega's trainer, counted from a Hugging Face config,
and the model FLOPs utilisation (MFU) of a measured step.

Torch-free: the shapes come from the family spec's own config parser (`families.family_for(config)
.model_args(config)`), the counts are exact integers.

Conventions (one multiply-add = 2 FLOPs; a matmul [m, k] @ [k, n] = 2 m k n):

- Matmuls only. Norms, RoPE, activations, the softmax, the cross entropy and the optimizer are
  elementwise (O(tokens x width), not O(tokens x width^2)) and not counted, as in Megatron-LM's
  count (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
  Using Megatron-LM", appendix "Floating-point operations") and PaLM's MFU (Chowdhery et al.
  2022, "PaLM", appendix B).
- Tokens are the documents' tokens (`document_lengths`); the padding a step still runs (a row of
  a microbatch shorter than its longest row; the columns after the longest are cut) is work that
  counts for no token, so it lowers MFU, as it should.
- Attention: per document of L tokens and per layer, the scores Q K^T and the weighted values
  P V are 2 matmuls of 2 L^2 nh d FLOPs over the full square (Megatron-LM's 4 s^2 h per layer,
  h = nh d the query heads' width), of which a causal model needs half: 2 L^2 nh d per document
  and layer. PaLM counts the full square (12 L H Q T per token for training); art-mega halves it
  (a causal kernel skips the upper triangle; the packed rows' block mask does not attend across
  documents either, so the count is per document, not per packed row). GQA does not change it:
  every query head reads the keys and values of its group.
- Backward: autograd computes the gradient of a matmul's input (same FLOPs as its forward) and
  of its weight (same again) only where they are needed. The base model is frozen: no weight
  gradients, only input gradients, and only where the input needs a gradient: the embedding is
  frozen, so in the first layer every matmul before the first LoRA adapter (with the default
  targets: the QKV projection and its adapter's A) gets no input gradient. Attention's backward
  is 2 x its forward (dQ and dK from the scores' gradient, dP and dV from the output's; a flash
  kernel's recomputation of the scores is hardware work, not model FLOPs). The LoRA factors are
  trained: their input and weight gradients are both counted (Hu et al. 2021, "LoRA").
- No activation recomputation: the families' `TransformerConfig` leaves `recompute_granularity`
  None (tests/unit/trainer/test_flops.py pins it), and the only checkpointed piece of the step, the
  chunked cross entropy (`logprobs.token_logprobs`), recomputes a softmax, not a matmul. Under
  `TrainerSpec.recompute` the re-run forwards are hardware work, not model FLOPs, and are not
  counted either (model FLOPs utilisation: Chowdhery et al. 2022, "PaLM", appendix B).
- The step is one forward with gradients and its backward: a loss that reads a KL reference
  (`GRPOLossConfig.needs_reference`) or recomputes the old policy's logprobs (`recomputes_old`)
  runs one more forward without gradients per microbatch, which this count does not include.
- MoE layers: the router (h -> experts) for every token and the top-k experts' SwiGLU MLPs for
  every token (`top_k` expert passes per token, whatever the balance between experts); each
  expert's linear_fc1 / linear_fc2 carries its own adapter, as `trainer.rank.lora.apply_lora` puts them.
  Megatron's router backward also forms the frozen router weight's gradient
  (`moe_utils.RouterGatingLinearFunction`), 2 h E per token and layer: work the model does not
  need, so not model FLOPs and not counted (tests/trainer/test_flops_engine.py shows it apart).
- The LM head (h -> vocabulary), tied to the embedding or not, is counted at the positions it
  runs at, `head_tokens`: art-mega's train step runs it only where a position predicts a trained
  token (`loss_mask` > 0, not a document's first token; `logprobs.forward_logits(needed=)`), a
  plain forward (Hugging Face's) at every token. Its input gradient likewise. The embedding
  lookup is a gather, not counted. At TP = 1 the vocabulary has no padding.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from art_mega.errors import PeakFlopsError, UserError
from art_mega.trainer.families import LORA_NAMES, family_for

LoraLayout = Literal["megatron", "peft"]
"""How the adapters are laid out: "megatron" (art-mega's trainer: one adapter per fused Megatron
linear, so q/k/v share one A [r, h] and gate/up another) or "peft" (Hugging Face PEFT on the HF
model: one adapter, with its own A, per HF module q_proj, k_proj, v_proj, gate_proj, up_proj, ...)."""


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder the count needs, read by its family's config parser.

    `num_heads` query heads of `head_dim` and `num_query_groups` KV heads; `ffn_hidden_size` the
    dense SwiGLU width; for an MoE model (`num_experts` > 0) every layer's MLP is `num_experts`
    SwiGLU experts of width `expert_ffn_hidden_size`, `top_k` per token, behind a router.
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    num_experts: int = 0
    top_k: int = 0
    expert_ffn_hidden_size: int = 0

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> ModelShape:
        """The shape of an HF config.json dict (Llama/SmolLM2, Qwen2/3 dense, Qwen3-MoE, Mistral).

        Raises:
            UserError: a model_type no family reads, or a config its family refuses (the
                family's one sentence).
        """
        config = dict(config)
        family = family_for(config)
        args = family.model_args(config)
        moe = family.expert_parallel
        return cls(
            hidden_size=args.hidden_size,
            num_layers=args.num_layers,
            num_heads=args.num_heads,
            num_query_groups=args.num_query_groups,
            head_dim=args.head_dim,
            ffn_hidden_size=args.ffn_hidden_size,
            vocab_size=args.vocab_size,
            num_experts=args.num_experts if moe else 0,
            top_k=args.top_k if moe else 0,
            expert_ffn_hidden_size=args.expert_ffn_hidden_size if moe else 0,
        )

    @property
    def attention_width(self) -> int:
        """nh * d, the width of the queries (and of the attention output linear_proj reads)."""
        return self.num_heads * self.head_dim

    def layer_linears(self) -> tuple[LayerLinear, ...]:
        """One decoder layer's matmul sites in forward order (the core attention sits between
        linear_qkv and linear_proj)."""
        h, kv = self.hidden_size, self.num_query_groups * self.head_dim
        attention = (
            LayerLinear("linear_qkv", h, (self.attention_width, kv, kv)),
            LayerLinear("linear_proj", self.attention_width, (h,)),
        )
        if not self.num_experts:
            ffn = self.ffn_hidden_size
            return (
                *attention,
                LayerLinear("linear_fc1", h, (ffn, ffn)),
                LayerLinear("linear_fc2", ffn, (h,)),
            )
        ffn, k = self.expert_ffn_hidden_size, self.top_k
        return (
            *attention,
            LayerLinear(None, h, (self.num_experts,)),
            LayerLinear("linear_fc1", h, (ffn, ffn), passes=k),
            LayerLinear("linear_fc2", ffn, (h,), passes=k),
        )


@dataclass(frozen=True)
class LayerLinear:
    """A matmul site y = x W^T of a decoder layer: W [sum(out_parts), in_features].

    `target`: its Megatron LoRA target name (None: the MoE router, never adapted). `out_parts`:
    the output widths of the HF modules it fuses (linear_qkv: q, k, v; linear_fc1: gate, up);
    a PEFT adapter has one A per part. `passes`: how many times a token goes through it (an
    expert linear: top_k, one pass per chosen expert).
    """

    target: str | None
    in_features: int
    out_parts: tuple[int, ...]
    passes: int = 1

    @property
    def out_features(self) -> int:
        return sum(self.out_parts)

    def lora_factors(self, layout: LoraLayout) -> tuple[tuple[int, int], ...]:
        """(in, out) of each adapter on this site: one per fused linear, or one per HF module."""
        if layout == "megatron":
            return ((self.in_features, self.out_features),)
        return tuple((self.in_features, out) for out in self.out_parts)


@dataclass(frozen=True)
class StepFlops:
    """The FLOPs of one GRPO + LoRA train step over `tokens` document tokens, term by term (see the
    module docstring for each convention). Every term is an exact integer count.

    - `base_forward`: 2 x (active parameters of every frozen matmul) per token: the layers' linears
      (an MoE layer's router and top-k experts), and the LM head at `head_tokens` positions.
    - `attention_forward`: causal Q K^T and P V per document, 2 L^2 nh d per layer.
    - `base_input_grads`: the frozen matmuls' input gradients (= their forward, but for the
      first layer's matmuls before its first adapter, whose input needs no gradient).
    - `attention_backward`: 2 x `attention_forward` where the queries, keys and values need a
      gradient (every layer with the QKV projection adapted or an adapter before it).
    - `lora_forward`: x A^T then (x A^T) B^T, 2 r (in + out) per token and adapter.
    - `lora_input_grads`: the gradient of x A^T (2 r out) and, where x needs one, of x (2 r in).
    - `lora_weight_grads`: the gradients of A and B, 2 r (in + out) per token and adapter.
    """

    tokens: int
    base_forward: int
    attention_forward: int
    base_input_grads: int
    attention_backward: int
    lora_forward: int
    lora_input_grads: int
    lora_weight_grads: int

    @property
    def total(self) -> int:
        """Every term: the step's model FLOPs."""
        return (
            self.base_forward
            + self.attention_forward
            + self.base_input_grads
            + self.attention_backward
            + self.lora_forward
            + self.lora_input_grads
            + self.lora_weight_grads
        )

    @property
    def attention(self) -> int:
        """The attention terms (forward and backward); `total - attention` are the linears'."""
        return self.attention_forward + self.attention_backward

    @property
    def per_token(self) -> float:
        """`total / tokens`: the FLOPs per document token of the step."""
        return self.total / self.tokens


def _positive_int(field: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"{field}={value!r} must be a whole number of at least 1.")
    return value


def attention_forward_flops(shape: ModelShape, document_lengths: Sequence[int]) -> int:
    """Causal attention of the forward pass: sum over documents of 2 L^2 nh d per layer (FLOPs).

    Megatron-LM's 4 s^2 h per layer (Narayanan et al. 2021, appendix) halved for the causal mask
    (see the module docstring); `document_lengths` in tokens.
    """
    return sum(2 * length * length * shape.attention_width * shape.num_layers for length in document_lengths)


def step_flops(
    config: Mapping[str, Any],
    document_lengths: Sequence[int],
    *,
    lora_rank: int,
    lora_targets: Sequence[str] = LORA_NAMES.default_targets,
    lora_layout: LoraLayout = "megatron",
    head_tokens: int | None = None,
) -> StepFlops:
    """The FLOPs of one GRPO + LoRA step over documents of `document_lengths` tokens.

    Args:
        config: the model's HF config.json as a dict.
        document_lengths: the step's documents, in tokens (each >= 1; padding excluded).
        lora_rank: r, the adapters' inner width (>= 1).
        lora_targets: the adapted linears, Megatron or HF names as `LoraConfig.targets` takes
            them (default: all four, art-mega's default).
        lora_layout: "megatron" (art-mega's trainer) or "peft" (PEFT on the HF model).
        head_tokens: the positions the LM head runs at: art-mega's GRPO step, the positions
            predicting a trained token (a document's trained tokens but its first); None: every
            token (a full forward).

    Returns the terms of the count (`StepFlops`, exact integers).

    Raises:
        UserError: an empty `document_lengths` or a length, or `lora_rank`, that is not a whole
            number >= 1; `head_tokens` outside 1..the tokens; an unknown LoRA target or
            layout; a model its family refuses.
    """
    if isinstance(document_lengths, (str, bytes)) or not document_lengths:
        raise UserError(
            f"document_lengths={document_lengths!r} must list at least one document length in tokens."
        )
    for i, length in enumerate(document_lengths):
        _positive_int(f"document_lengths[{i}]", length)
    rank = _positive_int("lora_rank", lora_rank)
    if lora_layout not in ("megatron", "peft"):
        raise UserError(f"lora_layout={lora_layout!r} must be 'megatron' or 'peft'.")
    if isinstance(lora_targets, str) or not lora_targets:
        raise UserError(f"lora_targets={lora_targets!r} must name at least one layer, e.g. ('linear_qkv',).")
    targets = set(LORA_NAMES.normalise(lora_targets))
    shape = ModelShape.from_hf_config(config)
    tokens = sum(document_lengths)
    if head_tokens is None:
        head_tokens = tokens
    elif _positive_int("head_tokens", head_tokens) > tokens:
        raise UserError(f"head_tokens={head_tokens} must be at most the documents' {tokens} tokens.")

    # Per token: one layer's base and LoRA matmuls, and the first layer's input gradients, where
    # nothing needs a gradient before the first adapter (the embedding is frozen); every later
    # layer's input comes from adapted layers, so it gets all of them.
    layer_base = layer_lora = first_base_grads = first_lora_grads = 0
    needs_grad = first_attention_grad = False
    for site in shape.layer_linears():
        cost = 2 * site.in_features * site.out_features * site.passes
        layer_base += cost
        first_base_grads += cost if needs_grad else 0
        if site.target in targets:
            for fan_in, fan_out in site.lora_factors(lora_layout):
                layer_lora += 2 * rank * (fan_in + fan_out) * site.passes
                # dL/d(x A^T) = dL/dy B always; dL/dx = dL/d(x A^T) A only where x needs it
                first_lora_grads += 2 * rank * (fan_out + (fan_in if needs_grad else 0)) * site.passes
            needs_grad = True
        if site.target == "linear_qkv":
            first_attention_grad = needs_grad
    later = shape.num_layers - 1
    head = 2 * shape.hidden_size * shape.vocab_size
    attention = attention_forward_flops(shape, document_lengths)
    return StepFlops(
        tokens=tokens,
        base_forward=shape.num_layers * layer_base * tokens + head * head_tokens,
        attention_forward=attention,
        base_input_grads=(first_base_grads + later * layer_base) * tokens + head * head_tokens,
        attention_backward=2 * (attention // shape.num_layers) * (later + first_attention_grad),
        lora_forward=shape.num_layers * layer_lora * tokens,
        lora_input_grads=(first_lora_grads + later * layer_lora) * tokens,
        lora_weight_grads=shape.num_layers * layer_lora * tokens,
    )


def mfu(flops_per_token: float, tokens_per_s: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: flops_per_token x tokens_per_s / peak_flops, a fraction (0.4 = 40%).

    PaLM's definition (Chowdhery et al. 2022, appendix B): the model's FLOPs at the observed
    throughput over the hardware's peak, so recomputation and padding count as waste.
    `flops_per_token` in FLOPs (`StepFlops.per_token`), `tokens_per_s` in tokens per second,
    `peak_flops` in FLOP/s (`peak_flops_for`).

    Raises:
        UserError: an argument that is not a finite number > 0 (one sentence naming it).
    """
    for field, value in (
        ("flops_per_token", flops_per_token),
        ("tokens_per_s", tokens_per_s),
        ("peak_flops", peak_flops),
    ):
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or value <= 0
        ):
            raise UserError(f"{field}={value!r} must be a finite number greater than 0.")
    return flops_per_token * tokens_per_s / peak_flops


PEAK_FLOPS: dict[str, dict[str, float]] = {
    "NVIDIA H100 80GB HBM3": {"bfloat16": 989.4e12, "float32": 66.9e12},
    "NVIDIA H200": {"bfloat16": 989.4e12, "float32": 66.9e12},
}
"""torch.cuda.get_device_name() -> dtype -> dense peak FLOP/s of one GPU (the SXM parts).

Source: NVIDIA's H100 and H200 Tensor Core GPU datasheets (both SXM: BF16 Tensor Core 1,979
TFLOPS "with sparsity", half of it dense: 989.4e12 = 132 SMs x 1,830 MHz x 4,096 dense BF16
FLOPs per SM and clock; FP32 without tensor cores 67 TFLOPS, 66.9e12 = 132 x 1,980 MHz x 256).
"float32" is the non-tensor-core figure: art-mega's fp32 steps leave TF32 off (torch's default).
The PCIe and NVL parts have lower clocks and other figures; they are not listed, so they are
refused rather than guessed."""


def peak_flops_for(device_name: str, dtype: str) -> float:
    """The dense peak FLOP/s of `device_name` (as torch.cuda.get_device_name() spells it) in
    `dtype` ("bfloat16" or "float32"), from `PEAK_FLOPS`.

    Raises:
        PeakFlopsError: a device or dtype the table does not hold (never a guess).
    """
    known = PEAK_FLOPS.get(device_name)
    if known is None or dtype not in known:
        listed = "; ".join(f"{name}: {', '.join(sorted(peaks))}" for name, peaks in PEAK_FLOPS.items())
        raise PeakFlopsError(
            f"no datasheet peak for {device_name!r} in {dtype}; known ({listed}): add its NVIDIA "
            "datasheet figure to art_mega.trainer.flops.PEAK_FLOPS or pass the peak yourself.",
            device_name,
            dtype,
        )
    return known[dtype]

"""Core attention for the local layer spec through PyTorch's `scaled_dot_product_attention`.

Megatron's local `DotProductAttention` materialises the scores of every head, [b, np, s, s],
converts them to fp32 for the softmax and keeps them for the backward. On an H200 with packed
4096-token rows (SmolLM2-135M shape, bf16, LoRA) that path was ~75% of the GPU time of a GRPO
step: the dtype copies, `masked_fill` and the softmax and its backward (torch.profiler, recorded
in benchmarks/RESULTS.md notes). `torch.nn.functional.scaled_dot_product_attention` runs the same
math in one fused kernel (memory-efficient attention on GPU, which takes an arbitrary mask; the
flash or math kernel on CPU) without keeping the scores.

Same interface and numbers as the module it replaces: GQA by repeating each key/value head for
its `np / ng` query heads (Megatron's `repeat_interleave` on the head dimension), softmax scale
1/sqrt(head dim) unless `softmax_scale` is given (`apply_query_key_layer_scaling` multiplies and
divides by the layer number in Megatron, a no-op on the result), an explicit mask wins over the
mask type (Megatron's `forward_torch_softmax`), no mask and a causal mask type mean causal.

Sliding windows: a layer that megatron-core's `is_layer_window_attention` marks (config
`window_size` = (left, 0) with `window_attn_skip_freq`) lets query i see keys i - left .. i,
i.e. the last left + 1 tokens (HF `sliding_window` = left + 1, `masking_utils.sliding_window_overlay`:
kv_idx > q_idx - sliding_window). Unlike Megatron's local attention, whose window mask replaces an
explicit mask (`fusions/fused_softmax.py` forward_torch_softmax), the window is combined with a
packed-row mask: documents are contiguous in a row, so distance in the row is distance in the
document.

Attention sinks (GPT-OSS, megatron-core's `softmax_type="learnable"`): a learned logit per head
joins each query's softmax denominator and is dropped from its numerator, p_j = exp(s_j) /
(sum_k exp(s_k) + exp(sink)) (transformers' `models/gpt_oss/modeling_gpt_oss.py`
eager_attention_forward; Megatron's `fusions/fused_softmax.py` SoftmaxOne). SDPA has no such
term, so a layer with sinks computes its scores explicitly (`_attention_with_sinks`); the
parameter is `softmax_offset` [np], this rank's heads, as in Megatron's `DotProductAttention`.
"""

from __future__ import annotations

import functools
import math
from typing import Any


def sliding_window_causal_mask(sq: int, skv: int, window_size: tuple[int, int], device: Any = None):
    """Bool [sq, skv], True = masked: query i (the last sq of skv positions) sees keys j with
    i' - window_size[0] <= j <= i' + window_size[1], i' = i + skv - sq (megatron-core's
    `transformer/utils.py` get_sliding_window_causal_mask, on `device` instead of "cuda")."""
    import torch

    allowed = torch.ones(sq, skv, dtype=torch.bool, device=device)
    allowed = torch.triu(allowed, diagonal=skv - sq - window_size[0])
    return ~torch.tril(allowed, diagonal=skv - sq + window_size[1])


def _attention_with_sinks(
    q: Any, k: Any, v: Any, masked: Any, sinks: Any, scale: float, dropout: float
) -> Any:
    """Softmax attention with one sink logit per head: q [b, h, sq, d], k/v [b, h, skv, d] (KV heads
    already repeated), `masked` bool [b or 1, 1 or h, sq, skv] (True = masked), `sinks` [h]. Scores
    and softmax in fp32, probabilities cast back to v's dtype; returns [b, h, sq, d]."""
    import torch

    scores = torch.matmul(q.float(), k.float().transpose(-2, -1)) * scale
    scores = scores.masked_fill(masked, float("-inf"))
    sink = sinks.float().reshape(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    if dropout:
        probs = torch.nn.functional.dropout(probs, p=dropout)
    return torch.matmul(probs.to(v.dtype), v)


def _attend(
    q: Any,
    k: Any,
    v: Any,
    attention_mask: Any,
    *,
    causal: bool,
    window: tuple[int, int] | None,
    sinks: Any,
    scale: float,
    dropout: float,
) -> Any:
    """Attention of q [b, h, sq, d] over k/v [b, h, skv, d] (KV heads already repeated) -> [b, h,
    sq, d] in v's dtype. `attention_mask` bool [b or 1, 1, sq, skv] (True = masked) or None (causal
    when `causal`, else none), combined with a causal `window` (left, 0) band (module docstring);
    with `sinks` [h] the explicit-scores path (`_attention_with_sinks`), else SDPA. `dropout`: the
    probability (0.0 outside training)."""
    import torch

    if window is not None:
        band = sliding_window_causal_mask(q.shape[2], k.shape[2], window, q.device)
        attention_mask = band if attention_mask is None else attention_mask | band
    if sinks is not None:
        if attention_mask is None:
            sq, skv = q.shape[2], k.shape[2]
            attention_mask = (
                sliding_window_causal_mask(sq, skv, (skv, 0), q.device)
                if causal
                else torch.zeros(sq, skv, dtype=torch.bool, device=q.device)
            )
        return _attention_with_sinks(q, k, v, attention_mask, sinks, scale, dropout)
    return torch.nn.functional.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=None if attention_mask is None else ~attention_mask,
        dropout_p=dropout,
        is_causal=attention_mask is None and causal,
        scale=scale,
    )


def _causal_window(config: Any, layer_number: int) -> tuple[int, int] | None:
    """The sliding window (left, 0) of layer `layer_number` (1-based) as megatron-core's
    `is_layer_window_attention` marks it from `config.window_size` / `window_attn_skip_freq`, None
    for a full-attention layer. Raises `ValueError` for a window that looks ahead or is unbounded
    on the left (the module's windows are causal)."""
    from megatron.core.transformer.utils import is_layer_window_attention

    windowed = is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number)
    window = tuple(config.window_size) if windowed else None
    if window is not None and (window[1] != 0 or window[0] < 0):
        raise ValueError(f"SdpaCoreAttention's sliding window is causal, (left >= 0, 0); got {window}")
    return window


@functools.cache
def sdpa_core_attention() -> type:
    """The `SdpaCoreAttention` class, a core-attention module for Megatron `ModuleSpec`s (built on
    first use: it subclasses megatron-core's `MegatronModule`)."""
    import torch
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.utils import divide

    class SdpaCoreAttention(MegatronModule):
        """Self-attention of one layer's heads on this TP rank, through SDPA.

        forward(query [s, b, np, hn], key/value [s, b, ng, hn], attention_mask) -> [s, b, np*hn]
        in the inputs' dtype; np and ng are this TP rank's query heads and query groups.
        `attention_mask` bool [b or 1, 1, s, s], True = masked (Megatron's convention,
        `logprobs.packed_attention_mask`), or None for the layer's mask type (causal); a
        window layer (`self.window`, (left, 0) or None) also masks keys more than left tokens
        back. No parameters of its own.

        Raises:
            ValueError: at construction for what it does not implement (context parallelism,
                a window that looks ahead or is unbounded on the left, a softmax other than
                "vanilla" or "learnable" (sinks, `softmax_offset` [np], loaded from the
                checkpoint)); in forward for an attention bias or packed-sequence (THD) parameters.
        """

        def __init__(
            self,
            config: Any,
            layer_number: int,
            attn_mask_type: Any,
            attention_type: str,
            attention_dropout: float | None = None,
            softmax_scale: float | None = None,
            cp_comm_type: str | None = None,
            pg_collection: Any = None,
        ) -> None:
            super().__init__(config=config)
            if config.context_parallel_size != 1:
                raise ValueError("SdpaCoreAttention runs without context parallelism (cp_attention does CP)")
            softmax_type = getattr(config, "softmax_type", "vanilla")
            if softmax_type not in ("vanilla", "learnable"):
                raise ValueError(f"SdpaCoreAttention has no {softmax_type!r} softmax (vanilla, learnable)")
            self.window = _causal_window(config, layer_number)
            tp_group = getattr(pg_collection, "tp", None) if pg_collection is not None else None
            tp = tp_group.size() if tp_group is not None else mpu.get_tensor_model_parallel_world_size()
            self.heads = divide(config.num_attention_heads, tp)
            self.groups = divide(config.num_query_groups, tp)
            self.head_dim = config.kv_channels
            self.softmax_scale = 1.0 / math.sqrt(self.head_dim) if softmax_scale is None else softmax_scale
            self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
            self.attn_mask_type = attn_mask_type
            self.softmax_offset = None
            if softmax_type == "learnable":
                device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
                self.softmax_offset = torch.nn.Parameter(
                    torch.zeros(self.heads, dtype=config.params_dtype, device=device)
                )
                set_tensor_model_parallel_attributes(self.softmax_offset, True, 0, 1)

        def forward(
            self,
            query: torch.Tensor,
            key: torch.Tensor,
            value: torch.Tensor,
            attention_mask: torch.Tensor | None,
            attn_mask_type: Any = None,
            attention_bias: torch.Tensor | None = None,
            packed_seq_params: Any = None,
        ) -> torch.Tensor:
            if attention_bias is not None or packed_seq_params is not None:
                raise ValueError("SdpaCoreAttention takes neither attention_bias nor packed_seq_params")
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hn]
            if self.groups != self.heads:
                k = k.repeat_interleave(self.heads // self.groups, dim=1)
                v = v.repeat_interleave(self.heads // self.groups, dim=1)
            mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
            out = _attend(
                q,
                k,
                v,
                attention_mask,
                causal=mask_type == AttnMaskType.causal,
                window=self.window,
                sinks=self.softmax_offset,
                scale=self.softmax_scale,
                dropout=self.dropout if self.training else 0.0,
            )
            seq, batch = query.shape[0], query.shape[1]
            return out.permute(2, 0, 1, 3).reshape(seq, batch, self.heads * self.head_dim)

    return SdpaCoreAttention


def with_sdpa_attention(spec: Any) -> Any:
    """`spec` (a local-spec transformer layer `ModuleSpec`) with `SdpaCoreAttention` as its
    self-attention's core attention. Modifies and returns `spec`; apply before
    `cp_attention.with_context_parallel_attention`, which replaces it again when CP > 1."""
    spec.submodules.self_attention.submodules.core_attention = sdpa_core_attention()
    return spec

"""Context parallelism with Megatron's local layer spec: the two-chunk sequence split and a core
attention that all-gathers keys and values over the CP group.

megatron-core 0.16.1's local `DotProductAttention` refuses CP > 1
(`transformer/dot_product_attention.py:57`: TransformerEngine only), which leaves CPU ranks
without it. Here each CP rank holds 2 of the 2*cp equal chunks of every row, chunks r and
2*cp-1-r (Megatron's load-balanced split, `utils.py:1994-2038` get_batch_on_this_cp_rank, and
`models/common/embeddings/rope_utils.py:48-70` get_pos_emb_on_this_cp_rank for RoPE), computes
attention for its own queries against the keys and values of the whole row, and the mask says
which of them each query may see.
"""

from __future__ import annotations

import copy
import functools
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor


def cp_token_indices(seq_len: int, cp_size: int, cp_rank: int, device: Any = "cpu") -> Tensor:
    """The row positions CP rank `cp_rank` holds, in its local order: int64 [seq_len / cp_size].

    Chunk c (of 2*cp_size chunks of seq_len / (2*cp_size) tokens) is positions
    c*n .. (c+1)*n - 1; rank r holds chunk r then chunk 2*cp_size-1-r
    (`megatron/core/utils.py:2031-2035`). Raises `ValueError` when seq_len is not a multiple
    of 2*cp_size.
    """
    import torch

    if seq_len % (2 * cp_size):
        raise ValueError(f"seq_len={seq_len} is not a multiple of 2 * cp={2 * cp_size}")
    chunk = seq_len // (2 * cp_size)
    offsets = torch.arange(chunk, device=device)
    return torch.cat([cp_rank * chunk + offsets, (2 * cp_size - 1 - cp_rank) * chunk + offsets])


def _gathered_to_sequence_order(seq_len: int, cp_size: int, device: Any) -> Tensor:
    """int64 [seq_len]: `gathered[perm]` is in sequence order, where `gathered` is every CP
    rank's local positions concatenated in rank order (an all-gather's result)."""
    import torch

    held = torch.cat([cp_token_indices(seq_len, cp_size, rank, device) for rank in range(cp_size)])
    return torch.argsort(held)


def padded_length(seq_len: int, cp_size: int) -> int:
    """`seq_len` rounded up to a multiple of 2*cp_size (the split needs equal chunks)."""
    multiple = 2 * cp_size
    return -(-seq_len // multiple) * multiple


def slice_for_cp_rank(values: Tensor, cp_size: int, cp_rank: int, dim: int = 1) -> Tensor:
    """This CP rank's positions of `values` along `dim` (`cp_token_indices` order).

    `values` any dtype, size S along `dim` (S a multiple of 2*cp_size); the result has S/cp_size
    there. The same selection as Megatron's `get_batch_on_this_cp_rank` (`utils.py:1994`).
    """
    index = cp_token_indices(values.shape[dim], cp_size, cp_rank, values.device)
    return values.index_select(dim, index)


def gather_from_cp_ranks(local: Tensor, group: Any, dim: int = 1, *, keep_own_grad: bool = True) -> Tensor:
    """Inverse of `slice_for_cp_rank`: every CP rank's positions, back in sequence order.

    `local` [..., S/cp, ...] (S/cp along `dim`) -> [..., S, ...], the same on every rank of
    `group`. Differentiable through Megatron's `gather_from_sequence_parallel_region`
    (`tensor_parallel/mappings.py:499`). `keep_own_grad=True`: the backward keeps the gradient
    of this rank's own positions (right when every rank computes the same function of the full
    result, such as the loss); False: the backward reduce-scatters (sums over ranks) the
    gradients, right when each rank's result feeds only its own part of the computation (keys
    and values in attention).
    """
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    cp_size = group.size()
    if cp_size == 1:
        return local
    seq_first = local.movedim(dim, 0)
    gathered = gather_from_sequence_parallel_region(
        seq_first, tensor_parallel_output_grad=not keep_own_grad, group=group
    )
    order = _gathered_to_sequence_order(gathered.shape[0], cp_size, gathered.device)
    return gathered.index_select(0, order).movedim(0, dim)


def attention_mask_for_queries(
    segment_ids: Tensor | None, query_positions: Tensor, seq_len: int | None = None
) -> Tensor:
    """Which keys the queries at `query_positions` may not see: bool [B, 1, Q, S], True = masked.

    `segment_ids` int [B, S] (the whole row): document index within the row from 1, 0 for
    padding; None means one document per row (plain causal, the result is [1, 1, Q, S] and
    `seq_len` gives S). `query_positions` int64 [Q]: row positions of the queries. Query at
    position t may see key u when u <= t and both belong to the same (non-padding) document;
    a padding query sees itself only, so no softmax row is empty (`logprobs.packed_attention_mask`
    is the all-positions case).
    """
    import torch

    length = seq_len if segment_ids is None else segment_ids.shape[1]
    device = query_positions.device
    keys = torch.arange(length, device=device)
    causal = keys[None, :] <= query_positions[:, None]  # [Q, S]
    itself = keys[None, :] == query_positions[:, None]
    if segment_ids is None:
        return ~causal[None, None]
    query_segments = segment_ids.index_select(1, query_positions)  # [B, Q]
    same = query_segments[:, :, None] == segment_ids[:, None, :]
    allowed = same & causal[None] & (query_segments[:, :, None] > 0)
    return ~(allowed | itself[None])[:, None]


def cp_attention_mask(
    segment_ids: Tensor | None, cp_size: int, cp_rank: int, seq_len: int | None = None
) -> Tensor:
    """The mask of this CP rank's queries against the whole row: bool [B, 1, S/cp, S], True = masked.

    `segment_ids` int [B, S] of the whole row, or None for plain causal attention
    ([1, 1, S/cp, S], `seq_len` = S). Equals `packed_attention_mask(segment_ids)` restricted
    to the rows (queries) `cp_token_indices` selects, with keys in sequence order.
    """
    length = seq_len if segment_ids is None else segment_ids.shape[1]
    device = "cpu" if segment_ids is None else segment_ids.device
    queries = cp_token_indices(length, cp_size, cp_rank, device)
    return attention_mask_for_queries(segment_ids, queries, length)


@functools.cache
def context_parallel_core_attention() -> type:
    """The `ContextParallelDotProductAttention` class, a core-attention module for Megatron
    `ModuleSpec`s (built on first use: it subclasses megatron-core's `MegatronModule`)."""
    from megatron.core import parallel_state as mpu
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.module import MegatronModule

    class ContextParallelDotProductAttention(MegatronModule):
        """Core attention for CP > 1 with the local spec: all-gather K/V, attend, keep own queries.

        forward(query [s, b, np, hn], key/value [s, b, ng, hn], attention_mask) -> [s, b, np*hn],
        s = S/cp this rank's positions (`cp_token_indices` order), any float dtype. Keys and
        values are all-gathered over the CP group (backward: reduce-scatter of their gradients,
        each rank's queries contribute to every key) and put back in sequence order; then
        Megatron's local `DotProductAttention` (same GQA head repetition, scaling and softmax,
        built with a copy of the config whose context_parallel_size is 1) attends the s local
        queries to all S keys. `attention_mask` bool [b, 1, s, S] (`cp_attention_mask`), or
        None for plain causal attention in the CP layout. No parameters of its own.
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
            cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
            self.cp_group = cp_group if cp_group is not None else mpu.get_context_parallel_group()
            local_config = copy.copy(config)
            local_config.context_parallel_size = 1
            self.local = DotProductAttention(
                local_config,
                layer_number,
                attn_mask_type,
                attention_type,
                attention_dropout=attention_dropout,
                softmax_scale=softmax_scale,
                pg_collection=pg_collection,
            )

        def forward(
            self,
            query: Tensor,
            key: Tensor,
            value: Tensor,
            attention_mask: Tensor | None,
            attn_mask_type: Any = None,
            attention_bias: Tensor | None = None,
            packed_seq_params: Any = None,
        ) -> Tensor:
            cp_size = self.cp_group.size()
            key = gather_from_cp_ranks(key, self.cp_group, dim=0, keep_own_grad=False)
            value = gather_from_cp_ranks(value, self.cp_group, dim=0, keep_own_grad=False)
            length = key.shape[0]
            if attention_mask is None:
                attention_mask = cp_attention_mask(None, cp_size, self.cp_group.rank(), length)
                attention_mask = attention_mask.to(query.device)
            if tuple(attention_mask.shape[-2:]) != (query.shape[0], length):
                raise ValueError(
                    f"attention_mask {tuple(attention_mask.shape)} must be [b, 1, {query.shape[0]}, {length}] "
                    "under context parallelism (cp_attention_mask)"
                )
            return self.local(
                query,
                key,
                value,
                attention_mask,
                attn_mask_type=attn_mask_type,
                attention_bias=attention_bias,
                packed_seq_params=packed_seq_params,
            )

    return ContextParallelDotProductAttention


def with_context_parallel_attention(spec: Any) -> Any:
    """`spec` (a local-spec transformer layer `ModuleSpec`) with `ContextParallelDotProductAttention`
    as its self-attention's core attention when megatron-core's CP group has more than one rank;
    unchanged otherwise (or before `init_parallel`). Modifies and returns `spec`."""
    from megatron.core import parallel_state as mpu

    if mpu.model_parallel_is_initialized() and mpu.get_context_parallel_world_size() > 1:
        spec.submodules.self_attention.submodules.core_attention = context_parallel_core_attention()
    return spec

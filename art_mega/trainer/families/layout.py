"""Megatron's fused weight layouts and their tensor-parallel shards, as pure tensor functions.

Shared by every model family's weight adapter (HF -> Megatron for loading, and back for export).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor


def shard(tensor: Tensor, dim: int, tp_size: int, tp_rank: int) -> Tensor:
    """The `tp_rank`-th of `tp_size` equal contiguous chunks of `tensor` along `dim` (a copy).

    Column-parallel layers (`tensor_parallel/layers.py` ColumnParallelLinear) keep output rows
    `dim=0`; row-parallel layers keep input columns `dim=1`. Raises `ValueError` when the size
    along `dim` is not divisible by `tp_size`.
    """
    size = tensor.shape[dim]
    if size % tp_size:
        raise ValueError(f"dimension {dim} of size {size} is not divisible by tensor-parallel size {tp_size}")
    step = size // tp_size
    return tensor.narrow(dim, tp_rank * step, step).clone()


def pad_rows(tensor: Tensor, rows: int) -> Tensor:
    """`tensor` with zero rows appended along dim 0 up to `rows` rows (itself if already that long).

    Used for vocabulary padding: Megatron's vocab-parallel embedding and output layer need a
    vocabulary divisible by TP; the extra rows are zeros, so their logits are 0 and are cut off.
    """
    import torch

    extra = rows - tensor.shape[0]
    if extra < 0:
        raise ValueError(f"cannot pad {tensor.shape[0]} rows down to {rows}")
    if extra == 0:
        return tensor
    return torch.cat([tensor, tensor.new_zeros((extra, *tensor.shape[1:]))], dim=0)


def fuse_qkv(q: Tensor, k: Tensor, v: Tensor, num_heads: int, num_query_groups: int) -> Tensor:
    """Megatron's fused QKV tensor from HF's separate q/k/v projection weights or biases.

    Shapes: q [num_heads*d, ...], k and v [num_query_groups*d, ...] (a weight has a trailing
    hidden dim, a bias none) -> [(num_heads + 2*num_query_groups)*d, ...]. Layout, per query
    group g (= KV head g): the g-th block of num_heads/num_query_groups query heads, then key
    head g, then value head g ("q1 q2 k1 v1 | q3 q4 k2 v2 | ..." in
    `megatron/core/transformer/attention.py` SelfAttention.get_query_key_value_tensors, which
    views the projection as [s, b, ng, (np/ng + 2) * hn] and splits each group into q, k, v).
    Column-parallel TP then gives each rank a contiguous 1/tp of these rows: whole groups when
    num_query_groups >= tp, otherwise a slice of one group that Megatron re-assembles by an
    all-gather (same function, "num_query_groups < world_size").
    """
    import torch

    head_dim = k.shape[0] // num_query_groups
    per_group = num_heads // num_query_groups
    rest = q.shape[1:]
    q = q.reshape(num_query_groups, per_group * head_dim, *rest)
    k = k.reshape(num_query_groups, head_dim, *rest)
    v = v.reshape(num_query_groups, head_dim, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def split_qkv(fused: Tensor, num_heads: int, num_query_groups: int) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of `fuse_qkv`: HF's (q, k, v) from a full (unsharded) Megatron fused QKV tensor."""
    rows = fused.shape[0]
    head_dim = rows // (num_heads + 2 * num_query_groups)
    per_group = num_heads // num_query_groups
    rest = fused.shape[1:]
    grouped = fused.reshape(num_query_groups, (per_group + 2) * head_dim, *rest)
    q, k, v = grouped.split([per_group * head_dim, head_dim, head_dim], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def fc1_shard(gate: Tensor, up: Tensor, tp_size: int, tp_rank: int) -> Tensor:
    """One TP rank's fused SwiGLU `linear_fc1` weight from HF's gate_proj and up_proj.

    Shapes: gate, up [ffn, hidden] -> [2*ffn/tp, hidden] = [gate shard; up shard]. Megatron's
    MLP splits each rank's fc1 output in two halves and computes act(first) * second
    (`megatron/core/transformer/mlp.py` MLP.forward with gated_linear_unit, `glu`), so each
    rank's weight is its gate rows followed by its up rows, not a shard of cat(gate, up).
    """
    import torch

    return torch.cat([shard(gate, 0, tp_size, tp_rank), shard(up, 0, tp_size, tp_rank)], dim=0)


def unfuse_fc1(shards: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Inverse of `fc1_shard` over all TP ranks' shards (in rank order): HF's (gate, up)."""
    import torch

    halves = [piece.chunk(2, dim=0) for piece in shards]
    gate = torch.cat([half[0] for half in halves], dim=0)
    up = torch.cat([half[1] for half in halves], dim=0)
    return gate, up


def fuse_qkv_gate(q_gate: Tensor, k: Tensor, v: Tensor, num_heads: int, num_query_groups: int) -> Tensor:
    """Megatron's gated fused QKV tensor from HF's q_proj with an output gate (per head [query;
    gate], [2*nh*d, ...]), k_proj and v_proj ([ng*d, ...]): per query group g, its query heads,
    their gates, key head g, value head g -> [(2*nh + 2*ng)*d, ...] (`transformer/attention.py`
    SelfAttention.get_query_key_value_tensors with output_gate views [ng, (2*np/ng + 2)*hn] and
    splits query, gate, key, value). TP shards it like `fuse_qkv`'s tensor."""
    import torch

    head_dim = k.shape[0] // num_query_groups
    per_group = num_heads // num_query_groups
    rest = q_gate.shape[1:]
    pairs = q_gate.reshape(num_query_groups, per_group, 2, head_dim, *rest)
    query = pairs[:, :, 0].reshape(num_query_groups, per_group * head_dim, *rest)
    gate = pairs[:, :, 1].reshape(num_query_groups, per_group * head_dim, *rest)
    k = k.reshape(num_query_groups, head_dim, *rest)
    v = v.reshape(num_query_groups, head_dim, *rest)
    return torch.cat([query, gate, k, v], dim=1).reshape(-1, *rest)


def split_qkv_gate(fused: Tensor, num_heads: int, num_query_groups: int) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of `fuse_qkv_gate`: HF's (q_proj with its per-head gates, k, v) from a full
    (unsharded) gated fused QKV tensor."""
    import torch

    rows = fused.shape[0]
    head_dim = rows // (2 * num_heads + 2 * num_query_groups)
    per_group = num_heads // num_query_groups
    rest = fused.shape[1:]
    grouped = fused.reshape(num_query_groups, (2 * per_group + 2) * head_dim, *rest)
    query, gate, k, v = grouped.split([per_group * head_dim, per_group * head_dim, head_dim, head_dim], dim=1)
    query = query.reshape(num_query_groups, per_group, 1, head_dim, *rest)
    gate = gate.reshape(num_query_groups, per_group, 1, head_dim, *rest)
    q_gate = torch.cat([query, gate], dim=2).reshape(-1, *rest)
    return q_gate, k.reshape(-1, *rest), v.reshape(-1, *rest)

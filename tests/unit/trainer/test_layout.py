"""Megatron's fused QKV and SwiGLU fc1 layouts, pinned by hand on labelled rows."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the cpu extra (torch) is not installed")

from art_mega.trainer.families.layout import fc1_shard, fuse_qkv, pad_rows, shard, split_qkv, unfuse_fc1  # noqa: E402


def labelled(prefix: int, heads: int, head_dim: int, hidden: int = 3) -> torch.Tensor:
    """Rows labelled prefix*100 + head*10 + row-within-head, constant across the hidden dim."""
    rows = [prefix * 100 + h * 10 + r for h in range(heads) for r in range(head_dim)]
    return torch.tensor(rows, dtype=torch.float32)[:, None].expand(-1, hidden).clone()


def test_fused_qkv_groups_queries_with_their_kv_head() -> None:
    q, k, v = labelled(1, 4, 2), labelled(2, 2, 2), labelled(3, 2, 2)
    fused = fuse_qkv(q, k, v, num_heads=4, num_query_groups=2)
    # Group 0: q heads 0, 1, k head 0, v head 0; group 1: q heads 2, 3, k head 1, v head 1.
    expected = [100, 101, 110, 111, 200, 201, 300, 301, 120, 121, 130, 131, 210, 211, 310, 311]
    assert fused[:, 0].tolist() == expected
    assert [t.tolist() for t in split_qkv(fused, 4, 2)] == [q.tolist(), k.tolist(), v.tolist()]
    # Biases (1-D) use the same layout.
    assert fuse_qkv(q[:, 0], k[:, 0], v[:, 0], 4, 2).tolist() == expected


def test_fused_qkv_shards_are_whole_groups_when_tp_divides_kv_heads() -> None:
    q, k, v = labelled(1, 4, 2), labelled(2, 2, 2), labelled(3, 2, 2)
    fused = fuse_qkv(q, k, v, 4, 2)
    assert shard(fused, 0, 2, 1)[:, 0].tolist() == [120, 121, 130, 131, 210, 211, 310, 311]


def test_fc1_shard_is_gate_rows_then_up_rows_per_rank() -> None:
    gate = torch.arange(4.0)[:, None].expand(-1, 3) + 10
    up = torch.arange(4.0)[:, None].expand(-1, 3) + 20
    shards = [fc1_shard(gate, up, 2, rank) for rank in range(2)]
    assert shards[0][:, 0].tolist() == [10, 11, 20, 21]
    assert shards[1][:, 0].tolist() == [12, 13, 22, 23]
    assert [t.tolist() for t in unfuse_fc1(shards)] == [gate.tolist(), up.tolist()]


def test_shard_and_pad() -> None:
    weight = torch.arange(12.0).reshape(3, 4)
    assert shard(weight, 1, 2, 1).tolist() == [[2, 3], [6, 7], [10, 11]]
    with pytest.raises(ValueError, match="dimension 0 of size 3 is not divisible by tensor-parallel size 2"):
        shard(weight, 0, 2, 0)
    padded = pad_rows(weight, 4)
    assert padded.shape == (4, 4) and padded[3].abs().sum() == 0
    assert pad_rows(weight, 3) is weight

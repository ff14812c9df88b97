"""The context-parallel split and attention mask against hand-written splits and a brute-force
mask, on small tensors (no Megatron world needed)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the cpu extra (torch) is not installed")

from art_mega.trainer.rank.cp_attention import (  # noqa: E402
    _gathered_to_sequence_order,
    cp_attention_mask,
    cp_token_indices,
    padded_length,
    slice_for_cp_rank,
)
from art_mega.trainer.rank.logprobs import packed_attention_mask  # noqa: E402

SEGMENTS = torch.tensor(
    [
        [1, 1, 1, 2, 2, 2, 2, 2, 3, 3, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2],
        [0] * 16,
    ]
)
"""Three rows of 16 tokens: three documents and padding; two documents; all padding."""


def brute_force_allowed(segments: list[int] | None, query: int, key: int) -> bool:
    """May the token at `query` attend to the one at `key`? (same document, not later; padding: itself)."""
    if query == key:
        return True
    if segments is None:
        return key < query
    return key < query and segments[query] == segments[key] and segments[query] > 0


@pytest.mark.parametrize(
    ("length", "cp_size", "held"),
    [
        (8, 1, [list(range(8))]),
        (8, 2, [[0, 1, 6, 7], [2, 3, 4, 5]]),
        (16, 4, [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]),
    ],
)
def test_rank_r_holds_chunks_r_and_2cp_minus_1_minus_r(length: int, cp_size: int, held: list) -> None:
    # The 2-rank test compares this split with Megatron's get_batch_on_this_cp_rank itself.
    row = torch.arange(length)[None]
    for cp_rank in range(cp_size):
        assert cp_token_indices(length, cp_size, cp_rank).tolist() == held[cp_rank]
        assert slice_for_cp_rank(row, cp_size, cp_rank).tolist() == [held[cp_rank]]


def test_gathered_slices_return_to_sequence_order() -> None:
    length, cp_size = 24, 3
    gathered = torch.cat([cp_token_indices(length, cp_size, rank) for rank in range(cp_size)])
    assert gathered.tolist() != list(range(length))
    assert gathered[_gathered_to_sequence_order(length, cp_size, "cpu")].tolist() == list(range(length))


@pytest.mark.parametrize("cp_size", [1, 2, 4])
def test_cp_mask_equals_brute_force(cp_size: int) -> None:
    length = SEGMENTS.shape[1]
    for cp_rank in range(cp_size):
        queries = cp_token_indices(length, cp_size, cp_rank).tolist()
        packed = cp_attention_mask(SEGMENTS, cp_size, cp_rank)
        causal = cp_attention_mask(None, cp_size, cp_rank, seq_len=length)
        assert packed.shape == (3, 1, length // cp_size, length) and packed.dtype == torch.bool
        assert causal.shape == (1, 1, length // cp_size, length)
        for row, segments in enumerate(SEGMENTS.tolist()):
            want = [[not brute_force_allowed(segments, q, k) for k in range(length)] for q in queries]
            assert packed[row, 0].tolist() == want, (cp_size, cp_rank, row)
        want = [[not brute_force_allowed(None, q, k) for k in range(length)] for q in queries]
        assert causal[0, 0].tolist() == want


def test_packed_mask_is_the_cp_mask_of_one_rank() -> None:
    length = SEGMENTS.shape[1]
    full = packed_attention_mask(SEGMENTS)
    assert torch.equal(full, cp_attention_mask(SEGMENTS, 1, 0))
    for cp_rank in range(2):
        rows = cp_token_indices(length, 2, cp_rank)
        assert torch.equal(cp_attention_mask(SEGMENTS, 2, cp_rank), full[:, :, rows])


def test_lengths_must_split_into_equal_chunks() -> None:
    assert [padded_length(n, 2) for n in (1, 4, 22, 24)] == [4, 4, 24, 24]
    with pytest.raises(ValueError, match="seq_len=22 is not a multiple of 2 \\* cp=4"):
        cp_token_indices(22, 2, 0)

"""Megatron rank groups, pinned by hand against megatron-core's "tp-cp-ep-dp-pp" layout."""

from __future__ import annotations

import pytest

from art_mega.topology import parallel_groups, rank_coordinates
from art_mega.topology.groups import orthogonal_groups


def lists(groups: tuple[tuple[int, ...], ...]) -> list[list[int]]:
    return [list(group) for group in groups]


def test_world8_tp2_pp2() -> None:
    groups = parallel_groups(8, tp=2, pp=2)
    assert (groups.world_size, groups.dp_size, groups.expert_dp_size) == (8, 2, 4)
    assert lists(groups.tp) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lists(groups.pp) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lists(groups.dp) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lists(groups.dp_cp) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lists(groups.cp) == [[0], [1], [2], [3], [4], [5], [6], [7]]
    assert lists(groups.model_parallel) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    # etp defaults to 1, so every rank is its own expert-TP group and expert DP spans a stage.
    assert lists(groups.expert_dp) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert lists(groups.expert_tp_ep_pp) == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_megatron_docstring_example_16_ranks_tp2_pp4() -> None:
    groups = parallel_groups(16, tp=2, pp=4)
    assert lists(groups.dp) == [
        [0, 2],
        [1, 3],
        [4, 6],
        [5, 7],
        [8, 10],
        [9, 11],
        [12, 14],
        [13, 15],
    ]
    assert lists(groups.tp) == [
        [0, 1],
        [2, 3],
        [4, 5],
        [6, 7],
        [8, 9],
        [10, 11],
        [12, 13],
        [14, 15],
    ]
    assert lists(groups.pp) == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]


def test_context_parallel_world8_tp2_cp2() -> None:
    groups = parallel_groups(8, tp=2, cp=2)
    assert groups.dp_size == 2
    assert lists(groups.cp) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lists(groups.dp) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lists(groups.dp_cp) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert lists(groups.tp_cp) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert lists(groups.model_parallel) == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_expert_world4_tp2_ep2_etp1() -> None:
    groups = parallel_groups(4, tp=2, ep=2, etp=1)
    assert (groups.dp_size, groups.expert_dp_size) == (2, 2)
    assert lists(groups.tp) == [[0, 1], [2, 3]]
    assert lists(groups.dp) == [[0, 2], [1, 3]]
    assert lists(groups.ep) == [[0, 1], [2, 3]]
    assert lists(groups.expert_tp) == [[0], [1], [2], [3]]
    assert lists(groups.expert_tp_ep) == [[0, 1], [2, 3]]
    assert lists(groups.expert_dp) == [[0, 2], [1, 3]]


def test_expert_world8_ep2_etp2_pp2() -> None:
    groups = parallel_groups(8, ep=2, etp=2, pp=2)
    assert (groups.dp_size, groups.expert_dp_size) == (4, 1)
    assert lists(groups.expert_tp) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lists(groups.ep) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lists(groups.expert_tp_ep) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert lists(groups.expert_tp_ep_pp) == [[0, 1, 2, 3, 4, 5, 6, 7]]
    assert lists(groups.expert_dp) == [[0], [1], [2], [3], [4], [5], [6], [7]]
    assert lists(groups.pp) == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_orthogonal_groups_matches_megatron_docstring() -> None:
    # parallel_size = [tp, dp, pp] = [2, 3, 4], mask selects dp.
    groups = orthogonal_groups([2, 3, 4], [False, True, False])
    assert len(groups) == 8
    assert list(groups[0]) == [0, 2, 4]
    assert list(groups[1]) == [1, 3, 5]
    assert list(groups[7]) == [19, 21, 23]


def test_rank_coordinates() -> None:
    assert rank_coordinates(5, 8, tp=2, pp=2) == {
        "tp_rank": 1,
        "cp_rank": 0,
        "ep_rank": 0,
        "etp_rank": 0,
        "pp_rank": 1,
        "dp_rank": 0,
        "expert_dp_rank": 1,
    }
    assert rank_coordinates(3, 4, tp=2, ep=2) == {
        "tp_rank": 1,
        "cp_rank": 0,
        "ep_rank": 1,
        "etp_rank": 0,
        "pp_rank": 0,
        "dp_rank": 1,
        "expert_dp_rank": 1,
    }


@pytest.mark.parametrize(
    "sizes",
    [
        {"tp": 2, "pp": 2},
        {"tp": 2, "cp": 2, "pp": 2},
        {"tp": 4, "ep": 2, "etp": 2, "pp": 2},
        {"cp": 2, "ep": 4, "pp": 1},
    ],
)
def test_groups_agree_with_coordinates(sizes: dict[str, int]) -> None:
    world = 16
    groups = parallel_groups(world, **sizes)
    coords = [rank_coordinates(rank, world, **sizes) for rank in range(world)]
    axis_of = {
        "tp": "tp_rank",
        "cp": "cp_rank",
        "dp": "dp_rank",
        "pp": "pp_rank",
        "ep": "ep_rank",
        "expert_tp": "etp_rank",
        "expert_dp": "expert_dp_rank",
    }
    for kind, axis in axis_of.items():
        seen = sorted(rank for group in getattr(groups, kind) for rank in group)
        assert seen == list(range(world)), kind
        for group in getattr(groups, kind):
            # Members are ordered by their coordinate on the group's own axis...
            assert [coords[rank][axis] for rank in group] == list(range(len(group))), kind
            # ...and agree on every other axis of the same (dense or expert) layout.
            dense = {"tp_rank", "cp_rank", "dp_rank", "pp_rank"}
            expert = {"etp_rank", "ep_rank", "expert_dp_rank", "pp_rank"}
            others = (dense if axis in dense else expert) - {axis}
            for other in others:
                assert len({coords[rank][other] for rank in group}) == 1, (kind, other)
    for rank in range(world):
        assert rank in groups.for_rank("dp", rank)


def test_sizes_that_do_not_divide_are_refused() -> None:
    with pytest.raises(ValueError, match="world size 6 is not divisible by tp\\*cp\\*pp=4"):
        parallel_groups(6, tp=4)
    with pytest.raises(ValueError, match="etp\\*ep\\*pp=4"):
        parallel_groups(6, ep=4)
    with pytest.raises(ValueError, match="rank 8 is outside"):
        rank_coordinates(8, 8)


def test_for_rank() -> None:
    groups = parallel_groups(8, tp=2, pp=2)
    assert groups.for_rank("pp", 6) == (2, 6)
    assert groups.for_rank("model_parallel", 7) == (2, 3, 6, 7)
    with pytest.raises(KeyError, match="unknown group kind 'world_size'"):
        groups.for_rank("world_size", 0)
    with pytest.raises(ValueError, match="rank 9"):
        groups.for_rank("tp", 9)

"""Megatron-core's process groups for a trainer world, computed as plain rank lists.

Same rank layout as megatron-core `RankGenerator` with the default order "tp-cp-ep-dp-pp".
"""

from __future__ import annotations

from collections.abc import Sequence
from math import prod

from pydantic import Field

from art_mega.topology.base import SpecModel

Groups = tuple[tuple[int, ...], ...]

_AXES = ("tp", "cp", "ep", "dp", "pp")
"""Megatron's default order, fastest-varying axis first."""


def _digits(index: int, shape: Sequence[int]) -> list[int]:
    """Mixed-radix digits of `index`, fastest-varying (first) axis first."""
    digits = []
    for size in shape:
        digits.append(index % size)
        index //= size
    return digits


def orthogonal_groups(sizes: Sequence[int], mask: Sequence[bool]) -> Groups:
    """Rank groups over the axes selected by `mask` of a grid shaped `sizes` (first = fastest).

    A rank's coordinates are its mixed-radix digits in `sizes`. Each group holds the ranks that
    agree on every unselected axis, ordered by their selected coordinates (first axis fastest);
    groups are ordered by the unselected coordinates the same way. This reproduces megatron-core's
    `generate_masked_orthogonal_rank_groups(world_size, sizes, mask)`.
    """
    strides = [prod(sizes[:axis]) for axis in range(len(sizes))]
    inner = [axis for axis, selected in enumerate(mask) if selected]
    outer = [axis for axis, selected in enumerate(mask) if not selected]
    inner_shape = [sizes[axis] for axis in inner]
    outer_shape = [sizes[axis] for axis in outer]
    groups = []
    for group_index in range(prod(outer_shape)):
        base = sum(
            digit * strides[axis]
            for axis, digit in zip(outer, _digits(group_index, outer_shape), strict=True)
        )
        groups.append(
            tuple(
                base
                + sum(
                    digit * strides[axis]
                    for axis, digit in zip(inner, _digits(member, inner_shape), strict=True)
                )
                for member in range(prod(inner_shape))
            )
        )
    return tuple(groups)


def _groups(sizes: dict[str, int], token: str) -> Groups:
    selected = set(token.split("-"))
    return orthogonal_groups([sizes[axis] for axis in _AXES], [a in selected for a in _AXES])


class ParallelGroups(SpecModel):
    """Every process group megatron-core builds for a trainer world, as global rank lists.

    Dense layers lay ranks out as tp (fastest), cp, dp, pp; expert layers as expert-tp, ep,
    expert-dp, pp. Field names follow `initialize_model_parallel`: `tp`, `cp`, `pp`, `dp`,
    `dp_cp` (data parallel with context parallel, used for gradient reduction), `tp_cp`,
    `model_parallel` (tp-pp), `ep`, `expert_tp`, `expert_tp_ep`, `expert_tp_ep_pp` and
    `expert_dp`.
    """

    world_size: int = Field(ge=1)
    dp_size: int = Field(ge=1)
    expert_dp_size: int = Field(ge=1)
    tp: Groups
    cp: Groups
    pp: Groups
    dp: Groups
    dp_cp: Groups
    tp_cp: Groups
    model_parallel: Groups
    ep: Groups
    expert_tp: Groups
    expert_tp_ep: Groups
    expert_tp_ep_pp: Groups
    expert_dp: Groups

    def for_rank(self, kind: str, rank: int) -> tuple[int, ...]:
        """The group of type `kind` (a field name such as "dp") that holds `rank`.

        Raises `KeyError` for an unknown kind and `ValueError` for a rank outside the world.
        """
        if kind not in _GROUP_FIELDS:
            raise KeyError(f"unknown group kind {kind!r}; use one of {', '.join(_GROUP_FIELDS)}")
        for group in getattr(self, kind):
            if rank in group:
                return group
        raise ValueError(f"rank {rank} is outside the trainer world of {self.world_size} ranks")


_SIZE_FIELDS = {"world_size", "dp_size", "expert_dp_size"}
_GROUP_FIELDS = tuple(name for name in ParallelGroups.model_fields if name not in _SIZE_FIELDS)


def _sizes(
    world_size: int, tp: int, cp: int, ep: int, etp: int, pp: int
) -> tuple[dict[str, int], dict[str, int]]:
    for name, size in (("tp*cp*pp", tp * cp * pp), ("etp*ep*pp", etp * ep * pp)):
        if world_size < 1 or world_size % size:
            raise ValueError(f"world size {world_size} is not divisible by {name}={size}")
    dense = {"tp": tp, "cp": cp, "ep": 1, "dp": world_size // (tp * cp * pp), "pp": pp}
    expert = {"tp": etp, "cp": 1, "ep": ep, "dp": world_size // (etp * ep * pp), "pp": pp}
    return dense, expert


def parallel_groups(
    world_size: int, *, tp: int = 1, cp: int = 1, ep: int = 1, etp: int = 1, pp: int = 1
) -> ParallelGroups:
    """All Megatron process groups of a world of `world_size` ranks.

    Raises `ValueError` when tp*cp*pp or etp*ep*pp does not divide `world_size`
    (`compile_topology` checks this first and raises `TopologyError`).
    """
    dense, expert = _sizes(world_size, tp, cp, ep, etp, pp)
    return ParallelGroups(
        world_size=world_size,
        dp_size=dense["dp"],
        expert_dp_size=expert["dp"],
        tp=_groups(dense, "tp"),
        cp=_groups(dense, "cp"),
        pp=_groups(dense, "pp"),
        dp=_groups(dense, "dp"),
        dp_cp=_groups(dense, "dp-cp"),
        tp_cp=_groups(dense, "tp-cp"),
        model_parallel=_groups(dense, "tp-pp"),
        ep=_groups(expert, "ep"),
        expert_tp=_groups(expert, "tp"),
        expert_tp_ep=_groups(expert, "tp-ep"),
        expert_tp_ep_pp=_groups(expert, "tp-ep-pp"),
        expert_dp=_groups(expert, "dp"),
    )


def rank_coordinates(
    rank: int, world_size: int, *, tp: int = 1, cp: int = 1, ep: int = 1, etp: int = 1, pp: int = 1
) -> dict[str, int]:
    """A rank's position on every parallel axis, keyed like `TrainerRank` fields.

    Keys: tp_rank, cp_rank, dp_rank, pp_rank (dense layout) and etp_rank, ep_rank,
    expert_dp_rank (expert layout). Raises `ValueError` for a rank outside the world or sizes
    that do not divide it.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the trainer world of {world_size} ranks")
    dense, expert = _sizes(world_size, tp, cp, ep, etp, pp)
    tp_rank, cp_rank, _, dp_rank, pp_rank = _digits(rank, [dense[a] for a in _AXES])
    etp_rank, _, ep_rank, expert_dp_rank, _ = _digits(rank, [expert[a] for a in _AXES])
    return {
        "tp_rank": tp_rank,
        "cp_rank": cp_rank,
        "ep_rank": ep_rank,
        "etp_rank": etp_rank,
        "pp_rank": pp_rank,
        "dp_rank": dp_rank,
        "expert_dp_rank": expert_dp_rank,
    }

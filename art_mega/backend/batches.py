"""A step's trajectories into batches: the checked groups, the RL step's batches, the packed row
length, the KL reference adapter."""

from __future__ import annotations

import logging
from typing import Any

from art_mega.backend.options import check_accumulation

log = logging.getLogger(__name__)


def rl_step_batches(
    documents: list[Any], seq_len: int, dp: int, rows_per_step: int | None
) -> tuple[list[Any], int]:
    """An rl job's batch files and optimizer steps: `documents` packed into rows of `seq_len`
    tokens, `rows_per_step` rows per optimizer step over the `dp` DP ranks (ART's
    grad_accumulation_sequences; None: `dp`, ART's MegatronBackend default, so one row per
    rank and step); returns (one `TrainBatch` per DP rank, `batch.pack_steps`; rows per step
    on each rank, `RLJob.step_rows`).

    Raises:
        HyperParameterError: `rows_per_step` is not a multiple of `dp` (`check_accumulation`).
        ValueError: a document longer than `seq_len`.
    """
    from art_mega.trainer.batch import pack_steps

    rows = check_accumulation(dp if rows_per_step is None else rows_per_step, dp)
    return pack_steps(documents, seq_len, dp, rows), rows // dp


def checked_groups(
    trajectory_groups: Any, drop_nonfinite_rewards: bool, scale_rewards: bool = True
) -> tuple[list[Any], int]:
    """`backend.train`'s groups after the input and reward checks, and how many trajectories
    with a NaN or inf reward were left out (only with `drop_nonfinite_rewards`); advantages are
    checked as the step computes them (`scale_rewards`).

    Raises:
        TrainInputError: see `trajectories.check_train_groups`.
        NonFiniteValueError: a NaN or inf reward (without `drop_nonfinite_rewards`), or rewards
            so large that a group's advantages overflow (group and trajectory named).
    """
    from art_mega.errors import NonFiniteValueError
    from art_mega.trainer.prepare.advantages import group_advantages
    from art_mega.trajectories import check_train_groups, nonfinite_rewards, without_trajectories

    groups = check_train_groups(trajectory_groups)
    bad = nonfinite_rewards(groups)
    if bad and not drop_nonfinite_rewards:
        g, t, reward = bad[0]
        raise NonFiniteValueError(
            f"backend.train(trajectory_groups): trajectory {t} of group {g} has the reward {reward} "
            f"({len(bad)} non-finite rewards in this call); rewards must be finite numbers: fix the "
            "reward, or pass drop_nonfinite_rewards=True to leave such trajectories out",
            "reward",
            reward,
            g,
            t,
        )
    if bad:
        groups = without_trajectories(groups, [(g, t) for g, t, _ in bad])
    for g, group in enumerate(groups):
        try:
            group_advantages([t.reward for t in group.trajectories], scale_rewards)
        except NonFiniteValueError as exc:
            raise NonFiniteValueError(
                f"backend.train(trajectory_groups): group {g}: {exc}",
                exc.quantity,
                exc.value,
                g,
                exc.trajectory,
            ) from None
    return groups, len(bad)


PACKED_ROW_TOKENS = 1024
"""The packed row length in tokens when `MegatronBackend(seq_len=None)` (the default): a batch
whose longest trajectory is longer gets rows of that length (up to max_model_len), so the
trainer's work follows the batch and not the model's context."""


def packed_row_len(limit: int, longest: int) -> int:
    """The packed row length in tokens of a batch whose longest sequence has `longest` tokens,
    under the sequence limit `limit` (`seq_len` / `init_args.max_seq_length` / max_model_len):
    `PACKED_ROW_TOKENS`, or `longest` when longer, never above `limit` (a longer sequence is
    then refused by the packing, naming the limit)."""
    return min(limit, max(PACKED_ROW_TOKENS, longest))

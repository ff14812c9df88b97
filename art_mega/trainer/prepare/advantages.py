"""Group-relative advantages (GRPO) and per-trajectory token weights.

GRPO (Shao et al. 2024, "DeepSeekMath", section 4.1.2): A_i = (r_i - mean(r)) / (std(r) + eps)
with the population standard deviation of the group's rewards, as ART computes it; a group whose
rewards are all equal carries no signal and is skipped; trajectories with A_i == 0 are dropped.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from art_mega.hyperparams import FLOAT32_MAX

STD_EPSILON = 1e-6


@dataclass(frozen=True)
class GroupAdvantages:
    """Advantages of one group, or why it was skipped."""

    advantages: tuple[float, ...]
    skipped: bool = False
    """True when every reward in the group was equal (no learning signal)."""

    def kept(self) -> list[int]:
        """Indices of trajectories with a non-zero advantage (the ones trained on)."""
        return [i for i, a in enumerate(self.advantages) if a != 0.0]


def group_advantages(rewards: Sequence[float], scale_rewards: bool = True) -> GroupAdvantages:
    """A_i = r_i - mean(r), divided by (population std + 1e-6) when `scale_rewards`.

    Args:
        rewards: the group's rewards, one per trajectory (any scale).
        scale_rewards: divide by the group's standard deviation (ART's default: True).

    Raises:
        NonFiniteValueError: a reward is NaN or +-inf (quantity "reward", its index as
            `trajectory`), or the rewards are so large that an advantage overflows
            (quantity "advantage"), in float64 or in the batch's float32. `backend.train` refuses such rewards earlier, naming the group.
    """
    from art_mega.errors import NonFiniteValueError

    for i, r in enumerate(rewards):
        if not math.isfinite(r):
            raise NonFiniteValueError(
                f"reward {i} of the group is {r}; rewards must be finite numbers", "reward", r, None, i
            )
    if not rewards:
        return GroupAdvantages((), skipped=True)
    if all(r == rewards[0] for r in rewards):
        return GroupAdvantages(tuple(0.0 for _ in rewards), skipped=True)
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) * (r - mean) for r in rewards) / len(rewards))
    scale = std + STD_EPSILON if scale_rewards else 1.0
    advantages = tuple((r - mean) / scale for r in rewards)
    for i, a in enumerate(advantages):
        # an infinite std zeroes every advantage; the batch holds advantages as float32
        if not (math.isfinite(a) and math.isfinite(scale)) or abs(a) > FLOAT32_MAX:
            raise NonFiniteValueError(
                f"advantage {i} of the group is not finite: its rewards overflow the trainer's "
                f"float32 (largest {max(abs(r) for r in rewards):g}); rescale the rewards",
                "advantage",
                a,
                None,
                i,
            )
    return GroupAdvantages(advantages)


def token_weight(assistant_tokens: int) -> float:
    """Weight of each assistant token of a trajectory: 1 / its assistant-token count (0 -> 0)."""
    return 1.0 / assistant_tokens if assistant_tokens > 0 else 0.0

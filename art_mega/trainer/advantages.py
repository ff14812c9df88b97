"""Group-relative advantages (GRPO) and per-trajectory token weights.

GRPO (Shao et al. 2024, "DeepSeekMath", section 4.1.2): A_i = (r_i - mean(r)) / (std(r) + eps)
with the population standard deviation of the group's rewards, as ART computes it; a group whose
rewards are all equal carries no signal and is skipped; trajectories with A_i == 0 are dropped.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

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
    """
    if not rewards:
        return GroupAdvantages((), skipped=True)
    mean = sum(rewards) / len(rewards)
    if all(r == rewards[0] for r in rewards):
        return GroupAdvantages(tuple(0.0 for _ in rewards), skipped=True)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    scale = std + STD_EPSILON if scale_rewards else 1.0
    return GroupAdvantages(tuple((r - mean) / scale for r in rewards))


def token_weight(assistant_tokens: int) -> float:
    """Weight of each assistant token of a trajectory: 1 / its assistant-token count (0 -> 0)."""
    return 1.0 / assistant_tokens if assistant_tokens > 0 else 0.0

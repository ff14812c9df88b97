"""Rewards without a reward function: RULER, an LLM judge that scores a group's trajectories
against each other (ART's `art.rewards`). LiteLLM judges need the `rewards` extra, imported on
the first call."""

from art_mega.rewards.ruler import DEFAULT_RUBRIC, TrajectoryScore, ruler, ruler_score_group

__all__ = ["DEFAULT_RUBRIC", "TrajectoryScore", "ruler", "ruler_score_group"]

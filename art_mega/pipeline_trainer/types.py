"""The callables a `PipelineTrainer` runs (ART's `art.pipeline_trainer.types` names)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from art_mega.trajectories import Trajectory, TrajectoryGroup

ScenarioT = TypeVar("ScenarioT", bound=dict)
"""A scenario: a dict (its "metadata" dict's scalar values are copied into the group's)."""

ConfigT = TypeVar("ConfigT")
"""The `config` object the trainer hands every rollout and eval unchanged."""

RolloutFn = Callable[[Any, ScenarioT, ConfigT], Awaitable[TrajectoryGroup]]
"""`rollout_fn(model, scenario, config)` -> one group of trajectories for the scenario."""

SingleRolloutFn = Callable[[Any, ScenarioT, ConfigT], Awaitable[Trajectory]]
"""`single(model, scenario, config)` -> one trajectory (see `make_group_rollout_fn`)."""

EvalFn = Callable[
    [Any, int, ConfigT],
    Awaitable[list[Trajectory | TrajectoryGroup] | dict[str, list[Trajectory | TrajectoryGroup]]],
]
"""`eval_fn(model, step, config)` -> trajectories/groups logged under "val", or split -> them."""

"""ART's `art.pipeline_trainer`: `PipelineTrainer` overlaps rollouts with training (dedicated
mode), `make_group_rollout_fn` turns a one-trajectory rollout into a group rollout.

ART's checkpoint retention strategies, `StatusReporter` and the pipeline autotuner are not part
of art-mega (the trainer refuses `checkpoint_retention_strategy`; `PipelineTrainer.status_line`
is its status): accessing one raises its sentence (`art_mega.unsupported`).
"""

from typing import Any

from art_mega.pipeline_trainer.trainer import PIPELINE_STATE_KEY, PipelineTrainer, make_group_rollout_fn
from art_mega.pipeline_trainer.types import EvalFn, RolloutFn, ScenarioT, SingleRolloutFn

__all__ = [
    "PIPELINE_STATE_KEY",
    "EvalFn",
    "PipelineTrainer",
    "RolloutFn",
    "ScenarioT",
    "SingleRolloutFn",
    "make_group_rollout_fn",
]


def __getattr__(name: str) -> Any:
    from art_mega.unsupported import missing

    raise missing("art_mega.pipeline_trainer", name)

"""PipelineTrainer's constructor: every value out of range and every ART option art-mega does
not implement is refused with one sentence naming the field and the value; shared mode (a
replica sharing GPUs with the trainer) is refused as ART refuses shared LocalBackend."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from art_mega.errors import HyperParameterError, UserError
from art_mega.pipeline_trainer import PipelineTrainer, make_group_rollout_fn
from tests.inference.common import replica_spec


async def rollout(model: Any, scenario: dict, config: Any) -> Any:
    raise AssertionError("never rolled out")


DEDICATED = SimpleNamespace(
    _runtime=SimpleNamespace(topology=SimpleNamespace(replicas=(replica_spec(port=9),)))
)
"""A backend's started runtime whose one replica has its own cores (the constructor reads only
the topology's replicas)."""


def make(backend: Any = DEDICATED, **options: Any) -> PipelineTrainer:
    return PipelineTrainer(object(), backend, rollout, [{"q": 1}], None, **options)


@pytest.mark.parametrize(
    ("options", "field", "words"),
    [
        ({"num_rollout_workers": 0}, "num_rollout_workers", "a whole number at least 1"),
        ({"num_rollout_workers": 2.0}, "num_rollout_workers", "a whole number at least 1"),
        ({"min_batch_size": 0}, "min_batch_size", "at least 1"),
        ({"min_batch_size": 4, "max_batch_size": 3}, "max_batch_size", "at least 4 or None"),
        ({"max_steps_off_policy": -1}, "max_steps_off_policy", "at least 0"),
        ({"max_steps_off_policy": True}, "max_steps_off_policy", "a whole number"),
        ({"queue_maxsize": 0}, "queue_maxsize", "at least 1 or None"),
        ({"max_steps": -1}, "max_steps", "at least 0 or None"),
        ({"discard_queue_multiplier": 0}, "discard_queue_multiplier", "at least 1"),
        ({"log_interval_seconds": 0}, "log_interval_seconds", "a number above 0"),
        ({"status_ewa_alpha": 0.0}, "status_ewa_alpha", "a number above 0"),
        ({"status_ewa_alpha": 1.5}, "status_ewa_alpha", "at most 1"),
        ({"total_scenarios": 0}, "total_scenarios", "at least 1 or None"),
        ({"eval_every_n_steps": -1}, "eval_every_n_steps", "at least 0"),
        ({"eval_at_start": "yes"}, "eval_at_start", "True or False"),
        ({"resume": 1}, "resume", "True or False"),
        ({"loss_fn": "dro"}, "loss_fn", "'cispo' or 'ppo'"),
        ({"loss_fn_config": {"a": 1}}, "loss_fn_config", "requires None too"),
        ({"adam_params": object()}, "adam_params", "requires None too"),
        ({"save_checkpoint": False}, "save_checkpoint", "commits a checkpoint every step"),
        (
            {"checkpoint_retention_strategy": lambda ctx: set()},
            "checkpoint_retention_strategy",
            "no retention",
        ),
        ({"checkpoint_retention_interval": 5}, "checkpoint_retention_interval", "leave it at 1"),
        # ART 0.5.23's keywords
        ({"pipeline": object()}, "pipeline", "pass num_rollout_workers=, min_batch_size="),
        ({"autotune": object()}, "autotune", "no pipeline autotuner"),
        ({"rollout_executor": object()}, "rollout_executor", "runs its rollouts in this process"),
        ({"limit_mean_steps_off_policy": 1.5}, "limit_mean_steps_off_policy", "per group with max_steps_off_policy"),
        ({"kl_penalty_coef": -0.1}, "kl_penalty_coef", "at least 0"),
        ({"kl_penalty_step_lag": 0}, "kl_penalty_step_lag", "at least 1 or None"),
        ({"grad_accumulation_sequences": 0}, "grad_accumulation_sequences", "at least 1 or None"),
        ({"optimizer_save_interval": 0}, "optimizer_save_interval", "at least 1"),
        ({"score_reference_groups_per_step": 0.0}, "score_reference_groups_per_step", "above 0"),
    ],
)
def test_out_of_range_and_unimplemented_options_are_refused(options: dict, field: str, words: str) -> None:
    with pytest.raises(HyperParameterError) as info:
        make(**options)
    message = str(info.value)
    assert info.value.name == field and info.value.value is options[field]
    assert message.startswith(f"PipelineTrainer({field}=") and words in message and message.count(". ") == 0


def test_shared_mode_is_refused_naming_the_replicas() -> None:
    shared = replica_spec(port=9).model_copy(update={"shared_gpus": True})
    backend = SimpleNamespace(_runtime=SimpleNamespace(topology=SimpleNamespace(replicas=(shared,))))
    with pytest.raises(UserError) as info:
        make(backend)
    assert str(info.value).startswith(
        f"PipelineTrainer runs only in dedicated mode, but replicas ['{shared.process_name}'] share their GPUs"
    )
    assert "trainer_gpu_ids and inference_gpu_ids" in str(info.value)


def test_defaults_follow_art() -> None:
    trainer = make(min_batch_size=3)
    assert (trainer.max_batch_size, trainer.max_steps_off_policy, trainer.queue_maxsize) == (30, 4, 120)
    assert (trainer.learning_rate, trainer.loss_fn, trainer.num_rollout_workers) == (1e-5, "cispo", 16)
    assert make(max_steps_off_policy=0).queue_maxsize == 1


async def test_group_rollouts_keep_failures_as_records() -> None:
    import art_mega as art

    calls = iter(range(3))

    async def single(model: Any, scenario: dict, config: Any) -> art.Trajectory:
        if next(calls) == 1:
            raise ValueError("tool down")
        return art.Trajectory(messages_and_choices=[{"role": "user", "content": scenario["q"]}], reward=1.0)

    group = await make_group_rollout_fn(single, n=3)(None, {"q": "hi"}, None)
    assert len(group.trajectories) == 2 and [e.message for e in group.exceptions] == ["tool down"]
    with pytest.raises(
        HyperParameterError, match=r"make_group_rollout_fn\(n=0\) must be a whole number at least 1"
    ):
        make_group_rollout_fn(single, n=0)


def test_art_0_5_23_keywords_reach_backend_train() -> None:
    from art_mega.pipeline_trainer.trainer import kl_options

    assert (
        make().num_rollout_workers == 16
        and make(num_rollout_workers=None, min_batch_size=None).min_batch_size == 4
    )
    assert make()._art_train_options(7) == {}  # ART's defaults: backend.train's own
    trainer = make(
        kl_penalty_coef=0.05, kl_penalty_step_lag=3, grad_accumulation_sequences=2, optimizer_save_interval=1
    )
    assert trainer._art_train_options(7) == {
        "kl_penalty_coef": 0.05,
        "kl_penalty_source": "sample",  # ART's pipeline trainer penalises the sampling policy's KL
        "kl_penalty_reference_step": 4,
        "grad_accumulation_sequences": 2,
        "optimizer_save_interval": 1,
    }
    assert kl_options(0.05, 3, 1)["kl_penalty_reference_step"] == 0
    assert kl_options(0.05, None, 9) == {"kl_penalty_coef": 0.05, "kl_penalty_source": "sample"}  # base model


def test_score_reference_options_are_accepted_with_a_logged_line(caplog) -> None:
    import logging

    with caplog.at_level(logging.INFO, logger="art_mega.pipeline_trainer.trainer"):
        make(score_reference_groups_per_step=8.0)
    assert [r.getMessage() for r in caplog.records] == [
        "PipelineTrainer(score_reference_groups_per_step=8.0): it scales ART's pipeline throughput "
        "score; art-mega's status line shows groups and steps per second instead"
    ]

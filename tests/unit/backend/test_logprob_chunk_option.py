"""ART's logprob_calculation_chunk_size reaches the rank's GRPOLossConfig (keyword or dev.TrainConfig)
and a value that is not a whole number >= 1 is refused in one sentence."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
from pydantic import ValidationError

import art_mega as art
from art_mega.backend import MegatronBackend, check_grpo_options
from art_mega.errors import HyperParameterError
from art_mega.trainer.protocol import GRPOLossConfig

BASE: dict[str, Any] = dict(
    learning_rate=5e-6,
    importance_sampling_level="token",
    epsilon=None,
    epsilon_high=None,
    kl_beta=0.0,
    tis_cap=None,
    scale_rewards=True,
    config=None,
    allow_stale=False,
    drop_nonfinite_rewards=False,
    unknown={},
)


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (0, "below 1"),
        (-8, "below 1"),
        (True, "a bool"),
        (8.0, "a float"),
        (math.nan, "a float"),
        ("8", "a str"),
    ],
)
def test_a_chunk_size_that_is_not_a_whole_number_of_at_least_1_is_refused(value: Any, why: str) -> None:
    with pytest.raises(HyperParameterError) as info:
        check_grpo_options(**BASE, logprob_calculation_chunk_size=value)
    assert str(info.value) == (
        f"backend.train(logprob_calculation_chunk_size={value!r}) must be a whole number of at least 1 "
        f"({why}); pass e.g. logprob_calculation_chunk_size=8"
    )
    assert info.value.name == "logprob_calculation_chunk_size" and info.value.value is value


def test_the_chunk_size_travels_in_the_loss_config() -> None:
    _, loss = check_grpo_options(**BASE)
    assert GRPOLossConfig(**loss).logprob_calculation_chunk_size is None
    _, loss = check_grpo_options(**BASE, logprob_calculation_chunk_size=8)
    config = GRPOLossConfig.model_validate(GRPOLossConfig(**loss).model_dump())
    assert config.logprob_calculation_chunk_size == 8
    for bad in (0, True, 2.0):
        with pytest.raises(ValidationError, match="logprob_calculation_chunk_size"):
            GRPOLossConfig(logprob_calculation_chunk_size=bad)


def plain(reward: float) -> art.Trajectory:
    return art.Trajectory(
        messages_and_choices=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}],
        reward=reward,
    )


def test_backend_train_and_dev_train_config_pass_it_to_the_step(tiny_llama_dir) -> None:  # noqa: ANN001
    backend = MegatronBackend()
    model = art.TrainableModel(name="m", project="p", base_model="tiny")
    backend._model, backend._model_dir, model._backend = model, tiny_llama_dir, backend

    async def step_with(steps, metrics, kind, learning_rate, loss, started, **packing):  # noqa: ANN001
        return loss

    backend._step_with = step_with  # type: ignore[method-assign]
    groups = [art.TrajectoryGroup([plain(1.0), plain(0.0)])]
    options = {"allow_training_without_logprobs": True}
    loss = asyncio.run(backend.train(model, groups, logprob_calculation_chunk_size=8, **options))
    assert loss["logprob_calculation_chunk_size"] == 8
    loss = asyncio.run(model.train(groups, _config={"logprob_calculation_chunk_size": 3, **options}))
    assert loss["logprob_calculation_chunk_size"] == 3
    assert "logprob_calculation_chunk_size" not in asyncio.run(backend.train(model, groups, **options))


def test_model_train_logs_its_groups_and_metrics_at_the_sampling_step(tiny_llama_dir, tmp_path) -> None:  # noqa: ANN001
    """ART's `model.train` logged the train batch and the trainer's metrics (LocalBackend._train_model):
    one history row at the step that sampled the groups, with their rewards and the step's loss."""
    import json

    from art_mega.types import TrainResult

    backend = MegatronBackend()
    model = art.TrainableModel(name="m", project="p", base_model="tiny", base_path=str(tmp_path))
    backend._model, backend._model_dir, model._backend = model, tiny_llama_dir, backend

    async def step_with(steps, metrics, kind, learning_rate, loss, started, **packing):  # noqa: ANN001
        return TrainResult(step=1, metrics={"loss/train": 0.25})

    backend._step_with = step_with  # type: ignore[method-assign]
    groups = (g for g in [art.TrajectoryGroup([plain(1.0), plain(0.0)])])  # a generator, read twice
    result = asyncio.run(model.train(groups, allow_training_without_logprobs=True))
    assert result.step == 1
    (row,) = [json.loads(line) for line in (model.output_dir / "history.jsonl").read_text().splitlines()]
    assert row["step"] == 0 and row["loss/train"] == 0.25 and row["train/reward"] == 0.5

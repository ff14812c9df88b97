"""ART 0.5.18's `costs/gpu`: `LocalBackend(gpu_cost_per_hour_usd=)` or its automatic price, charged
on each train row as step wall seconds * per-GPU price * GPUs / 3600, through the real model.log."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import numpy as np
import pytest

import art_mega as art
from art_mega.errors import HyperParameterError
from art_mega.local.backend import _visible_gpu_names, per_gpu_price, priced_gpu_count

DEDICATED = {"trainer_gpu_ids": [0, 1], "inference_gpu_ids": [2]}


def group(*rewards: float) -> art.TrajectoryGroup:
    return art.TrajectoryGroup(
        art.Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}], reward=r) for r in rewards
    )


def test_the_automatic_price_is_arts_table() -> None:
    """ART prices a host only when every visible GPU is of one priced kind (H200: $3/hour)."""
    assert per_gpu_price(["NVIDIA H200", "NVIDIA H200"]) == 3.0
    assert per_gpu_price(["nvidia h200 nvl"]) == 3.0
    assert per_gpu_price(["NVIDIA H200", "NVIDIA A100-SXM4-80GB"]) is None  # one unpriced GPU: no guess
    assert per_gpu_price(["NVIDIA A100-SXM4-80GB"]) is None
    assert per_gpu_price([]) is None


def test_the_gpu_count_is_arts() -> None:
    """The model's dedicated GPU ids (each once), else every visible GPU."""
    assert priced_gpu_count(DEDICATED, visible=8) == 3
    assert priced_gpu_count({"trainer_gpu_ids": [0], "inference_gpu_ids": [0]}, visible=8) == 1
    assert priced_gpu_count({}, visible=8) == 8
    assert priced_gpu_count(None, visible=0) == 0


@pytest.mark.parametrize("price", [-1.0, math.inf, math.nan, "3.0", True, [3.0]])
def test_a_price_that_is_not_a_finite_number_at_least_0_is_refused(price) -> None:  # noqa: ANN001
    with pytest.raises(HyperParameterError) as caught:
        art.LocalBackend(gpu_cost_per_hour_usd=price)
    assert str(caught.value).startswith(
        f"LocalBackend(gpu_cost_per_hour_usd={price!r}) must be a finite number"
    )
    assert (caught.value.name, caught.value.value) == ("gpu_cost_per_hour_usd", price)


def test_a_price_is_taken_as_a_float() -> None:
    assert art.LocalBackend(gpu_cost_per_hour_usd=np.float32(2.5)).gpu_cost_per_hour_usd == 2.5
    assert art.LocalBackend(gpu_cost_per_hour_usd=0).gpu_cost_per_hour_usd == 0.0
    assert art.LocalBackend().gpu_cost_per_hour_usd is None


def _registered(tmp_path: Path, backend: art.LocalBackend, config: dict | None = None) -> art.TrainableModel:
    model = art.TrainableModel(
        name="m", project="p", base_model="tiny", base_path=str(tmp_path), _internal_config=config
    )
    model._backend = backend  # in name only: the rows need no runtime
    return model


def test_train_rows_carry_costs_gpu_at_the_given_price(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """costs/gpu = time/step_wall_s * 2.5 $/GPU-hour * 3 dedicated GPUs / 3600, once per train
    step, in the cost rollups; none on val rows; a caller's costs/gpu replaces it."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    model = _registered(tmp_path, art.LocalBackend(gpu_cost_per_hour_usd=2.5), DEDICATED)

    async def go() -> tuple[dict, ...]:
        await asyncio.sleep(0.05)  # a step of measurable length, so the cost is not 0
        first = await model.log([group(1.0, 0.0)], split="train", step=0)
        again = await model.log(None, split="train", metrics={"loss/train": 1.0}, step=0)
        val = await model.log([group(1.0)], split="val", step=0)
        await asyncio.sleep(0.05)
        second = await model.log([group(1.0, 0.0)], split="train", step=1)
        given = await model.log(None, split="train", metrics={"costs/gpu": 0.125}, step=2)
        return first, again, val, second, given

    first, again, val, second, given = asyncio.run(go())
    assert first["time/step_wall_s"] >= 0.05
    assert first["costs/gpu"] == pytest.approx(first["time/step_wall_s"] * 2.5 * 3 / 3600)
    assert first["costs/all"] == first["costs/gpu"]
    assert "costs/gpu" not in again and "costs/gpu" not in val  # the same step is charged once
    assert second["costs/gpu"] == pytest.approx(second["time/step_wall_s"] * 2.5 * 3 / 3600)
    assert second["costs/cum/all"] == pytest.approx(first["costs/gpu"] + second["costs/gpu"])
    assert given["costs/gpu"] == 0.125


def test_a_host_without_gpus_logs_costs_gpu_only_when_priced(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """No GPU here: no automatic price, so no costs/gpu row; a given price charges the 0 GPUs the
    model holds, 0.0 (ART leaves that row out; art-mega shows the price was applied)."""
    if _visible_gpu_names():
        pytest.skip("this host has a GPU CUDA can use; the test is about a host without one")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    unpriced = _registered(tmp_path / "a", art.LocalBackend())
    row = asyncio.run(unpriced.log([group(1.0, 0.0)], split="train", step=0))
    assert "time/step_wall_s" in row and "costs/gpu" not in row and "costs/all" not in row
    priced = _registered(tmp_path / "b", art.LocalBackend(gpu_cost_per_hour_usd=3.0))
    row = asyncio.run(priced.log([group(1.0, 0.0)], split="train", step=0))
    assert row["costs/gpu"] == 0.0

"""model.log records the rollout time of a step itself: the seconds the gather_trajectory_groups
calls that returned the logged groups took (issue 34: the step-time plot had no rollout bar
unless the program timed rollouts itself)."""

import asyncio

import pytest

import art_mega as art


def _trajectory(reward: float) -> art.Trajectory:
    return art.Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}], reward=reward)


async def _rollout(delay: float, reward: float) -> art.Trajectory:
    await asyncio.sleep(delay)
    return _trajectory(reward)


async def test_train_rows_get_the_gather_time_and_val_rows_the_eval_time(tmp_path):
    model = art.Model(name="timed", project="p", base_path=str(tmp_path))
    groups = await art.gather_trajectory_groups(
        [art.TrajectoryGroup(_rollout(0.3, r) for r in (0.0, 1.0)) for _ in range(2)], pbar_desc=None
    )
    more = await art.gather_trajectory_groups(
        [art.TrajectoryGroup(_rollout(0.2, r) for r in (0.5, 0.25))], pbar_desc=None
    )
    row = await model.log(groups + more, split="train", step=1)
    # two calls, concurrent rollouts within each: ~0.3 s + ~0.2 s, each call counted once
    assert row["time/step_actor_s"] == pytest.approx(0.5, abs=0.15)
    assert row["train/reward_min"] == 0.0 and row["train/reward_max"] == 1.0
    val = await model.log(groups, split="val", step=1)
    assert val["time/step_eval_s"] == pytest.approx(0.3, abs=0.1) and "time/step_actor_s" not in val


async def test_a_caller_timing_wins_and_built_groups_have_none(tmp_path):
    model = art.Model(name="timed", project="p", base_path=str(tmp_path))
    groups = await art.gather_trajectory_groups(
        [art.TrajectoryGroup(_rollout(0.05, r) for r in (0.0, 1.0))], pbar_desc=None
    )
    row = await model.log(groups, split="train", step=1, metrics={"time/step_actor_s": 7.0})
    assert row["time/step_actor_s"] == 7.0
    built = [art.TrajectoryGroup([_trajectory(0.0), _trajectory(1.0)])]
    assert "time/step_actor_s" not in await model.log(built, split="train", step=2)

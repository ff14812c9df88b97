import asyncio

import pytest

from art_mega import Trajectory, TrajectoryGroup
from art_mega.gather import gather_trajectory_groups
from art_mega.rollouts import wire


async def rollout(reward: float, fail: bool = False, delay: float = 0.0) -> Trajectory:
    await asyncio.sleep(delay)
    if fail:
        raise ValueError(f"bad rollout {reward}")
    return Trajectory(messages_and_choices=[{"role": "assistant", "content": str(reward)}], reward=reward)


def test_group_from_trajectories_and_generators():
    group = TrajectoryGroup(Trajectory(reward=r) for r in (0.0, 1.0))
    assert [t.reward for t in group] == [0.0, 1.0]
    assert len(group) == 2
    assert wire.decode(wire.encode(group)) == group


async def test_awaitable_group_records_exceptions():
    pending = TrajectoryGroup((rollout(r, fail=r == 2) for r in range(4)), metrics={"m": 1})
    assert pending.num_trajectories == 4
    (group,) = await gather_trajectory_groups([pending], pbar_desc=None, max_exceptions=1)
    assert [t.reward for t in group.trajectories] == [0, 1, 3]
    assert [(e.type, e.message) for e in group.exceptions] == [("<class 'ValueError'>", "bad rollout 2")]
    assert group.metrics == {"m": 1}


async def test_gather_runs_concurrently_and_keeps_order():
    started = asyncio.get_running_loop().time()
    groups = await gather_trajectory_groups(
        (TrajectoryGroup(rollout(g * 10 + i, delay=0.2) for i in range(3)) for g in range(4)), pbar_desc=None
    )
    assert asyncio.get_running_loop().time() - started < 1.5  # 12 rollouts of 0.2 s each, at once
    assert [[t.reward for t in g] for g in groups] == [[0, 1, 2], [10, 11, 12], [20, 21, 22], [30, 31, 32]]


async def test_after_each_may_drop_or_replace():
    async def keep_high(group):
        return group if group.trajectories[0].reward >= 10 else None

    groups = await gather_trajectory_groups(
        [TrajectoryGroup([rollout(g * 10)]) for g in range(3)], pbar_desc="test", after_each=keep_high
    )
    assert [g.trajectories[0].reward for g in groups] == [10, 20]
    doubled = await gather_trajectory_groups(
        [TrajectoryGroup([rollout(1)])], pbar_desc=None, after_each=lambda g: [g, g]
    )
    assert len(doubled) == 2


async def test_max_exceptions_as_count_and_fraction():
    def make():
        return [TrajectoryGroup([rollout(i, fail=i < 2) for i in range(4)])]

    with pytest.raises(ValueError, match="bad rollout"):
        await gather_trajectory_groups(make(), pbar_desc=None)
    groups = await gather_trajectory_groups(make(), pbar_desc=None, max_exceptions=2)
    assert len(groups[0].exceptions) == 2
    groups = await gather_trajectory_groups(make(), pbar_desc=None, max_exceptions=0.5)
    assert len(groups[0].trajectories) == 2
    with pytest.raises(ValueError, match="bad rollout"):
        await gather_trajectory_groups(make(), pbar_desc=None, max_exceptions=0.25)

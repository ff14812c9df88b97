"""gather_trajectory_groups / gather_trajectories with ART 0.5.18's semantics: which exception
propagates and when, what a raising group counts, what gather returns, the progress metrics."""

from __future__ import annotations

import asyncio
import warnings
from typing import Any

import pytest
from openai.types.chat.chat_completion import Choice

from art_mega import Trajectory, TrajectoryGroup
from art_mega.errors import HyperParameterError
from art_mega.gather import GatherProgress, gather_trajectories, gather_trajectory_groups
from art_mega.trajectories import GROUP_PROGRESS

seen: list[Any] = []
"""The gathers' progress objects, as rollouts see them (GROUP_PROGRESS)."""


async def rollout(reward: float, *, fail_after: int | None = None, **metrics: float) -> Trajectory:
    """A rollout that yields to the loop `fail_after` times, then raises ValueError(f"fail {reward}")
    (None: returns). Yield counts order the failures without clocks (the loop is FIFO)."""
    seen.append(GROUP_PROGRESS.get())
    for _ in range(fail_after or 0):
        await asyncio.sleep(0)
    if fail_after is not None:
        raise ValueError(f"fail {reward}")
    return Trajectory(reward=reward, metrics=metrics)


class Hanging:
    """A rollout that never ends unless cancelled; records the cancellation."""

    def __init__(self) -> None:
        self.cancelled = False

    async def __call__(self) -> Trajectory:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        raise AssertionError("unreachable")


async def test_past_max_exceptions_the_exception_that_passed_it_is_raised_and_the_rest_cancelled():
    hanging = Hanging()
    group = TrajectoryGroup(
        [rollout(0, fail_after=1), rollout(1, fail_after=3), rollout(2, fail_after=5), hanging()]
    )
    with pytest.raises(ValueError, match="^fail 1$"):  # the second one: max_exceptions=1 allows one
        await gather_trajectory_groups([group], pbar_desc=None, max_exceptions=1)
    assert hanging.cancelled


async def test_outside_a_gather_the_first_rollout_exception_is_raised():
    hanging = Hanging()
    with pytest.raises(ValueError, match="^fail 7$"):  # ART's default limit is 0
        await TrajectoryGroup([rollout(1), rollout(7, fail_after=0), hanging()])
    assert hanging.cancelled


async def test_a_whole_group_raising_is_counted_and_left_out():
    async def broken_group() -> TrajectoryGroup:
        raise RuntimeError("judge down")

    seen.clear()
    pending = TrajectoryGroup([rollout(1.0), rollout(0.0, fail_after=0)])
    groups = await gather_trajectory_groups(
        [broken_group(), pending, TrajectoryGroup([Trajectory(reward=0.5)])], pbar_desc=None, max_exceptions=2
    )
    assert [[t.reward for t in g] for g in groups] == [[1.0], [0.5]]  # the broken group is gone
    assert [e.message for e in groups[0].exceptions] == ["fail 0.0"]
    progress = seen[0]
    assert [str(e) for e in progress.exceptions] == ["judge down", "fail 0.0"]
    assert progress.total == 1 + 2 + 1  # an awaitable of a group counts as one rollout
    assert progress.metric_sums["exceptions"] == 2
    with pytest.raises(RuntimeError, match="^judge down$"):
        await gather_trajectory_groups([broken_group(), TrajectoryGroup([rollout(1.0)])], pbar_desc=None)


async def test_a_fraction_is_of_all_rollouts_and_a_group_whose_rollouts_all_raised_is_kept():
    def make() -> list[Any]:
        return [TrajectoryGroup([rollout(i, fail_after=0) for i in range(2)]), TrajectoryGroup([rollout(2)])]

    groups = await gather_trajectory_groups(make(), pbar_desc=None, max_exceptions=2 / 3)  # 2 of 3: not above
    assert [len(g) for g in groups] == [0, 1] and len(groups[0].exceptions) == 2
    with pytest.raises(ValueError, match="^fail 1$"):  # 2/3 > 0.66: the second exception is raised
        await gather_trajectory_groups(make(), pbar_desc=None, max_exceptions=0.66)


async def test_a_group_awaited_inside_another_awaitable_is_counted_once():
    async def wrapped() -> TrajectoryGroup:
        return await TrajectoryGroup([rollout(1.0, correct=1.0), rollout(0.0, correct=0.0)])

    seen.clear()
    (group,) = await gather_trajectory_groups([wrapped()], pbar_desc=None)
    progress = seen[0]
    assert progress.metric_divisors["reward"] == 2 and progress.completed == 2
    assert progress.postfix() == {"reward": 0.5, "correct": 0.5}
    assert len(group) == 2


def _choice(tokens: int) -> Choice:
    content = [{"token": "x", "logprob": -0.5, "bytes": [120], "top_logprobs": []}] * tokens
    return Choice.model_validate(
        {
            "index": 0,
            "finish_reason": "stop",
            "message": {"role": "assistant", "content": "x" * tokens},
            "logprobs": {"content": content},
        }
    )


async def test_progress_shows_metric_means_cut_to_max_metrics_with_completion_tokens_last():
    async def sampled(reward: float, *sizes: int) -> Trajectory:
        seen.append(GROUP_PROGRESS.get())
        return Trajectory(
            messages_and_choices=[{"role": "user", "content": "q"}, *(_choice(n) for n in sizes)],
            reward=reward,
            metrics={"correct": reward},
        )

    seen.clear()
    (group,) = await gather_trajectory_groups(
        [TrajectoryGroup([sampled(1.0, 3, 1), sampled(0.0, 4), rollout(5.0, fail_after=0)])],
        pbar_desc=None,
        max_exceptions=1,
    )
    assert [t.metrics.get("completion_tokens") for t in group] == [2.0, 4.0]  # mean tokens per choice
    progress: GatherProgress = seen[0]
    assert progress.postfix() == {"reward": 0.5, "correct": 0.5, "exceptions": 1.0, "completion_tokens": 3.0}
    progress.max_metrics = 2  # the first two names; completion_tokens only when among them
    assert progress.postfix() == {"reward": 0.5, "correct": 0.5}
    progress.max_metrics = 0
    assert progress.postfix() == {}
    assert progress.completed == 2  # an exception does not advance the bar (ART)


async def test_gather_trajectories_returns_exceptions_in_place_within_the_limit():
    results = await gather_trajectories(
        [rollout(1.0), rollout(2.0, fail_after=0), _pair()], pbar_desc=None, max_exceptions=1
    )
    assert results[0].reward == 1.0
    assert isinstance(results[1], ValueError) and str(results[1]) == "fail 2.0"
    assert [t.reward for t in results[2]] == [3.0, 4.0]
    (pending,) = await gather_trajectories([TrajectoryGroup([rollout(5.0)])], pbar_desc=None)
    assert [t.reward for t in pending] == [5.0]  # a group is its trajectories, as in ART
    with pytest.raises(ValueError, match="^fail 2.0$"):
        await gather_trajectories([rollout(1.0), rollout(2.0, fail_after=0)], pbar_desc=None)


async def _pair() -> list[Trajectory]:
    return [Trajectory(reward=3.0), Trajectory(reward=4.0)]


async def test_after_each_and_a_wrong_return_type_and_built_groups():
    async def not_a_group() -> Any:
        return [Trajectory()]

    with pytest.raises(TypeError, match=r"group 1 returned a list, not an art.TrajectoryGroup"):
        await gather_trajectory_groups([TrajectoryGroup([rollout(1)]), not_a_group()], pbar_desc=None)
    built = TrajectoryGroup([Trajectory(reward=2.0)])
    groups = await gather_trajectory_groups([built], pbar_desc="built", after_each=lambda g: [g, g])
    assert groups == [built, built]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_metrics": -1}, r"max_metrics=-1\) must be how many metrics"),
        ({"max_metrics": True}, r"max_metrics=True\) must be how many metrics"),
        ({"max_metrics": 2.5}, r"max_metrics=2.5\) must be how many metrics"),
        (
            {"pbar_total_completion_tokens": "yes"},
            r"pbar_total_completion_tokens='yes'\) must be True or False",
        ),
    ],
)
async def test_bad_options_are_refused_in_one_sentence(options: dict[str, Any], message: str):
    with pytest.raises(HyperParameterError, match=r"^gather_trajectory_groups\(" + message):
        await gather_trajectory_groups([], **options)


async def test_an_item_that_is_not_a_group_is_refused_before_anything_runs():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the other items' coroutines are closed, not left unawaited
        with pytest.raises(
            HyperParameterError, match=r"gather_trajectory_groups\(groups\): item 1 is a Trajectory, not a"
        ):
            await gather_trajectory_groups([TrajectoryGroup([rollout(1)]), Trajectory()], pbar_desc=None)
        with pytest.raises(
            HyperParameterError, match=r"gather_trajectories\(trajectories\): item 0 is a list"
        ):
            await gather_trajectories([[Trajectory()]], pbar_desc=None)


async def test_pbar_total_completion_tokens_warns_as_deprecated():
    with pytest.warns(FutureWarning, match="pbar_total_completion_tokens=True\\) is deprecated"):
        groups = await gather_trajectory_groups(
            [TrajectoryGroup([rollout(1)])], pbar_desc=None, pbar_total_completion_tokens=True
        )
    assert len(groups) == 1

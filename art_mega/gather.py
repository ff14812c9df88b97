"""gather_trajectory_groups: run every rollout of every group concurrently, as ART does.

Shows a progress bar with the live mean reward, applies `after_each` to each finished group
(returning None drops it), records rollout exceptions per group, and raises only when their
number passes `max_exceptions` (a count, or a fraction of all rollouts when a float < 1).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from art_mega.errors import RolloutExceptionsExceeded
from art_mega.trajectories import GROUP_PROGRESS, PendingTrajectoryGroup, Trajectory, TrajectoryGroup


@dataclass
class GatherProgress:
    """Live counts of one gather: finished trajectories, their reward sum, exceptions."""

    total: int
    description: str | None = None
    finished: int = 0
    reward_sum: float = 0.0
    exceptions: list[BaseException] = field(default_factory=list)
    _bar: Any = None
    _task: Any = None

    @property
    def mean_reward(self) -> float:
        return self.reward_sum / self.finished if self.finished else 0.0

    def start(self) -> None:
        if self.description is None:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("reward={task.fields[reward]:.3f} exceptions={task.fields[exceptions]}"),
            TimeElapsedColumn(),
            transient=False,
        )
        self._bar.start()
        self._task = self._bar.add_task(self.description, total=self.total, reward=0.0, exceptions=0)

    def _refresh(self) -> None:
        if self._bar is not None:
            self._bar.update(
                self._task,
                completed=self.finished + len(self.exceptions),
                reward=self.mean_reward,
                exceptions=len(self.exceptions),
            )

    def on_trajectory(self, trajectory: Trajectory) -> None:
        self.finished += 1
        self.reward_sum += trajectory.reward
        self._refresh()

    def on_exception(self, exc: BaseException) -> None:
        self.exceptions.append(exc)
        self._refresh()

    def stop(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def _limit(max_exceptions: int | float, total: int) -> float:
    if not isinstance(max_exceptions, numbers.Integral) and 0 < max_exceptions < 1:  # numpy's too
        return max_exceptions * total
    return float(max_exceptions)


async def gather_trajectory_groups(
    groups: Iterable[Awaitable[TrajectoryGroup] | TrajectoryGroup],
    *,
    pbar_desc: str | None = "gather",
    max_exceptions: int | float = 0,
    after_each: Callable[[TrajectoryGroup], Any] | None = None,
    pbar_total_completion_tokens: bool = False,
) -> list[TrajectoryGroup]:
    """Await every group concurrently and return the finished groups in input order.

    Args:
        groups: `TrajectoryGroup(rollout(...) for _ in range(n))` awaitables (or built groups).
        pbar_desc: progress bar label; None hides the bar.
        max_exceptions: how many rollouts may raise before this raises: an int count, or a
            float in (0, 1) as a fraction of all rollouts (a float >= 1 is a count and inf no
            limit, as in ART).
        after_each: called with each finished group (sync or async); may return a group, a
            list of groups, or None to drop it.
        pbar_total_completion_tokens: accepted for ART compatibility; ignored.

    Raises:
        HyperParameterError: `max_exceptions` is a bool, a string, NaN or negative, `pbar_desc`
            not a string or None, or `after_each` not callable (before any rollout runs).
        RolloutExceptionsExceeded: more rollouts raised than `max_exceptions` allows (chained
            to the first exception).
    """
    del pbar_total_completion_tokens
    check_gather_options(max_exceptions, pbar_desc, after_each)
    pending = list(groups)
    total = sum(_count(g) for g in pending)
    progress = GatherProgress(total=total, description=pbar_desc)
    token = GROUP_PROGRESS.set(progress)
    progress.start()

    async def finish(group: Awaitable[TrajectoryGroup] | TrajectoryGroup) -> list[TrajectoryGroup]:
        built = await group if inspect.isawaitable(group) else group
        if after_each is None:
            return [built]
        result = after_each(built)
        if inspect.isawaitable(result):
            result = await result
        if result is None:
            return []
        return list(result) if isinstance(result, list) else [result]

    try:
        tasks = [asyncio.ensure_future(finish(g)) for g in pending]
        finished = await asyncio.gather(*tasks)
    finally:
        progress.stop()
        GROUP_PROGRESS.reset(token)
    if len(progress.exceptions) > _limit(max_exceptions, max(total, 1)):
        first = progress.exceptions[0]
        raise RolloutExceptionsExceeded(len(progress.exceptions), total, max_exceptions, first) from first
    return [g for batch in finished for g in batch]


def check_gather_options(max_exceptions: Any, pbar_desc: Any, after_each: Any) -> None:
    """Refuse `gather_trajectory_groups` options that would mean something else than written: a
    negative count raised even when nothing failed, NaN always raised, True counted as 1.

    Raises:
        HyperParameterError: the option, its value and the fix.
    """
    from art_mega.errors import HyperParameterError
    from art_mega.hyperparams import check

    def count_problem(value: Any) -> str | None:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            why = f"a {type(value).__name__}"
        elif math.isnan(value) or value < 0:
            why = "NaN" if math.isnan(value) else "negative"
        else:
            return None
        return f"must be a count of at least 0 or a fraction in (0, 1) of all rollouts ({why})"

    where = "gather_trajectory_groups"
    check(where, "max_exceptions", max_exceptions, count_problem, "3 or max_exceptions=0.1")
    if pbar_desc is not None and not isinstance(pbar_desc, str):
        raise HyperParameterError(
            f"{where}(pbar_desc={pbar_desc!r}) must be a label string, or None to hide the bar",
            "pbar_desc",
            pbar_desc,
        )
    if after_each is not None and not callable(after_each):
        raise HyperParameterError(
            f"{where}(after_each={after_each!r}) must be a function taking each finished group, or None",
            "after_each",
            after_each,
        )


def _count(group: Any) -> int:
    """Rollouts a group stands for: pending ones know their count; others count as built."""
    if isinstance(group, PendingTrajectoryGroup):
        return group.num_trajectories
    if isinstance(group, TrajectoryGroup):
        return len(group.trajectories)
    return 1

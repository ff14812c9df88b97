"""gather_trajectory_groups / gather_trajectories: run rollouts concurrently, as ART 0.5.18 does.

Exception semantics (ART's): a rollout that raises inside a group is recorded in the group's
`exceptions` and left out of its trajectories; an awaitable of a whole group that raises is
counted as one exception and its group left out of the result. Once the count passes
`max_exceptions` (a count, or a fraction of all rollouts when a float in (0, 1)), the exception
that passed it is raised at once, itself; art-mega then cancels the rollouts still running
(ART leaves them running). Only `Exception`s are counted: a cancellation or KeyboardInterrupt
propagates (ART counts any BaseException).

The progress bar (rich; `pbar_desc=None` hides it) shows, as ART's tqdm postfix does, the mean
reward, the exception count and the mean of every trajectory metric (at most `max_metrics` of
them), `completion_tokens` last. Each finished trajectory with sampled logprobs gets
`metrics["completion_tokens"]` (`trajectories.record_completion_tokens`), as in ART.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import math
import numbers
import time
import warnings
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from art_mega.trajectories import (
    GROUP_PROGRESS,
    PendingTrajectoryGroup,
    Trajectory,
    TrajectoryGroup,
    record_completion_tokens,
)


@dataclass
class GatherProgress:
    """Live counts of one gather (ART's GatherContext): metric sums and divisors, exceptions.

    Attributes:
        total: the rollouts the gather stands for (the denominator of a fractional limit).
        description: the progress bar's label; None: no bar.
        max_exceptions: the limit (see the module docstring).
        max_metrics: how many metrics the bar shows (None: all).
        completed: the bar's position: trajectories finished (one per awaitable in
            `gather_trajectories`); a rollout that raised does not advance it, as in ART.
        metric_sums, metric_divisors: per name ("reward", "exceptions", each metric), the sum
            of the values seen and how many values were seen (none for "exceptions": a count).
        exceptions: the exceptions counted, in the order they were raised.
    """

    total: int
    description: str | None = None
    max_exceptions: int | float = 0
    max_metrics: int | None = None
    completed: int = 0
    metric_sums: Counter[str] = field(default_factory=Counter)
    metric_divisors: Counter[str] = field(default_factory=Counter)
    exceptions: list[BaseException] = field(default_factory=list)
    _seen: set[int] = field(default_factory=set)
    _bar: Any = None
    _started: float = 0.0

    def start(self) -> None:
        """Open the bar (`art_mega.progress.bar`: tqdm on a terminal); elsewhere `stop` prints
        one line instead."""
        if self.description is None:
            return
        from art_mega import progress

        self._started = time.monotonic()
        self._bar = progress.bar(self.total, self.description, "rollout")

    def stop(self) -> None:
        if self.description is None:
            return
        if self._bar is not None:
            self._bar.close()
            return
        from art_mega import progress

        shown = ", ".join(f"{name}={value:.4g}" for name, value in self.postfix().items())
        seconds = time.monotonic() - self._started
        progress.line(
            f"{self.description}: {self.completed}/{self.total} rollouts in {seconds:.1f} s"
            + (f", {shown}" if shown else "")
        )

    def postfix(self) -> dict[str, float]:
        """What the bar shows after its counts: name -> sum / max(1, divisor), in first-seen
        order, cut to `max_metrics` names, then `completion_tokens` moved last (ART's order)."""
        names = list(self.metric_sums)
        if self.max_metrics is not None:
            names = names[: self.max_metrics]
        shown = {name: self.metric_sums[name] / max(1, self.metric_divisors[name]) for name in names}
        if "completion_tokens" in shown:
            shown["completion_tokens"] = shown.pop("completion_tokens")
        return shown

    def _refresh(self) -> None:
        if self._bar is not None:
            self._bar.n = self.completed
            self._bar.set_postfix({name: f"{value:.4g}" for name, value in self.postfix().items()})

    def record(self, trajectory: Trajectory) -> bool:
        """Add `trajectory`'s reward and metrics to the sums (once per trajectory: a group
        awaited inside another awaitable is not counted twice); False when already counted."""
        if id(trajectory) in self._seen:
            return False
        self._seen.add(id(trajectory))
        record_completion_tokens(trajectory)
        self.metric_sums["reward"] += trajectory.reward
        self.metric_divisors["reward"] += 1
        self.metric_sums.update(trajectory.metrics)
        self.metric_divisors.update(trajectory.metrics.keys())
        return True

    def advance(self, n: int) -> None:
        self.completed += n
        self._refresh()

    def on_trajectory(self, trajectory: Trajectory) -> None:
        """A rollout of a pending group returned `trajectory`."""
        if self.record(trajectory):
            self.advance(1)

    def on_exception(self, exc: BaseException) -> bool:
        """A rollout (or a whole group) raised `exc`: count it; True when the count passes
        `max_exceptions` (also for an exception counted before, re-raised by an outer awaitable)."""
        if not any(exc is counted for counted in self.exceptions):
            self.exceptions.append(exc)
            self.metric_sums["exceptions"] += 1
            self._refresh()
        return self.too_many_exceptions()

    def too_many_exceptions(self) -> bool:
        count = len(self.exceptions)
        limit = self.max_exceptions
        if not isinstance(limit, numbers.Integral) and 0 < limit < 1:  # numpy's floats too
            return count / max(self.total, 1) > limit
        return count > limit


async def gather_trajectory_groups(
    groups: Iterable[Awaitable[TrajectoryGroup] | TrajectoryGroup],
    *,
    pbar_desc: str | None = "gather",
    pbar_total_completion_tokens: bool = False,
    max_exceptions: int | float = 0,
    max_metrics: int | None = None,
    after_each: Callable[[TrajectoryGroup], Any] | None = None,
) -> list[TrajectoryGroup]:
    """Await every group concurrently and return the finished groups in input order.

    Args:
        groups: `TrajectoryGroup(rollout(...) for _ in range(n))` pending groups, awaitables
            that return a TrajectoryGroup, or built groups.
        pbar_desc: progress bar label; None hides the bar (ART shows one without a label).
        pbar_total_completion_tokens: deprecated in ART, which prints so and shows nothing;
            True warns (FutureWarning).
        max_exceptions: how many rollouts may raise before the next one's exception is raised:
            an int count, or a float in (0, 1) as a fraction of all rollouts (a pending group
            counts its rollouts, any other awaitable 1); a float >= 1 is a count, inf no limit.
        max_metrics: how many metrics the progress bar shows (None: all).
        after_each: called with each finished group (sync or async); may return a group, a
            list of groups, or None to drop it. An exception it raises propagates.

    Returns:
        The groups in input order (an `after_each` list in place); a group whose awaitable
        raised (within `max_exceptions`) is left out; a pending group whose every rollout
        raised is kept, empty, with its exception records.

    Raises:
        HyperParameterError: an option of the wrong type or out of range, or an item of
            `groups` that is neither a TrajectoryGroup nor awaitable (before any rollout runs).
        Exception: the rollout's (or group's) own exception that passed `max_exceptions`.
        TypeError: an awaitable returned something other than a TrajectoryGroup.
    """
    check_gather_options(max_exceptions, pbar_desc, after_each, max_metrics, pbar_total_completion_tokens)
    pending = list(groups)
    _check_items(pending, "gather_trajectory_groups(groups)", "groups")
    progress = GatherProgress(
        total=sum(_count(g) for g in pending),
        description=pbar_desc,
        max_exceptions=max_exceptions,
        max_metrics=max_metrics,
    )

    async def finish(index: int, item: Any) -> list[TrajectoryGroup]:
        built = await await_group(progress, item, index)
        if built is None:
            return []
        if after_each is None:
            return [built]
        result = after_each(built)
        if inspect.isawaitable(result):
            result = await result
        if result is None:
            return []
        return list(result) if isinstance(result, list) else [result]

    started = time.monotonic()
    finished = await _run(progress, [finish(i, g) for i, g in enumerate(pending)])
    gathered = (next(_GATHER_CALLS), time.monotonic() - started)
    out = [g for batch in finished for g in batch]
    for group in out:
        group._gathered = gathered
    return out


_GATHER_CALLS = itertools.count()
"""Numbers `gather_trajectory_groups` calls, so that groups of one call count its time once."""


async def await_group(progress: GatherProgress, item: Any, index: int) -> TrajectoryGroup | None:
    """`item` (a pending group, an awaitable of a group, or a built group; number `index` of
    its gather) awaited with ART's semantics, its trajectories counted in `progress`; None
    when a non-pending awaitable raised within `progress.max_exceptions`.

    Must run where `GROUP_PROGRESS` is `progress` (see `_run`), so that a pending group's
    rollouts report to it.

    Raises:
        Exception: the exception that passed `max_exceptions`, itself.
        TypeError: an awaitable returned something other than a TrajectoryGroup.
    """
    if isinstance(item, PendingTrajectoryGroup):
        built = await item  # its rollouts report to `progress` themselves
    elif isinstance(item, TrajectoryGroup):
        built = item
    else:
        try:
            built = await item
        except Exception as exc:
            if progress.on_exception(exc):
                raise
            return None
        if not isinstance(built, TrajectoryGroup):
            raise TypeError(
                f"gather_trajectory_groups: group {index} returned a {type(built).__name__}, not "
                "an art.TrajectoryGroup; return art.TrajectoryGroup([...]) from it"
            )
    progress.advance(sum(progress.record(t) for t in built.trajectories))
    return built


async def gather_trajectories(
    trajectories: Iterable[Awaitable[Trajectory] | Awaitable[Iterable[Trajectory]]],
    *,
    pbar_desc: str | None = "gather",
    pbar_total_completion_tokens: bool = False,
    max_exceptions: int | float = 0,
) -> list[Any]:
    """Await every rollout concurrently (ART's `gather_trajectories`).

    Args:
        trajectories: awaitables, each returning a Trajectory or an iterable of them.
        pbar_desc, pbar_total_completion_tokens, max_exceptions: as for
            `gather_trajectory_groups` (each awaitable is one rollout of the total).

    Returns:
        One entry per awaitable, in input order: its Trajectory, its list of trajectories, or
        (within `max_exceptions`) the exception it raised.

    Raises:
        HyperParameterError: an option of the wrong type or out of range, or an item that is
            not awaitable (before any rollout runs).
        Exception: the rollout's own exception that passed `max_exceptions`.
        TypeError: an awaitable returned something other than a Trajectory or trajectories.
    """
    check_gather_options(
        max_exceptions, pbar_desc, None, None, pbar_total_completion_tokens, where="gather_trajectories"
    )
    items = list(trajectories)
    _check_items(items, "gather_trajectories(trajectories)", "trajectories", groups_allowed=False)
    progress = GatherProgress(total=len(items), description=pbar_desc, max_exceptions=max_exceptions)

    async def one(index: int, item: Awaitable[Any]) -> Any:
        try:
            result = await item
        except Exception as exc:
            if progress.on_exception(exc):
                raise
            return exc
        returned = [result] if isinstance(result, Trajectory) else _trajectory_list(result)
        if returned is None:
            raise TypeError(
                f"gather_trajectories: item {index} returned a {type(result).__name__}; a rollout "
                "returns an art.Trajectory or a list of them"
            )
        for trajectory in returned:
            progress.record(trajectory)
        progress.advance(1)
        return result if isinstance(result, Trajectory) else returned

    return await _run(progress, [one(i, t) for i, t in enumerate(items)])


async def _run(progress: GatherProgress, coroutines: list[Any]) -> list[Any]:
    """The results of `coroutines` run concurrently with `progress` as the rollouts' gather;
    when one raises, the others are cancelled (and waited for) before its exception goes on."""
    token = GROUP_PROGRESS.set(progress)
    progress.start()
    tasks = [asyncio.ensure_future(c) for c in coroutines]  # copies the context: progress is set
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    finally:
        progress.stop()
        GROUP_PROGRESS.reset(token)


def _trajectory_list(value: Any) -> list[Trajectory] | None:
    if isinstance(value, (str, bytes, dict)) or not isinstance(value, Iterable):  # a group: its trajectories
        return None
    items = list(value)
    return items if all(isinstance(t, Trajectory) for t in items) else None


def check_gather_options(
    max_exceptions: Any,
    pbar_desc: Any,
    after_each: Any,
    max_metrics: Any = None,
    pbar_total_completion_tokens: Any = False,
    where: str = "gather_trajectory_groups",
) -> None:
    """Refuse gather options that would mean something else than written: a negative count
    raised even when nothing failed, NaN always raised, True counted as 1, a negative
    `max_metrics` cut metrics from the end. `pbar_total_completion_tokens=True` warns.

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

    check(where, "max_exceptions", max_exceptions, count_problem, "3 or max_exceptions=0.1")
    if max_metrics is not None and (
        isinstance(max_metrics, bool) or not isinstance(max_metrics, numbers.Integral) or max_metrics < 0
    ):
        raise HyperParameterError(
            f"{where}(max_metrics={max_metrics!r}) must be how many metrics the progress bar shows "
            "(an int >= 0), or None for all",
            "max_metrics",
            max_metrics,
        )
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
    if not isinstance(pbar_total_completion_tokens, bool):
        raise HyperParameterError(
            f"{where}(pbar_total_completion_tokens={pbar_total_completion_tokens!r}) must be True or "
            "False (it is deprecated in ART and shows nothing: remove it)",
            "pbar_total_completion_tokens",
            pbar_total_completion_tokens,
        )
    if pbar_total_completion_tokens:
        warnings.warn(
            f"{where}(pbar_total_completion_tokens=True) is deprecated in ART and shows nothing here "
            "either; remove it",
            FutureWarning,
            stacklevel=3,
        )


def _check_items(items: list[Any], argument: str, name: str, groups_allowed: bool = True) -> None:
    """Refuse an item that is not awaitable (nor, with `groups_allowed`, a built group),
    closing the rollout coroutines of all items first: none of them will run."""
    from art_mega.errors import HyperParameterError

    for i, item in enumerate(items):
        if inspect.isawaitable(item) or (groups_allowed and isinstance(item, TrajectoryGroup)):
            continue
        for other in items:
            _close(other)
        wanted = "a TrajectoryGroup or an awaitable of one" if groups_allowed else "an awaitable rollout"
        hint = (
            "wrap trajectories in art.TrajectoryGroup([...])"
            if groups_allowed
            else "pass rollout(...) coroutines"
        )
        raise HyperParameterError(
            f"{argument}: item {i} is a {type(item).__name__}, not {wanted}; {hint}", name, item
        )


def _close(item: Any) -> None:
    """Close a rollout coroutine that will never run (no 'never awaited' warning)."""
    if inspect.iscoroutine(item):
        item.close()
    elif isinstance(item, PendingTrajectoryGroup):
        item.close()


def _count(group: Any) -> int:
    """Rollouts a group stands for: pending ones know their count; built ones count their
    trajectories; any other awaitable counts 1 (as in ART)."""
    if isinstance(group, PendingTrajectoryGroup):
        return group.num_trajectories
    if isinstance(group, TrajectoryGroup):
        return len(group.trajectories)
    return 1

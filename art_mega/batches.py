"""ART's `trajectory_group_batches`: yield batches of finished trajectory groups while later
groups still run, so a program can train on one batch as the next one is gathered."""

from __future__ import annotations

import asyncio
import contextvars
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Iterable
from typing import Any

from art_mega.gather import GatherProgress, await_group, check_gather_options
from art_mega.hyperparams import check, whole_problem
from art_mega.trajectories import GROUP_PROGRESS, TrajectoryGroup


async def trajectory_group_batches(
    groups: Iterable[Awaitable[TrajectoryGroup] | TrajectoryGroup],
    *,
    batch_size: int,
    max_batch_exceptions: int | float = 0,
    max_concurrent_batches: int = 4,
    skip_batches: int = 0,
    pbar_desc: str | None = "batches",
    pbar_total_completion_tokens: bool = False,
) -> AsyncIterator[list[TrajectoryGroup]]:
    """Run `groups` with at most `batch_size * max_concurrent_batches` in flight and yield them
    in batches of `batch_size` in the order they finish (the last batch may be shorter), as ART;
    groups that finish in the same turn of the event loop keep their input order.

    Args:
        groups: pending `TrajectoryGroup(...)`s, awaitables of groups, or built groups; the
            first `batch_size * skip_batches` are skipped (never awaited: their coroutines are
            closed), to resume after `skip_batches` batches.
        max_batch_exceptions: how many rollouts or groups may raise per batch before the next
            exception is raised (a count, or a float in (0, 1) as a fraction of `batch_size`);
            a group that raised within it is left out of its batch. The counts restart with
            each batch (ART's reset also drops the limit to 0 after the first batch; here it holds).
        pbar_desc: the progress bar's label; None: no bar.

    Raises:
        HyperParameterError: `batch_size` or `max_concurrent_batches` not a whole number >= 1,
            `skip_batches` not one >= 0, or a gather option out of range (before any group runs).
        Exception: the rollout's own exception that passed `max_batch_exceptions`; the groups
            still running are cancelled first.
    """
    where = "trajectory_group_batches"
    check(where, "batch_size", batch_size, whole_problem(1), "8")
    check(where, "max_concurrent_batches", max_concurrent_batches, whole_problem(1), "4")
    check(where, "skip_batches", skip_batches, whole_problem(0), "0")
    check_gather_options(
        max_batch_exceptions, pbar_desc, None, None, pbar_total_completion_tokens, where=where
    )
    items = list(groups)
    for skipped in items[: batch_size * skip_batches]:
        if hasattr(skipped, "close"):  # a coroutine that will never run: no "never awaited" warning
            skipped.close()
    unstarted = items[batch_size * skip_batches :]
    progress = GatherProgress(total=batch_size, description=pbar_desc, max_exceptions=max_batch_exceptions)
    # the groups' tasks run in a context of their own whose GROUP_PROGRESS is `progress`, so
    # their rollouts report to it while the caller's code between batches does not
    context = contextvars.copy_context()
    context.run(GROUP_PROGRESS.set, progress)
    loop = asyncio.get_running_loop()
    pending: set[asyncio.Task[TrajectoryGroup | None]] = set()
    started: dict[asyncio.Task[TrajectoryGroup | None], int] = {}  # task -> its index in `groups`
    batch: list[TrajectoryGroup] = []
    index = 0
    try:
        progress.start()
        while unstarted or pending:
            while unstarted and len(pending) < batch_size * max_concurrent_batches:
                task = loop.create_task(await_group(progress, unstarted.pop(0), index), context=context)
                pending.add(task)
                started[task] = index
                index += 1
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=started.pop):  # finished together: in input order
                if (group := task.result()) is not None:
                    batch.append(group)
            if len(batch) >= batch_size:
                _next_batch(progress)
                yield batch[:batch_size]
                batch = batch[batch_size:]
        if batch:
            yield batch
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for never in unstarted:
            if hasattr(never, "close"):
                never.close()
        progress.stop()


def _next_batch(progress: Any) -> None:
    """Restart `progress`'s counts (and bar) for the next batch; the groups in flight keep it."""
    progress.stop()
    progress.completed = 0
    progress.metric_sums = Counter()
    progress.metric_divisors = Counter()
    progress.exceptions = []
    progress.start()

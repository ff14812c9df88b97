"""ART's `yield_trajectory` / `capture_yielded_trajectory`: a rollout hands its trajectory to the
caller from deep inside other code (e.g. an agent framework's callback) instead of returning it."""

from __future__ import annotations

import contextvars
from collections.abc import Coroutine
from typing import Any

from art_mega.trajectories import Trajectory


class _Yielded:
    """The slot one `capture_yielded_trajectory` call reads (one per capture, per task)."""

    def __init__(self) -> None:
        self.trajectory: Trajectory | None = None


_CURRENT: contextvars.ContextVar[_Yielded | None] = contextvars.ContextVar("yielded_trajectory", default=None)


def yield_trajectory(trajectory: Trajectory) -> None:
    """Hand `trajectory` to the enclosing `capture_yielded_trajectory` (the last one yielded wins).

    Raises:
        RuntimeError: not called inside `capture_yielded_trajectory(...)` (ART drops it silently).
        TypeError: `trajectory` is not an `art_mega.Trajectory`.
    """
    slot = _CURRENT.get()
    if slot is None:
        raise RuntimeError(
            "yield_trajectory() was called outside capture_yielded_trajectory(...); await "
            "art.capture_yielded_trajectory(rollout(...)) so the trajectory has somewhere to go"
        )
    if not isinstance(trajectory, Trajectory):
        raise TypeError(f"yield_trajectory() takes an art_mega.Trajectory, not a {type(trajectory).__name__}")
    slot.trajectory = trajectory


async def capture_yielded_trajectory(coroutine: Coroutine[Any, Any, Any]) -> Trajectory:
    """Await `coroutine` and return the trajectory it (or code it awaited) passed to
    `yield_trajectory`; the coroutine's own return value is discarded, as in ART.

    Raises:
        RuntimeError: the coroutine finished without yielding a trajectory; and what it raises.
    """
    slot = _Yielded()
    token = _CURRENT.set(slot)
    try:
        await coroutine
    finally:
        _CURRENT.reset(token)
    if slot.trajectory is None:
        raise RuntimeError(
            "No trajectory yielded: the coroutine never called art.yield_trajectory(trajectory)"
        )
    return slot.trajectory

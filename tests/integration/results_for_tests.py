"""Rollout functions whose results JSON cannot carry as they are (tests/integration/test_remote_results.py)."""

import math

import numpy as np

from art_mega import Trajectory


async def scored(kind: str) -> Trajectory:
    """A trajectory whose metadata['scores'][2] is a value of `kind`."""
    odd = {
        "set": {3},
        "bytes": b"\x00\x01",
        "object": object(),
        "array": np.arange(3),
        "complex": 1j,
    }[kind]
    trajectory = Trajectory(reward=1.0)  # Trajectory(metadata=...) refuses the value itself
    trajectory.metadata["scores"] = [0.5, 1, odd]
    return trajectory


async def numbers() -> list:
    """Non-finite floats and numpy scalars where JSON has none, in a trajectory and outside one."""
    trajectory = Trajectory(
        reward=math.nan,
        metrics={"ratio": math.inf},
        metadata={"nan": math.nan, "f32": np.float32(0.25), "i64": np.int64(7), "flag": np.bool_(False)},
    )
    return [trajectory, {"loss": -math.inf, "step": np.int32(2)}]


async def echo(value):
    return value

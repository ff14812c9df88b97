"""Rollout functions returning ART's trajectory fields (tests/integration/test_remote_groups.py)."""

from art_mega import Trajectory, TrajectoryGroup
from art_mega.trajectories import History


async def judged_group() -> TrajectoryGroup:
    """A group built on the worker: a trajectory with ART's fields, and one rollout that raised."""
    trajectory = Trajectory(
        messages_and_choices=[{"role": "user", "content": "q"}],
        additional_histories=[History(messages_and_choices=[{"role": "assistant", "content": "sub"}])],
        reward=1.0,
        initial_policy_version=2,
        final_policy_version=3,
    )
    trajectory.log("scored on the worker")
    try:
        raise LookupError("judge lost the answer")
    except LookupError as exc:
        raised = exc
    group = TrajectoryGroup([trajectory.finish(), raised], logs=["built"])
    group.log("sent")
    return group


async def answer() -> Trajectory:
    return Trajectory(messages_and_choices=[{"role": "assistant", "content": "4"}], reward=1.0).finish()


async def fails() -> Trajectory:
    raise ZeroDivisionError("reward over zero rollouts")

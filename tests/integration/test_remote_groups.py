"""ART's TrajectoryGroup fields (exception records, logs, histories, policy versions, durations)
through a real agent and rollout worker process, and a remote rollout's exception in a group."""

import pytest
import pytest_asyncio

from art_mega import ArtRuntime, TrajectoryGroup
from art_mega.gather import gather_trajectory_groups
from art_mega.trajectories import History, PydanticException
from tests.helpers import loopback_topology
from tests.integration import groups_for_tests as g

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def executor():
    runtime = await ArtRuntime.start_local(loopback_topology(1, cpu_slots=1))
    try:
        yield await runtime.rollout_executor([g.judged_group, g.answer, g.fails])
    finally:
        await runtime.close()


async def test_a_group_built_on_a_worker_arrives_with_its_records_logs_and_histories(executor):
    group = await executor.run(0, g.judged_group)
    assert isinstance(group, TrajectoryGroup) and group.logs == ["built", "sent"]
    (record,) = group.exceptions
    assert isinstance(record, PydanticException)
    assert (record.type, record.message) == ("<class 'LookupError'>", "judge lost the answer")
    assert "in judged_group" in record.traceback and "groups_for_tests.py" in record.traceback
    (trajectory,) = group.trajectories
    assert trajectory.additional_histories == [
        History(messages_and_choices=[{"role": "assistant", "content": "sub"}])
    ]
    assert (trajectory.initial_policy_version, trajectory.final_policy_version) == (2, 3)
    assert trajectory.logs == ["scored on the worker"] and trajectory.metrics["duration"] >= 0.0


async def test_a_remote_rollout_that_raises_is_recorded_with_the_workers_traceback(executor):
    (group,) = await gather_trajectory_groups(
        [TrajectoryGroup([executor.run(0, g.answer), executor.run(0, g.fails)])],
        pbar_desc=None,
        max_exceptions=1,
    )
    assert [t.reward for t in group] == [1.0]
    (record,) = group.exceptions
    assert record.type == "<class 'art_mega.errors.RemoteRolloutError'>"
    assert "reward over zero rollouts" in record.message
    assert "in fails" in record.traceback and "ZeroDivisionError" in record.traceback

"""The rollout executor on real agents and worker processes (two loopback hosts)."""

import asyncio
import os

import pytest
import pytest_asyncio

from art_mega import ArtRuntime, Trajectory
from art_mega.errors import RemoteRolloutError, UserError
from tests.helpers import loopback_topology
from tests.integration import rollouts_for_tests as r

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def runtime():
    rt = await ArtRuntime.start_local(loopback_topology(2, cpu_slots=2))
    yield rt
    await rt.close()


async def test_runs_on_every_worker_in_its_own_process(runtime):
    executor = await runtime.rollout_executor(r.where)
    assert [w.host_id for w in executor.workers] == ["host0", "host0", "host1", "host1"]
    seen = await asyncio.gather(*(executor.run(w, r.where) for w in executor.workers))
    assert [s["pid"] for s in seen] == [w.pid for w in executor.workers]
    assert len({s["pid"] for s in seen} | {os.getpid()}) == 5


async def test_values_and_trajectories_round_trip(runtime):
    executor = await runtime.rollout_executor([r.echo, r.answer], target_workers=2)
    assert [w.host_id for w in executor.workers] == ["host0", "host1"]
    value = {"a": [1, 2.5, "x", None, True], "b": {"c": "d"}}
    assert await executor.run(1, r.echo, value) == value
    trajectory = await executor.run(executor.workers[1], r.answer, "maybe", reward=1.0)
    assert isinstance(trajectory, Trajectory)
    assert trajectory.reward == 1.0 and trajectory.messages()[0]["content"] == "maybe"
    assert trajectory.metadata["pid"] == executor.workers[1].pid
    assert await executor.submit(r.echo, 7) == 7


async def test_remote_exception_is_reported_with_its_message(runtime):
    executor = await runtime.rollout_executor(r.fail, target_workers=1)
    with pytest.raises(RemoteRolloutError, match="ValueError: boom") as info:
        await executor.run(0, r.fail, "boom")
    assert "host0" in str(info.value)
    assert "raise ValueError(message)" in info.value.failure.traceback
    assert await executor.run(0, r.echo, 3) == 3  # the worker survives


async def test_bad_requests_are_user_errors(runtime):
    with pytest.raises(UserError, match="lambda"):
        await runtime.rollout_executor(lambda: None)
    with pytest.raises(UserError, match="target_workers=5 is out of range"):
        await runtime.rollout_executor(r.echo, target_workers=5)
    executor = await runtime.rollout_executor(r.echo, target_workers=1)
    with pytest.raises(UserError, match="not a worker of this executor"):
        await executor.run(3, r.echo, 1)
    with pytest.raises(UserError, match="cannot travel"):
        await executor.run(0, r.echo, {1, 2})


async def test_edited_rollout_module_is_refused(runtime, tmp_module):
    path = tmp_module(
        "edited_rollouts", "async def first():\n    return 1\n\nasync def second():\n    return 2\n"
    )
    import edited_rollouts

    executor = await runtime.rollout_executor(edited_rollouts.first, target_workers=1)
    assert await executor.run(0, edited_rollouts.first) == 1
    path.write_text(path.read_text() + "\n# edited after hashing\n")
    with pytest.raises(UserError, match="changed after the controller hashed it"):
        await executor.run(0, edited_rollouts.second)


async def test_workers_stop_when_the_executor_closes(runtime):
    executor = await runtime.rollout_executor(r.sleep)
    pids = [w.pid for w in executor.workers]
    pending = asyncio.create_task(executor.run(0, r.sleep, 30))
    await asyncio.sleep(0.2)
    await executor.close()
    from tests.conftest import wait_gone

    assert wait_gone(pids, 10) == []
    with pytest.raises(Exception, match="exited|gone|unreachable"):
        await pending
    health = await runtime.health()
    remaining = {c.pid for h in health.values() for c in h.children}
    assert remaining and not remaining & set(pids)

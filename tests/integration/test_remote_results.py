"""Rollout results and arguments JSON cannot carry, through real agents and worker processes.

Before: a set in a trajectory's metadata arrived as a list, bytes as a str and NaN as None; a
numpy scalar or array was a pydantic serializer traceback from the worker; a NaN reward a
validation traceback on the controller. Now each is refused in one sentence naming the rollout,
the host and the key path, or arrives by the documented rule of `art_mega.rollouts.wire`.
"""

import math

import pytest
import pytest_asyncio

from art_mega import ArtRuntime, Trajectory
from art_mega.errors import RolloutValueError, UserError
from tests.helpers import loopback_topology
from tests.integration import results_for_tests as r

pytestmark = pytest.mark.asyncio(loop_scope="module")

ROLLOUT = "tests.integration.results_for_tests:scored"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def executor():
    runtime = await ArtRuntime.start_local(loopback_topology(1, cpu_slots=1))
    try:
        yield await runtime.rollout_executor([r.scored, r.numbers, r.echo])
    finally:
        await runtime.close()


@pytest.mark.parametrize(
    "kind,problem",
    [
        ("set", "is a set, which JSON cannot carry (it would arrive as a list); return a list"),
        ("bytes", "is bytes, which JSON cannot carry; decode it to str"),
        ("object", "is a builtins.object, which JSON cannot carry"),
        (
            "array",
            "is a numpy array (shape (3,), dtype int64), which JSON cannot carry; return array.tolist()",
        ),
        ("complex", "is the complex number 1j, which JSON cannot carry"),
    ],
)
async def test_a_result_json_cannot_carry_is_one_sentence_naming_host_and_key_path(executor, kind, problem):
    worker = executor.workers[0]
    with pytest.raises(RolloutValueError) as caught:
        await executor.run(worker, r.scored, kind)
    message = str(caught.value)
    assert message.startswith(
        f"rollout {ROLLOUT} on host host0 (worker {worker.worker_id}) returned a value that cannot "
        f"travel: trajectory.metadata['scores'][2] {problem}"
    ), message
    assert "\n" not in message and "Traceback" not in message
    assert (caught.value.host, caught.value.rollout) == ("host0", ROLLOUT)
    assert isinstance(caught.value, UserError)  # exit code 2 through the CLI
    assert await executor.run(worker, r.echo, 3) == 3  # the worker lives on


async def test_non_finite_floats_and_numpy_scalars_arrive_by_the_documented_rule(executor):
    trajectory, plain = await executor.run(0, r.numbers)
    assert isinstance(trajectory, Trajectory)
    assert math.isnan(trajectory.reward) and trajectory.metrics["ratio"] == math.inf
    assert math.isnan(trajectory.metadata["nan"])
    metadata = {k: (v, type(v)) for k, v in trajectory.metadata.items() if k != "nan"}
    assert metadata == {"f32": (0.25, float), "i64": (7, int), "flag": (False, bool)}
    assert plain == {"loss": -math.inf, "step": 2} and type(plain["step"]) is int


async def test_an_argument_json_cannot_carry_names_its_key_path_and_host(executor):
    worker = executor.workers[0]
    with pytest.raises(RolloutValueError) as caught:
        await executor.run(worker, r.echo, {"ids": {1, 2}})
    assert str(caught.value).startswith(
        f"an argument of rollout tests.integration.results_for_tests:echo cannot travel to host host0 "
        f"(worker {worker.worker_id}): args[0]['ids'] is a set"
    )
    with pytest.raises(RolloutValueError, match=r"kwargs\['value'\] is bytes"):
        await executor.run(worker, r.echo, value=b"x")

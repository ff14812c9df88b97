"""ART's `art.distributed` executor on real agents and worker processes (one loopback host, two
slots): used without await, started by its first run, ART's worker ids via `set_workers`, and a
typed `TrainableModel[Policy]` sent to a worker and back."""

import asyncio
import os

import pytest
import pytest_asyncio

from art_mega import TrainableModel
from art_mega.distributed import ArtRuntime, InstalledAsyncCallable
from art_mega.errors import RolloutValueError, UserError
from tests.helpers import loopback_topology
from tests.integration import distributed_for_tests as d

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def runtime():
    rt = await ArtRuntime.start_local(loopback_topology(1, cpu_slots=2))
    yield rt
    await rt.close()


async def _children(runtime) -> set[int]:
    return {c.pid for h in (await runtime.health()).values() for c in h.children}


async def test_an_executor_used_without_await_starts_once_and_runs_by_art_worker_ids(runtime):
    executor = runtime.rollout_executor(InstalledAsyncCallable.from_callable(d.where), target_workers=2)
    with pytest.raises(UserError, match="workers are not started yet"):
        _ = executor.workers
    before = await _children(runtime)
    executor.set_workers((10, 20))
    # two first runs at once share one start: two processes, one per worker id
    seen = await asyncio.gather(executor.run(10, d.where), executor.run(20, d.where))
    pids = [w.pid for w in executor.workers]
    assert [s["pid"] for s in seen] == pids
    assert len(set(pids)) == 2 and os.getpid() not in pids
    assert await _children(runtime) - before == set(pids)
    # a kept id keeps its process; the new id takes the one 10 left
    executor.set_workers((20, 30))
    seen = await asyncio.gather(executor.run(20, d.where), executor.run(30, d.where))
    assert [s["pid"] for s in seen] == [pids[1], pids[0]]
    with pytest.raises(
        UserError, match=r"worker=10 is not a worker of this executor; use a worker id \(\[20, 30\]"
    ):
        await executor.run(10, d.where)
    assert (await executor.submit(d.where))["pid"] in pids
    await executor.close()
    assert not await _children(runtime) & set(pids)


async def test_a_typed_trainable_model_reaches_the_worker_typed_and_comes_back(runtime):
    executor = await runtime.rollout_executor(d.policy_of, target_workers=1)
    model = TrainableModel[d.Policy](
        name="typed-001", project="wire", base_model="tiny-llama", config=d.Policy(bonus_word="maybe")
    )
    kind, word, back = await executor.run(0, d.policy_of, model)
    assert (kind, word) == ("Policy", "maybe")
    assert type(back) is TrainableModel[d.Policy]
    assert back.config == d.Policy(bonus_word="maybe", max_completion_tokens=6)
    assert (back.name, back.base_model) == ("typed-001", "tiny-llama")


async def test_a_type_argument_the_worker_cannot_import_is_one_sentence(runtime, tmp_module):
    tmp_module(
        "controller_only_config", "from pydantic import BaseModel\n\nclass Cfg(BaseModel):\n    x: int = 1\n"
    )
    import controller_only_config

    executor = await runtime.rollout_executor(d.policy_of, target_workers=1)
    model = TrainableModel[controller_only_config.Cfg](
        name="typed-002", project="wire", base_model="tiny-llama", config=controller_only_config.Cfg()
    )
    with pytest.raises(RolloutValueError) as caught:
        await executor.run(0, d.policy_of, model)
    message = str(caught.value)
    assert message.startswith(
        "rollout tests.integration.distributed_for_tests:policy_of on host host0 (worker "
    ), message
    assert (
        "could not rebuild its arguments on this host: args[0] is a art_mega.model:TrainableModel"
        "[controller_only_config:Cfg] model, whose type argument controller_only_config:Cfg cannot be "
        "imported here (No module named 'controller_only_config'); make its module importable on every host"
    ) in message
    assert "\n" not in message
    await executor.close()


async def test_closing_while_the_workers_start_ends_the_waiting_run_with_one_sentence(runtime, tmp_module):
    tmp_module(
        "slow_to_import",
        "import os, time\n\nif 'ART_MEGA_SYS_PATH' in os.environ:\n    time.sleep(5)\n\n"
        "async def value():\n    return 1\n",
    )
    import slow_to_import

    executor = runtime.rollout_executor(slow_to_import.value, target_workers=1)
    waiting = asyncio.create_task(executor.run(0, slow_to_import.value))
    await asyncio.sleep(0.5)
    await executor.close()
    with pytest.raises(
        RuntimeError, match="^this rollout executor was closed while its workers were starting$"
    ):
        await waiting

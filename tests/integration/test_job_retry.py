"""A step whose save fails on one rank while every rank stays up is retried from the last commit.

Real trainer ranks (two gloo ranks of the tiny Llama, DP=2) are children of a real agent, driven
by `TrainerService` with the jobs, checkpoint folders and commit pointer the way `MegatronBackend`
drives them (helpers shared with `test_checkpoint_crash`).

The failure is a real one, after the optimizer step and before the commit: a stale file sits where
rank 0 must create the staging folder of step 2's checkpoint, so rank 0's `mkdir` raises
FileExistsError while rank 1 waits for it in the save's first barrier. Both ranks stay alive and
both hold step 2's update in memory. The retry must start from step 1's commit; its result is
compared, tensor by tensor, with a run of the same steps that never failed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from art_mega import ArtRuntime, TrainerSpec, compile_topology
from art_mega.agent.ports import free_port
from art_mega.errors import TrainerJobError
from art_mega.trainer.checkpoint import read_commit, write_commit
from art_mega.trainer.protocol import EngineConfig, ExportJob, LoraConfig
from art_mega.trainer.remote import TrainerService
from tests.helpers import loopback_cluster
from tests.integration.test_checkpoint_crash import rl_job

pytest.importorskip("megatron.core", reason="trainer ranks need megatron-core (the trainer-cpu extra)")

TOLERANCE = 1e-6


def flat_state(path: Path) -> dict[str, Any]:
    """A rank file's step count, LoRA shards and optimizer state as {dotted key: value}."""
    import torch

    payload = torch.load(path, weights_only=False)
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}.{key}", item)
        elif isinstance(value, list | tuple):
            for index, item in enumerate(value):
                walk(f"{prefix}.{index}", item)
        else:
            flat[prefix] = value

    walk("", {k: payload[k] for k in ("steps", "lora", "optimizers")})
    return flat


def assert_same_state(got: Path, want: Path) -> None:
    import torch

    a, b = flat_state(got), flat_state(want)
    assert sorted(a) == sorted(b)
    assert any(k.startswith(".optimizers.") and torch.is_tensor(v) for k, v in a.items())
    for key, value in a.items():
        if torch.is_tensor(value):
            assert torch.allclose(value.float(), b[key].float(), rtol=0, atol=TOLERANCE), key
        else:
            assert value == b[key], key


async def commit_steps(service: TrainerService, run: Path, steps: range) -> None:
    """Run and commit `steps` in order (step 0 exports the initial adapter)."""
    checkpoints = run / "checkpoints"
    for step in steps:
        job = rl_job(run, step) if step else ExportJob(step=0, checkpoint_dir=str(checkpoints / "0000"))
        await service.run(job)
        write_commit(checkpoints, step)


async def test_a_save_failing_on_one_rank_is_retried_from_the_last_commit(tmp_path, tiny_llama_dir):
    import torch

    topology = compile_topology(
        loopback_cluster(1, tmp=str(tmp_path)),
        trainer=TrainerSpec(cpu_ranks_per_host=2, master_port=free_port()),
    )
    failing, never_failed = tmp_path / "failing", tmp_path / "never-failed"
    for run in (failing, never_failed):
        (run / "checkpoints").mkdir(parents=True)
    checkpoints = failing / "checkpoints"
    base = EngineConfig(model_dir=str(tiny_llama_dir), lora=LoraConfig(rank=4, alpha=8.0))
    runtime = await ArtRuntime.start_local(topology)
    service = TrainerService(runtime.clients, topology, tmp_path / "logs")
    try:
        await service.start(base)
        await commit_steps(service, failing, range(2))

        blocker = checkpoints / ".staging-0002"
        blocker.write_text("a stale file where the staging folder must go\n")
        step2 = rl_job(failing, 2)
        with pytest.raises(TrainerJobError) as info:
            await service.run(step2)
        message = str(info.value)
        assert (
            message.startswith("trainer rank 0 on host host0 (log ")
            and "trainer-rank0.log) failed: " in message
        )
        assert "FileExistsError" in message and ".staging-0002" in message
        assert info.value.rank == 0 and service.dirty
        assert read_commit(checkpoints) == 1 and not (checkpoints / "0002").exists()

        # the service refuses a retry on ranks that hold the failed step's update
        with pytest.raises(
            TrainerJobError, match=r"call TrainerService.recover\(<last committed checkpoint>\)"
        ):
            await service.run(step2)
        # and so does the rank itself, past the service's guard (rank 1 still waits in the barrier)
        service.dirty = False
        with pytest.raises(
            TrainerJobError,
            match=r"trainer rank 0 holds the uncommitted state of an earlier failed job.*\(step 1\)",
        ):
            await service.run(step2)
        assert service.dirty

        blocker.unlink()  # the disk is fixed
        assert await service.recover(checkpoints / "0001") > 0 and not service.dirty
        assert await service.recover(checkpoints / "0001") == 0.0  # clean: nothing to do
        # a refused step changes nothing on any rank, so it leaves the service clean
        with pytest.raises(
            TrainerJobError, match="the last committed step is 1, so the next rl job must name step 2"
        ):
            await service.run(rl_job(failing, 3))
        assert not service.dirty
        retried = await service.run(step2)
        write_commit(checkpoints, 2)
        assert retried.adapter_ready[0].step == 2 and read_commit(checkpoints) == 2

        # the same steps on fresh ranks, without a failure
        await service.stop()
        await service.start(base)
        await commit_steps(service, never_failed, range(3))
        for rank in ("rank00000.pt", "rank00001.pt"):
            assert_same_state(checkpoints / "0001" / rank, never_failed / "checkpoints" / "0001" / rank)
            assert_same_state(checkpoints / "0002" / rank, never_failed / "checkpoints" / "0002" / rank)
            assert flat_state(checkpoints / "0002" / rank)[".steps"] == 2
            # the step did move the LoRA weights (the comparison above is not of two untouched states)
            before, after = flat_state(checkpoints / "0001" / rank), flat_state(checkpoints / "0002" / rank)
            assert any(not torch.equal(before[k], after[k]) for k in before if k.startswith(".lora."))
    finally:
        await service.stop()
        await runtime.close()

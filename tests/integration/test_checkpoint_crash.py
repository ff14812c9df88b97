"""A rank killed in the middle of a checkpoint save: the last commit stays loadable, the next run resumes.

Real trainer ranks (two gloo ranks of the tiny Llama, DP=2) run as children of a real agent and
are driven by `TrainerService` with the jobs, checkpoint folders and commit pointer
(`checkpoint.read_commit` / `write_commit`) the way `MegatronBackend` drives them.

Where the kill lands: a save of the tiny model takes milliseconds, so watching the folder and
killing would race it. The ranks run with `$ART_MEGA_TEST_SAVE_PAUSE` (documented in
`art_mega.trainer.rank.jobs`): while the named file exists, each rank waits inside `write_checkpoint`
after its adapter and optimizer-state file are written into the staging folder and before the
folder is renamed. The test sees both ranks' state files appear there (the real save got that
far) and SIGKILLs rank 1 at that point.
"""

import asyncio
import hashlib
import json
import os
import signal
import time

import pytest

from art_mega import ArtRuntime, TrainerSpec, compile_topology
from art_mega.agent.ports import free_port
from art_mega.errors import TrainerJobError
from art_mega.trainer.checkpoint import read_commit, write_commit
from art_mega.trainer.protocol import EngineConfig, ExportJob, LoraConfig, RLJob
from art_mega.trainer.remote import TrainerService
from tests.helpers import loopback_cluster

pytest.importorskip("megatron.core", reason="trainer ranks need megatron-core (the trainer-cpu extra)")

SEQ_LEN = 32


def write_batch(batch_dir, step: int) -> None:
    """Two GRPO documents of fixed tokens, packed for DP=2 and saved as the backend saves them."""
    from art_mega.trainer.batch import Document, pack

    docs = [
        Document([1, 5, 6, 7, 8, 2], [0, 0, 1, 1, 1, 1], [0, 0, -2.0, -2.0, -2.0, -2.0], 1.0, 0.25),
        Document([1, 9, 10, 11, 2], [0, 0, 1, 1, 1], [0, 0, -2.0, -2.0, -2.0], -1.0, 1 / 3),
    ]
    batch_dir.mkdir(parents=True)
    for rank, batch in enumerate(pack(docs, SEQ_LEN, 2)):
        batch.save(batch_dir / f"dp{rank}.safetensors")


def rl_job(run, step: int) -> RLJob:
    batch_dir = run / "batches" / f"{step:04d}-{time.monotonic_ns()}"
    write_batch(batch_dir, step)
    return RLJob(
        step=step,
        batch_dir=str(batch_dir),
        checkpoint_dir=str(run / "checkpoints" / f"{step:04d}"),
        learning_rate=1e-3,
    )


def adapter_sha256(checkpoint) -> str:
    return hashlib.sha256((checkpoint / "adapter_model.safetensors").read_bytes()).hexdigest()


async def wait_for(paths, job: asyncio.Task, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(p.exists() for p in paths):
        assert not job.done(), f"the job ended before the save reached {paths}: {job.exception()!r}"
        assert time.monotonic() < deadline, f"{paths} did not appear within {timeout_s} s"
        await asyncio.sleep(0.05)


async def test_a_rank_killed_mid_save_leaves_the_last_commit_and_the_next_run_resumes(
    tmp_path, tiny_llama_dir, monkeypatch
):
    pause = tmp_path / "pause-save"
    monkeypatch.setenv("ART_MEGA_TEST_SAVE_PAUSE", str(pause))  # inherited by the agent, then the ranks
    topology = compile_topology(
        loopback_cluster(1, tmp=str(tmp_path)),
        trainer=TrainerSpec(cpu_ranks_per_host=2, master_port=free_port()),
    )
    run = tmp_path / "run"
    checkpoints = run / "checkpoints"
    checkpoints.mkdir(parents=True)
    base = EngineConfig(model_dir=str(tiny_llama_dir), lora=LoraConfig(rank=4, alpha=8.0))
    runtime = await ArtRuntime.start_local(topology)
    service = TrainerService(runtime.clients, topology, run / "logs")
    try:
        await service.start(base)
        with pytest.raises(
            TrainerJobError, match="nothing is committed yet, so the next rl job must name step 0"
        ):
            await service.run(rl_job(run, 1))
        await service.run(ExportJob(step=0, checkpoint_dir=str(checkpoints / "0000")))
        write_commit(checkpoints, 0)
        await service.run(rl_job(run, 1))
        write_commit(checkpoints, 1)
        committed_sha = adapter_sha256(checkpoints / "0001")

        pause.touch()
        save = asyncio.create_task(service.run(rl_job(run, 2)))
        staging = checkpoints / ".staging-0002"
        await wait_for([staging / "rank00000.pt", staging / "rank00001.pt"], save)
        rank1 = next(c for c in (await runtime.health())["host0"].children if c.child_id == "trainer-rank1")
        os.kill(rank1.pid, signal.SIGKILL)
        with pytest.raises(TrainerJobError, match="rank 1 on host host0") as info:
            await save
        assert "exited with code -9" in str(info.value)
        pause.unlink()
        await service.stop()

        # the commit pointer still names step 1, whose checkpoint is whole; the half save is not a checkpoint
        assert read_commit(checkpoints) == 1
        manifest = json.loads((checkpoints / "0001" / "manifest.json").read_text())
        assert manifest["step"] == 1 and manifest["adapter_sha256"] == committed_sha
        assert manifest["layout"] == {"world_size": 2, "tp": 1, "dp": 2}
        assert sorted(p.name for p in checkpoints.iterdir() if p.is_dir() and p.name.isdigit()) == [
            "0000",
            "0001",
        ]
        assert (staging / "rank00001.pt").exists() and not (staging / "manifest.json").exists()

        # a fresh service on the same runtime resumes from the commit, as MegatronBackend.register does
        fresh = TrainerService(runtime.clients, topology, run / "logs")
        service = fresh
        await fresh.start(
            base.model_copy(update={"resume_dir": str(checkpoints / f"{read_commit(checkpoints):04d}")})
        )
        for wrong in (1, 3):
            with pytest.raises(
                TrainerJobError, match="the last committed step is 1, so the next rl job must name step 2"
            ):
                await fresh.run(rl_job(run, wrong))
        result = await fresh.run(rl_job(run, 2))
        write_commit(checkpoints, 2)
        assert read_commit(checkpoints) == 2 and not staging.exists()
        assert result.adapter_ready[0].sha256 == adapter_sha256(checkpoints / "0002")
        assert json.loads((checkpoints / "0002" / "manifest.json").read_text())["step"] == 2
        import torch

        state = torch.load(checkpoints / "0002" / "rank00000.pt", weights_only=False)
        assert state["steps"] == 2  # step 1's optimizer state was loaded, then one more step taken
        assert result.rank0.metrics["time/megatron_s"] > 0 and result.rank0.metrics["time/checkpoint_s"] > 0
    finally:
        pause.unlink(missing_ok=True)
        await service.stop()
        await runtime.close()


def test_check_job_step_names_the_expected_step():
    from art_mega.trainer.rank.jobs import StepOrderError, check_job_step

    assert check_job_step("export", 0, None) == 0
    assert check_job_step("sft", 8, 7) == 8
    for step in (7, 9, None, "8", True):
        with pytest.raises(
            StepOrderError, match="the last committed step is 7, so the next sft job must name step 8"
        ):
            check_job_step("sft", step, 7)
    with pytest.raises(
        StepOrderError, match="job step 1 refused: nothing is committed yet, .* must name step 0"
    ):
        check_job_step("rl", 1, None)

"""Checkpoints with a host-local artifact_root and trainer ranks on two hosts.

Two loopback agents (host0: rank 0, host1: rank 1; DP=2) whose artifact_root is declared
host-local while the disk underneath is one: both hosts' lowest ranks lead a save, see each
other's mark in the one staging folder, and only rank 0 renames it. A rank killed mid-save
(`$ART_MEGA_TEST_SAVE_PAUSE`, as in test_checkpoint_crash.py) leaves the last commit whole, and a
fresh service resumes from it. Private roots (one folder per host) are covered end to end in
test_nixl_transport.py.
"""

import asyncio
import json
import os
import signal

import pytest

from art_mega import ArtRuntime, TrainerSpec, compile_topology
from art_mega.agent.ports import free_port
from art_mega.errors import TrainerJobError
from art_mega.trainer.checkpoint import read_commit, write_commit
from art_mega.trainer.protocol import EngineConfig, ExportJob, LoraConfig
from art_mega.trainer.remote import TrainerService
from tests.helpers import loopback_cluster
from tests.integration.test_checkpoint_crash import adapter_sha256, rl_job, wait_for

pytest.importorskip("megatron.core", reason="trainer ranks need megatron-core (the trainer-cpu extra)")


async def test_one_disk_declared_host_local_commits_once_and_survives_a_kill_mid_save(
    tmp_path, tiny_llama_dir, monkeypatch
):
    pause = tmp_path / "pause-save"
    monkeypatch.setenv("ART_MEGA_TEST_SAVE_PAUSE", str(pause))
    topology = compile_topology(
        loopback_cluster(2, tmp=str(tmp_path), shared_artifact_root=False),
        trainer=TrainerSpec(host_ids=("host0", "host1"), cpu_ranks_per_host=1, master_port=free_port()),
    )
    run = tmp_path / "run"
    checkpoints = run / "checkpoints"
    checkpoints.mkdir(parents=True)
    base = EngineConfig(model_dir=str(tiny_llama_dir), lora=LoraConfig(rank=4, alpha=8.0))
    runtime = await ArtRuntime.start_local(topology)
    service = TrainerService(runtime.clients, topology, run / "logs")
    try:
        await service.start(base)
        await service.run(ExportJob(step=0, checkpoint_dir=str(checkpoints / "0000")))
        write_commit(checkpoints, 0)
        await service.run(rl_job(run, 1))
        write_commit(checkpoints, 1)
        committed_sha = adapter_sha256(checkpoints / "0001")
        assert sorted(p.name for p in (checkpoints / "0001").iterdir()) == [
            "adapter_config.json",
            "adapter_model.safetensors",
            "manifest.json",
            "rank00000.pt",
            "rank00001.pt",
        ]  # no leader marks, one folder
        assert not list(checkpoints.glob(".*"))  # nothing staged or trashed left

        pause.touch()
        save = asyncio.create_task(service.run(rl_job(run, 2)))
        staging = checkpoints / ".staging-0002"
        await wait_for([staging / "rank00000.pt", staging / "rank00001.pt"], save)
        assert sorted(p.name for p in staging.glob(".leader-rank*")) == [".leader-rank0", ".leader-rank1"]
        rank1 = next(c for c in (await runtime.health())["host1"].children if c.child_id == "trainer-rank1")
        os.kill(rank1.pid, signal.SIGKILL)
        with pytest.raises(TrainerJobError, match="rank 1 on host host1"):
            await save
        pause.unlink()
        await service.stop()
        assert read_commit(checkpoints) == 1
        assert (
            json.loads((checkpoints / "0001" / "manifest.json").read_text())["adapter_sha256"]
            == committed_sha
        )
        assert not (checkpoints / "0002").exists()

        service = TrainerService(runtime.clients, topology, run / "logs")
        await service.start(base.model_copy(update={"resume_dir": str(checkpoints / "0001")}))
        result = await service.run(rl_job(run, 2))
        write_commit(checkpoints, 2)
        assert read_commit(checkpoints) == 2 and not staging.exists()
        assert result.adapter_ready[0].sha256 == adapter_sha256(checkpoints / "0002")
        assert sorted(p.name for p in (checkpoints / "0002").iterdir()) == [
            "adapter_config.json",
            "adapter_model.safetensors",
            "manifest.json",
            "rank00000.pt",
            "rank00001.pt",
        ]
        import torch

        state = torch.load(checkpoints / "0002" / "rank00001.pt", weights_only=False)
        assert state["steps"] == 2  # rank 1 resumed step 1's optimizer state, then took one step
    finally:
        pause.unlink(missing_ok=True)
        await service.stop()
        await runtime.close()

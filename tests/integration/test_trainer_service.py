"""Trainer ranks as agent children: started from the rank table, driven by jobs, deaths named."""

import os
import signal
import time

import pytest

from art_mega import ArtRuntime, TrainerSpec, compile_topology
from art_mega.agent.ports import free_port
from art_mega.errors import TrainerJobError
from art_mega.trainer.protocol import PingJob
from art_mega.trainer.service import TrainerService
from tests.helpers import loopback_cluster

pytest.importorskip("megatron.core", reason="trainer ranks need megatron-core (the trainer-cpu extra)")


async def test_ranks_run_jobs_and_a_dead_rank_is_named(tmp_path):
    topology = compile_topology(
        loopback_cluster(1), trainer=TrainerSpec(cpu_ranks_per_host=2, master_port=free_port())
    )
    runtime = await ArtRuntime.start_local(topology)
    service = TrainerService(runtime.clients, topology, tmp_path / "logs")
    try:
        ready_s = await service.start()
        assert ready_s < 120
        result = await service.run(PingJob())
        assert sorted(result.events) == [0, 1]
        assert all(e.metrics["sum"] == 3.0 for e in result.events.values())
        again = await service.run(PingJob())  # ranks stay up between jobs
        assert again.job_id != result.job_id

        health = await runtime.health()
        rank1 = next(c for c in health["host0"].children if c.child_id == "trainer-rank1")
        os.kill(rank1.pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(TrainerJobError, match="rank 1 on host host0") as info:
            await service.run(PingJob(), timeout_s=60)
        assert time.monotonic() - started < 10
        assert info.value.log_path and info.value.log_path.endswith("trainer-rank1.log")
    finally:
        await service.stop()
        await runtime.close()

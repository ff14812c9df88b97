"""Trainer ranks as agent children: started from the rank table, driven by jobs, deaths named."""

import asyncio
import os
import signal
import time

import pytest

from art_mega import ArtRuntime, TrainerSpec, compile_topology
from art_mega.agent.ports import free_port
from art_mega.errors import TrainerJobError
from art_mega.readahead import listing_path
from art_mega.trainer.protocol import PingJob
from art_mega.trainer.remote import TrainerService
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
        # once ready, a rank lists the files its start read, for the next start to read ahead
        listing = listing_path(topology.cluster.cache_root, "trainer-rank", "")
        deadline = time.monotonic() + 30
        while not listing.exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        named = listing.read_text().splitlines()
        assert any(p.endswith(os.path.join("torch", "distributed", "__init__.py")) for p in named)
        assert any(os.path.basename(p).startswith("libtorch_cpu") for p in named)
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

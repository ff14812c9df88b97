"""Like prog_hold_workers, but closes its runtime in `finally` as real programs do: the close
then runs while the launcher is being stopped or has lost a host."""

import asyncio
import json
import os

from art_mega import ArtRuntime, compile_topology
from tests.integration.rollouts_for_tests import sleep


async def main(launch):
    runtime = await ArtRuntime.start(
        launch, compile_topology(launch.homogeneous_cluster(cpu_slots=2, allow_shared_kernel=True))
    )
    try:
        executor = await runtime.rollout_executor(sleep)
        running = [asyncio.create_task(executor.run(w, sleep, 120)) for w in executor.workers]
        health = await runtime.health()
        pids = {
            "controller": os.getpid(),
            "agents": [h.pid for h in health.values()],
            "workers": [w.pid for w in executor.workers],
        }
        print("PIDS " + json.dumps(pids), flush=True)
        await asyncio.gather(*running)
    finally:
        await runtime.close()

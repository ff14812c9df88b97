"""Kills its own host's agent mid-program: the controller must cancel it and name the host."""

import asyncio
import os
import signal

from art_mega import ArtRuntime, compile_topology


async def main(launch):
    runtime = await ArtRuntime.start(
        launch, compile_topology(launch.homogeneous_cluster(allow_shared_kernel=True))
    )
    health = await runtime.health()
    print(f"KILLING_AGENT {health['host0'].pid}", flush=True)
    os.kill(health["host0"].pid, signal.SIGKILL)
    await asyncio.sleep(60)
    print("NOT_CANCELLED", flush=True)

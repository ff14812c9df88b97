"""Starts rollout workers that take a minute to import this module, announcing it first: a
signal sent after the announcement lands while every agent is starting its workers."""

import os
import time

from art_mega import ArtRuntime, compile_topology

if "ART_MEGA_SYS_PATH" in os.environ:  # only in a rollout worker (its agent sets the variable)
    time.sleep(60)


async def rollout(value: int) -> int:
    return value


async def main(launch):
    runtime = await ArtRuntime.start(
        launch, compile_topology(launch.homogeneous_cluster(cpu_slots=2, allow_shared_kernel=True))
    )
    print("STARTING_WORKERS", flush=True)
    await runtime.rollout_executor(rollout)
    print("WORKERS_STARTED", flush=True)

"""Blocks its own event loop, as a synchronous dataset or tokenizer load does, then uses its
runtime: prints `PIDS {...}` once its workers run, waits for a line on stdin (the test's
go-ahead; EOF also goes on), blocks the loop with `time.sleep($ART_TEST_BLOCK_S)` while a
rollout is in flight on every worker, then runs one more rollout on every worker and prints
`AFTER {...}` with every pid its runtime then sees."""

import asyncio
import json
import os
import sys
import time

from art_mega import ArtRuntime, compile_topology
from tests.integration.rollouts_for_tests import echo, where


async def main(launch):
    runtime = await ArtRuntime.start(
        launch, compile_topology(launch.homogeneous_cluster(cpu_slots=2, allow_shared_kernel=True))
    )
    try:
        executor = await runtime.rollout_executor([echo, where])

        async def pids() -> dict:
            health = await runtime.health()
            return {
                "controller": os.getpid(),
                "agents": sorted(h.pid for h in health.values()),
                "workers": sorted(w.pid for w in executor.workers),
                "children": sorted(c.pid for h in health.values() for c in h.children),
            }

        print("PIDS " + json.dumps(await pids()), flush=True)
        await asyncio.to_thread(sys.stdin.readline)
        in_flight = [asyncio.create_task(executor.run(w, echo, i)) for i, w in enumerate(executor.workers)]
        await asyncio.sleep(0)  # the rollouts are sent before the loop blocks
        time.sleep(float(os.environ["ART_TEST_BLOCK_S"]))
        echoed = await asyncio.gather(*in_flight)
        ran_on = await asyncio.gather(*(executor.run(w, where) for w in executor.workers))
        after = await pids()
        after.update(echoed=echoed, ran_on=sorted(r["pid"] for r in ran_on))
        print("AFTER " + json.dumps(after), flush=True)
    finally:
        await runtime.close()

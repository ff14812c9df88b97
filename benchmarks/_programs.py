"""Programs the launch and preflight benchmarks run through `art-mega`."""

import json
import os
import time


async def ready(launch) -> None:
    """Print when the program starts: every agent is up and proven by then."""
    print(f"READY_AT {time.time():.6f} hosts={launch.host_count}", flush=True)


async def preflight(launch) -> None:
    """Start a runtime with the whole proof (admission, FS probe, etcd, collective); print phases."""
    from art_mega import ArtRuntime, compile_topology

    topology = compile_topology(
        launch.homogeneous_cluster(
            allow_shared_kernel=True, artifact_root=os.environ.get("BENCH_ARTIFACT_ROOT")
        )
    )
    started = time.perf_counter()
    runtime = await ArtRuntime.start(launch, topology, metadata_store=True, collective=True)
    total = time.perf_counter() - started
    try:
        report = runtime.preflight
        links = report.collective.bandwidth_gbps if report.collective else {}
        print("PHASES " + json.dumps({"total": total, **report.phases_s, "links": links}), flush=True)
        print(f"PROVEN_AT {time.time():.6f}", flush=True)
    finally:
        await runtime.close()

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
        run_s = max(report.collective.run_s.values(), default=0.0) if report.collective else 0.0
        phases = {"total": total, **report.phases_s, "collective_run": run_s, "links": links}
        print("PHASES " + json.dumps(phases), flush=True)
        print(f"PROVEN_AT {time.time():.6f}", flush=True)
    finally:
        await runtime.close()

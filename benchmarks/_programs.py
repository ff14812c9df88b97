"""Programs the launch and preflight benchmarks run through `art-mega`, and what the training
benchmarks' programs share: the quickstart's task and their event files. Nothing here imports
art_mega at module level (benchmarks/peers_trl.py's TRL worker imports it without art-mega)."""

import json
import os
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
QUICKSTART_PROGRAM = REPO / "examples" / "multinode" / "train.py"
"""The quickstart's training program; the training benchmarks train its task."""


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


def quickstart_module():
    """examples/multinode/train.py as a module (it imports art_mega): its questions, answer
    rule, reward, rollout and validation."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("quickstart_train", QUICKSTART_PROGRAM)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def emit(path: str, **event: object) -> None:
    """Append `event` to the JSON-lines file at `path` (a benchmark program's progress, read by
    the benchmark that started it)."""
    with open(path, "a") as out:
        out.write(json.dumps(event) + "\n")


def art_program_command(benchmark: str | os.PathLike[str]) -> list[str]:
    """The command that runs `art_program` of the benchmark file `benchmark` through this
    checkout's `art-mega local`."""
    return [
        str(REPO / ".venv" / "bin" / "art-mega"),
        "local",
        "--program",
        f"{Path(benchmark).resolve()}:art_program",
    ]

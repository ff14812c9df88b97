"""Benchmark the rollout executor's round trip and throughput on one loopback host.

Starts `ArtRuntime.start_local` on a one-host loopback topology (127.0.0.1, port 0) with
`cpu_slots` rollout workers, runs the trivial rollout `_rollouts.noop`, and prints:

- `executor.run` sequential round trip, p50 and p99 (ms), on worker 0;
- `executor.submit` throughput (rollouts/s) with C concurrent callers over every worker;
- a signed `GET /v1/health` round trip (p50, p99) as a reference: the part of a rollout round
  trip that is controller HTTP (aiohttp) + HMAC + the agent's HTTP layer (uvicorn, Starlette)
  alone, without the hop to a worker;
- the peer, in the same run: a Ray actor method call round trip (p50, p99) on a local Ray
  (`ray.get(actor.noop.remote(i))`), in blocks of 50 calls alternating with executor.run's, and
  executor.run p50 / Ray p50 (skipped with a line when ray is not installed:
  `pip install 'art-mega[bench]'`).

It never fails on a slow figure. `--record` writes the rows into `benchmarks/RESULTS.md`,
replacing rows with the same figure name and keeping the others.

Usage: python benchmarks/executor.py [--quick] [--calls N] [--concurrency C] [--slots S] [--record]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import math
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from art_mega import ArtRuntime
from art_mega.topology import ClusterSpec, EndpointSpec, HostSpec, compile_topology

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))  # `_rollouts` and `_results` (workers get `_rollouts` via module_root)

from _results import RESULTS, report  # noqa: E402

WARMUP_CALLS = 200
PEER_BLOCK = 50


def loopback_topology(cpu_slots: int):
    """One host on 127.0.0.1, port 0 (the agent picks a free port), `cpu_slots` rollout workers."""
    tmp = Path(tempfile.gettempdir()) / "art-mega-bench"
    cluster = ClusterSpec(
        hosts=(
            HostSpec(
                host_id="host0",
                node_rank=0,
                worker_address=EndpointSpec(host="127.0.0.1", port=0),
                cpu_slots=cpu_slots,
            ),
        ),
        controller_host_id="host0",
        artifact_root=str(tmp / "artifacts"),
        cache_root=str(tmp / "cache"),
        allow_shared_kernel=True,
    )
    return compile_topology(cluster)


def percentile(samples: Sequence[float], q: float) -> float:
    """The `q`-th percentile (0..100) of `samples`, nearest rank."""
    ordered = sorted(samples)
    rank = max(1, min(len(ordered), math.ceil(q / 100 * len(ordered))))
    return ordered[rank - 1]


async def sequential_ms(call: Callable[[int], Awaitable[object]], n: int) -> list[float]:
    """Wall time (ms) of `n` awaited calls, one after another."""
    samples = []
    for i in range(n):
        start = time.perf_counter()
        await call(i)
        samples.append((time.perf_counter() - start) * 1e3)
    return samples


async def throughput(call: Callable[[int], Awaitable[object]], n: int, concurrency: int) -> float:
    """Calls per second for `n` calls made by `concurrency` callers that each loop until done."""
    counter = iter(range(n))

    async def caller() -> None:
        for i in counter:
            await call(i)

    start = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(concurrency)))
    return n / (time.perf_counter() - start)


async def measure(calls: int, concurrency: int, slots: int) -> list[tuple[str, float, str]]:
    """Run the measurements; returns (figure, value, unit) rows. The executor.run and Ray peer
    round trips are taken in alternating blocks of PEER_BLOCK calls, so both see the same load."""
    noop = importlib.import_module("_rollouts").noop
    ray_echo = start_ray_echo()
    runtime = await ArtRuntime.start_local(loopback_topology(slots))
    try:
        executor = await runtime.rollout_executor(noop)
        client = runtime._clients["host0"]

        async def run(i: int) -> object:
            return await executor.run(0, noop, i)

        async def submit(i: int) -> object:
            return await executor.submit(noop, i)

        async def health(_: int) -> object:
            return await client.health()

        await sequential_ms(run, WARMUP_CALLS)
        await sequential_ms(health, WARMUP_CALLS)
        await throughput(submit, max(WARMUP_CALLS, concurrency * 4), concurrency)
        if ray_echo is not None:
            await sequential_ms(ray_echo, WARMUP_CALLS)

        run_ms: list[float] = []
        ray_ms: list[float] = []
        while len(run_ms) < calls:
            block = min(PEER_BLOCK, calls - len(run_ms))
            run_ms += await sequential_ms(run, block)
            if ray_echo is not None:
                ray_ms += await sequential_ms(ray_echo, block)
        health_ms = await sequential_ms(health, calls)
        rate = await throughput(submit, max(calls, concurrency * 10), concurrency)
    finally:
        await runtime.close()
        if ray_echo is not None:
            import ray

            ray.shutdown()
    workers = f"{slots} worker{'s' if slots != 1 else ''}"
    figures = [
        ("executor.run round trip p50", percentile(run_ms, 50), "ms"),
        ("executor.run round trip p99", percentile(run_ms, 99), "ms"),
        (f"executor.submit throughput, {concurrency} callers, {workers}", rate, "rollouts/s"),
        ("signed GET /v1/health round trip p50", percentile(health_ms, 50), "ms"),
        ("signed GET /v1/health round trip p99", percentile(health_ms, 99), "ms"),
    ]
    if ray_ms:
        figures += [
            ("peer: Ray actor method call round trip p50", percentile(ray_ms, 50), "ms"),
            ("peer: Ray actor method call round trip p99", percentile(ray_ms, 99), "ms"),
            (
                "executor.run p50 / Ray actor call p50",
                percentile(run_ms, 50) / percentile(ray_ms, 50),
                "ratio",
            ),
        ]
    return figures


def start_ray_echo() -> Callable[[int], Awaitable[object]] | None:
    """Start a local Ray with one echo actor; returns an async call that does
    `ray.get(actor.noop.remote(i))` (the peer: what most RL frameworks use for rollout workers),
    or None, with a line printed, when ray is not installed."""
    try:
        import ray
    except ImportError:
        print("ray is not installed (pip install 'art-mega[bench]'): the Ray peer rows are skipped")
        return None

    @ray.remote(num_cpus=0)
    class Echo:
        def noop(self, x):
            return x

    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False, configure_logging=False)
    actor = Echo.remote()

    async def call(i: int) -> object:
        return ray.get(actor.noop.remote(i))

    return call


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="300 calls instead of 2000")
    parser.add_argument("--calls", type=int, default=None, help="calls per measurement (default 2000)")
    parser.add_argument("--concurrency", type=int, default=64, help="concurrent callers for throughput")
    parser.add_argument("--slots", type=int, default=2, help="rollout workers (cpu_slots) on the host")
    parser.add_argument("--record", action="store_true", help=f"write the rows into {RESULTS.name}")
    args = parser.parse_args(argv)
    calls = args.calls if args.calls is not None else 300 if args.quick else 2000
    if calls < 1 or args.concurrency < 1 or args.slots < 1:
        parser.error("--calls, --concurrency and --slots must be >= 1")

    figures = asyncio.run(measure(calls, args.concurrency, args.slots))
    shown = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--record"]
    report(figures, " ".join(["python benchmarks/executor.py", *shown]), args.record)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark the rollout executor's round trip and throughput on one loopback host.

Starts `ArtRuntime.start_local` on a one-host loopback topology (127.0.0.1, port 0) with
`cpu_slots` rollout workers, runs the trivial rollout `_rollouts.noop`, and prints:

- `executor.run` sequential round trip, p50 and p99 (ms), on worker 0;
- `executor.submit` throughput (rollouts/s) with C concurrent callers over every worker;
- a signed `GET /v1/health` round trip (p50, p99) as a reference: the part of a rollout round
  trip that is controller HTTP (aiohttp) + HMAC + the agent's HTTP layer (uvicorn, Starlette)
  alone, without the hop to a worker.

It never fails on a slow figure. `--record` writes the rows into `benchmarks/RESULTS.md`,
replacing rows with the same figure name and keeping the others.

Usage: python benchmarks/executor.py [--quick] [--calls N] [--concurrency C] [--slots S] [--record]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib
import math
import os
import platform
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from art_mega import ArtRuntime
from art_mega.topology import ClusterSpec, EndpointSpec, HostSpec, compile_topology

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "RESULTS.md"
TABLE_HEADER = ("figure", "value", "unit", "machine", "date", "command")
WARMUP_CALLS = 200


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
    """Run the three measurements; returns (figure, value, unit) rows."""
    noop = importlib.import_module("_rollouts").noop
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

        run_ms = await sequential_ms(run, calls)
        health_ms = await sequential_ms(health, calls)
        rate = await throughput(submit, max(calls, concurrency * 10), concurrency)
    finally:
        await runtime.close()
    workers = f"{slots} worker{'s' if slots != 1 else ''}"
    return [
        ("executor.run round trip p50", percentile(run_ms, 50), "ms"),
        ("executor.run round trip p99", percentile(run_ms, 99), "ms"),
        (f"executor.submit throughput, {concurrency} callers, {workers}", rate, "rollouts/s"),
        ("signed GET /v1/health round trip p50", percentile(health_ms, 50), "ms"),
        ("signed GET /v1/health round trip p99", percentile(health_ms, 99), "ms"),
    ]


def fmt(value: float) -> str:
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}" if value < 1 else f"{value:.2f}"


def print_table(rows: Sequence[Sequence[str]]) -> None:
    """Print `rows` under TABLE_HEADER as a plain aligned table (readable in logs and pipes)."""
    widths = [max(len(r[i]) for r in (TABLE_HEADER, *rows)) for i in range(len(TABLE_HEADER))]
    for n, row in enumerate((TABLE_HEADER, *rows)):
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if n == 0:
            print("  ".join("-" * w for w in widths))


def record(rows: Sequence[Sequence[str]], path: Path = RESULTS) -> None:
    """Put `rows` into the markdown table of `path`: same figure name replaced, others kept.

    The table is the first block of lines starting with `|` after the header row; text around it
    is kept. A missing file or table is created.
    """
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    lines = text.splitlines()
    head = next((i for i, line in enumerate(lines) if line.startswith("| figure |")), None)
    if head is None:
        lines += ["", "| " + " | ".join(TABLE_HEADER) + " |", "|" + "---|" * len(TABLE_HEADER)]
        head = len(lines) - 2
    end = head + 2
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    existing = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines[head + 2 : end]]
    new = {row[0]: list(row) for row in rows}
    merged = [new.pop(row[0]) if row[0] in new else row for row in existing]
    merged += [list(row) for row in rows if row[0] in new]
    body = ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in merged]
    lines[head + 2 : end] = body
    path.write_text("\n".join(lines) + "\n")


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
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))  # so that `_rollouts` imports (workers get it via module_root)

    figures = asyncio.run(measure(calls, args.concurrency, args.slots))
    machine = f"cpu x{os.cpu_count()}, {platform.system()}, py{platform.python_version()}"
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    shown = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--record"]
    command = " ".join(["python benchmarks/executor.py", *shown])
    rows = [(name, fmt(value), unit, machine, date, command) for name, value, unit in figures]
    print_table(rows)
    if args.record:
        record(rows)
        print(f"recorded in {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The cluster proof's phases on 2 and 4 network-namespace hosts (needs root, sshd, torch, etcd).

Runs `ArtRuntime.start(..., metadata_store=True, collective=True)` through `art-mega ssh` and
reports seconds for admission, the shared-FS probe, the managed etcd, the gloo collective (with
its bandwidth probe) and the whole proof. Target: the whole proof < 1 s for 4 hosts on CPU.

The collective's wall time includes waiting for each probe's `import torch`, which the agents
start when the proof begins (warm probes) so it overlaps the earlier phases; on namespace hosts
all probes share this machine's cores, so that wait is the bulk of it. "collective run" is the
slowest rank's time from having its config (torch imported) to its result: rendezvous, process
group, all-reduce, all-gather and the bandwidth probe.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from _netns import run_ssh  # noqa: E402
from _results import report  # noqa: E402

from art_mega.runtime.runtime import Phase  # noqa: E402
from tests.integration.netns import NetnsCluster, netns_unavailable_reason  # noqa: E402

PHASES = (*Phase, "collective_run", "total")
"""The runtime's proof phases in order, then two figures of the benchmark program's own."""
LABELS = {"collective_run": "collective run (slowest rank, torch imported)"}


def run_once(cluster: NetnsCluster, port: int, root: str) -> dict:
    env = dict(os.environ, BENCH_ARTIFACT_ROOT=root)
    stdout = run_ssh(cluster, "benchmarks/_programs.py:preflight", port, timeout=180, env=env)
    line = next(line for line in stdout.splitlines() if line.startswith("PHASES "))
    return json.loads(line.split(" ", 1)[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="one repetition per host count")
    parser.add_argument("--record", action="store_true", help="write the rows into benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    reason = netns_unavailable_reason()
    if reason:
        print(f"preflight benchmark skipped: {reason}")
        return 0
    reps = 1 if args.quick else 3
    figures = []
    for n in (2, 4):
        with NetnsCluster(n) as cluster, tempfile.TemporaryDirectory(prefix="art-mega-bench-") as root:
            runs = [run_once(cluster, 22600 + i, root) for i in range(reps)]
        for phase in PHASES:
            value = statistics.median(r.get(phase, 0.0) for r in runs)
            figures.append((f"preflight {LABELS.get(phase, phase)}, {n} hosts", value, "s"))
        links = [v for r in runs for v in r["links"].values()]
        figures.append(
            (f"preflight gloo link bandwidth (median of links), {n} hosts", statistics.median(links), "GB/s")
        )
    report(figures, "python benchmarks/preflight.py" + (" --quick" if args.quick else ""), args.record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Launch-to-ready over SSH on 1, 2 and 4 network-namespace hosts (needs root, sshd, iproute2).

Launch-to-ready is the wall time from starting `art-mega ssh` (inside h0) until the program's
`main(launch)` runs with every agent started and proven. Hosts start in parallel, so the figure
should grow sub-linearly. Target: 4 hosts < 3 s. Prints a table; never fails on a slow figure.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from _netns import run_ssh  # noqa: E402
from _results import report  # noqa: E402

from tests.integration.netns import NetnsCluster, netns_unavailable_reason  # noqa: E402


def launch_to_ready(cluster: NetnsCluster, port: int) -> float:
    started = time.time()
    stdout = run_ssh(cluster, "benchmarks/_programs.py:ready", port, timeout=120)
    line = next(line for line in stdout.splitlines() if line.startswith("READY_AT "))
    return float(line.split()[1]) - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="one repetition per host count")
    parser.add_argument("--record", action="store_true", help="write the rows into benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    reason = netns_unavailable_reason()
    if reason:
        print(f"launch benchmark skipped: {reason}")
        return 0
    reps = 1 if args.quick else 3
    figures = []
    medians = {}
    for n in (1, 2, 4):
        with NetnsCluster(n) as cluster:
            samples = [launch_to_ready(cluster, 22500 + i) for i in range(reps)]
        medians[n] = statistics.median(samples)
        figures.append((f"launch-to-ready over SSH, {n} host{'s' if n > 1 else ''}", medians[n], "s"))
    figures.append(("launch-to-ready 4 hosts / 1 host", medians[4] / medians[1], "ratio"))
    report(figures, "python benchmarks/launch.py" + (" --quick" if args.quick else ""), args.record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

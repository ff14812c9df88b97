"""Launch scale: the multinode smoke (every agent started and proven, the cluster proved by
preflight, one rollout worker per host) over `art-mega ssh` on 8/16/32/64 namespace hosts.

Per host count it records the wall time from starting the controller to its exit, the
controller's own CPU-seconds (user + system, `getrusage(RUSAGE_CHILDREN)` of the `ip netns exec`
child that waits for it: the agents run under the hosts' sshds, not under the controller), those
divided by the hosts, and the controller's peak RSS. A figure that grows faster than the hosts
(CPU-seconds per host rising with N) is the controller's superlinear part. Needs root, sshd,
iproute2; never fails on a slow figure.

    python benchmarks/launch_scale.py [--hosts 8 16 32 64 | --quick] [--record]
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from _results import report  # noqa: E402

from tests.conftest import cli_env  # noqa: E402
from tests.integration.netns import NetnsCluster, netns_unavailable_reason  # noqa: E402

SMOKE = "examples/multinode/program.py:main"


def launch_once(cluster: NetnsCluster, port: int) -> tuple[float, float, float]:
    """(wall s, controller CPU s, controller peak RSS MiB) of one smoke launch over every host."""
    argv = [sys.executable, "-m", "art_mega", "ssh", "--program", SMOKE, "--port", str(port)]
    for host in cluster.hosts:
        argv += ["--host", host.ssh_alias]
    argv += [f"--ssh-arg=-F {cluster.ssh_config}", "--startup-timeout", "600"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    result = subprocess.run(
        cluster.hosts[0].argv(argv), cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=1800
    )
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode != 0 or f"ART_MULTINODE_SMOKE_PASS hosts={cluster.n}" not in result.stdout:
        raise RuntimeError(
            f"smoke on {cluster.n} hosts failed ({result.returncode}): {result.stderr[-1500:]}"
        )
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, after.ru_maxrss / 1024


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hosts", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--quick", action="store_true", help="8 and 16 hosts only")
    parser.add_argument("--record", action="store_true", help="write the rows into benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    reason = netns_unavailable_reason()
    if reason:
        print(f"launch scale benchmark skipped: {reason}")
        return 0
    figures = []
    hosts = [8, 16] if args.quick else args.hosts
    for n in hosts:
        with NetnsCluster(n, ready_timeout_s=60) as cluster:
            wall, cpu, rss = launch_once(cluster, 22600)
        print(
            f"{n} hosts: wall {wall:.1f} s, controller CPU {cpu:.2f} s ({cpu / n:.3f} s/host), RSS {rss:.0f} MiB"
        )
        figures += [
            (f"smoke + preflight over SSH, {n} namespace hosts: wall", wall, "s"),
            (f"smoke + preflight over SSH, {n} namespace hosts: controller CPU per host", cpu / n, "s/host"),
            (f"smoke + preflight over SSH, {n} namespace hosts: controller peak RSS", rss, "MiB"),
        ]
    report(
        figures, "python benchmarks/launch_scale.py --hosts " + " ".join(map(str, hosts)), args.record
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

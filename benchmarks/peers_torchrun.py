"""Peer: art-mega launch + preflight against `torchrun` with a gloo rendezvous, same namespace hosts.

Both start from h0 over SSH and end when a gloo collective over every host has completed:

- art-mega: `art-mega ssh --program benchmarks/_programs.py:preflight` (agents started and
  proven, admission, FS probe, etcd, the gloo collective with its bandwidth probe); the figure
  is the program's PROVEN_AT time minus the start.
- torchrun: from h0, one `ssh hN torchrun --nnodes=N --nproc-per-node=1 --rdzv-backend=c10d
  --rdzv-endpoint=h0:PORT --rdzv-conf=is_host=0|1` per host, in parallel (what a torchrun user
  scripts with pdsh); each rank inits gloo and runs one all_reduce; the figure is the last
  rank's ALLREDUCE_AT time minus the start.

Prints both and art-mega / torchrun. Needs root, sshd, iproute2 and torch; never fails on a
slow figure. Usage: python benchmarks/peers_torchrun.py [--quick] [--record]
(--quick: 2 hosts, one repetition; otherwise 2 and 4 hosts, 3 repetitions, medians).
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from _netns import run_ssh  # noqa: E402
from _results import report  # noqa: E402

from tests.integration.netns import NetnsCluster, netns_unavailable_reason  # noqa: E402

MARK = "ALLREDUCE_AT "


def worker() -> None:
    """One torchrun rank: gloo init from torchrun's env, one all_reduce, print the time."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    value = torch.ones(1)
    dist.all_reduce(value)
    print(f"{MARK}{time.time():.6f} world={dist.get_world_size()} sum={value.item():.0f}", flush=True)
    dist.destroy_process_group()


def art_mega_seconds(cluster: NetnsCluster, port: int) -> float:
    """Wall seconds from starting `art-mega ssh` in h0 to the end of the program's cluster proof.

    Raises:
        RuntimeError: the launcher failed (see `_netns.run_ssh`).
    """
    started = time.time()
    stdout = run_ssh(cluster, "benchmarks/_programs.py:preflight", port, timeout=300)
    line = next(line for line in stdout.splitlines() if line.startswith("PROVEN_AT "))
    return float(line.split()[1]) - started


def torchrun_seconds(cluster: NetnsCluster, port: int) -> float:
    """Wall time from starting the per-host ssh commands in h0 to the last rank's all_reduce.

    Raises:
        RuntimeError: a host's torchrun failed or a rank did not report.
    """
    n = len(cluster.hosts)
    head = cluster.hosts[0].address
    procs = []
    started = time.time()
    for i, host in enumerate(cluster.hosts):
        # every namespace has the machine's hostname: say which host runs the store
        command = (
            f"cd {shlex.quote(str(REPO))} && OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=eth0 "
            f"{shlex.quote(sys.executable)} -m torch.distributed.run --nnodes={n} --nproc-per-node=1 "
            f"--rdzv-backend=c10d --rdzv-endpoint={head}:{port} --rdzv-id=bench{port} --rdzv-conf=is_host={int(i == 0)} "
            f"--local-addr={host.address} benchmarks/peers_torchrun.py --worker"
        )
        argv = cluster.hosts[0].argv(cluster.ssh_argv(host, command))
        procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    times = []
    for host, proc in zip(cluster.hosts, procs):
        stdout, stderr = proc.communicate(timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"torchrun on {host.name} exited {proc.returncode}: {stderr[-800:]}")
        times += [float(line.split()[1]) for line in stdout.splitlines() if line.startswith(MARK)]
    if len(times) != n:
        raise RuntimeError(f"{len(times)} of {n} torchrun ranks reported an all_reduce")
    return max(times) - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 hosts, one repetition")
    parser.add_argument("--record", action="store_true", help="write the rows into benchmarks/RESULTS.md")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker()
        return 0
    reason = netns_unavailable_reason()
    if reason:
        print(f"torchrun peer benchmark skipped: {reason}")
        return 0
    reps = 1 if args.quick else 3
    figures = []
    for n in (2,) if args.quick else (2, 4):
        ours, theirs = [], []
        with NetnsCluster(n) as cluster:
            for i in range(reps):  # alternate, so both see the same outside load
                ours.append(art_mega_seconds(cluster, 22800 + i))
                theirs.append(torchrun_seconds(cluster, 29700 + os.getpid() % 200 + i))
        a, t = statistics.median(ours), statistics.median(theirs)
        figures += [
            (f"art-mega ssh launch + preflight to a proven gloo collective, {n} hosts", a, "s"),
            (f"peer: torchrun c10d rendezvous + gloo all_reduce over SSH, {n} hosts", t, "s"),
            (f"art-mega launch + preflight / torchrun, {n} hosts", a / t, "ratio"),
        ]
    shown = " --quick" if args.quick else ""
    report(figures, f"python benchmarks/peers_torchrun.py{shown}", args.record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

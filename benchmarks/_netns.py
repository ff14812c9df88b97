"""Running `art-mega ssh` over namespace hosts, shared by the launch and preflight benchmarks."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def run_ssh(cluster: Any, program: str, port: int, timeout: float, env: dict[str, str] | None = None) -> str:
    """Run `art-mega ssh --program PROGRAM` inside h0 over every host; return its stdout.

    Raises:
        RuntimeError: the launcher failed (with the tail of its stderr).
    """
    argv = [sys.executable, "-m", "art_mega", "ssh", "--program", program, "--port", str(port)]
    for host in cluster.hosts:
        argv += ["--host", host.ssh_alias]
    argv.append(f"--ssh-arg=-F {cluster.ssh_config}")
    result = cluster.hosts[0].run(argv, cwd=REPO, env=env, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"art-mega ssh failed: {result.stderr[-800:]}")
    return result.stdout

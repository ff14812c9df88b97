"""A SkyPilot node with another ART_MEGA_SECRET is named at once, on both sides, not waited for."""

from __future__ import annotations

import subprocess
import sys
import time

from tests.conftest import REPO, cli_env

SMOKE = "examples/multinode/program.py:main"


def test_a_node_with_the_wrong_secret_is_refused_at_once(netns_cluster):
    cluster = netns_cluster(2)
    processes = []
    started = time.monotonic()
    for rank, (host, secret) in enumerate(zip(cluster.hosts, ("a" * 64, "b" * 64))):
        env = cli_env()
        env.update(
            ART_MEGA_SECRET=secret,
            SKYPILOT_NODE_IPS="\n".join(h.address for h in cluster.hosts),
            SKYPILOT_NUM_NODES="2",
            SKYPILOT_NODE_RANK=str(rank),
        )
        argv = [sys.executable, "-m", "art_mega", "skypilot", "--program", SMOKE, "--port", "23300"]
        argv += ["--startup-timeout", "90"]
        processes.append(
            host.exec(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    (out0, err0), (out1, err1) = [p.communicate(timeout=120) for p in processes]
    elapsed = time.monotonic() - started
    reason = "its hello is not signed with this launch's secret; give every node the same ART_MEGA_SECRET"
    assert (processes[0].returncode, processes[1].returncode) == (2, 2), (err0, err1)
    assert err0.strip().splitlines()[-1] == (
        f"art-mega: error: rank 1 ({cluster.hosts[1].address}) was refused: {reason}"
    ), err0
    assert f"error: rank 0 refused this rank: {reason}" in err1, err1
    assert "Traceback" not in err0 + err1 and "did not arrive" not in err0
    assert elapsed < 45, f"{elapsed:.1f} s: the launch waited for its 90 s startup timeout"

"""No agent outlives its controller: the lease, a stopped host, and a signal during start-up.

Namespace hosts (tests/integration/netns.py) with short leases; the launcher runs inside h0.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, cli_env, wait_gone
from tests.integration.netns import NetnsCluster
from tests.integration.test_ssh_launch import _art_mega_pids, _listeners, _read_pids

HOLD = "tests/integration/programs/prog_hold_workers.py:main"
HOLD_AND_CLOSE = "tests/integration/programs/prog_hold_and_close.py:main"
SMOKE = "examples/multinode/program.py:main"
LEASE_S = 4.0
PORT = 22600


def _ssh_argv(cluster: NetnsCluster, program: str, port: int = PORT, lease_s: float = LEASE_S) -> list[str]:
    argv = [sys.executable, "-m", "art_mega", "ssh", "--program", program, "--port", str(port)]
    for host in cluster.hosts:
        argv += ["--host", host.ssh_alias]
    return [
        *argv,
        f"--ssh-arg=-F {cluster.ssh_config}",
        "--startup-timeout",
        "60",
        "--controller-lease",
        str(lease_s),
    ]


def _launch(cluster: NetnsCluster, program: str = HOLD, **kw) -> subprocess.Popen[str]:
    return cluster.hosts[0].exec(
        _ssh_argv(cluster, program, **kw),
        cwd=REPO,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _gone_within(cluster: NetnsCluster, seconds: float) -> tuple[float, list[int]]:
    """(seconds it took, art-mega pids still alive) once no host runs one, or after `seconds`."""
    started = time.monotonic()
    left = _art_mega_pids(cluster)
    while left and time.monotonic() - started < seconds:
        time.sleep(0.1)
        left = _art_mega_pids(cluster)
    return time.monotonic() - started, left


@pytest.fixture(scope="module")
def hosts() -> NetnsCluster:
    from tests.integration.conftest import require_netns

    require_netns()
    with NetnsCluster(2) as cluster:
        yield cluster


def _children_of(pid: int, candidates: list[int]) -> list[int]:
    """The pids in `candidates` whose parent is `pid` (from /proc)."""
    found = []
    for child in candidates:
        with contextlib.suppress(OSError):
            if int(open(f"/proc/{child}/stat").read().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(child)
    return found


def test_agents_of_a_vanished_controller_exit_within_the_lease_and_free_their_ports(hosts):
    """h0 (the controller's host) is cut off without a FIN, as in a partition, and its controller
    is SIGKILLed 2 s later: h1's agent hears nothing more, stops its children and exits, so no
    art-mega process is left anywhere within the lease and the same ports take a new launch."""
    process = _launch(hosts)
    pids = _read_pids(process)
    assert len(pids["agents"]) == 2 and len(pids["workers"]) == 4
    hosts.hosts[0].set_link(False)
    cut_at = time.monotonic()
    try:
        time.sleep(2.0)
        process.kill()
        killed_at = time.monotonic()
        process.wait(10)
        # The lease counts from the last heartbeat before the cut; 1 s for the agent's own exit.
        _, left = _gone_within(hosts, LEASE_S + 1 - (time.monotonic() - killed_at))
        gone_at = time.monotonic()
        assert left == [], f"still running {gone_at - cut_at:.1f} s after the cut: {left}"
        print(
            f"no art-mega process {gone_at - cut_at:.1f} s after the cut, {gone_at - killed_at:.1f} s after the SIGKILL"
        )
    finally:
        hosts.hosts[0].set_link(True)
    assert not any(_listeners(hosts, PORT).values())
    relaunch = _launch(hosts, SMOKE)
    out, err = relaunch.communicate(timeout=120)
    assert relaunch.returncode == 0, err
    assert "ART_MULTINODE_SMOKE_PASS hosts=2" in out


def test_skypilot_nodes_of_a_vanished_rank_0_exit_within_the_lease(hosts):
    """The same cut and SIGKILL of rank 0 in a (simulated) SkyPilot task: node 1's agent lets
    its lease run out, and node 1's own `art-mega skypilot`, which no FIN will ever reach, ends
    with it instead of waiting for rank 0's outcome forever."""
    env = dict(
        cli_env(),
        ART_MEGA_SECRET="z" * 64,
        ART_MEGA_CONTROLLER_LEASE=str(LEASE_S),
        SKYPILOT_NODE_IPS="\n".join(h.address for h in hosts.hosts),
        SKYPILOT_NUM_NODES=str(len(hosts.hosts)),
    )
    argv = [sys.executable, "-m", "art_mega", "skypilot", "--program", HOLD, "--port", str(PORT + 2)]
    nodes = [
        host.exec(
            argv,
            cwd=REPO,
            env=dict(env, SKYPILOT_NODE_RANK=str(rank)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank, host in enumerate(hosts.hosts)
    ]
    _read_pids(nodes[0])
    hosts.hosts[0].set_link(False)
    try:
        nodes[0].kill()
        _, err = nodes[1].communicate(timeout=LEASE_S + 10)
        _, left = _gone_within(hosts, 5)
    finally:
        hosts.hosts[0].set_link(True)
    assert nodes[1].returncode == 1, err
    assert "rank 0 was not heard from" in err and "Traceback" not in err, err
    assert left == [], left


def test_a_stopped_host_is_named_within_the_lease_and_nothing_is_left(hosts):
    """h1's agent is SIGSTOPped (alive, silent): the controller names h1 once the lease has
    passed, cancels the program and exits; every process on every host is gone."""
    process = _launch(hosts, HOLD_AND_CLOSE)
    pids = _read_pids(process)
    frozen = pids["agents"][1]
    os.kill(frozen, signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        _, err = process.communicate(timeout=60)
        exited_after = time.monotonic() - stopped_at
    finally:
        with contextlib.suppress(ProcessLookupError):  # the launcher SIGKILLs it over SSH
            os.kill(frozen, signal.SIGCONT)
    assert process.returncode == 1, err
    lost = [line for line in err.splitlines() if "was lost" in line]
    assert lost and "host h1" in lost[0] and f"for {LEASE_S:g} s" in lost[0], err
    assert "Traceback" not in err, err
    assert LEASE_S <= exited_after < LEASE_S + 10, (exited_after, err)
    print(f"named and exited {exited_after:.1f} s after the SIGSTOP")
    assert wait_gone(pids["agents"] + pids["workers"], 5) == []
    assert _art_mega_pids(hosts) == []


def test_sigterm_with_a_stopped_host_cleans_every_other_host_within_15_s(hosts):
    process = _launch(hosts, HOLD_AND_CLOSE)
    pids = _read_pids(process)
    frozen = pids["agents"][1]
    others = [p for p in pids["agents"] + pids["workers"] if p != frozen]
    others = [p for p in others if p not in _children_of(frozen, pids["workers"])]
    assert len(others) == 3  # h0's agent and its two workers
    os.kill(frozen, signal.SIGSTOP)
    try:
        time.sleep(1.0)  # heartbeats to h1 are now unanswered
        process.send_signal(signal.SIGTERM)
        signalled_at = time.monotonic()
        assert wait_gone(others, 15) == [], (
            f"other hosts not clean {time.monotonic() - signalled_at:.1f} s after SIGTERM"
        )
        print(f"every other host clean {time.monotonic() - signalled_at:.1f} s after SIGTERM")
        _, err = process.communicate(timeout=30)
    finally:
        with contextlib.suppress(ProcessLookupError):  # the launcher SIGKILLs it over SSH
            os.kill(frozen, signal.SIGCONT)
    assert process.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err, err
    assert wait_gone(pids["agents"] + pids["workers"], 5) == []
    assert _art_mega_pids(hosts) == []


def _has_process(cluster: NetnsCluster, fragment: bytes) -> bool:
    for pid in _art_mega_pids(cluster):
        with contextlib.suppress(OSError):
            if fragment in open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" "):
                return True
    return False


def _sigterm_once(cluster: NetnsCluster, process: subprocess.Popen[str], fragment: bytes) -> str:
    """SIGTERM the launcher as soon as a host runs a process whose command line has `fragment`;
    check it exits 128+SIGTERM leaving no process anywhere; its stderr."""
    deadline = time.monotonic() + 60
    while not _has_process(cluster, fragment):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.02)
    process.send_signal(signal.SIGTERM)
    signalled_at = time.monotonic()
    _, err = process.communicate(timeout=30)
    assert process.returncode == 128 + signal.SIGTERM, err
    _, left = _gone_within(cluster, 15 - (time.monotonic() - signalled_at))
    assert left == [], left
    return err


def test_sigterm_while_agents_and_their_workers_start_prints_no_tracebacks(hosts):
    """Two moments of start-up: the agents themselves starting (importing, binding), and every
    agent starting rollout workers (they take a minute to import the program's module). Either
    way the terminal gets the launcher's line, not one traceback per request and host."""
    err = _sigterm_once(hosts, _launch(hosts, SMOKE, port=PORT + 1), b"art_mega worker")
    assert "Traceback" not in err and len(err.splitlines()) <= 3, err
    program = "tests/integration/programs/prog_slow_workers.py:main"
    err = _sigterm_once(hosts, _launch(hosts, program, port=PORT + 1), b"art_mega.rollouts.worker")
    assert "Traceback" not in err and len(err.splitlines()) <= 3, err

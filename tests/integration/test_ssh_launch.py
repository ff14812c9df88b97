"""`art-mega ssh` and a simulated `art-mega skypilot` on three real hosts made of network namespaces.

The launcher runs inside h0 (the root namespace cannot reach the hosts, by design).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, cli_env, wait_gone
from tests.integration.netns import NetnsCluster

SMOKE = "examples/multinode/program.py:main"
HOLD = "tests/integration/programs/prog_hold_workers.py:main"
REPLAY = "tests/integration/programs/prog_replay_to_sibling.py:main"
PORT = 22222


def _ssh(
    cluster: NetnsCluster, *args: str, hosts: list[str] | None = None, program: str = SMOKE
) -> list[str]:
    argv = [sys.executable, "-m", "art_mega", "ssh", "--program", program, "--port", str(PORT)]
    for host in hosts if hosts is not None else [h.ssh_alias for h in cluster.hosts]:
        argv += ["--host", host]
    return [*argv, f"--ssh-arg=-F {cluster.ssh_config}", "--startup-timeout", "60", *args]


def _run(cluster: NetnsCluster, argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return cluster.hosts[0].run(argv, cwd=REPO, env=cli_env(), timeout=timeout)


def _start(cluster: NetnsCluster, argv: list[str]) -> subprocess.Popen[str]:
    return cluster.hosts[0].exec(
        argv, cwd=REPO, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _listeners(cluster: NetnsCluster, port: int) -> dict[str, bool]:
    """Which hosts have a TCP listener on `port` (read from each namespace's /proc/net/tcp)."""
    found = {}
    for host in cluster.hosts:
        table = host.run(["cat", "/proc/net/tcp", "/proc/net/tcp6"]).stdout
        found[host.name] = any(
            len(f := line.split()) > 3 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port
            for line in table.splitlines()[1:]
        )
    return found


def _art_mega_pids(cluster: NetnsCluster) -> list[int]:
    pids = []
    for host in cluster.hosts:
        for pid in host.pids():
            try:
                cmdline = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ")
            except OSError:
                continue
            if b"art_mega" in cmdline:
                pids.append(pid)
    return pids


def _read_pids(process: subprocess.Popen[str]) -> dict:
    for line in process.stdout:
        if line.startswith("PIDS "):
            return json.loads(line[5:])
    raise AssertionError(f"no PIDS line; stderr: {process.stderr.read()}")


def _one_sentence(result: subprocess.CompletedProcess[str], *fragments: str) -> str:
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    errors = [line for line in result.stderr.splitlines() if line.startswith("art-mega: error: ")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


def test_smoke_over_ssh_on_three_hosts(netns3):
    h2 = netns3.hosts[2]
    hosts = ["h0", "root@h1", f"h2={h2.address}"]
    result = _run(netns3, _ssh(netns3, hosts=hosts))
    assert result.returncode == 0, result.stderr
    assert "ART_MULTINODE_SMOKE_PASS hosts=3 answers=['yes', 'no', 'maybe']" in result.stdout
    assert not any(_listeners(netns3, PORT).values())
    assert wait_gone(_art_mega_pids(netns3), 5) == []


def test_worker_host_differs_from_the_ssh_target(netns3):
    """SSH reaches h1 at its first address; its agent binds a second address given by =WORKER_HOST."""
    h1 = netns3.hosts[1]
    second = h1.address.rsplit(".", 1)[0] + ".102"
    h1.run(["ip", "addr", "add", f"{second}/24", "dev", "eth0"], check=True)
    try:
        result = _run(netns3, _ssh(netns3, "--port", "23200", hosts=["h0", f"h1={second}"]))
        assert result.returncode == 0, result.stderr
        assert "ART_MULTINODE_SMOKE_PASS hosts=2" in result.stdout
    finally:
        h1.run(["ip", "addr", "del", f"{second}/24", "dev", "eth0"])


def test_smoke_through_simulated_skypilot(netns3):
    env = cli_env()
    env.update(
        ART_MEGA_SECRET="z" * 64,
        SKYPILOT_NODE_IPS="\n".join(h.address for h in netns3.hosts),
        SKYPILOT_NUM_NODES="3",
    )
    processes = []
    for rank, host in enumerate(netns3.hosts):
        argv = [sys.executable, "-m", "art_mega", "skypilot", "--program", SMOKE, "--port", "23100"]
        node_env = dict(env, SKYPILOT_NODE_RANK=str(rank))
        processes.append(
            host.exec(argv, cwd=REPO, env=node_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    outputs = [p.communicate(timeout=120) for p in processes]
    assert [p.returncode for p in processes] == [0, 0, 0], outputs
    assert "ART_MULTINODE_SMOKE_PASS hosts=3 answers=['yes', 'no', 'maybe']" in outputs[0][0]
    assert not any(_listeners(netns3, 23100).values()) and not any(_listeners(netns3, 23101).values())


def test_killed_agent_fails_the_run_within_5_s_naming_the_host(netns3):
    process = _start(netns3, _ssh(netns3, program=HOLD))
    pids = _read_pids(process)
    victim = pids["agents"][1]
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    _, err = process.communicate(timeout=60)
    assert time.monotonic() - killed_at < 5, err
    assert process.returncode == 1, err
    assert "host h1" in err and "lost" in err
    assert wait_gone(pids["agents"] + pids["workers"], 15) == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_signals_leave_no_process_and_no_listener(netns3, sig):
    process = _start(netns3, _ssh(netns3, program=HOLD))
    pids = _read_pids(process)
    assert len(pids["agents"]) == 3 and len(pids["workers"]) == 6
    process.send_signal(sig)
    started = time.monotonic()
    _, err = process.communicate(timeout=30)
    assert process.returncode == 128 + sig, err
    assert wait_gone(pids["agents"] + pids["workers"], 15 - (time.monotonic() - started)) == []
    assert _art_mega_pids(netns3) == []
    assert not any(_listeners(netns3, PORT).values())


def test_pre_existing_listener_stops_the_launch_before_anything_starts(netns3):
    h1 = netns3.hosts[1]
    blocker = h1.exec(
        [
            sys.executable,
            "-c",
            f"import socket,time; s=socket.create_server(('{h1.address}', {PORT})); print('up', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert blocker.stdout.readline().strip() == "up"
        result = _run(netns3, _ssh(netns3))
        _one_sentence(result, h1.address, "refusing to reuse a pre-existing listener")
        assert _art_mega_pids(netns3) == []
    finally:
        blocker.kill()
        blocker.wait()


def test_wrong_key_unreachable_host_and_bad_python(netns3, tmp_path):
    wrong = tmp_path / "wrong_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(wrong)], check=True)
    config = tmp_path / "ssh_config"
    config.write_text(netns3.ssh_config.read_text().replace(str(netns3.key_path), str(wrong)))
    argv = _ssh(netns3)
    argv[argv.index(f"--ssh-arg=-F {netns3.ssh_config}")] = f"--ssh-arg=-F {config}"
    _one_sentence(_run(netns3, argv), "authentication failed")

    _one_sentence(_run(netns3, _ssh(netns3, "--ssh-arg=-p 2")), "cannot connect")

    result = _run(netns3, _ssh(netns3, "--python", "/nonexistent/python3"))
    _one_sentence(result, "--python /nonexistent/python3 does not exist")
    assert _art_mega_pids(netns3) == []


def test_known_hosts_markers_never_crash_and_a_revoked_host_key_is_refused(netns3, tmp_path):
    """A known_hosts with comments, `@cert-authority` and `@revoked` lines (which made every launch
    crash with paramiko's InvalidHostKey): h1's revoked key is refused in one sentence naming h1 and
    the file, nothing is left running, and the file is not rewritten."""
    h0, h1 = netns3.hosts[0], netns3.hosts[1]
    ca = tmp_path / "ca"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(ca)], check=True)
    known = tmp_path / "known_hosts"
    known.write_text(
        "# lab hosts\n"
        f"@cert-authority *.lab.example {ca.with_suffix('.pub').read_text().strip()}\n"
        f"{h0.address} {h0.host_public_key}\n"
        f"{h1.address} {h1.host_public_key}\n"
        f"@revoked * {h1.host_public_key}\n"
    )
    before = known.read_bytes()
    config = tmp_path / "ssh_config"
    config.write_text(netns3.ssh_config.read_text().replace(str(netns3.known_hosts), str(known)))
    argv = _ssh(netns3, hosts=["h0", "h1"])
    argv[argv.index(f"--ssh-arg=-F {netns3.ssh_config}")] = f"--ssh-arg=-F {config}"
    _one_sentence(
        _run(netns3, argv), f"ssh h1 (root@{h1.address}:22)", f"is marked @revoked in {known} line 5"
    )
    assert known.read_bytes() == before
    assert wait_gone(_art_mega_pids(netns3), 10) == []


def test_a_shutdown_replayed_to_a_sibling_host_and_an_unsigned_body_are_refused(netns3):
    """Over two namespace hosts: a signed /v1/shutdown made for h0's agent, sent to h1's agent, is
    refused and runs nothing (h1's agent and worker live on, the program ends normally); an unsigned
    300 MB upload to h1's agent is refused on its headers and the agent's RSS does not grow."""
    result = _run(netns3, _ssh(netns3, hosts=["h0", "h1"], program=REPLAY))
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("REPLAY "))
    replay = json.loads(line[len("REPLAY ") :])
    assert replay["status"] == 401, replay
    assert replay["detail"] == f"signed for the agent at {replay['host0']}, not this one"
    assert replay["host0"] == f"tcp://{netns3.hosts[0].address}:{PORT}"
    assert replay["children_before"] == replay["children_after"] == 1 and replay["same_pid"]
    assert replay["echo_after"] == "after"
    assert replay["upload_status"] == "HTTP/1.1 401 Unauthorized" and replay["upload_sent"] < 64 << 20
    assert replay["rss_grown_kib"] < 2 * 1024, replay
    assert wait_gone(_art_mega_pids(netns3), 10) == []

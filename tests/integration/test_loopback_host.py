"""A host whose worker host is loopback, on real namespace hosts over real SSH.

The remote agent sees from SSH_CONNECTION that its controller is another machine, so listening on
a loopback address (a name resolving to 127.0.1.1, as Debian does for a machine's own name) is
refused there, naming the host and the `--host` fix; in a multi-host launch the controller refuses
it before any SSH connection.
"""

from __future__ import annotations

import sys

from tests.conftest import REPO, cli_env, wait_gone
from tests.integration.netns import NetnsCluster

SMOKE = "examples/multinode/program.py:main"


def _ssh(cluster: NetnsCluster, *hosts: str) -> list[str]:
    argv = [sys.executable, "-m", "art_mega", "ssh", "--program", SMOKE, "--port", "22231"]
    for host in hosts:
        argv += ["--host", host]
    return [*argv, f"--ssh-arg=-F {cluster.ssh_config}", "--startup-timeout", "60"]


def _art_mega_pids(cluster: NetnsCluster) -> list[int]:
    found = []
    for host in cluster.hosts[1:]:
        for pid in host.pids():
            try:
                cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
            except OSError:
                continue
            if b"art_mega" in cmdline:
                found.append(pid)
    return found


def _error_line(stderr: str) -> str:
    errors = [line for line in stderr.splitlines() if line.startswith("art-mega: error: ")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr
    return errors[0]


def test_remote_agent_refuses_to_listen_on_loopback(netns3):
    h0, h1 = netns3.hosts[0], netns3.hosts[1]
    # glibc reads the name 127.0.257 as 127.0.1.1: the remote host resolves its worker host to
    # Debian's own-hostname address without an /etc/hosts edit.
    result = h0.run(_ssh(netns3, f"{h1.ssh_alias}=127.0.257"), cwd=REPO, env=cli_env(), timeout=120)
    assert result.returncode == 2, (result.stdout, result.stderr)
    line = _error_line(result.stderr)
    assert line.count("art-mega: error: ") == 1, line
    for fragment in (
        f"host {h1.ssh_alias}",
        "this agent would listen on 127.0.1.1 (127.0.257 resolves to it here; Debian's /etc/hosts",
        f"the controller at {h0.address} and the other hosts cannot reach",
        f"--host SSH_TARGET={h1.address}",
    ):
        assert fragment in line, line
    assert wait_gone(_art_mega_pids(netns3), 10) == []


def test_multi_host_launch_with_a_loopback_worker_host_is_refused_before_ssh(netns3):
    h0, h1, h2 = netns3.hosts
    result = h0.run(
        _ssh(netns3, f"{h1.ssh_alias}=127.0.257", h2.ssh_alias), cwd=REPO, env=cli_env(), timeout=120
    )
    assert result.returncode == 2, (result.stdout, result.stderr)
    line = _error_line(result.stderr)
    assert f"--host '{h1.ssh_alias}=127.0.257' would advertise its agent at 127.0.1.1" in line, line
    assert f"--host {h1.ssh_alias}=ADDRESS" in line, line
    assert "refused to start" not in line
    assert _art_mega_pids(netns3) == []

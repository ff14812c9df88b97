"""The namespace harness gives real, reachable, key-only sshd hosts and leaves nothing behind."""

from __future__ import annotations

import errno
import fcntl
import json
import socket
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import pid_alive, wait_gone
from tests.integration import netns
from tests.integration.netns import NetnsCluster, NetnsError

pytestmark = pytest.mark.root

# Runs inside a host namespace: paramiko with the cluster's ssh_config, known_hosts and key.
PARAMIKO_CLIENT = r"""
import json, sys
import paramiko

spec = json.loads(sys.argv[1])
config = paramiko.SSHConfig.from_path(spec["config"])
report = {}
for alias in spec["aliases"]:
    entry = config.lookup(alias)
    client = paramiko.SSHClient()
    client.load_host_keys(spec.get("known_hosts") or entry["userknownhostsfile"])
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    try:
        client.connect(
            entry["hostname"], port=int(entry["port"]), username=entry["user"],
            key_filename=spec.get("key") or entry["identityfile"][0],
            look_for_keys=False, allow_agent=False, timeout=5, banner_timeout=5, auth_timeout=5,
        )
        runs = []
        for command in spec["commands"]:
            _, out, err = client.exec_command(command, timeout=10)
            stdout, stderr = out.read().decode(), err.read().decode()
            runs.append({"code": out.channel.recv_exit_status(), "stdout": stdout, "stderr": stderr})
        report[alias] = {"hostname": entry["hostname"], "runs": runs}
    except paramiko.AuthenticationException as e:
        report[alias] = {"error": "AuthenticationException", "detail": str(e)}
    except paramiko.SSHException as e:
        report[alias] = {"error": type(e).__name__, "detail": str(e)}
    finally:
        client.close()
print(json.dumps(report))
"""


def paramiko_from(host: netns.NetnsHost, cluster: NetnsCluster, aliases: list[str], **spec) -> dict:
    """Run PARAMIKO_CLIENT inside `host` against `aliases`; return its JSON report."""
    spec = {"config": str(cluster.ssh_config), "aliases": aliases, "commands": ["true"], **spec}
    proc = host.run([sys.executable, "-c", PARAMIKO_CLIENT, json.dumps(spec)], timeout=30)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_paramiko_reaches_every_host_with_config_and_known_hosts(netns3: NetnsCluster) -> None:
    h0, h1, h2 = netns3.hosts
    boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    report = paramiko_from(
        h0,
        netns3,
        ["h1", "h2"],
        commands=["cat /proc/sys/kernel/random/boot_id; hostname -I || ip -4 addr", "exit 3"],
    )
    for host in (h1, h2):
        entry = report[host.ssh_alias]
        assert entry.get("hostname") == host.address, entry
        listing, exit3 = entry["runs"]
        assert listing["code"] == 0, listing
        reported_boot_id, addresses = listing["stdout"].split("\n", 1)
        assert reported_boot_id == boot_id  # one kernel: every namespace shares the boot_id
        assert addresses.split() == [host.address], listing
        assert exit3["code"] == 3, exit3


def test_wrong_client_key_and_unknown_host_key_are_refused(netns3: NetnsCluster, tmp_path: Path) -> None:
    wrong_key = tmp_path / "wrong_ed25519"
    netns._new_ed25519(wrong_key)
    report = paramiko_from(netns3.hosts[0], netns3, ["h1", "h2"], key=str(wrong_key))
    assert {entry.get("error") for entry in report.values()} == {"AuthenticationException"}, report

    empty_known_hosts = tmp_path / "known_hosts"
    empty_known_hosts.write_text("")
    report = paramiko_from(netns3.hosts[0], netns3, ["h1"], known_hosts=str(empty_known_hosts))
    assert "not found in known_hosts" in report["h1"].get("detail", ""), report


def test_openssh_client_uses_ssh_config_and_passes_exit_codes(netns3: NetnsCluster) -> None:
    h0, h1, h2 = netns3.hosts
    listing = h2.ssh(h1, "hostname -I")
    assert listing.returncode == 0, listing.stderr
    assert listing.stdout.split() == [h1.address]
    assert h0.ssh("h2", "exit 3").returncode == 3
    assert h0.ssh(h0, "hostname -I").stdout.split() == [h0.address]  # own address over lo


def test_hosts_are_namespaces_with_one_address_each(netns3: NetnsCluster) -> None:
    names = netns.netns_list()
    assert all(h.netns in names for h in netns3.hosts) and netns3.switch_netns in names
    for host in netns3.hosts:
        assert host.run(["hostname", "-I"]).stdout.split() == [host.address]
        assert host.sshd_pid in host.pids()
    assert len({h.address for h in netns3.hosts}) == 3
    text = netns3.ssh_config.read_text()
    assert "Host h1\n" in text and f"HostName {netns3.hosts[1].address}" in text
    assert oct(netns3.key_path.stat().st_mode & 0o777) == "0o600"
    assert len(netns3.known_hosts.read_text().splitlines()) == 3


def test_kill_host_processes_keeps_sshd_and_unplugging_drops_traffic(netns3: NetnsCluster) -> None:
    h0, h1, _ = netns3.hosts
    sleeper = h1.exec(["sleep", "60"])
    # `ip netns exec` enters the namespace a moment after Popen returns; kill only once it is inside.
    deadline = time.monotonic() + 10
    while sleeper.pid not in h1.pids() and time.monotonic() < deadline:
        time.sleep(0.01)
    killed = netns3.kill_host_processes(h1)
    assert sleeper.wait(timeout=5) == -9 and killed == [sleeper.pid]
    assert h1.sshd_pid in h1.pids()

    connect = f"import socket; socket.create_connection(({h1.address!r}, 22), timeout=0.5).close()"
    h1.set_link(False)
    try:
        assert h0.run([sys.executable, "-I", "-S", "-c", connect]).returncode != 0
    finally:
        h1.set_link(True)
    assert h0.run([sys.executable, "-I", "-S", "-c", connect]).returncode == 0


def test_close_leaves_no_namespace_process_or_file(netns_cluster) -> None:
    root_links = netns._ip("-o", "link").stdout
    cluster = netns_cluster(2)
    assert netns._ip("-o", "link").stdout == root_links  # the root namespace's network is untouched
    session = cluster.hosts[0].exec(cluster.ssh_argv("h1", "sleep 60"))  # also leaves a child in h1
    sshd_pids = [h.sshd_pid for h in cluster.hosts]
    pids = [p for h in cluster.hosts for p in h.pids()]
    names, tmpdir = cluster.namespaces, cluster.tmpdir
    claim = netns.CLAIM_DIR / f"{cluster.subnet.rsplit('.', 1)[0]}"
    assert claim.exists()
    # from the root namespace the subnet is unreachable at once: nothing leaves the machine
    assert cluster.subnet in netns.root_unreachable_routes()
    with pytest.raises(OSError) as refused:
        socket.create_connection((cluster.hosts[1].address, 22), timeout=5).close()
    assert refused.value.errno == errno.EHOSTUNREACH, refused.value  # not a timeout
    # while the hosts still reach each other over their bridge
    connect = (
        f"import socket; socket.create_connection(({cluster.hosts[1].address!r}, 22), timeout=2).close()"
    )
    assert cluster.hosts[0].run([sys.executable, "-I", "-S", "-c", connect]).returncode == 0

    cluster.close()
    assert session.poll() is not None
    assert not set(names) & set(netns.netns_list())
    assert not wait_gone(pids, 2) and not any(pid_alive(p) for p in sshd_pids)
    assert not tmpdir.exists() and not claim.exists()
    assert cluster.subnet not in netns.root_unreachable_routes()
    cluster.close()  # idempotent


def test_reaping_removes_a_route_nobody_claims() -> None:
    if netns.netns_unavailable_reason():
        pytest.skip(netns.netns_unavailable_reason())
    netns.CLAIM_DIR.mkdir(parents=True, exist_ok=True)
    with open(netns.CLAIM_DIR / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # nobody claims a subnet meanwhile
        claimed = {p.name for p in netns.CLAIM_DIR.glob(f"{netns.SUBNET_PREFIX}.*")}
        octet = next(o for o in range(254, 0, -1) if f"{netns.SUBNET_PREFIX}.{o}" not in claimed)
        subnet = f"{netns.SUBNET_PREFIX}.{octet}.0/24"
        netns._ip("route", "replace", "unreachable", subnet)  # as a killed test process leaves it
        try:
            netns.reap_stale_namespaces()
            assert subnet not in netns.root_unreachable_routes()
        finally:
            netns._ip("route", "del", "unreachable", subnet, check=False)


def test_setup_failure_midway_still_tears_down(monkeypatch: pytest.MonkeyPatch) -> None:
    if netns.netns_unavailable_reason():
        pytest.skip(netns.netns_unavailable_reason())

    def fail(self: NetnsCluster) -> None:
        raise NetnsError("injected")

    monkeypatch.setattr(NetnsCluster, "_wait_ready", fail)
    cluster = NetnsCluster(2)
    with pytest.raises(NetnsError, match="injected"):
        cluster.start()
    assert cluster.namespaces and not set(cluster.namespaces) & set(netns.netns_list())
    assert not any(pid_alive(h.sshd_pid) for h in cluster.hosts)
    assert not cluster.tmpdir.exists() and cluster not in netns._live
    assert cluster.subnet not in netns.root_unreachable_routes()

"""netif: interface syntax checks for gloo and NCCL, and telling loopback addresses from others."""

import pytest

from art_mega.preflight.netif import (
    gloo_ifname_problem,
    interface_names,
    is_loopback_ip,
    loopback_in_multi_host,
    loopback_ip,
    nccl_ifname_problem,
    ssh_client_elsewhere,
)

HOST = ("docker0", "eth0", "eth1", "lo")


@pytest.mark.parametrize("value", ["eth0", "eth0,eth1", "lo"])
def test_gloo_takes_exact_names_the_host_has(value):
    assert gloo_ifname_problem(value, HOST) is None


@pytest.mark.parametrize(
    "value,reason",
    [
        ("^lo,docker", "uses '^', NCCL_SOCKET_IFNAME's syntax, which gloo does not take"),
        ("=eth0", "uses '=', NCCL_SOCKET_IFNAME's syntax"),
        ("eth", "names interface 'eth', which this host does not have (it has docker0, eth0, eth1, lo)"),
        (",eth0", "has an empty interface name"),
    ],
)
def test_gloo_names_what_cannot_work(value, reason):
    assert gloo_ifname_problem(value, HOST).startswith(reason)


def test_gloo_syntax_is_checked_even_when_interfaces_are_not_reported():
    assert "'^'" in gloo_ifname_problem("^lo", ())
    assert gloo_ifname_problem("eth7", ()) is None


@pytest.mark.parametrize(
    "value,selects",
    [
        ("eth", True),
        ("=eth", False),
        ("=eth1", True),
        ("^lo,docker", True),
        ("^eth,lo,docker", False),
        ("ib", False),
    ],
)
def test_nccl_prefix_exact_and_exclude_rules(value, selects):
    assert (nccl_ifname_problem(value, HOST) is None) is selects


def test_this_host_reports_its_loopback_interface():
    assert "lo" in interface_names()


@pytest.mark.parametrize(
    "text,loopback",
    [
        ("127.0.1.1", True),
        ("127.0.0.1", True),
        ("::1", True),
        ("::ffff:127.0.1.1", True),
        ("10.0.0.1", False),
        ("fd00::1", False),
        ("localhost", False),  # a name: only resolution can say
    ],
)
def test_loopback_ip_literals(text, loopback):
    assert is_loopback_ip(text) is loopback


def test_names_are_resolved_for_loopback():
    # glibc's resolver reads 127.0.257 as 127.0.1.1 (inet_aton's last part takes 16 bits):
    # a name that resolves to Debian's own-hostname address without editing /etc/hosts.
    assert loopback_ip("127.0.257") == "127.0.1.1"
    assert loopback_ip("localhost") in {"127.0.0.1", "::1"}
    assert loopback_ip("10.0.0.1") is None
    assert loopback_ip("no-such-host.invalid") is None


def test_loopback_counts_only_among_hosts_that_are_not_all_loopback():
    assert loopback_in_multi_host([("a", "127.0.1.1")]) is None
    assert loopback_in_multi_host([("a", "127.0.0.2"), ("b", "127.0.0.3")]) is None
    assert loopback_in_multi_host([("a", "10.0.0.1"), ("b", "127.0.257")]) == ("b", "127.0.257", "127.0.1.1")
    assert loopback_in_multi_host([("a", "10.0.0.1"), ("b", "10.0.0.2")]) is None


@pytest.mark.parametrize(
    "value,expected",
    [
        ("10.0.0.1 50000 10.0.0.2 22", ("10.0.0.1", "10.0.0.2")),
        ("fd00::1 50000 fd00::2 22", ("fd00::1", "fd00::2")),
        ("127.0.0.1 50000 127.0.0.1 22", None),  # ssh to this machine
        ("10.0.0.2 50000 10.0.0.2 22", None),  # this machine through its own address
        (None, None),  # not started over SSH
        ("garbage", None),
        ("host-a 1 host-b 22", None),
    ],
)
def test_ssh_client_elsewhere(value, expected):
    assert ssh_client_elsewhere(value) == expected

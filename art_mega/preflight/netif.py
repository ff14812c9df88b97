"""Which network interface this host uses to reach a peer, pinning gloo to it, and the checks
that catch interface and address mistakes before any rank starts.

gloo otherwise binds the address its hostname resolves to, which need not be the network the
other hosts reach us on (namespace hosts share one hostname; cloud hosts often resolve to a
private address of another interface; Debian maps a machine's own name to 127.0.1.1).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
from collections.abc import Sequence


def local_interface(peer_host: str) -> tuple[str, str]:
    """(interface name, local IP) this host uses to reach `peer_host` (Linux; "" when unknown)."""
    try:
        family = socket.AF_INET6 if ":" in peer_host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.connect((peer_host, 9))
            local_ip = sock.getsockname()[0]
    except OSError:
        return "", ""

    try:
        out = subprocess.run(["ip", "-o", "addr", "show"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return "", local_ip
    for line in out.splitlines():
        fields = line.split()
        if len(fields) > 3 and fields[3].split("/")[0] == local_ip:
            return fields[1], local_ip
    return "", local_ip


def gloo_interface_for(peer_host: str) -> str:
    """Set GLOO_SOCKET_IFNAME (unless already set) to the interface that reaches `peer_host`."""
    if not os.environ.get("GLOO_SOCKET_IFNAME"):
        interface, _ = local_interface(peer_host)
        if interface:
            os.environ["GLOO_SOCKET_IFNAME"] = interface
    return os.environ.get("GLOO_SOCKET_IFNAME", "")


def interface_names() -> tuple[str, ...]:
    """Names of every network interface of this host (network namespace), up or down, sorted."""
    try:
        return tuple(sorted(name for _, name in socket.if_nameindex()))
    except OSError:
        return ()


def gloo_ifname_problem(value: str, interfaces: Sequence[str]) -> str | None:
    """Why `GLOO_SOCKET_IFNAME=value` cannot work on a host with `interfaces`; None when it can.

    gloo (torch's ProcessGroupGloo) splits the value at commas and opens a device on each named
    interface, by exact name: it has no `^` (exclude) or `=` (exact) prefixes, which are
    NCCL_SOCKET_IFNAME's syntax. An empty `interfaces` (not reported) skips the existence check.
    """
    names = value.split(",")
    if any(not name.strip() for name in names):
        return "has an empty interface name; list interfaces as eth0 or eth0,eth1"
    for name in names:
        if name in interfaces:
            continue
        if name[0] in "^=":
            return (
                f"uses {name[0]!r}, NCCL_SOCKET_IFNAME's syntax, which gloo does not take (gloo opens "
                "exactly the interfaces named); name the interfaces to use, e.g. GLOO_SOCKET_IFNAME=eth0"
            )
        if interfaces:
            return (
                f"names interface {name!r}, which this host does not have (it has "
                f"{', '.join(interfaces)}); name one of those or unset it"
            )
    return None


def nccl_ifname_problem(value: str, interfaces: Sequence[str]) -> str | None:
    """Why `NCCL_SOCKET_IFNAME=value` selects no interface on a host with `interfaces`; None if it does.

    NCCL's rules: a comma-separated list of name prefixes (`eth` matches `eth0`), `=` before the
    list for exact names, `^` before the list to use every interface except those. An empty
    `interfaces` (not reported) skips the check.
    """
    if not interfaces:
        return None
    text, exclude, exact = value, False, False
    if text.startswith("^"):
        text, exclude = text[1:], True
    if text.startswith("="):
        text, exact = text[1:], True
    patterns = [p for p in text.split(",") if p]

    def matches(name: str) -> bool:
        return any(name == p if exact else name.startswith(p) for p in patterns)

    chosen = [n for n in interfaces if matches(n) != exclude]
    if chosen:
        return None
    return (
        f"selects none of this host's interfaces ({', '.join(interfaces)}); name a prefix of one of "
        "them, e.g. NCCL_SOCKET_IFNAME=eth"
    )


def loopback_ip(host: str) -> str | None:
    """The loopback address `host` (an IP literal or a name, resolved here) stands for, or None.

    A name counts as loopback when any address it resolves to is loopback (127.0.0.0/8, ::1 or
    IPv4-mapped 127.x), as Debian's /etc/hosts does for the machine's own name (127.0.1.1). A
    name that does not resolve is None (the launcher reports unreachable hosts itself).
    """
    if is_loopback_ip(host):
        return host
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return None
    for *_, sockaddr in infos:
        if is_loopback_ip(str(sockaddr[0])):
            return str(sockaddr[0])
    return None


def _ip_literal(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address `text` spells (an IPv4-mapped IPv6 one as IPv4, a zone id dropped); None for a name."""
    try:
        ip = ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return None
    if ip.version == 6 and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def is_loopback_ip(text: str) -> bool:
    """True for an IP literal in 127.0.0.0/8, ::1 or ::ffff:127.x (names are never loopback here)."""
    ip = _ip_literal(text)
    return ip is not None and ip.is_loopback


def is_unspecified_ip(text: str) -> bool:
    """True for 0.0.0.0, :: or ::ffff:0.0.0.0: an address to bind, never one to reach a host at."""
    ip = _ip_literal(text)
    return ip is not None and ip.is_unspecified


def loopback_in_multi_host(hosts: Sequence[tuple[str, str]]) -> tuple[str, str, str] | None:
    """The first (label, host, loopback IP) that other hosts could not reach, or None.

    `hosts` are (label, worker host) pairs of one launch. A worker host that is (or resolves
    here to) a loopback address is advertised to every rank as the place to reach that host's
    agent and rendezvous; on another machine that address is the other machine itself. It is
    refused when the launch has two or more hosts and not all of them are loopback (all on
    loopback is one machine, as in tests).
    """
    if len(hosts) < 2:
        return None
    found = [(label, host, loopback_ip(host)) for label, host in hosts]
    if all(ip is not None for *_, ip in found):
        return None
    for label, host, ip in found:
        if ip is not None:
            return label, host, ip
    return None


def ssh_client_elsewhere(ssh_connection: str | None) -> tuple[str, str] | None:
    """(client IP, this host's IP) from `SSH_CONNECTION` when the SSH client is another machine.

    sshd sets `SSH_CONNECTION="CLIENT_IP CLIENT_PORT SERVER_IP SERVER_PORT"` in every session. The
    client is on this machine when its IP is loopback or equals the server's; None then, and
    when the variable is unset or malformed (not started over SSH).
    """
    parts = (ssh_connection or "").split()
    if len(parts) != 4:
        return None
    client, server = parts[0], parts[2]
    try:
        ipaddress.ip_address(client.split("%", 1)[0])
        ipaddress.ip_address(server.split("%", 1)[0])
    except ValueError:
        return None
    if is_loopback_ip(client) or client == server:
        return None
    return client, server

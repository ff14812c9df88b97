"""Which network interface this host uses to reach a peer, and pinning gloo to it.

gloo otherwise binds the address its hostname resolves to, which need not be the network the
other hosts reach us on (namespace hosts share one hostname; cloud hosts often resolve to a
private address of another interface).
"""

from __future__ import annotations

import os
import socket
import subprocess


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

"""Free TCP ports for servers art-mega starts later (vLLM replicas, etcd, torch rendezvous).

A port chosen by binding port 0 comes from the kernel's ephemeral range, the same range the
kernel draws from for every outgoing connection and every other port-0 listener (gloo's pair
sockets, HTTP clients). A vLLM replica binds its port ~30 s after it was chosen, and in that
window any of those sockets can take it (`OSError: [Errno 98] Address already in use`; seen in
CI). So `free_port` picks below the ephemeral range, where the kernel never hands out ports on
its own, and checks that the port binds right now.
"""

from __future__ import annotations

import random
import socket
import threading

EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
LOWEST_PORT = 10000
"""Lowest port `free_port` hands out; below it live well-known and commonly configured services."""

_issued: set[tuple[str, int]] = set()
_lock = threading.Lock()


def ephemeral_low() -> int:
    """First port of the kernel's ephemeral range (32768 on Linux by default; 32768 when unreadable)."""
    try:
        with open(EPHEMERAL_RANGE_FILE) as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _binds(family: int, socktype: int, proto: int, addr: tuple) -> bool:
    with socket.socket(family, socktype, proto) as sock:
        try:
            sock.bind(addr)
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1", attempts: int = 200) -> int:
    """A TCP port on `host` that binds now and lies below the kernel's ephemeral range.

    Ports already returned by this process are not returned again, so two servers planned in
    one process (etcd's client and peer port) never get the same one.

    Args:
        host: address or name the server will bind (resolved with `getaddrinfo`).
        attempts: random candidates tried before falling back to a kernel-chosen port.

    Returns:
        A port number in [LOWEST_PORT, start of the ephemeral range), or a kernel-chosen
        ephemeral port when no candidate bound (or the ephemeral range starts too low).

    Raises:
        OSError: `host` does not resolve or cannot be bound at all.
    """
    family, socktype, proto, _, addr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    high = ephemeral_low()
    with _lock:
        if high - LOWEST_PORT >= 1000:
            for _ in range(attempts):
                port = random.randrange(LOWEST_PORT, high)
                if (host, port) in _issued:
                    continue
                if _binds(family, socktype, proto, (addr[0], port, *addr[2:])):
                    _issued.add((host, port))
                    return port
        with socket.socket(family, socktype, proto) as sock:
            sock.bind(addr)
            port = sock.getsockname()[1]
        _issued.add((host, port))
        return port

"""Free TCP ports for servers art-mega starts later (vLLM replicas, etcd, torch rendezvous).

A port chosen by binding port 0 comes from the kernel's ephemeral range, the same range the
kernel draws from for every outgoing connection and every other port-0 listener (gloo's pair
sockets, HTTP clients). A vLLM replica binds its port ~30 s after it was chosen, and in that
window any of those sockets can take it (`OSError: [Errno 98] Address already in use`; seen in
CI). So `free_port` picks outside the ephemeral range (below it; also above it on hosts whose
range was widened downwards), where the kernel never hands out ports on its own, and checks that
the port binds right now.
"""

from __future__ import annotations

import random
import socket
import threading

EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
DEFAULT_EPHEMERAL_RANGE = (32768, 60999)
"""Linux's default `ip_local_port_range`, used when the file is unreadable or malformed."""
LOWEST_PORT = 10000
"""Lowest port `free_port` hands out; below it live well-known and commonly configured services."""
HIGHEST_PORT = 65535
MIN_WINDOW = 1000
"""Fewer ports than this outside the ephemeral range: fall back to a kernel-chosen port."""

_issued: set[int] = set()
_lock = threading.Lock()


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral range (first, last port, inclusive) from `EPHEMERAL_RANGE_FILE`;
    `DEFAULT_EPHEMERAL_RANGE` when the file is unreadable or does not hold two ports."""
    try:
        with open(EPHEMERAL_RANGE_FILE) as fh:
            first, last = (int(x) for x in fh.read().split()[:2])
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL_RANGE
    if not 0 < first <= last <= HIGHEST_PORT:
        return DEFAULT_EPHEMERAL_RANGE
    return first, last


def ephemeral_low() -> int:
    """First port of the kernel's ephemeral range (32768 on Linux by default; see `ephemeral_range`)."""
    return ephemeral_range()[0]


def candidate_windows() -> tuple[range, ...]:
    """The port windows `free_port` draws from: [LOWEST_PORT, first ephemeral port); when that
    holds fewer than `MIN_WINDOW` ports (a range widened downwards, e.g. "1024 60999"), also
    (last ephemeral port, HIGHEST_PORT]; () when even both hold fewer than `MIN_WINDOW`."""
    first, last = ephemeral_range()
    below = range(LOWEST_PORT, first)
    if len(below) >= MIN_WINDOW:
        return (below,)
    windows = tuple(w for w in (below, range(max(last + 1, LOWEST_PORT), HIGHEST_PORT + 1)) if w)
    return windows if sum(len(w) for w in windows) >= MIN_WINDOW else ()


def _candidate(windows: tuple[range, ...], sizes: list[int]) -> int:
    """One port drawn uniformly from the union of `windows` (`sizes`: their lengths)."""
    (window,) = random.choices(windows, weights=sizes)
    return window[random.randrange(len(window))]


def _binds(family: int, socktype: int, proto: int, addr: tuple) -> bool:
    with socket.socket(family, socktype, proto) as sock:
        try:
            sock.bind(addr)
        except OSError:
            return False
    return True


def _wildcard(family: int, port: int) -> tuple:
    """The family's any-address at `port`: a port that binds there is free on every address."""
    return ("::", port, 0, 0) if family == socket.AF_INET6 else ("0.0.0.0", port)


def free_port(host: str = "127.0.0.1", attempts: int = 200) -> int:
    """A TCP port on `host` that binds now and lies outside the kernel's ephemeral range.

    The port also binds on the any-address (0.0.0.0 or ::), so it suits servers that listen on
    every address whatever host they are given (torch's TCPStore master does): a port taken on
    another address of this machine (127.0.0.2, another interface) is skipped.

    Ports already returned by this process are not returned again, whatever host they were
    asked for (a server on 0.0.0.0 and one on 127.0.0.1 cannot share a port), so two servers
    planned in one process (etcd's client and peer port) never get the same one. Thread-safe.

    Args:
        host: address or name the server will bind (resolved with `getaddrinfo`; the first
            answer is checked).
        attempts: random candidates tried before falling back to a kernel-chosen port.

    Returns:
        A port number from `candidate_windows()`, or a kernel-chosen ephemeral port when no
        candidate bound (or the ephemeral range leaves fewer than `MIN_WINDOW` ports outside).

    Raises:
        OSError: `host` does not resolve (`socket.gaierror`) or cannot be bound at all.
    """
    family, socktype, proto, _, addr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    windows = candidate_windows()
    sizes = [len(w) for w in windows]
    with _lock:
        for _ in range(attempts if windows else 0):
            port = _candidate(windows, sizes)
            if port in _issued:
                continue
            at = (addr[0], port, *addr[2:])
            if _binds(family, socktype, proto, at) and _binds(
                family, socktype, proto, _wildcard(family, port)
            ):
                _issued.add(port)
                return port
        for _ in range(max(attempts, 1)):  # the kernel picks; one this process issued: ask again
            with socket.socket(family, socktype, proto) as sock:
                sock.bind(addr)
                port = sock.getsockname()[1]
            if port not in _issued:
                break
        _issued.add(port)
        return port

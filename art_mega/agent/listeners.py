"""Listening-socket facts: is HOST:PORT already taken, and which PIDs hold a listener (Linux).

Readiness is proved, not assumed: an agent is ready only when its own PID holds the socket.
"""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path


def has_listener(host: str, port: int, timeout_s: float = 0.5) -> bool:
    """True when a TCP connect to HOST:PORT succeeds (someone is listening there)."""
    if port == 0:
        return False
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def bind_listener(host: str, port: int, backlog: int = 512) -> socket.socket:
    """Bind and listen on HOST:PORT (port 0 = a fresh free port) without SO_REUSEPORT.

    Raises:
        OSError: EADDRINUSE when another socket listens there (never shared or adopted).
    """
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, socktype, proto, _, addr = infos[0]
    sock = socket.socket(family, socktype, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(addr)
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(False)
    return sock


def is_address_in_use(exc: OSError) -> bool:
    return exc.errno == errno.EADDRINUSE


def _listening_inodes(port: int) -> set[str]:
    inodes: set[str] = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10:
                continue
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                inodes.add(inode)
    return inodes


def listener_pids(port: int) -> set[int]:
    """PIDs (visible to us) holding a listening TCP socket on `port`, from /proc (Linux only)."""
    inodes = _listening_inodes(port)
    if not inodes:
        return set()
    wanted = {f"socket:[{i}]" for i in inodes}
    pids: set[int] = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            for fd in os.scandir(f"/proc/{entry.name}/fd"):
                try:
                    if os.readlink(fd.path) in wanted:
                        pids.add(int(entry.name))
                        break
                except OSError:
                    continue
        except OSError:
            continue
    return pids

"""`free_port` hands out ports outside the kernel's ephemeral range, never twice, never one in use."""

from __future__ import annotations

import socket

from art_mega.runtime import ports


def _binds(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_ports_lie_below_the_ephemeral_range_are_distinct_and_bind():
    low = ports.ephemeral_low()
    got = [ports.free_port() for _ in range(50)]
    assert len(set(got)) == len(got)
    assert all(ports.LOWEST_PORT <= port < low for port in got), (low, sorted(got)[:3], sorted(got)[-3:])
    assert all(_binds(port) for port in got)


def test_a_port_in_use_is_skipped(monkeypatch):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        monkeypatch.setattr(ports, "LOWEST_PORT", 1024)
        monkeypatch.setattr(ports, "ephemeral_low", lambda: 65535)
        others = [p for p in range(taken - 20, taken + 20) if p != taken]
        candidates = iter([taken, taken, *others])
        monkeypatch.setattr(ports.random, "randrange", lambda lo, hi: next(candidates))
        port = ports.free_port()
    assert port != taken
    assert port in others


def test_falls_back_to_a_kernel_port_when_the_range_below_is_too_small(tmp_path, monkeypatch):
    range_file = tmp_path / "ip_local_port_range"
    range_file.write_text("10500\t60999\n")
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE_FILE", str(range_file))
    assert ports.ephemeral_low() == 10500
    port = ports.free_port()
    # Not from [10000, 10500): the window is under 1000 ports, so the kernel chose it.
    assert not ports.LOWEST_PORT <= port < 10500
    assert _binds(port)


def test_unreadable_range_file_means_the_linux_default(tmp_path, monkeypatch):
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE_FILE", str(tmp_path / "missing"))
    assert ports.ephemeral_low() == 32768

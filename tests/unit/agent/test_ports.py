"""`free_port` hands out ports outside the kernel's ephemeral range, never twice, never one in use."""

from __future__ import annotations

import random
import socket
import threading

import pytest

from art_mega.agent import ports


def _binds(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


@pytest.fixture
def range_file(tmp_path, monkeypatch):
    """Write the ephemeral range `free_port` reads (as the kernel file would say it)."""
    path = tmp_path / "ip_local_port_range"
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE_FILE", str(path))
    return path


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
        others = [p for p in range(taken - 20, taken + 20) if p != taken]
        candidates = iter([taken, taken, *others])
        monkeypatch.setattr(ports, "_candidate", lambda windows, sizes: next(candidates))
        port = ports.free_port()
    assert port != taken
    assert port in others


def test_falls_back_to_a_kernel_port_when_no_window_is_large_enough(range_file):
    range_file.write_text("10500\t65199\n")
    assert ports.ephemeral_range() == (10500, 65199)
    assert ports.candidate_windows() == ()
    port = ports.free_port()
    # Not from [10000, 10500) nor (65199, 65535]: both under 1000 ports, so the kernel chose it.
    assert 10500 <= port <= 65199
    assert _binds(port)


def test_a_range_widened_downwards_uses_the_ports_above_it(range_file):
    range_file.write_text("1024\t60999\n")
    assert ports.candidate_windows() == (range(61000, 65536),)
    got = [ports.free_port() for _ in range(20)]
    assert all(61000 <= port <= 65535 for port in got), got
    assert len(set(got)) == len(got)


@pytest.mark.parametrize("text", ["", "garbage\n", "32768\n", "0 0\n", "61000 32768\n"])
def test_an_unreadable_or_odd_range_file_means_the_linux_default(range_file, text):
    range_file.write_text(text)
    assert ports.ephemeral_range() == ports.DEFAULT_EPHEMERAL_RANGE == (32768, 60999)
    assert ports.ephemeral_low() == 32768


def test_a_missing_range_file_means_the_linux_default(tmp_path, monkeypatch):
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE_FILE", str(tmp_path / "missing"))
    assert ports.ephemeral_low() == 32768


def test_a_port_is_never_handed_out_twice_for_two_spellings_of_one_address():
    # Same random stream for each host spelling: before the fix, all three got the same port,
    # though a server on 0.0.0.0 and one on 127.0.0.1 cannot both bind it.
    got = []
    for host in ("0.0.0.0", "127.0.0.1", "localhost"):
        random.seed(7)
        got.append(ports.free_port(host))
    assert len(set(got)) == 3, got


def test_ipv6_loopback_and_unresolvable_hosts():
    if not socket.has_ipv6 or not _binds_v6():
        pytest.skip("no IPv6 loopback here")
    port = ports.free_port("::1")
    assert ports.LOWEST_PORT <= port < ports.ephemeral_low()
    with pytest.raises(socket.gaierror):
        ports.free_port("no-such-host.invalid")


def _binds_v6() -> bool:
    with socket.socket(socket.AF_INET6) as sock:
        try:
            sock.bind(("::1", 0))
        except OSError:
            return False
    return True


def test_concurrent_callers_never_share_a_port():
    got: list[int] = []

    def take() -> None:
        got.extend(ports.free_port() for _ in range(40))

    threads = [threading.Thread(target=take) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(got) == 320 and len(set(got)) == 320


def _taken_only_on_127_0_0_2() -> socket.socket:
    """A listening socket on 127.0.0.2 whose port binds on 127.0.0.1: the kernel's pick for
    127.0.0.2 may be a port another socket of this machine holds on 127.0.0.1 (CI saw one)."""
    for _ in range(50):
        busy = socket.socket()
        busy.bind(("127.0.0.2", 0))
        if _binds(busy.getsockname()[1], "127.0.0.1"):
            busy.listen()
            return busy
        busy.close()
    raise AssertionError("no port of 127.0.0.2 in 50 was free on 127.0.0.1")


def test_a_port_taken_on_another_address_is_skipped(monkeypatch):
    # torch's TCPStore master listens on every address whatever host it is given, so a port
    # that binds on 127.0.0.1 but is taken on 127.0.0.2 fails it (EADDRINUSE)
    busy = _taken_only_on_127_0_0_2()
    with busy:
        taken = busy.getsockname()[1]
        others = [p for p in range(taken - 20, taken + 20) if p != taken]
        candidates = iter([taken, *others])
        monkeypatch.setattr(ports, "_candidate", lambda windows, sizes: next(candidates))
        port = ports.free_port("127.0.0.1")
    assert port in others

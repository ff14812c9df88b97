"""Lost agents are named within seconds; nothing outlives close(), a signal, or a SIGKILLed controller."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from art_mega import ArtRuntime
from art_mega.agent.listeners import listener_pids
from tests.conftest import REPO, cli_env, wait_gone
from tests.helpers import loopback_topology
from tests.integration import rollouts_for_tests as r

PROGRAMS = "tests/integration/programs"


def _start(program: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "art_mega", "local", "--program", f"{PROGRAMS}/{program}"],
        cwd=REPO,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _read_pids(process: subprocess.Popen[str]) -> dict:
    for line in process.stdout:
        if line.startswith("PIDS "):
            return json.loads(line[5:])
    raise AssertionError(f"no PIDS line; stderr: {process.stderr.read()}")


async def test_close_leaves_no_process_and_no_listener():
    runtime = await ArtRuntime.start_local(loopback_topology(2, cpu_slots=2))
    executor = await runtime.rollout_executor(r.sleep)
    health = await runtime.health()
    agent_pids = [h.pid for h in health.values()]
    ports = [int(h.address.rsplit(":", 1)[1]) for h in health.values()]
    worker_pids = [w.pid for w in executor.workers]
    assert len(worker_pids) == 4
    await runtime.close()
    await runtime.close()  # idempotent
    assert wait_gone(agent_pids + worker_pids, 10) == []
    assert all(not listener_pids(p) for p in ports)
    with pytest.raises(RuntimeError, match="closed"):
        await runtime.health()


async def test_lost_agent_is_detected_and_named():
    runtime = await ArtRuntime.start_local(loopback_topology(2))
    try:
        health = await runtime.health()
        victim = health["host1"].pid
        started = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        while runtime.lost is None and time.monotonic() - started < 10:
            await asyncio.sleep(0.05)
        assert runtime.lost is not None
        assert time.monotonic() - started < 5
        assert "host host1" in str(runtime.lost)
        with pytest.raises(Exception, match="host host1"):
            await runtime.health()
    finally:
        await runtime.close()


def test_lost_agent_cancels_the_program_and_names_the_host():
    process = _start("prog_kill_agent.py:main")
    line = process.stdout.readline()
    assert line.startswith("KILLING_AGENT"), process.stderr.read()
    killed_at = time.monotonic()
    out, err = process.communicate(timeout=30)
    assert time.monotonic() - killed_at < 5, err
    assert process.returncode == 1, err
    assert "host host0" in err and "was lost" in err
    assert "NOT_CANCELLED" not in out


def test_sigkill_of_the_controller_leaves_nothing():
    process = _start("prog_hold_workers.py:main")
    pids = _read_pids(process)
    assert len(pids["workers"]) == 2
    process.kill()
    process.wait(10)
    assert wait_gone(pids["agents"] + pids["workers"], 15) == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_signals_clean_up_every_host_and_exit_128_plus_signal(sig):
    process = _start("prog_hold_workers.py:main")
    pids = _read_pids(process)
    process.send_signal(sig)
    _, err = process.communicate(timeout=30)
    assert process.returncode == 128 + sig, err
    assert wait_gone(pids["agents"] + pids["workers"], 15) == []


async def _first_loss(
    clients: list, expected: dict, silent_after_s: float, act
) -> tuple[float, object] | None:
    """Seconds from `act()` to the first host a fresh monitor (0.2 s beats, 1 s refusal bound,
    `silent_after_s` silence bound) declares lost, and its error; None after 15 s."""
    from art_mega.runtime.monitor import AgentMonitor

    lost: list[tuple[float, object]] = []
    monitor = AgentMonitor(
        clients,
        expected,
        lambda exc: lost.append((time.monotonic(), exc)),
        interval_s=0.2,
        lost_after_s=1.0,
        silent_after_s=silent_after_s,
    )
    monitor.start()
    act()
    started = time.monotonic()
    while not lost and time.monotonic() - started < 15:
        await asyncio.sleep(0.05)
    await monitor.stop()
    return (lost[0][0] - started, lost[0][1]) if lost else None


async def test_a_silent_agent_gets_the_longer_bound_and_a_refusing_one_the_short():
    """SIGSTOP freezes host1's agent (alive, no answers: what an overloaded host looks like):
    the monitor waits `silent_after_s`, not `lost_after_s`; SIGKILL (port refused) takes the short bound."""
    runtime = await ArtRuntime.start_local(loopback_topology(2))
    stopped: list[int] = []
    try:
        health = await runtime.health()
        expected = {host: (h.launch_id, h.pid) for host, h in health.items()}
        clients = list(runtime.clients.values())
        frozen = health["host1"].pid

        def freeze() -> None:
            os.kill(frozen, signal.SIGSTOP)
            stopped.append(frozen)

        silent = await _first_loss(clients, expected, 4.0, freeze)
        assert silent is not None, "a silent agent was never declared lost"
        assert 3.5 <= silent[0] < 10, silent[0]
        assert "host host1" in str(silent[1]) and "for 4 s" in str(silent[1])

        killed = await _first_loss(
            clients[:1], expected, 30.0, lambda: os.kill(health["host0"].pid, signal.SIGKILL)
        )
        assert killed is not None and killed[0] < 10  # well under the 30 s silence bound
        assert "host host0" in str(killed[1]) and "for 1 s" in str(killed[1])
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        await runtime.close()

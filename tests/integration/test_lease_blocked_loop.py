"""The controller lease is held by the heartbeat thread, not the program's event loop: a program
that blocks its loop for several leases (a synchronous dataset or tokenizer load) loses no agent
and no child; a paused machine (every process stopped, then continued) neither expires a lease
nor names a host lost; a stalled heartbeat thread is not its agents' silence. Short leases.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time

from art_mega.runtime.monitor import AgentMonitor
from tests.conftest import REPO, cli_env, wait_gone
from tests.integration.test_agent_lease import _start_agent

BLOCK = "tests/integration/programs/prog_block_loop.py:main"
LEASE_S = 2.0


def _lines(process: subprocess.Popen[str], prefix: str) -> dict:
    for line in process.stdout:
        if line.startswith(prefix):
            return json.loads(line[len(prefix) :])
    raise AssertionError(f"no {prefix.strip()} line; stderr: {process.stderr.read()}")


def _local(block_s: float) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "art_mega", "local", "--program", BLOCK]
    return subprocess.Popen(
        [*argv, "--controller-lease", str(LEASE_S)],
        cwd=REPO,
        env=dict(cli_env(), ART_TEST_BLOCK_S=str(block_s)),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(process: subprocess.Popen[str], before: dict) -> None:
    """The program's AFTER line shows the same agent, workers and children, each rollout done."""
    after = _lines(process, "AFTER ")
    _, err = process.communicate(timeout=60)
    assert process.returncode == 0, err
    assert "lost" not in err and "not heard" not in err, err
    for key in ("agents", "workers", "children"):
        assert after[key] == before[key], (key, before, after)
    assert after["echoed"] == list(range(len(before["workers"])))
    assert after["ran_on"] == before["workers"]
    assert wait_gone(before["agents"] + before["children"], 10) == []


def test_a_program_that_blocks_its_loop_for_three_leases_keeps_every_agent_and_child():
    """time.sleep(3 leases) on the program's loop, with a rollout in flight on every worker."""
    process = _local(block_s=3 * LEASE_S)
    try:
        before = _lines(process, "PIDS ")
        assert len(before["workers"]) == 2 and set(before["workers"]) <= set(before["children"])
        process.stdin.write("go\n")
        process.stdin.flush()
        _finish(process, before)
    finally:
        if process.poll() is None:
            process.kill()


def test_a_paused_machine_expires_no_lease_and_names_no_host():
    """Controller, agent and workers all SIGSTOPped for 3 leases, then continued (a suspended
    or migrated VM): each side excuses its own stall, so the run goes on."""
    process = _local(block_s=0)
    paused: list[int] = []
    try:
        before = _lines(process, "PIDS ")
        paused = [before["controller"], *before["agents"], *before["children"]]
        for pid in paused:
            os.kill(pid, signal.SIGSTOP)
        time.sleep(3 * LEASE_S)
        for pid in paused:
            os.kill(pid, signal.SIGCONT)
        process.stdin.write("go\n")
        process.stdin.flush()
        _finish(process, before)
    finally:
        for pid in paused:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGCONT)
        if process.poll() is None:
            process.kill()


async def test_a_stalled_heartbeat_thread_is_not_its_agents_silence():
    """The heartbeat thread's own loop blocked for 2 s (longer than the 1 s silence and refusal
    bounds; the agent's 5 s lease holds): no host is unresponsive or lost once it runs again.
    A frozen agent is still named after that."""
    agent, client, _ = _start_agent("--controller-lease", "5")
    lost: list = []
    monitor = None
    try:
        health = await client.health()
        monitor = AgentMonitor(
            [client],
            {"host0": (health.launch_id, health.pid)},
            lost.append,
            interval_s=0.2,
            lost_after_s=1.0,
            silent_after_s=1.0,
        )
        monitor.start()
        await asyncio.sleep(0.5)
        assert monitor.silent_s(client.address) < 1.0
        monitor._thread.loop.call_soon_threadsafe(time.sleep, 2.0)
        await asyncio.sleep(2.1)
        assert monitor.unresponsive(1.0) == [] and monitor.silent_s(client.address) < 1.0
        await asyncio.sleep(1.0)
        assert lost == [] and agent.poll() is None

        agent.send_signal(signal.SIGSTOP)
        frozen_at = time.monotonic()
        while not lost and time.monotonic() - frozen_at < 10:
            await asyncio.sleep(0.05)
        assert [e.host for e in lost] == ["host0"] and "stopped answering" in str(lost[0])
    finally:
        if monitor is not None:
            await monitor.stop()
        await client.aclose()
        agent.send_signal(signal.SIGCONT)
        agent.kill()
        agent.wait(10)


async def test_a_closed_client_ends_its_heartbeats_and_stop_ends_the_thread():
    """The heartbeats use their own client: closing the caller's ends them quietly (the agent's
    lease then runs out), and `stop` ends the heartbeat thread."""
    import threading

    agent, client, _ = _start_agent("--controller-lease", "1")
    try:
        health = await client.health()
        before = set(threading.enumerate())  # other tests' monitors may still be stopping
        monitor = AgentMonitor([client], {"host0": (health.launch_id, health.pid)}, lambda exc: None)
        monitor.start()
        (thread,) = [t for t in threading.enumerate() if t.name == "art-mega-heartbeats" and t not in before]
        await asyncio.sleep(1.5)
        assert agent.poll() is None
        await client.aclose()
        code = await asyncio.to_thread(agent.wait, 10)
        assert code == 1 and monitor.lost is None
        await monitor.stop()
        assert not thread.is_alive()
    finally:
        if agent.poll() is None:
            agent.kill()


def test_a_signal_the_blocked_loop_cannot_handle_lets_every_lease_run_out():
    """SIGTERM while the program blocks its loop for good: the program cannot clean up, so the
    heartbeats stop after `UNHANDLED_SIGNAL_S` and every agent stops its children and exits
    within that plus the lease (the loop still runs the cleanup once it is free)."""
    from art_mega.runtime.monitor import UNHANDLED_SIGNAL_S

    process = _local(block_s=300)
    try:
        before = _lines(process, "PIDS ")
        process.stdin.write("go\n")
        process.stdin.flush()
        time.sleep(1.0)  # the program is in its time.sleep
        process.send_signal(signal.SIGTERM)
        left = wait_gone(before["agents"] + before["children"], UNHANDLED_SIGNAL_S + LEASE_S + 5)
        assert left == [], left
        assert process.poll() is None  # the controller itself still sleeps in the program
    finally:
        process.kill()
    err = process.communicate(timeout=30)[1]
    assert "has not handled a stop signal for 5 s" in err, err
    assert "its controller was not heard from for 2 s" in err, err

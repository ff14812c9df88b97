"""An agent's lease on its controller, on one real agent process on loopback (1 s leases).

The namespace-host cases (a cut-off controller, a stopped host) are in test_controller_lease.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import pytest

from art_mega.agent.client import AgentClient
from art_mega.agent.listeners import listener_pids
from art_mega.rollouts.installed import InstalledAsyncCallable
from art_mega.rollouts.remote import start_rollout_workers
from art_mega.runtime.monitor import AgentMonitor
from tests.conftest import REPO, cli_env, run_cli, wait_gone
from tests.integration import rollouts_for_tests as r

SECRET = "k" * 64
LEASE_S = 1.0


def _start_agent(*extra: str) -> tuple[subprocess.Popen[str], AgentClient, int]:
    env = dict(cli_env(), ART_MEGA_SECRET=SECRET)
    argv = [sys.executable, "-m", "art_mega", "worker", "--address", "tcp://127.0.0.1:0", *extra]
    process = subprocess.Popen(
        argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    line = process.stdout.readline()
    assert line.startswith("ART_MEGA_READY "), process.stderr.read()
    ready = json.loads(line.split(" ", 1)[1])
    url = f"http://127.0.0.1:{ready['port']}"
    return process, AgentClient("host0", ready["address"], url, SECRET.encode()), ready["port"]


async def test_the_lease_is_held_by_heartbeats_released_at_the_end_and_expires_without_them():
    process, client, port = _start_agent("--controller-lease", str(LEASE_S))
    try:
        await asyncio.sleep(1.5 * LEASE_S)  # no controller has claimed it yet: it waits
        health = await client.health()
        assert health.controller_lease_s == LEASE_S and process.poll() is None

        monitor = AgentMonitor([client], {"host0": (health.launch_id, health.pid)}, lambda exc: None)
        monitor.start()
        ref = InstalledAsyncCallable.from_callable(r.sleep).ref()
        workers = await start_rollout_workers(client, 2, (str(REPO),), (ref,))
        await asyncio.sleep(2.5 * LEASE_S)  # beats every lease/4 hold it well past one lease
        assert process.poll() is None and monitor.lost is None

        await monitor.release()  # the controller ended normally: the agent waits for the next
        await asyncio.sleep(1.5 * LEASE_S)
        assert process.poll() is None
        assert len((await client.health()).children) == 2

        await client.lease()  # a new controller claims it, then falls silent
        silent_from = time.monotonic()
        code = await asyncio.to_thread(process.wait, 10 * LEASE_S)
        assert time.monotonic() - silent_from >= LEASE_S
    finally:
        await client.aclose()
        if process.poll() is None:
            process.kill()
    assert code == 1
    err = process.stderr.read()
    assert "its controller was not heard from for 1 s (--controller-lease)" in err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert wait_gone(list(workers.pids), 5) == []
    assert not listener_pids(port)


@pytest.mark.parametrize(
    ("args", "env", "fragment"),
    [
        (
            ["worker", "--address", "tcp://127.0.0.1:0", "--controller-lease", "0"],
            {},
            "--controller-lease '0'",
        ),
        (
            ["worker", "--address", "tcp://127.0.0.1:0"],
            {"ART_MEGA_CONTROLLER_LEASE": "nan"},
            "ART_MEGA_CONTROLLER_LEASE 'nan'",
        ),
        (
            ["local", "--program", "examples/multinode/program.py:main", "--controller-lease", "inf"],
            {},
            "--controller-lease 'inf'",
        ),
        (
            [
                "ssh",
                "--program",
                "examples/multinode/program.py:main",
                "--host",
                "h0",
                "--controller-lease",
                "-1",
            ],
            {},
            "--controller-lease '-1'",
        ),
    ],
)
def test_a_lease_that_is_not_a_finite_positive_number_is_refused_in_one_sentence(args, env, fragment):
    result = run_cli(*args, env=dict(cli_env(), ART_MEGA_SECRET=SECRET, **env), timeout=60)
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert fragment in lines[0] and "finite positive number of seconds" in lines[0], lines[0]
    assert os.environ.get("ART_MEGA_CONTROLLER_LEASE") is None

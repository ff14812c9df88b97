"""An agent whose warm preflight probe died before its config came runs the rank cold."""

from __future__ import annotations

import os
import signal
import sys

from art_mega.agent.supervisor import Supervisor
from art_mega.preflight.protocol import PreflightPrepareRequest, PreflightRunRequest
from art_mega.preflight.routes import PreflightProbes
from tests.unit.preflight.test_preflight_probe import solo_config


async def test_a_warm_probe_killed_before_its_config_is_replaced_by_a_cold_one():
    supervisor = Supervisor("adv")
    probes = PreflightProbes(supervisor)
    assert await probes.prepare(PreflightPrepareRequest()) is not None
    (probe,) = [c for c in supervisor.statuses() if c.role == "preflight"]
    os.kill(probe.pid, signal.SIGKILL)  # no await before run_preflight: the agent has not noticed
    config = solo_config()
    reply = await probes.run(PreflightRunRequest(config=config, python=sys.executable, timeout_s=30))
    assert reply.result is not None and reply.result["ok"] is True, reply
    assert [(m["host"], m["warm"]) for m in reply.result["members"]] == [("solo", False)]
    assert [c for c in supervisor.statuses() if c.returncode is None] == []

"""An agent whose warm preflight probe died before its config came runs the rank cold."""

from __future__ import annotations

import os
import signal
import sys

from art_mega.agent.app import AgentState
from art_mega.preflight.protocol import PreflightPrepareRequest, PreflightRunRequest
from tests.unit.test_preflight_probe import solo_config


async def test_a_warm_probe_killed_before_its_config_is_replaced_by_a_cold_one():
    state = AgentState("adv", b"s" * 32, "127.0.0.1:1")
    assert await state.prepare_preflight(PreflightPrepareRequest()) is not None
    (probe,) = [c for c in state.supervisor.statuses() if c.role == "preflight"]
    os.kill(probe.pid, signal.SIGKILL)  # no await before run_preflight: the agent has not noticed
    config = solo_config()
    reply = await state.run_preflight(PreflightRunRequest(config=config, python=sys.executable, timeout_s=30))
    assert reply.result is not None and reply.result["ok"] is True, reply
    assert [(m["host"], m["warm"]) for m in reply.result["members"]] == [("solo", False)]
    assert [c for c in state.supervisor.statuses() if c.returncode is None] == []

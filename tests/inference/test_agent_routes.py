"""The agent's inference routes with a stand-in interpreter (no vLLM needed): a failed start, a
stop that lands during a start, unsigned requests."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from art_mega.agent.ports import free_port
from art_mega.errors import ReplicaStartError
from art_mega.inference import ReplicaLaunch, start_replicas, stop_replicas
from tests.inference.common import replica_spec
from tests.inference.conftest import Agent

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_failed_start_names_host_and_log_and_leaves_no_child(agent: Agent, tmp_path: Path) -> None:
    python = tmp_path / "python"
    python.write_text('#!/bin/sh\necho "Traceback: ModuleNotFoundError: vllm" >&2\nexit 1\n')
    python.chmod(0o755)
    spec = replica_spec(free_port(), name="broken")
    launch = ReplicaLaunch(model="/m", served_model_name="tiny", python=str(python), log_dir=str(tmp_path))
    with pytest.raises(ReplicaStartError) as info:
        await start_replicas(agent.clients, [spec], launch)
    message = str(info.value)
    assert message.startswith("host host0: replica broken-0") and "exited with code 1" in message
    assert "ModuleNotFoundError: vllm" in message and str(tmp_path / "broken-0.log") in message
    health = await agent.client.health()
    assert "broken-0" not in {c.child_id for c in health.children}
    await stop_replicas(agent.clients, [spec])  # stopping what is not running is a no-op


async def test_unsigned_requests_are_refused(agent: Agent) -> None:
    body = {"replica": replica_spec(free_port()).model_dump(mode="json"), "launch": {}}
    async with httpx.AsyncClient(base_url=agent.process.endpoint.url) as client:
        for path, payload in (("/v1/inference/start", body), ("/v1/inference/stop", {"names": []})):
            reply = await client.post(path, json=payload)
            assert reply.status_code == 401, (path, reply.text)


async def test_a_stop_during_a_start_stops_that_replica(agent: Agent, tmp_path: Path) -> None:
    """A stop sent right behind a start (a register cancelled while it starts) stops that
    replica, and the start answers that it failed. The stop waits for a spawn in progress (the
    start's lock); a stop landing inside that millisecond window is not forced here."""
    import asyncio

    from art_mega.inference.protocol import (
        INFERENCE_START,
        INFERENCE_STOP,
        InferenceStartRequest,
        InferenceStopRequest,
    )

    python = tmp_path / "python"
    python.write_text("#!/bin/sh\nexec sleep 60\n")  # never healthy: the start waits until stopped
    python.chmod(0o755)
    launch = ReplicaLaunch(
        model="/m", served_model_name="tiny", python=str(python), log_dir=str(tmp_path), ready_timeout_s=30
    )
    for attempt in range(3):
        spec = replica_spec(free_port(), name=f"raced{attempt}")
        body = InferenceStartRequest(replica=spec, launch=launch)
        start = asyncio.ensure_future(agent.client.call(INFERENCE_START, body, timeout_s=60))
        await asyncio.sleep(0.001 * attempt)  # the stop lands during the spawn, or just after it
        stopped = await agent.client.call(INFERENCE_STOP, InferenceStopRequest(names=[spec.process_name]))
        started = await asyncio.wait_for(start, 30)
        assert not started.ok, started  # stopped before it was ever healthy
        assert [c.child_id for c in stopped.stopped] == [spec.process_name], (attempt, stopped, started)
        health = await agent.client.health()
        (child,) = [c for c in health.children if c.child_id == spec.process_name] or [None]
        assert child is None or child.returncode is not None, (attempt, child)

"""Start an agent process on this machine and prove it is ready.

Ready means: it printed the ready line with our launch id, its own PID holds the listening
socket (checked in /proc), and a signed health call answers with the same launch id and PID.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from dataclasses import dataclass

from art_mega.agent.auth import SECRET_ENV
from art_mega.agent.client import AgentClient
from art_mega.agent.listeners import has_listener, listener_pids
from art_mega.agent.protocol import READY_PREFIX
from art_mega.agent.supervisor import spawn_child, stop_process
from art_mega.errors import EXIT_CODES, AgentError, AgentStartError, UserError
from art_mega.topology import EndpointSpec


@dataclass
class LocalAgent:
    """A started, proven agent process on this machine."""

    host_id: str
    endpoint: EndpointSpec
    process: asyncio.subprocess.Process
    launch_id: str
    _drain: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    async def stop(self, grace_s: float = 5.0) -> int:
        """SIGTERM the agent (it stops its children first), SIGKILL after `grace_s` seconds."""
        code = await stop_process(self.process, grace_s)
        if self._drain is not None:
            self._drain.cancel()
        return code


async def _drain(stream: asyncio.StreamReader) -> None:
    while await stream.readline():
        pass


def refuse_existing_listener(endpoint: EndpointSpec, field: str = "worker address") -> None:
    """Raise `UserError` when HOST:PORT already has a listener: it is never reused or adopted."""
    if has_listener(endpoint.host, endpoint.port):
        raise UserError(
            f"{field} {endpoint.address} already has a listener: refusing to reuse a "
            "pre-existing listener; stop it or pick another port"
        )


async def start_local_agent(
    host_id: str,
    endpoint: EndpointSpec,
    launch_id: str,
    secret: bytes,
    startup_timeout_s: float,
    controller_lease_s: float | None = None,
) -> LocalAgent:
    """Start `python -m art_mega worker` on `endpoint` (port 0 = a free port) and prove readiness.

    The secret reaches the agent through its environment, never its command line.
    `controller_lease_s` is the agent's `--controller-lease` (None: its environment's or the
    default); the caller's heartbeats hold it (`AgentClient.lease`).

    Raises:
        UserError: the address already has a listener.
        AgentStartError: the agent exited, timed out after `startup_timeout_s` seconds, or could
            not prove it holds the listener.
    """
    refuse_existing_listener(endpoint)
    env = dict(os.environ)
    env[SECRET_ENV] = secret.decode()
    env["PYTHONUNBUFFERED"] = "1"
    argv = [
        sys.executable,
        "-m",
        "art_mega",
        "worker",
        "--address",
        endpoint.address,
        "--launch-id",
        launch_id,
    ]
    if controller_lease_s is not None:
        argv += ["--controller-lease", repr(controller_lease_s)]
    process = await spawn_child(argv, env=env, stdout=asyncio.subprocess.PIPE, death_signal=signal.SIGTERM)
    assert process.stdout is not None
    try:
        ready = await asyncio.wait_for(_read_ready(process.stdout), startup_timeout_s)
    except TimeoutError:
        await stop_process(process, 2.0)
        raise AgentStartError(
            host_id, endpoint.address, f"agent not ready after {startup_timeout_s:g} s"
        ) from None
    except BaseException:
        await stop_process(process, 2.0)
        raise
    if ready is None:
        code = await process.wait()
        if code == EXIT_CODES[UserError].code:  # the agent's own one-sentence refusal
            raise UserError(
                f"host {host_id}: the agent refused to start on {endpoint.address} (see its message above)"
            )
        raise AgentStartError(host_id, endpoint.address, f"agent exited with code {code} before it was ready")
    agent = LocalAgent(host_id, EndpointSpec(host=endpoint.host, port=int(ready["port"])), process, launch_id)
    agent._drain = asyncio.create_task(_drain(process.stdout))
    try:
        await prove_ready(agent, ready, secret)
    except BaseException:
        await agent.stop(2.0)
        raise
    return agent


async def _read_ready(stream: asyncio.StreamReader) -> dict | None:
    while True:
        line = await stream.readline()
        if not line:
            return None
        text = line.decode(errors="replace").strip()
        if text.startswith(READY_PREFIX):
            return json.loads(text[len(READY_PREFIX) :])


async def prove_ready(agent: LocalAgent, ready: dict, secret: bytes) -> None:
    """Check the ready line and a signed health call against the process we started."""
    host, address = agent.host_id, agent.endpoint.address
    if ready.get("launch_id") != agent.launch_id or int(ready.get("pid", -1)) != agent.pid:
        raise AgentStartError(host, address, f"the ready line came from another launch or process: {ready}")
    holders = listener_pids(agent.endpoint.port)
    if sys.platform.startswith("linux") and agent.pid not in holders:
        raise AgentStartError(
            host, address, f"the listener is held by pids {sorted(holders)}, not by agent pid {agent.pid}"
        )
    client = AgentClient(agent.host_id, agent.endpoint.address, agent.endpoint.url, secret, timeout_s=10.0)
    try:
        health = await client.health()
    except AgentError as exc:
        raise AgentStartError(exc.host, exc.address, exc.reason) from exc
    finally:
        await client.aclose()
    if health.launch_id != agent.launch_id or health.pid != agent.pid:
        raise AgentStartError(
            host,
            address,
            f"health answered with launch id {health.launch_id} pid {health.pid}, "
            f"expected {agent.launch_id} pid {agent.pid}",
        )

"""Choose the open ports of a topology (`topology.open_ports`) on the hosts that bind them.

Each open listener's port is asked of its own host's agent (`agent.protocol.FREE_PORT`: a port
that binds there now, outside the kernel's ephemeral range), so two runs on one machine, each
with its own agents, get different ports instead of meeting on a fixed default.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

from art_mega.agent.client import AgentClient
from art_mega.agent.protocol import FREE_PORT, FreePortRequest
from art_mega.errors import PreflightError
from art_mega.topology import CompiledTopology
from art_mega.topology.open_ports import OpenPort, open_ports, ports_in_use, with_ports

ASKS_PER_PORT = 20
"""Answers asked for one listener before giving up: an agent never repeats a port it handed out,
but two agents on one machine (hosts sharing an address) or a set port may match its answer."""


async def choose_ports(
    topology: CompiledTopology, ask: Callable[[OpenPort], Awaitable[int]]
) -> CompiledTopology:
    """`topology` with a port for each open listener, `await ask(listener)` answering one that is
    free on `listener.host_id` at `listener.bind_host`; `topology` itself when none is open.

    An answer another listener of the same machine already takes (a set port), or one chosen for
    an earlier listener on any machine, is asked again, up to `ASKS_PER_PORT` times.

    Raises:
        PreflightError: every answer for one listener was taken (names the host and the field).
        Whatever `ask` raises (`AgentError` when the agent does not answer).
    """
    wanted = open_ports(topology)
    if not wanted:
        return topology
    taken = ports_in_use(topology)
    chosen: dict[str, int] = {}
    for listener in wanted:
        used = taken.setdefault(listener.machine, set())
        for _ in range(ASKS_PER_PORT):
            port = await ask(listener)
            # nor one chosen for any other listener: two addresses (127.0.0.1 and 127.0.0.2,
            # or two interfaces) may be one kernel, where a wildcard bind takes every address
            if port not in used and port not in chosen.values():
                break
        else:
            raise PreflightError(
                f"host {listener.host_id}'s agent answered {ASKS_PER_PORT} free ports for "
                f"{listener.field} ({listener.process}) that other listeners at {listener.machine} "
                "already take; set that port yourself",
                (listener.host_id,),
            )
        used.add(port)
        chosen[listener.process] = port
    return with_ports(topology, chosen)


async def choose_ports_on_agents(
    topology: CompiledTopology, clients: Mapping[str, AgentClient]
) -> CompiledTopology:
    """`choose_ports` asking each listener's host agent (`clients`, by host id) for a free port at
    the address the listener binds. Raises `AgentError` when an agent does not answer."""

    async def ask(listener: OpenPort) -> int:
        reply = await clients[listener.host_id].call(FREE_PORT, FreePortRequest(host=listener.bind_host))
        return reply.port

    return await choose_ports(topology, ask)

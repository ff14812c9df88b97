"""`art-mega skypilot`: the same command on every node of a SkyPilot task.

Every rank starts its own agent on `node_ips[rank]:PORT`. Rank 0 also listens on PORT+1, waits
(bounded) for every peer to report its agent, runs the program over all agents, then tells each
peer the outcome; peers exit 0 on success and non-zero on failure or when rank 0 goes away. The
lifecycle connection is authenticated with the launch secret in both directions. The SKYPILOT_*
variables are read once, validated, and removed: the program sees only `ArtLaunchContext`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import ipaddress
import json
import secrets
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from art_mega.agent.auth import SECRET_ENV, load_secret
from art_mega.agent.client import AgentClient
from art_mega.agent.listeners import bind_listener, is_address_in_use
from art_mega.errors import AgentError, LoopbackAddressError, UserError
from art_mega.launch.context import ArtLaunchContext
from art_mega.launch.controller import SignalGuard, report, supervise
from art_mega.launch.program import ProgramRef
from art_mega.preflight.netif import loopback_in_multi_host
from art_mega.runtime.local_agent import LocalAgent, start_local_agent
from art_mega.topology import EndpointSpec

SKYPILOT_VARS = ("SKYPILOT_NODE_RANK", "SKYPILOT_NODE_IPS", "SKYPILOT_NUM_NODES")
MAX_MESSAGE_BYTES = 64 * 1024


@dataclass(frozen=True)
class SkyPilotNode:
    """This node's place in the SkyPilot task."""

    rank: int
    node_ips: tuple[str, ...]

    @property
    def num_nodes(self) -> int:
        return len(self.node_ips)


def read_skypilot_env(env: Mapping[str, str]) -> SkyPilotNode:
    """Validate SKYPILOT_NODE_RANK, SKYPILOT_NODE_IPS (newline- or comma-separated), SKYPILOT_NUM_NODES.

    Raises:
        UserError: a missing variable, a rank or count not written in ASCII digits (`int()` and
            `str.isdigit` also take '٣' and '²'), a rank out of range, a count that differs from
            the number of IPs, or a duplicate or invalid IP.
        LoopbackAddressError: a loopback IP among two or more nodes that are not all loopback
            (the other nodes would reach themselves at it).
    """
    for name in SKYPILOT_VARS:
        if not env.get(name, "").strip():
            raise UserError(f"{name} is not set; run art-mega skypilot inside a SkyPilot task's run: section")
    rank_text = env["SKYPILOT_NODE_RANK"].strip()
    count_text = env["SKYPILOT_NUM_NODES"].strip()
    if not _ascii_decimal(rank_text):
        raise UserError(
            f"SKYPILOT_NODE_RANK={rank_text!r} is not a non-negative integer in ASCII digits; SkyPilot sets "
            "it to 0, 1, ...: run inside the task's run: section and do not override it"
        )
    if not _ascii_decimal(count_text) or int(count_text) < 1:
        raise UserError(
            f"SKYPILOT_NUM_NODES={count_text!r} is not a positive integer in ASCII digits; SkyPilot sets it "
            "to the task's num_nodes: do not override it"
        )
    ips = [p.strip() for p in env["SKYPILOT_NODE_IPS"].replace(",", "\n").splitlines() if p.strip()]
    for ip in ips:
        try:
            ipaddress.ip_address(ip)
        except ValueError:
            raise UserError(f"SKYPILOT_NODE_IPS contains {ip!r}, which is not an IP address") from None
    duplicates = sorted({ip for ip in ips if ips.count(ip) > 1})
    if duplicates:
        raise UserError(
            f"SKYPILOT_NODE_IPS lists {duplicates[0]} more than once; every node needs its own IP"
        )
    loopback = loopback_in_multi_host([(ip, ip) for ip in ips])
    if loopback is not None:
        raise LoopbackAddressError(
            f"SKYPILOT_NODE_IPS lists {loopback[0]}, a loopback address, among {len(ips)} nodes; the other "
            "nodes cannot reach that node at it: list every node's network IP (SkyPilot sets them)",
            loopback[0],
            loopback[0],
        )
    rank, count = int(rank_text), int(count_text)
    if count != len(ips):
        raise UserError(f"SKYPILOT_NUM_NODES={count} but SKYPILOT_NODE_IPS lists {len(ips)} addresses")
    if rank >= count:
        raise UserError(f"SKYPILOT_NODE_RANK={rank} is out of range for {count} nodes (0..{count - 1})")
    return SkyPilotNode(rank=rank, node_ips=tuple(ips))


def _ascii_decimal(text: str) -> bool:
    return text.isascii() and text.isdigit()


def _mac(secret: bytes, *parts: Any) -> str:
    return hmac.new(secret, "|".join(str(p) for p in parts).encode(), hashlib.sha256).hexdigest()


def launch_id_for(secret: bytes, node: SkyPilotNode) -> str:
    """The launch id every rank derives alike from the secret and the node list."""
    return _mac(secret, "launch-id", *node.node_ips)[:16]


async def _send(writer: asyncio.StreamWriter, message: dict[str, Any]) -> None:
    writer.write(json.dumps(message).encode() + b"\n")
    await writer.drain()


async def _receive(reader: asyncio.StreamReader) -> dict[str, Any] | None:
    line = await reader.readline()
    if not line:
        return None
    return json.loads(line)


async def _peer(node: SkyPilotNode, agent: LocalAgent, secret: bytes, port: int, timeout_s: float) -> int:
    """Report this rank's agent to rank 0 and wait for the outcome; return the exit code."""
    rank0 = EndpointSpec(host=node.node_ips[0], port=port + 1)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            reader, writer = await asyncio.open_connection(rank0.host, rank0.port, limit=MAX_MESSAGE_BYTES)
            break
        except OSError:
            if time.monotonic() > deadline:
                report(f"error: rank 0 lifecycle port {rank0.address} did not answer within {timeout_s:g} s")
                return 1
            await asyncio.sleep(0.2)
    nonce = secrets.token_hex(16)
    await _send(
        writer,
        {
            "rank": node.rank,
            "pid": agent.pid,
            "nonce": nonce,
            "mac": _mac(secret, "hello", node.rank, agent.pid, nonce),
        },
    )
    receiving = asyncio.ensure_future(_receive(reader))
    agent_exit = asyncio.ensure_future(agent.process.wait())
    try:
        # No FIN comes from a rank 0 whose host was cut off: this node's agent, whose lease on
        # rank 0 then runs out, is what ends the wait.
        await asyncio.wait({receiving, agent_exit}, return_when=asyncio.FIRST_COMPLETED)
        outcome = receiving.result() if receiving.done() else None
    except (OSError, ValueError):
        outcome = None
    finally:
        receiving.cancel()
        agent_exit.cancel()
        writer.close()
    if outcome is None and agent.process.returncode is not None:
        report(
            f"error: this node's agent exited with code {agent.process.returncode} before rank 0 told "
            "the outcome (code 1: rank 0 was not heard from for the agent's --controller-lease)"
        )
        return 1
    if outcome is None:
        report("error: rank 0 disconnected before telling the outcome")
        return 1
    if "refused" in outcome:  # unsigned: rank 0 cannot sign for a secret it does not share
        report(f"error: rank 0 refused this rank: {str(outcome['refused'])[:200]}")
        return 2
    code = int(outcome.get("code", 1))
    if not hmac.compare_digest(str(outcome.get("mac", "")), _mac(secret, "outcome", code, nonce)):
        report("error: rank 0's outcome message is not signed with this launch's secret")
        return 1
    if code != 0:
        report(f"rank 0 reported failure (exit code {code})")
    return code


async def _gather_peers(
    node: SkyPilotNode, secret: bytes, port: int, timeout_s: float
) -> tuple[asyncio.base_events.Server, dict[int, tuple[int, str, asyncio.StreamWriter]]]:
    """Listen on PORT+1 until every other rank has said hello (bounded by `timeout_s`).

    A hello from a rank's own IP whose signature does not verify (that node has another
    ART_MEGA_SECRET) fails the launch at once, naming the rank; from elsewhere it is ignored.
    """
    peers: dict[int, tuple[int, str, asyncio.StreamWriter]] = {}
    refused: dict[int, str] = {}
    complete = asyncio.Event()
    expected = node.num_nodes - 1

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            hello = await asyncio.wait_for(_receive(reader), 10)
            rank, pid, nonce = int(hello["rank"]), int(hello["pid"]), str(hello["nonce"])
        except (TimeoutError, OSError, ValueError, KeyError, TypeError):
            writer.close()
            return
        valid = hmac.compare_digest(str(hello.get("mac", "")), _mac(secret, "hello", rank, pid, nonce))
        if not valid and 0 < rank < node.num_nodes and _from_ip(writer, node.node_ips[rank]):
            refused[rank] = (
                f"its hello is not signed with this launch's secret; give every node the same {SECRET_ENV}"
            )
            with contextlib.suppress(OSError):
                await _send(writer, {"refused": refused[rank]})
            writer.close()
            complete.set()
            return
        if not valid or not 0 < rank < node.num_nodes or rank in peers:
            writer.close()
            return
        peers[rank] = (pid, nonce, writer)
        if len(peers) == expected:
            complete.set()

    try:
        sock = bind_listener(node.node_ips[0], port + 1)
    except OSError as exc:
        if is_address_in_use(exc):
            raise UserError(
                f"lifecycle address {node.node_ips[0]}:{port + 1} already has a listener: refusing to reuse a "
                "pre-existing listener; pick another --port"
            ) from None
        raise
    server = await asyncio.start_server(handle, sock=sock, limit=MAX_MESSAGE_BYTES)
    if expected:
        try:
            await asyncio.wait_for(complete.wait(), timeout_s)
        except TimeoutError:
            missing = [f"rank {r} ({node.node_ips[r]})" for r in range(1, node.num_nodes) if r not in peers]
            for _, _, writer in peers.values():
                writer.close()
            server.close()
            raise UserError(
                f"{', '.join(missing)} did not arrive within {timeout_s:g} s (--startup-timeout)"
            ) from None
        if refused:
            for _, _, writer in peers.values():
                writer.close()
            server.close()
            rank = min(refused)
            raise UserError(f"rank {rank} ({node.node_ips[rank]}) was refused: {refused[rank]}")
    return server, peers


def _from_ip(writer: asyncio.StreamWriter, ip: str) -> bool:
    """Whether the connection behind `writer` comes from `ip`."""
    peer = writer.get_extra_info("peername")
    try:
        return peer is not None and ipaddress.ip_address(peer[0]) == ipaddress.ip_address(ip)
    except ValueError:
        return False


async def run_skypilot(
    main: Callable[[ArtLaunchContext], Any],
    program: ProgramRef,
    node: SkyPilotNode,
    secret: bytes,
    port: int,
    startup_timeout_s: float,
    debug: bool = False,
    launch_id: str | None = None,
) -> int:
    """Run this node's part of the launch and return its exit code.

    `launch_id` defaults to `launch_id_for(secret, node)` (`art-mega slurm` adds its job id).
    """
    guard = SignalGuard()
    guard.install()
    launch_id = launch_id or launch_id_for(secret, node)
    agent: LocalAgent | None = None
    server = None
    peers: dict[int, tuple[int, str, asyncio.StreamWriter]] = {}
    clients: list[AgentClient] = []
    code = 1
    try:
        endpoint = EndpointSpec(host=node.node_ips[node.rank], port=port)
        agent = await start_local_agent(f"rank{node.rank}", endpoint, launch_id, secret, startup_timeout_s)
        if node.rank != 0:
            code = await _peer(node, agent, secret, port, startup_timeout_s)
            return code
        server, peers = await _gather_peers(node, secret, port, startup_timeout_s)
        pids = {0: agent.pid, **{r: p[0] for r, p in peers.items()}}
        for rank, ip in enumerate(node.node_ips):
            address = EndpointSpec(host=ip, port=port).address
            clients.append(
                AgentClient(f"rank{rank}-{ip}", address, EndpointSpec(host=ip, port=port).url, secret)
            )
        replies = await asyncio.gather(*(c.health(timeout_s=10) for c in clients))
        for rank, (client, reply) in enumerate(zip(clients, replies)):
            if reply.launch_id != launch_id or reply.pid != pids[rank]:
                raise AgentError(
                    client.host,
                    client.address,
                    f"answered with launch id {reply.launch_id} pid {reply.pid}, expected {launch_id} pid {pids[rank]}",
                )
        launch = ArtLaunchContext(
            worker_addresses=tuple(c.address for c in clients),
            launch_id=launch_id,
            controller_rank=0,
            sys_path=program.sys_path,
            _secret=secret,
        )
        expected = {c.host: (launch_id, pids[r]) for r, c in enumerate(clients)}
        code = await supervise(main, launch, clients, expected, guard, debug)
        return code
    except asyncio.CancelledError:
        code = 128 + (guard.received or signal.SIGTERM)
        return code
    finally:
        if guard.received is not None:
            code = 128 + guard.received

        async def tell_and_stop() -> None:
            for _, nonce, writer in peers.values():
                try:
                    await _send(writer, {"code": code, "mac": _mac(secret, "outcome", code, nonce)})
                    writer.close()
                except OSError:
                    pass
            if server is not None:
                server.close()
            await asyncio.gather(*(c.aclose() for c in clients), return_exceptions=True)
            if agent is not None:
                await agent.stop()

        await asyncio.shield(tell_and_stop())
        guard.uninstall()


def prepare(environ: dict[str, str]) -> tuple[SkyPilotNode, bytes]:
    """Validate and remove SKYPILOT_* and ART_MEGA_SECRET from `environ` (the program never sees them)."""
    node = read_skypilot_env(environ)
    try:
        secret = load_secret(environ.get(SECRET_ENV))
    except ValueError:
        raise UserError(
            f"{SECRET_ENV} is not set; deliver it with the task's secrets: section "
            f"(sky launch --secret {SECRET_ENV}=...)"
        ) from None
    for name in (*SKYPILOT_VARS, SECRET_ENV):
        environ.pop(name, None)
    return node, secret


__all__ = ["SkyPilotNode", "prepare", "read_skypilot_env", "run_skypilot"]

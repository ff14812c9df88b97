"""`art-mega ssh`: start an agent on every host over SSH, prove each, run the program, clean up.

Every host starts in parallel. A host is ready only when its agent printed our launch id, says
its own PID holds the listener, and answers a signed health call with that launch id and PID.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import socket
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from art_mega.agent.client import AgentClient
from art_mega.agent.lease import DEFAULT_CONTROLLER_LEASE_S
from art_mega.errors import EXIT_CODES, AgentError, HostLostError, UserError
from art_mega.launch.context import ArtLaunchContext
from art_mega.launch.controller import UNRESPONSIVE_AFTER_S, SignalGuard, report, run_with_restarts, supervise
from art_mega.launch.program import ProgramRef
from art_mega.launch.ssh_session import AgentSession, agent_command, connect
from art_mega.launch.ssh_target import (
    ConnectSpec,
    HostTarget,
    parse_host,
    parse_ssh_args,
    resolve,
    worker_host_for,
)
from art_mega.runtime.local_agent import refuse_existing_listener
from art_mega.runtime.monitor import AgentMonitor
from art_mega.topology import EndpointSpec

DEFAULT_AGENT_PORT = 22222
STOP_GRACE_S = 5.0


@dataclass
class SshHost:
    """One `--host` through its life: target, resolved connection, agent endpoint, session."""

    target: HostTarget
    spec: ConnectSpec
    endpoint: EndpointSpec
    session: AgentSession | None = None
    pid: int | None = None
    client: AgentClient | None = None

    @property
    def label(self) -> str:
        return self.target.target


def plan_hosts(host_values: Sequence[str], ssh_args: Sequence[str], port: int) -> list[SshHost]:
    """Parse and resolve every `--host`; check targets and worker addresses are unique.

    Raises:
        UserError: no host, a malformed value, a duplicate target or worker host, a bad port.
    """
    if not host_values:
        raise UserError("--host is required at least once: --host [USER@]SSH_TARGET[=WORKER_HOST]")
    if not 1 <= port <= 65535:
        raise UserError(f"--port {port} is out of range; use 1..65535 (the agents need a fixed port)")
    options = parse_ssh_args(list(ssh_args))
    hosts: list[SshHost] = []
    for value in host_values:
        target = parse_host(value)
        spec = resolve(target.target, target.user, options)
        endpoint = EndpointSpec(host=worker_host_for(target, spec), port=port)
        hosts.append(SshHost(target, spec, endpoint))
    for attr, what in (
        (lambda h: h.target.target, "SSH targets"),
        (lambda h: h.endpoint.address, "worker hosts"),
    ):
        seen: dict[str, str] = {}
        for host in hosts:
            key = attr(host)
            if key in seen:
                raise UserError(
                    f"--host {host.target.text!r} repeats {what[:-1]} {key} of --host {seen[key]!r}; {what} must be unique"
                )
            seen[key] = host.target.text
    return hosts


def _is_local_address(host: str) -> bool:
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, socktype, proto, _, addr in infos:
        try:
            with socket.socket(family, socktype, proto) as sock:
                sock.bind((addr[0], 0))
                return True
        except OSError:
            continue
    return False


async def _start_host(
    host: SshHost,
    python: str,
    launch_id: str,
    secret: bytes,
    timeout_s: float,
    lease_s: float,
    monitor: AgentMonitor,
) -> None:
    """Start and prove one host's agent; it is watched (its lease held) from the moment it is proven."""
    client = await asyncio.to_thread(connect, host.spec, host.label)
    host.session = AgentSession(host.label, client)
    command = agent_command(python, host.endpoint.address, launch_id, os.getcwd(), lease_s)
    await asyncio.to_thread(host.session.start, command, secret)
    ready = await asyncio.to_thread(host.session.wait_ready, timeout_s)
    where = f"host {host.label} ({host.endpoint.address})"
    if ready is None:
        if await asyncio.to_thread(host.session.wait_exit, 5.0):
            code = host.session.exit_status()
            tail = host.session.stderr_tail()
            if code == 127 or "No such file" in tail or "not found" in tail:
                raise UserError(
                    f"{where}: --python {python} does not exist or cannot run there (exit {code}: {tail})"
                )
            if code == EXIT_CODES[UserError].code:
                reason = tail.removeprefix("art-mega: error: ")  # the agent's own one-sentence refusal
                raise UserError(f"{where}: the agent refused to start: {reason}")
            raise UserError(f"{where}: the agent exited with code {code} before it was ready: {tail}")
        raise UserError(f"{where}: the agent was not ready after {timeout_s:g} s (--startup-timeout)")
    if ready.get("launch_id") != launch_id or not ready.get("holds_listener"):
        raise UserError(
            f"{where}: the agent's ready line does not prove this launch holds the listener: {ready}"
        )
    host.pid = int(ready["pid"])
    host.client = AgentClient(host.label, host.endpoint.address, host.endpoint.url, secret, timeout_s=10.0)
    health = await host.client.health()
    if health.launch_id != launch_id or health.pid != host.pid:
        raise UserError(
            f"{where}: health answered with launch id {health.launch_id} pid {health.pid}, expected {launch_id} pid {host.pid}"
        )
    monitor.watch(host.client, (launch_id, host.pid))


async def _stop_host(host: SshHost, unresponsive: bool) -> None:
    """Ask the agent to stop, then close its session (the agent exits on stdin EOF), then kill
    its process group over SSH if it is still there. An `unresponsive` agent (stopped, frozen,
    cut off) is killed at once: waiting for its answers would only hold up the cleanup."""
    grace = 0.0 if unresponsive else STOP_GRACE_S
    if host.client is not None:
        if not unresponsive:
            try:
                await host.client.shutdown(timeout_s=STOP_GRACE_S)
            except AgentError:
                pass
        await host.client.aclose()
    if host.session is not None:
        await asyncio.to_thread(host.session.stop, grace, host.pid)


async def _stop_hosts(hosts: Sequence[SshHost], silent: set[str], monitor: AgentMonitor) -> None:
    """Stop every host in parallel (the silent ones without waiting for them), then the heartbeats."""
    await asyncio.gather(
        *(_stop_host(h, h.endpoint.address in silent) for h in hosts), return_exceptions=True
    )
    await monitor.stop()


def _session_watcher(host: SshHost) -> Callable[[], Any]:
    async def watch() -> None:
        assert host.session is not None
        while True:
            if host.session.exited() or not host.session.transport_active():
                code = host.session.exit_status()
                raise HostLostError(
                    host.label, host.endpoint.address, f"its SSH session ended (agent exit code {code})"
                )
            await asyncio.sleep(0.25)

    return watch


async def run_ssh(
    main: Callable[[ArtLaunchContext], Any],
    program: ProgramRef,
    host_values: Sequence[str],
    python: str,
    port: int,
    ssh_args: Sequence[str],
    startup_timeout_s: float,
    debug: bool = False,
    controller_lease_s: float = DEFAULT_CONTROLLER_LEASE_S,
    max_restarts: int = 0,
) -> int:
    """Start agents over SSH on every host, run `main(launch)`, and stop every host (bounded).

    Every agent runs with `--controller-lease controller_lease_s`; this controller's heartbeats
    hold each lease from the moment that agent is proven until it is stopped. When a host is
    lost, up to `max_restarts` times: every host is stopped, the same hosts are started again
    (retrying each for up to `startup_timeout_s` plus the lease, the time a cut-off agent takes
    to give up its port) with a new launch id and secret, and the program runs again
    (`controller.run_with_restarts`).
    """
    hosts = plan_hosts(host_values, ssh_args, port)
    for host in hosts:
        refuse_existing_listener(host.endpoint, f"--host {host.target.text!r} worker address")
    guard = SignalGuard()
    guard.install()
    try:

        async def attempt(number: int) -> tuple[int, HostLostError | None]:
            fresh = [SshHost(h.target, h.spec, h.endpoint) for h in hosts]
            wait_s = startup_timeout_s + (controller_lease_s + STOP_GRACE_S if number else 0.0)
            return await _run_once(
                main, program, fresh, python, startup_timeout_s, debug, controller_lease_s, guard, wait_s
            )

        return await run_with_restarts(attempt, max_restarts, guard)
    finally:
        guard.uninstall()


async def _start_host_retrying(
    host: SshHost,
    python: str,
    launch_id: str,
    secret: bytes,
    timeout_s: float,
    lease_s: float,
    monitor: AgentMonitor,
    wait_s: float,
) -> None:
    """`_start_host`, tried again (after closing what a try left) until `wait_s` seconds have
    passed: after a restart the host may still be unreachable or its old agent may still hold
    the port until its lease runs out."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while True:
        try:
            await _start_host(host, python, launch_id, secret, timeout_s, lease_s, monitor)
            return
        except (UserError, AgentError, OSError) as exc:
            if loop.time() + 1.0 > deadline:
                raise
            if host.session is not None or host.client is not None:
                await _stop_host(host, unresponsive=True)
            host.session, host.client, host.pid = None, None, None
            report(f"waiting for host {host.label}: {str(exc)[:200]}")
            await asyncio.sleep(1.0)


async def _run_once(
    main: Callable[[ArtLaunchContext], Any],
    program: ProgramRef,
    hosts: list[SshHost],
    python: str,
    startup_timeout_s: float,
    debug: bool,
    controller_lease_s: float,
    guard: SignalGuard,
    wait_s: float,
) -> tuple[int, HostLostError | None]:
    """One launch over `hosts`: start and prove every agent, run the program, stop every host."""
    launch_id = secrets.token_hex(8)
    secret = secrets.token_hex(32).encode()
    code = 0
    lost: list[HostLostError] = []
    monitor = AgentMonitor([], {}, lambda exc: None)
    monitor.start()
    try:
        if wait_s > startup_timeout_s:
            starts = [
                _start_host_retrying(
                    h, python, launch_id, secret, startup_timeout_s, controller_lease_s, monitor, wait_s
                )
                for h in hosts
            ]
        else:
            starts = [
                _start_host(h, python, launch_id, secret, startup_timeout_s, controller_lease_s, monitor)
                for h in hosts
            ]
        results = await asyncio.gather(*starts, return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            raise failures[0]
        if monitor.lost is not None:  # a host proven early was lost while the others started
            report(f"error: {monitor.lost}")
            return 1, monitor.lost
        controller_rank = next((i for i, h in enumerate(hosts) if _is_local_address(h.endpoint.host)), 0)
        launch = ArtLaunchContext(
            worker_addresses=tuple(h.endpoint.address for h in hosts),
            launch_id=launch_id,
            controller_rank=controller_rank,
            sys_path=program.sys_path,
            _secret=secret,
        )
        clients = [h.client for h in hosts if h.client is not None]
        expected = {h.label: (launch_id, h.pid or -1) for h in hosts}
        code = await supervise(
            main,
            launch,
            clients,
            expected,
            guard,
            debug,
            [_session_watcher(h) for h in hosts],
            monitor=monitor,
            lost_out=lost,
        )
    except asyncio.CancelledError:
        code = 128 + (guard.received or signal.SIGTERM)
    finally:
        monitor.on_lost = lambda exc: None
        silent = {c.address for c in monitor.unresponsive(UNRESPONSIVE_AFTER_S)}
        if lost:
            silent.add(lost[0].address)
        await asyncio.shield(_stop_hosts(hosts, silent, monitor))
    if guard.received is not None:
        code = 128 + guard.received
    return code, (lost[0] if lost else None)


def default_python() -> str:
    """The controller's interpreter: the same path must exist on every host."""
    return sys.executable

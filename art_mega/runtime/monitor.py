"""Heartbeats between the controller and every agent, both ways: a lost host is named within a
bound, and an agent whose controller vanished stops its children and exits (`lease`).

Each heartbeat is a signed `POST /v1/lease`: it holds the agent's lease on this controller and
answers with the agent's health. Beats go out every `interval_s` seconds, and at least four
times per lease the agent reports, so a live controller never lets a lease run out.

An agent is lost when its heartbeats have been refused or reset for `lost_after_s` seconds (its
process is gone), when they have gone unanswered for its lease (the host is stopped, frozen or
cut off: the same bound after which that agent gives up on the controller; longer than the
refusal bound because an overloaded but healthy host also answers late, and a false "lost"
cancels a whole training run), or when it answers with another launch id or PID (it was
restarted: its children are gone).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from art_mega.runtime.client import AgentClient, AgentError

HEARTBEAT_INTERVAL_S = 0.5
LOST_AFTER_S = 3.0
SILENT_AFTER_S = 20.0
"""The silence bound for an agent that reports no lease of its own."""
BEATS_PER_LEASE = 4


class HostLostError(Exception):
    """An agent stopped answering or was replaced; the message names the host and address."""

    def __init__(self, host: str, address: str, reason: str) -> None:
        super().__init__(f"host {host} ({address}) was lost: {reason}")
        self.host = host
        self.address = address
        self.reason = reason


class AgentMonitor:
    """Heartbeats to every agent; calls `on_lost(HostLostError)` once, for the first lost host.

    The other agents keep getting heartbeats after a loss (their leases stay held while the
    launcher cleans up) until `stop`.

    Args:
        clients: one client per agent, watched from `start`; `watch` adds more later.
        expected: (launch_id, pid) each agent must keep answering with, by host.
        on_lost: called once, from the event loop, with the error that names the host.
        interval_s: the most seconds between heartbeats (less where an agent's lease asks).
        lost_after_s: seconds of refused or reset heartbeats before a host counts as lost.
        silent_after_s: seconds of heartbeats without any answer (timeouts) before a host
            counts as lost; None: the agent's own controller lease (`SILENT_AFTER_S` when it
            reports none).
    """

    def __init__(
        self,
        clients: Sequence[AgentClient],
        expected: dict[str, tuple[str, int]],
        on_lost: Callable[[HostLostError], None],
        interval_s: float = HEARTBEAT_INTERVAL_S,
        lost_after_s: float = LOST_AFTER_S,
        silent_after_s: float | None = None,
    ) -> None:
        self.clients = list(clients)
        self._expected = dict(expected)
        self.on_lost = on_lost
        self._interval_s = interval_s
        self._lost_after_s = lost_after_s
        self._silent_after_s = silent_after_s
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._last_ok: dict[str, float] = {}
        self._started = False
        self.lost: HostLostError | None = None

    def start(self) -> None:
        """Start a heartbeat to every client given so far."""
        self._started = True
        for client in self.clients:
            self._spawn(client)

    def watch(self, client: AgentClient, expected: tuple[str, int] | None = None) -> None:
        """Watch one more agent (e.g. the moment it is proven ready, while others still start)."""
        if client not in self.clients:
            self.clients.append(client)
        if expected is not None:
            self._expected[client.host] = expected
        if self._started:
            self._spawn(client)

    def _spawn(self, client: AgentClient) -> None:
        if client.address not in self._tasks:
            self._last_ok[client.address] = time.monotonic()
            self._tasks[client.address] = asyncio.create_task(
                self._watch(client), name=f"art-mega-heartbeat-{client.host}"
            )

    def silent_s(self, address: str) -> float:
        """Seconds since the agent at `address` last answered a heartbeat (0 if not watched)."""
        last = self._last_ok.get(address)
        return 0.0 if last is None else time.monotonic() - last

    def unresponsive(self, after_s: float) -> list[AgentClient]:
        """The watched agents that are lost or have not answered for more than `after_s` s."""
        lost = self.lost.address if self.lost is not None else None
        return [c for c in self.clients if c.address == lost or self.silent_s(c.address) > after_s]

    async def release(self, timeout_s: float = 5.0) -> None:
        """Stop the heartbeats, then release every agent's lease (the controller ends normally)."""
        await self.stop()
        await asyncio.gather(
            *(c.lease(hold=False, timeout_s=timeout_s) for c in self.clients), return_exceptions=True
        )

    async def stop(self) -> None:
        """Stop every heartbeat (idempotent)."""
        tasks, self._tasks = list(self._tasks.values()), {}
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _watch(self, client: AgentClient) -> None:
        try:
            await self._beat(client)
        except RuntimeError:
            if not client.closed:
                raise
        except HostLostError as exc:
            if self.lost is None:
                self.lost = exc
                self.on_lost(exc)

    async def _beat(self, client: AgentClient) -> None:
        reason = "agent stopped answering"
        bound = self._lost_after_s
        interval = self._interval_s
        silent_bound = self._silent_after_s if self._silent_after_s is not None else SILENT_AFTER_S
        while True:
            started = time.monotonic()
            try:
                health = await client.lease(timeout_s=interval * 2)
                expected = self._expected.get(client.host)
                if expected is not None and (health.launch_id, health.pid) != expected:
                    raise HostLostError(
                        client.host,
                        client.address,
                        f"agent was replaced (launch id {health.launch_id}, pid {health.pid}; "
                        f"expected {expected[0]}, pid {expected[1]})",
                    )
                if health.controller_lease_s is not None:
                    interval = min(self._interval_s, health.controller_lease_s / BEATS_PER_LEASE)
                    if self._silent_after_s is None:
                        silent_bound = health.controller_lease_s
                self._last_ok[client.address] = time.monotonic()
            except AgentError as exc:
                reason = f"agent stopped answering ({exc})"
                # A refusal proves the process is gone; silence may be load: wait longer for it.
                bound = max(silent_bound, self._lost_after_s) if exc.timed_out else self._lost_after_s
            if self.silent_s(client.address) >= bound:
                raise HostLostError(client.host, client.address, f"{reason} for {bound:g} s")
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))

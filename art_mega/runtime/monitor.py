"""Heartbeats from the controller to every agent: a lost or replaced agent is named within seconds.

An agent is lost when its health calls have been refused or reset for `lost_after_s` seconds
(its process is gone), when they have gone unanswered for `silent_after_s` seconds (the host or
its network is down; a longer bound, because an overloaded but healthy host also answers late,
and a false "lost" cancels a whole training run), or when it answers with another launch id or
PID (it was restarted: its children are gone).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from art_mega.runtime.client import AgentClient, AgentError

HEARTBEAT_INTERVAL_S = 0.5
LOST_AFTER_S = 3.0
SILENT_AFTER_S = 20.0


class HostLostError(Exception):
    """An agent stopped answering or was replaced; the message names the host and address."""

    def __init__(self, host: str, address: str, reason: str) -> None:
        super().__init__(f"host {host} ({address}) was lost: {reason}")
        self.host = host
        self.address = address
        self.reason = reason


class AgentMonitor:
    """Polls every agent's health; calls `on_lost(HostLostError)` once for the first lost host.

    Args:
        clients: one client per agent.
        expected: (launch_id, pid) each agent must keep answering with, by host.
        on_lost: called once, from the event loop, with the error that names the host.
        interval_s: seconds between heartbeats.
        lost_after_s: seconds of refused or reset health calls before a host counts as lost.
        silent_after_s: seconds of health calls without any answer (timeouts) before a host
            counts as lost.
    """

    def __init__(
        self,
        clients: Sequence[AgentClient],
        expected: dict[str, tuple[str, int]],
        on_lost: Callable[[HostLostError], None],
        interval_s: float = HEARTBEAT_INTERVAL_S,
        lost_after_s: float = LOST_AFTER_S,
        silent_after_s: float = SILENT_AFTER_S,
    ) -> None:
        self._clients = list(clients)
        self._expected = expected
        self._on_lost = on_lost
        self._interval_s = interval_s
        self._lost_after_s = lost_after_s
        self._silent_after_s = max(silent_after_s, lost_after_s)
        self._task: asyncio.Task[None] | None = None
        self.lost: HostLostError | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="art-mega-agent-monitor")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def _watch(self, client: AgentClient) -> None:
        last_ok = time.monotonic()
        reason = "agent stopped answering"
        bound = self._lost_after_s
        while True:
            started = time.monotonic()
            try:
                health = await client.health(timeout_s=self._interval_s * 2)
                expected = self._expected.get(client.host)
                if expected is not None and (health.launch_id, health.pid) != expected:
                    raise HostLostError(
                        client.host,
                        client.address,
                        f"agent was replaced (launch id {health.launch_id}, pid {health.pid}; "
                        f"expected {expected[0]}, pid {expected[1]})",
                    )
                last_ok = time.monotonic()
            except AgentError as exc:
                reason = f"agent stopped answering ({exc})"
                # A refusal proves the process is gone; silence may be load: wait longer for it.
                bound = self._silent_after_s if exc.timed_out else self._lost_after_s
            if time.monotonic() - last_ok >= bound:
                raise HostLostError(client.host, client.address, f"{reason} for {bound:.0f} s")
            await asyncio.sleep(max(0.0, self._interval_s - (time.monotonic() - started)))

    async def _run(self) -> None:
        tasks = [asyncio.create_task(self._watch(c)) for c in self._clients]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                exc = task.exception()
                if isinstance(exc, HostLostError):
                    self.lost = exc
                    self._on_lost(exc)
                    return
        finally:
            for task in tasks:
                task.cancel()

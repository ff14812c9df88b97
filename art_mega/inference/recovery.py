"""Crash recovery: a replica that dies is reported by its agent, taken out of routing, restarted,
given the keep window's adapters, and only then routed to again.

The agent supervises each replica as a child; its health answer lists the child with its exit
code once the process is gone. `ReplicaRecovery` polls those answers. A replica a client's request
marked down (it refused or reset a connection: `policy_client.FailoverTransport`) whose process
still runs is routed to again once it answers its health check.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from art_mega.errors import ReplicaHTTPError
from art_mega.inference.adapters import AdapterPublisher
from art_mega.inference.protocol import INFERENCE_STOP, InferenceStopRequest, ReplicaLaunch
from art_mega.inference.remote import start_replica
from art_mega.inference.router import REFUSED
from art_mega.inference.server_api import ReplicaClient
from art_mega.topology.compiled import ReplicaSpec

if TYPE_CHECKING:
    from art_mega.agent.client import AgentClient

log = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.5
MAX_RESTARTS = 3
"""Failed restarts in a row after which a replica stays down."""


@dataclass(frozen=True)
class RecoveryEvent:
    """One thing that happened to a replica: `kind` is "down" (its agent reported it exited),
    "restarted" (ready again, still out of routing), "up" (adapters reloaded, routed to) or
    "failed" (a restart or reload failed); `detail` says why; `at` is `time.time()`."""

    replica: str
    kind: str
    detail: str
    at: float = field(default_factory=time.time)


class ReplicaRecovery:
    """Watches `replicas` through the agents of their head hosts and brings dead ones back.

    Every `interval_s` seconds each agent's health is read; a replica child listed with an exit
    code is marked down in the publisher's router (no new traffic; new adapters skip it), started
    again through its agent with `launch` (shared, or made per replica), then
    `publisher.restore` loads the keep window and marks it up. A restart that fails is retried
    up to `max_restarts` times in a row, then the replica stays down. `events` records what
    happened, in order; `on_event` (if given) is called with each. An agent that does not
    answer is skipped (losing a host is the runtime's `AgentMonitor`'s business).
    `before_restart(name)` (if given) is awaited before each restart: a replica that shares the
    trainer's GPUs waits there until the train step in progress is over
    (`SharedGpuReplicas.wait_awake`).

    Stop it (`stop()`) before stopping the replicas on purpose, or it restarts them.
    """

    def __init__(
        self,
        clients: Mapping[str, AgentClient],
        replicas: Sequence[ReplicaSpec],
        launch: ReplicaLaunch | Callable[[ReplicaSpec], ReplicaLaunch],
        publisher: AdapterPublisher,
        interval_s: float = POLL_INTERVAL_S,
        max_restarts: int = MAX_RESTARTS,
        on_event: Callable[[RecoveryEvent], None] | None = None,
        before_restart: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        self.clients = clients
        self.replicas = {spec.process_name: spec for spec in replicas}
        self.launch = launch
        self.publisher = publisher
        self.interval_s = interval_s
        self.max_restarts = max_restarts
        self.on_event = on_event
        self.before_restart = before_restart
        self.events: list[RecoveryEvent] = []
        self._recovering: dict[str, asyncio.Task[None]] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start watching (in the running event loop)."""
        self._task = asyncio.create_task(self._watch(), name="art-mega-replica-recovery")

    async def stop(self) -> None:
        """Stop watching and cancel restarts in progress."""
        tasks = [t for t in (self._task, *self._recovering.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._task = None
        self._recovering.clear()

    def _record(self, replica: str, kind: str, detail: str) -> None:
        event = RecoveryEvent(replica, kind, detail)
        self.events.append(event)
        (log.warning if kind in ("down", "failed") else log.info)("replica %s %s: %s", replica, kind, detail)
        if self.on_event is not None:
            self.on_event(event)

    async def _watch(self) -> None:
        from art_mega.errors import AgentError

        hosts = sorted({spec.host_ids[0] for spec in self.replicas.values()})
        while True:
            for host in hosts:
                try:
                    health = await self.clients[host].health(timeout_s=max(self.interval_s * 4, 2.0))
                except AgentError:
                    continue
                for child in health.children:
                    if (
                        child.child_id in self.replicas
                        and child.returncode is not None
                        and child.child_id not in self._recovering
                    ):
                        detail = (
                            f"exited with code {child.returncode} (pid {child.pid}, log {child.log_path})"
                        )
                        self._recovering[child.child_id] = asyncio.create_task(
                            self._recover(child.child_id, detail)
                        )
                    elif (
                        child.child_id in self.replicas
                        and child.returncode is None
                        and child.child_id not in self._recovering
                        and self.publisher.router.down().get(child.child_id, "").startswith(REFUSED)
                    ):
                        self._recovering[child.child_id] = asyncio.create_task(self._recheck(child.child_id))
            await asyncio.sleep(self.interval_s)

    async def _recheck(self, name: str) -> None:
        """Route to replica `name` again if it answers `GET /health`: a client's request marked
        it down (`router.REFUSED`) while its agent still lists its process as running.
        It gets the keep window first (`publisher.restore`): publications skipped it meanwhile."""
        router = self.publisher.router
        try:
            async with ReplicaClient(name, router.endpoint(name).url, 5.0) as client:
                if not await client.healthy():
                    return
            loaded = await self.publisher.restore(name)
            served = ", ".join(loaded) or "the base model"
            self._record(name, "up", f"healthy again after a client's request failed; serving {served}")
        except ReplicaHTTPError as exc:
            self._record(name, "failed", f"reloading adapters after a failed request: {exc}")
        finally:
            self._recovering.pop(name, None)

    async def _recover(self, name: str, detail: str) -> None:
        spec = self.replicas[name]
        host = spec.host_ids[0]
        self.publisher.router.mark_down(name, f"{detail}; restarting")
        self._record(name, "down", f"host {host}: {detail}")
        launch = self.launch(spec) if callable(self.launch) else self.launch
        try:
            for attempt in range(1, self.max_restarts + 1):
                if self.before_restart is not None:
                    await self.before_restart(name)
                answer = await start_replica(self.clients[host], spec, launch)
                if not answer.ok:
                    self._record(name, "failed", f"restart {attempt}/{self.max_restarts}: {answer.error}")
                    continue
                self._record(name, "restarted", f"pid {answer.pid} ready in {answer.seconds:.1f} s")
                try:
                    loaded = await self.publisher.restore(name)
                except ReplicaHTTPError as exc:
                    self._record(name, "failed", f"reloading adapters: {exc}")
                    await self.clients[host].call(INFERENCE_STOP, InferenceStopRequest(names=(name,)))
                    continue
                self._record(name, "up", f"serving {', '.join(loaded) or 'the base model'}")
                return
            self.publisher.router.mark_down(name, f"{detail}; {self.max_restarts} restarts failed")
        finally:
            self._recovering.pop(name, None)

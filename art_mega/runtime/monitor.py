"""Heartbeats between the controller and every agent, both ways: a lost host is named within a
bound, and an agent whose controller vanished stops its children and exits (`agent.lease`).

Each heartbeat is a signed `POST /v1/lease`: it holds the agent's lease on this controller and
answers with the agent's health. Beats go out every `interval_s` seconds, and at least four
times per lease the agent reports, so a live controller never lets a lease run out.

The heartbeats run on a daemon thread with its own event loop and its own clients
(`AgentClient.twin`), not on the controller's event loop: that loop also runs the user's
program, which may block it for any time (a synchronous dataset or tokenizer load, a long
reward function, a loaded machine) without any lease running out or any host counting as lost.
A killed controller process takes the thread with it, so its agents still give up within their
lease. Silence is counted only while the heartbeat thread itself could run: a stall of the
whole controller process (stopped and continued, swapped out, starved of the GIL) is not its
agents' silence. Hosts that did vanish meanwhile refuse the next beats and are named then.

A stop signal (SIGTERM, SIGHUP, SIGINT) is handled on the program's event loop; one that loop
has not handled for `UNHANDLED_SIGNAL_S` (the program blocks it) ends the heartbeats, so that
every agent's lease runs out and it stops its children.

An agent is lost when its heartbeats have been refused or reset for `lost_after_s` seconds (its
process is gone), when they have gone unanswered for its lease (the host is stopped, frozen or
cut off: the same bound after which that agent gives up on the controller; longer than the
refusal bound because an overloaded but healthy host also answers late, and a false "lost"
cancels a whole training run), or when it answers with another launch id or PID (it was
restarted: its children are gone).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from art_mega.agent.client import AgentClient
from art_mega.errors import AgentError, HostLostError

HEARTBEAT_INTERVAL_S = 0.5
LOST_AFTER_S = 3.0
SILENT_AFTER_S = 20.0
"""The silence bound for an agent that reports no lease of its own."""
BEATS_PER_LEASE = 4
CLOCK_TICK_S = 0.05
"""How often the heartbeat thread's stall clock checks that its own loop still runs (seconds)."""
UNHANDLED_SIGNAL_S = 5.0
"""Seconds a stop signal may wait for the program's event loop (blocked by the program) before
the heartbeats end, so that every agent's lease runs out and it stops its children: the bound on
a SIGTERM to a controller whose program never lets its loop run again is this plus the lease."""


class StopSignals:
    """Stop signals this process received and how many its event loop has handled. Both are
    counted on the main thread (`arrive` from the signal handler, `handle` from the loop's);
    the heartbeat threads read `unhandled_s`."""

    def __init__(self) -> None:
        self.arrived = 0
        self.handled = 0
        self._since: float | None = None

    def arrive(self) -> None:
        self.arrived += 1
        if self.arrived > self.handled and self._since is None:
            self._since = time.monotonic()

    def handle(self) -> None:
        self.handled += 1
        if self.handled >= self.arrived:
            self._since = None

    def unhandled_s(self) -> float:
        """Seconds the oldest signal not handled yet has waited (0 when there is none)."""
        since = self._since
        return 0.0 if since is None or self.handled >= self.arrived else time.monotonic() - since


STOP_SIGNALS = StopSignals()
"""This process's: `launch.controller.SignalGuard` counts into it."""
_abandoned = threading.Event()


def _abandon_leases() -> None:
    """Say once, from a heartbeat thread, that the heartbeats end for an unhandled signal."""
    if not _abandoned.is_set():
        _abandoned.set()
        print(
            f"art-mega: the program's event loop has not handled a stop signal for "
            f"{UNHANDLED_SIGNAL_S:g} s (it is blocked); the heartbeats stop, so every agent stops "
            "its children once its --controller-lease runs out",
            file=sys.stderr,
            flush=True,
        )


class StallClock:
    """Seconds an event loop could not run: each wake-up later than `tolerance_s` past its due
    time adds the excess. `run` ticks on the loop measured; `stalled_s` may be read from any thread.
    """

    def __init__(self, tolerance_s: float, tick_s: float = CLOCK_TICK_S) -> None:
        self._tolerance_s = tolerance_s
        self._tick_s = tick_s
        self._state = (0.0, time.monotonic() + tick_s)
        """(seconds stalled before the last tick, when the next tick is due): one tuple, so that
        another thread never reads a total and a due time from different ticks."""

    def stalled_s(self) -> float:
        """Seconds stalled so far, a stall still in progress (its tick not run yet) included;
        never decreases."""
        total, due = self._state
        return total + max(0.0, time.monotonic() - due - self._tolerance_s)

    async def run(self) -> None:
        """Tick until cancelled."""
        while True:
            await asyncio.sleep(self._tick_s)
            total, due = self._state
            now = time.monotonic()
            self._state = (total + max(0.0, now - due - self._tolerance_s), now + self._tick_s)


class _HeartbeatThread:
    """A daemon thread running its own event loop, where the heartbeat tasks live."""

    def __init__(self, clock: StallClock) -> None:
        self.loop = asyncio.new_event_loop()
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self._clock = clock
        self._done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self.thread = threading.Thread(target=self._run, name="art-mega-heartbeats", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        ticking = self.loop.create_task(self._clock.run())
        try:
            self.loop.run_forever()
        finally:
            pending = [ticking, *self.tasks.values()]
            for task in pending:
                task.cancel()
            # The tasks close their own clients as they end.
            try:
                self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
                self.loop.close()
            finally:
                self._done.set_result(None)

    def spawn(self, name: str, factory: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Start `factory()` as task `name` on this thread's loop (from any thread)."""

        def create() -> None:
            self.tasks[name] = self.loop.create_task(factory(), name=name)

        self.loop.call_soon_threadsafe(create)

    async def stop(self) -> None:
        """Cancel every task, wait until they ended, the thread's loop is closed and the thread
        has exited."""
        try:
            self.loop.call_soon_threadsafe(self.loop.stop)
        except RuntimeError:  # it stopped itself (the owner's loop was closed) and is closed
            pass
        await asyncio.wrap_future(self._done)
        await asyncio.to_thread(self.thread.join, 5.0)


class AgentMonitor:
    """Heartbeats to every agent; calls `on_lost(HostLostError)` once, for the first lost host.

    The heartbeats run on their own thread (see the module docstring); `on_lost` is called on
    the event loop that called `start`. The other agents keep getting heartbeats after a loss
    (their leases stay held while the launcher cleans up) until `stop`, until the client given
    for an agent is closed (that agent's heartbeats end quietly), or until that event loop is
    closed.

    Args:
        clients: one client per agent, watched from `start`; `watch` adds more later. The
            heartbeats use twins of them (`AgentClient.twin`), never these clients themselves.
        expected: (launch_id, pid) each agent must keep answering with, by host.
        on_lost: called once, from the event loop that called `start`, with the error that
            names the host.
        interval_s: the most seconds between heartbeats (less where an agent's lease asks);
            also the most the heartbeat thread may be stalled before the stall is excused.
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
        self._clock = StallClock(tolerance_s=interval_s)
        self._last_ok: dict[str, tuple[float, float]] = {}
        """By address: (monotonic time of the last answer, the stall clock's reading then)."""
        self._beating: set[str] = set()
        """Addresses with a heartbeat on the running thread (touched on the owner's loop only)."""
        self._owner: asyncio.AbstractEventLoop | None = None
        self._thread: _HeartbeatThread | None = None
        self._started = False
        self.lost: HostLostError | None = None

    def start(self) -> None:
        """Start a heartbeat to every client given so far (call it on the program's event loop)."""
        self._owner = asyncio.get_running_loop()
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
        if client.address in self._beating:
            return
        if self._thread is None:
            self._thread = _HeartbeatThread(self._clock)
        thread = self._thread
        self._beating.add(client.address)
        self._last_ok[client.address] = (time.monotonic(), self._clock.stalled_s())
        thread.spawn(
            f"art-mega-heartbeat-{client.host}-{client.address}", lambda: self._watch(client, thread)
        )

    def silent_s(self, address: str) -> float:
        """Seconds since the agent at `address` last answered a heartbeat, less the time the
        heartbeat thread itself was stalled (0 if not watched)."""
        last = self._last_ok.get(address)
        if last is None:
            return 0.0
        answered, stalled = last
        return max(0.0, time.monotonic() - answered - (self._clock.stalled_s() - stalled))

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
        """Stop every heartbeat and their thread (idempotent); a later `watch` starts anew."""
        thread, self._thread = self._thread, None
        self._beating.clear()
        if thread is not None:
            await thread.stop()

    def _deliver(self, exc: HostLostError, thread: _HeartbeatThread) -> None:
        """On the owner's loop: record the first loss of the running heartbeats and report it."""
        if self.lost is None and self._thread is thread:
            self.lost = exc
            self.on_lost(exc)

    async def _watch(self, client: AgentClient, thread: _HeartbeatThread) -> None:
        twin = client.twin()
        try:
            await self._beat(client, twin)
        except HostLostError as exc:
            owner = self._owner
            if owner is not None and not owner.is_closed():
                try:
                    owner.call_soon_threadsafe(self._deliver, exc, thread)
                except RuntimeError:  # the owner's loop closed meanwhile: nobody to tell
                    pass
        finally:
            await twin.aclose()
            owner = self._owner
            if owner is not None and owner.is_closed():  # nobody will call `stop`: end the thread
                thread.loop.stop()

    async def _beat(self, client: AgentClient, twin: AgentClient) -> None:
        """Beat until `client` (the caller's) or the owner's loop is closed; raise `HostLostError`."""
        reason = "agent stopped answering"
        bound = self._lost_after_s
        interval = self._interval_s
        silent_bound = self._silent_after_s if self._silent_after_s is not None else SILENT_AFTER_S
        owner = self._owner
        while not client.closed and not (owner is not None and owner.is_closed()):
            if STOP_SIGNALS.unhandled_s() >= UNHANDLED_SIGNAL_S:
                _abandon_leases()
                return
            started = time.monotonic()
            try:
                health = await twin.lease(timeout_s=interval * 2)
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
                self._last_ok[client.address] = (time.monotonic(), self._clock.stalled_s())
            except AgentError as exc:
                reason = f"agent stopped answering ({exc})"
                # A refusal proves the process is gone; silence may be load: wait longer for it.
                bound = max(silent_bound, self._lost_after_s) if exc.timed_out else self._lost_after_s
            if self.silent_s(client.address) >= bound:
                raise HostLostError(client.host, client.address, f"{reason} for {bound:g} s")
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))

"""The controller loop shared by every launcher: run `main(launch)` over proven agents.

It watches every agent for the program's whole life (a lost host cancels the program and is
named), holds every agent's lease on this controller with the same heartbeats (`monitor`: they
run on their own thread, so a program that blocks this event loop loses no agent), turns SIGTERM/SIGHUP/SIGINT into a bounded cleanup and exit code 128+signal, and reports the
program's failure as `art_mega.errors.EXIT_CODES` says (`describe_failure`): 0 success, 1 failure,
2 user error.
"""

from __future__ import annotations

import asyncio
import secrets
import signal
import sys
import traceback
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from art_mega.agent.client import AgentClient
from art_mega.errors import (
    AgentError,
    AgentUnauthorizedError,
    HostLostError,
    UserError,
    describe,
    exit_code_for,
)
from art_mega.launch.context import ArtLaunchContext
from art_mega.launch.program import ProgramRef
from art_mega.runtime.local_agent import LocalAgent, start_local_agent
from art_mega.runtime.monitor import STOP_SIGNALS, AgentMonitor
from art_mega.topology import EndpointSpec

HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
CLEANUP_TIMEOUT_S = 30.0
ABORT_CLEANUP_S = 5.0
"""Bound on closing the program's runtimes after a signal or a lost host: a stopped or cut-off
host must not hold up the others (their agents then stop every child they still have)."""
UNRESPONSIVE_AFTER_S = 1.0
"""After a signal or a lost host, an agent whose heartbeats have gone unanswered this long (two
beats) is cut off: the program's calls to it fail at once, and its launcher kills it at once."""


def report(message: str) -> None:
    """Print one line for the user on stderr."""
    print(f"art-mega: {message}", file=sys.stderr, flush=True)


class SignalGuard:
    """Turns the first SIGTERM/SIGHUP/SIGINT into a cancellation of `target`; later ones are noted.

    Cleanup that follows is never interrupted by another signal. `on_signal`, when set, is
    called first (from the event loop).
    """

    def __init__(self) -> None:
        self.received: int | None = None
        self.target: asyncio.Task[Any] | None = None
        self.on_signal: Callable[[], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def install(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.target = asyncio.current_task()
        for sig in HANDLED_SIGNALS:
            self._loop.add_signal_handler(sig, self._handle, sig)
            # The loop still learns of the signal through its wakeup fd; this handler runs on
            # the main thread even while the program blocks the loop, so the heartbeats can
            # tell a signal the loop will not handle (`monitor.UNHANDLED_SIGNAL_S`).
            signal.signal(sig, _count_arrival)

    def uninstall(self) -> None:
        if self._loop is not None:
            for sig in HANDLED_SIGNALS:
                self._loop.remove_signal_handler(sig)

    def _handle(self, sig: int) -> None:
        STOP_SIGNALS.handle()
        if self.received is not None:
            return
        self.received = sig
        report(f"received {signal.Signals(sig).name}; stopping every host")
        if self.on_signal is not None:
            self.on_signal()
        if self.target is not None:
            self.target.cancel()


def _count_arrival(signum: int, frame: object) -> None:
    """The Python-level handler of every handled signal (the loop's own runs from its wakeup fd)."""
    STOP_SIGNALS.arrive()


def describe_failure(exc: BaseException, debug: bool) -> tuple[int, str]:
    """Exit code and message for an exception that ended the program, as its row of
    `errors.EXIT_CODES` says: `errors.describe`'s one sentence, or the traceback for a failure
    in code (with "the program failed:" before it unless `debug`); `errors.exit_code_for`'s code."""
    code = exit_code_for(exc)
    if isinstance(exc, KeyboardInterrupt):
        return code, "the program raised KeyboardInterrupt; every host was stopped"
    sentence = describe(exc)
    if sentence is not None:
        return code, f"error: {sentence}"
    text = "".join(traceback.format_exception(exc))
    return code, f"the program failed:\n{text}" if not debug else text


async def supervise(
    main: Callable[[ArtLaunchContext], Any],
    launch: ArtLaunchContext,
    clients: Sequence[AgentClient],
    expected: dict[str, tuple[str, int]],
    guard: SignalGuard,
    debug: bool = False,
    watchers: Sequence[Callable[[], Awaitable[None]]] = (),
    monitor: AgentMonitor | None = None,
    lost_out: list[HostLostError] | None = None,
) -> int:
    """Run `main(launch)` while watching every agent; return the process exit code.

    `lost_out`, when given, receives the `HostLostError` that ended the program (none when it
    ended otherwise), so a launcher can restart (`run_with_restarts`).

    `watchers` are extra coroutine functions (e.g. one per SSH session) that raise
    `HostLostError` when their host is lost; that cancels the program like a lost heartbeat.
    `monitor`: the launcher's running heartbeats (it stops them once its agents are stopped);
    None: one over `clients` and `expected`, stopped on return. After a signal or a lost host
    the program's runtimes get `ABORT_CLEANUP_S` seconds to close.
    """
    owned = monitor is None
    watched = AgentMonitor(clients, expected, _ignore_loss) if monitor is None else monitor
    main_task = asyncio.create_task(main(launch), name="art-mega-program")
    guard.target = main_task
    lost: list[HostLostError] = [] if lost_out is None else lost_out
    cutting: list[asyncio.Task[None]] = []

    def start_cutting() -> None:
        if not cutting:
            cutting.append(asyncio.create_task(_cut_off_unresponsive(launch, watched)))

    def on_lost(exc: HostLostError) -> None:
        lost.append(exc)
        report(f"error: {exc}; cancelling the program")
        start_cutting()
        main_task.cancel()

    guard.on_signal = start_cutting
    watched.on_lost = on_lost
    if owned:
        watched.start()
    elif watched.lost is not None:
        on_lost(watched.lost)

    def watcher_done(task: asyncio.Task[None]) -> None:
        if not task.cancelled() and isinstance(task.exception(), HostLostError) and not lost:
            on_lost(task.exception())  # type: ignore[arg-type]

    watching = [asyncio.create_task(w()) for w in watchers]
    for task in watching:
        task.add_done_callback(watcher_done)
    code = 0
    try:
        await main_task
    except asyncio.CancelledError:
        if guard.received is not None:
            code = 128 + guard.received
        elif lost:
            code = 1
        else:
            raise
    except BaseException as exc:  # the user's program: report, never re-raise
        if guard.received is not None:
            code = 128 + guard.received
        elif lost:
            code = 1
        elif isinstance(exc, AgentError) and (found := await _confirm_lost(clients, exc)) is not None:
            code = 1
            lost.append(found)
            report(f"error: {found}; the program was stopped")
        else:
            code, message = describe_failure(exc, debug)
            report(message)
    finally:
        watched.on_lost = _ignore_loss  # agents stopped from here on are not "lost"
        for task in watching:
            task.cancel()
        await asyncio.gather(*watching, return_exceptions=True)
        aborted = bool(lost) or guard.received is not None
        await _close_runtimes(launch, ABORT_CLEANUP_S if aborted else CLEANUP_TIMEOUT_S)
        guard.on_signal = None
        for task in cutting:
            task.cancel()
        await asyncio.gather(*cutting, return_exceptions=True)
        if owned:
            await watched.stop()
    return code


async def run_with_restarts(
    attempt: Callable[[int], Awaitable[tuple[int, HostLostError | None]]],
    max_restarts: int,
    guard: SignalGuard | None = None,
) -> int:
    """Run `attempt(n)` (n = 0, 1, ...) until it ends without a lost host, a signal arrives, or
    `max_restarts` restarts are spent (torchelastic's `--max-restarts`); return the last code.

    `attempt` starts every host, proves it, runs the program and stops every host; it returns
    its exit code and the `HostLostError` that ended it (None: it ended otherwise). Each restart
    is reported with its cause on stderr and recorded in `metrics.LAUNCH_RESTARTS`, which a
    model writes into its run's history.jsonl when the program registers it again (the program
    resumes from its run's LATEST checkpoint, as any relaunch does).
    """
    from art_mega.metrics import LAUNCH_RESTARTS

    number = 0
    while True:
        code, lost = await attempt(number)
        signalled = guard is not None and guard.received is not None
        if lost is None or signalled or code == 0:
            return code
        if number >= max_restarts:
            if max_restarts:
                report(f"error: {lost}; no restart left (--max-restarts {max_restarts})")
            return code
        number += 1
        report(
            f"restart {number}/{max_restarts}: {lost}; every host was stopped, now waiting for the hosts, "
            "proving the cluster again and rerunning the program (it resumes from LATEST)"
        )
        LAUNCH_RESTARTS.append({"restart": number, "max_restarts": max_restarts, "cause": str(lost)})


async def _cut_off_unresponsive(launch: ArtLaunchContext, monitor: AgentMonitor) -> None:
    """Until cancelled, close the program's clients of every host that is lost or stops
    answering: its calls (the program's own cleanup included) then fail at once instead of
    waiting out their timeouts, which a stopped host would make every step of cleanup do."""
    cut: set[str] = set()
    while True:
        for silent in monitor.unresponsive(UNRESPONSIVE_AFTER_S):
            if silent.address in cut:
                continue
            cut.add(silent.address)
            for runtime in launch._runtimes:
                for client in runtime.clients.values():
                    if client.address == silent.address:
                        await client.aclose()
        await asyncio.sleep(0.1)


def _ignore_loss(exc: HostLostError) -> None:
    """The monitor's loss handler once the program has ended."""


async def _confirm_lost(clients: Sequence[AgentClient], exc: AgentError) -> HostLostError | None:
    """If the agent behind a failed call no longer answers, name it as this launch's lost host."""
    for client in clients:
        if client.address == exc.address:
            try:
                await client.health(timeout_s=1.0)
            except AgentError:
                return HostLostError(client.host, client.address, exc.reason)
            return None
    return None


async def _close_runtimes(launch: ArtLaunchContext, timeout_s: float) -> bool:
    """Close the program's runtimes, newest first, within `timeout_s` seconds in all; True when
    every one closed (what is left runs under agents that their launcher stops)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    clean = True
    for runtime in reversed(launch._runtimes):
        try:
            await asyncio.wait_for(runtime.close(), max(0.0, deadline - loop.time()))
        except TimeoutError:
            clean = False
            report(f"warning: closing a runtime took over {timeout_s:g} s; its agents stop what is left")
        except Exception as exc:  # cleanup goes on for the others
            clean = False
            report(f"warning: closing a runtime failed: {exc}")
    return clean


async def run_local(
    main: Callable[[ArtLaunchContext], Any],
    program: ProgramRef,
    port: int,
    startup_timeout_s: float,
    debug: bool = False,
    controller_lease_s: float | None = None,
    max_restarts: int = 0,
) -> int:
    """`art-mega local`: own one loopback agent, run the program, stop the agent.

    `controller_lease_s`: the agent's `--controller-lease` (None: the environment's or 20 s).
    A lost agent (killed, frozen) is started again and the program rerun up to `max_restarts`
    times (`run_with_restarts`)."""
    guard = SignalGuard()
    guard.install()
    try:

        async def attempt(number: int) -> tuple[int, HostLostError | None]:
            return await _run_local_once(
                main, program, port, startup_timeout_s, debug, controller_lease_s, guard
            )

        return await run_with_restarts(attempt, max_restarts, guard)
    finally:
        guard.uninstall()


async def _run_local_once(
    main: Callable[[ArtLaunchContext], Any],
    program: ProgramRef,
    port: int,
    startup_timeout_s: float,
    debug: bool,
    controller_lease_s: float | None,
    guard: SignalGuard,
) -> tuple[int, HostLostError | None]:
    launch_id = secrets.token_hex(8)
    secret = secrets.token_hex(32).encode()
    agent: LocalAgent | None = None
    clients: list[AgentClient] = []
    lost: list[HostLostError] = []
    code = 0
    try:
        agent = await start_local_agent(
            "host0",
            EndpointSpec(host="127.0.0.1", port=port),
            launch_id,
            secret,
            startup_timeout_s,
            controller_lease_s,
        )
        client = AgentClient("host0", agent.endpoint.address, agent.endpoint.url, secret)
        clients.append(client)
        launch = ArtLaunchContext(
            worker_addresses=(agent.endpoint.address,),
            launch_id=launch_id,
            controller_rank=0,
            sys_path=program.sys_path,
            _secret=secret,
        )
        code = await supervise(
            main, launch, clients, {"host0": (launch_id, agent.pid)}, guard, debug, lost_out=lost
        )
    except asyncio.CancelledError:
        code = 128 + (guard.received or signal.SIGTERM)
    finally:
        await asyncio.shield(_stop_local(agent, clients))
    return code, (lost[0] if lost else None)


async def _stop_local(agent: LocalAgent | None, clients: list[AgentClient]) -> None:
    for client in clients:
        try:
            await client.shutdown(timeout_s=5.0)
        except AgentError:
            pass
        await client.aclose()
    if agent is not None:
        await agent.stop(grace_s=5.0)


async def run_attached(
    main: Callable[[ArtLaunchContext], Any],
    program: ProgramRef,
    worker_addresses: Sequence[str],
    secret: bytes,
    launch_id: str | None,
    debug: bool = False,
) -> int:
    """`art-mega controller`: run the program over agents someone else started.

    Every agent must answer a signed health call and report one launch id (the given one, or
    the first agent's when none is given). The agents are not stopped at the end: when the
    program ended on its own, their leases are released and they wait for the next controller;
    after a signal or a lost host their leases run out and they stop their children and exit.
    """
    guard = SignalGuard()
    guard.install()
    endpoints = [EndpointSpec.parse(a) for a in worker_addresses]
    if len({e.address for e in endpoints}) != len(endpoints):
        raise UserError(f"--worker values must be unique, got {[e.address for e in endpoints]}")
    clients = [AgentClient(f"host{i}", e.address, e.url, secret) for i, e in enumerate(endpoints)]
    try:
        try:
            replies = await asyncio.gather(*(c.health(timeout_s=10.0) for c in clients))
        except AgentError as exc:
            if isinstance(exc, AgentUnauthorizedError):
                raise UserError(
                    f"--worker {exc.address} refused the launch secret; set ART_MEGA_SECRET to the secret the workers were started with"
                ) from None
            raise UserError(
                f"--worker {exc.address} does not answer; is `art-mega worker` running there? ({exc})"
            ) from None
        seen: dict[tuple[str, int, str], str] = {}
        for client, reply in zip(clients, replies):
            key = (reply.boot_id, reply.pid, reply.hostname)
            if key in seen:
                raise UserError(
                    f"--worker {client.address} is the same agent as --worker {seen[key]}; list each agent once"
                )
            seen[key] = client.address
        wanted = launch_id or replies[0].launch_id
        for client, reply in zip(clients, replies):
            if reply.launch_id != wanted:
                raise UserError(
                    f"--worker {client.address} reports launch id {reply.launch_id}, expected {wanted}; "
                    "start every worker with the same --launch-id"
                )
        launch = ArtLaunchContext(
            worker_addresses=tuple(e.address for e in endpoints),
            launch_id=wanted,
            sys_path=program.sys_path,
            _secret=secret,
        )
        expected = {c.host: (r.launch_id, r.pid) for c, r in zip(clients, replies)}
        monitor = AgentMonitor(clients, expected, _ignore_loss)
        monitor.start()
        try:
            code = await supervise(main, launch, clients, expected, guard, debug, monitor=monitor)
        finally:
            if guard.received is None and monitor.lost is None:
                await monitor.release()
            await monitor.stop()
        return code
    except asyncio.CancelledError:
        return 128 + (guard.received or signal.SIGTERM)
    finally:
        await asyncio.gather(*(c.aclose() for c in clients), return_exceptions=True)
        guard.uninstall()

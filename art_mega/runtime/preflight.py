"""The preflight collective, controller side: one probe rank per participating host, proved.

Each host's agent runs `preflight_probe` in the environment the trainer (or replica) will use:
gloo on CPU, NCCL with its network proved from the log on GPU. It checks the all-reduce sum
N(N+1)/2, membership and order against the topology, and measures GB/s per host pair. Bounded by
`timeout_s`; a rank that never arrives is named and every probe process is stopped.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from art_mega.runtime.admission import PreflightError
from art_mega.runtime.client import AgentClient
from art_mega.runtime.protocol import PreflightRunRequest, PreflightRunResponse


@dataclass(frozen=True)
class CollectiveReport:
    """What the collective proved and measured."""

    host_ids: tuple[str, ...]
    backend: str
    members: tuple[dict[str, Any], ...] = ()
    bandwidth_gbps: dict[str, float] = field(default_factory=dict)
    """GB/s per link, keyed "hostA-hostB" (a measurement, never pass/fail)."""
    seconds: float = 0.0
    """Wall time of the whole phase, probe start-up included."""
    run_s: dict[str, float] = field(default_factory=dict)
    """Per host: seconds from its probe having the config (torch imported) to its result."""


async def run_collective(
    clients: Mapping[str, AgentClient],
    host_ids: Sequence[str],
    master_host: str,
    timeout_s: float,
    backend: Literal["gloo", "nccl"] = "gloo",
    nccl_net: str | None = None,
    python: str | None = None,
    bandwidth_bytes: int = 8 << 20,
    log_dir: str = "/tmp",
) -> CollectiveReport:
    """Run one probe rank per host in `host_ids` (rank = position) and check the result.

    Raises:
        PreflightError: a rank did not arrive within `timeout_s` seconds (named), a rank failed
            (host, rank and its error), or membership/order differ from the topology.
    """
    started = time.monotonic()
    world = len(host_ids)
    port = await clients[host_ids[0]].free_port(master_host)
    requests = {
        host: PreflightRunRequest(
            config={
                "rank": rank,
                "world_size": world,
                "host_id": host,
                "master_host": master_host,
                "master_port": port,
                "backend": backend,
                "nccl_net": nccl_net,
                "timeout_s": timeout_s,
                "bandwidth_bytes": bandwidth_bytes,
                "log_dir": log_dir,
            },
            python=python,
            timeout_s=timeout_s,
        )
        for rank, host in enumerate(host_ids)
    }
    replies: list[PreflightRunResponse | BaseException] = await asyncio.gather(
        *(clients[h].preflight_run(r) for h, r in requests.items()), return_exceptions=True
    )
    by_host = dict(zip(host_ids, replies))
    _raise_for_failures(by_host, host_ids, timeout_s)
    results = {h: r.result for h, r in by_host.items() if isinstance(r, PreflightRunResponse) and r.result}
    members = tuple(results[host_ids[0]]["members"])
    for rank, member in enumerate(members):
        if (
            member.get("rank") != rank
            or member.get("host") != host_ids[rank]
            or member.get("backend") != backend
        ):
            raise PreflightError(
                f"preflight collective: rank {rank} reported {member}, expected host {host_ids[rank]} on {backend}"
            )
    bandwidth: dict[str, float] = {}
    for result in results.values():
        for link, gbps in result.get("bandwidth_gbps", {}).items():
            i, j = (int(x) for x in link.split("-"))
            bandwidth[f"{host_ids[i]}-{host_ids[j]}"] = round(float(gbps), 3)
    run_s = {h: float(r.get("run_s", 0.0)) for h, r in results.items()}
    return CollectiveReport(tuple(host_ids), backend, members, bandwidth, time.monotonic() - started, run_s)


def _raise_for_failures(
    by_host: Mapping[str, PreflightRunResponse | BaseException], host_ids: Sequence[str], timeout_s: float
) -> None:
    missing: set[int] = set()
    failures = []
    for rank, host in enumerate(host_ids):
        reply = by_host[host]
        if isinstance(reply, BaseException):
            failures.append(f"host {host} (rank {rank}): {reply}")
            continue
        result = reply.result or {}
        if reply.timed_out or result.get("phase") == "start":
            missing.add(rank)
        elif result.get("missing_ranks"):
            missing.update(int(r) for r in result["missing_ranks"])
        elif not result.get("ok"):
            failures.append(f"host {host} (rank {rank}): {_why_failed(reply)}")
    if missing:
        names = ", ".join(f"host {host_ids[r]} (rank {r})" for r in sorted(missing))
        # a rank that failed at once (killed, bad config) is reported missing by the others
        why = f" ({'; '.join(f.splitlines()[0] for f in failures)})" if failures else ""
        raise PreflightError(
            f"preflight collective: {names} did not arrive within {timeout_s:g} s; every probe was stopped{why}"
        )
    if failures:
        # a rank stuck after rendezvous blames its whole group: name where each one was stuck
        raise PreflightError("preflight collective failed on " + "; ".join(failures))


def _why_failed(reply: PreflightRunResponse) -> str:
    """The probe's own error, else how its process ended and the last line it wrote to stderr."""
    error = (reply.result or {}).get("error")
    if error:
        return str(error)
    code = reply.exit_code
    try:
        how = f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0 else ""
    except ValueError:
        how = ""
    how = how or f"exited with code {code}"
    tail = reply.stderr_tail.strip().splitlines()[-1:]
    return f"the probe {how} without a result" + (f"; its stderr ends: {tail[0]}" if tail else "")

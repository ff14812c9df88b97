"""The preflight collective, controller side: one probe rank per participating host, proved.

Each host's agent runs `preflight.probe` in the environment the trainer (or replica) will use:
gloo on CPU, NCCL with its network proved from the log on GPU. It checks the all-reduce sum
N(N+1)/2, membership and order against the topology, one torch version across the ranks, and
measures GB/s per host pair. Bounded by `timeout_s`; a rank that never arrives is named and every
probe process is stopped. A rank that fails on its own (a bad interface, a torch that cannot be
imported, a probe that died) ends the collective at once: the other ranks' probes are stopped
instead of waiting out `timeout_s`, and only the failed host is named.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from art_mega.agent.client import AgentClient
from art_mega.errors import PreflightError
from art_mega.preflight.protocol import (
    PREFLIGHT_DISCARD,
    PREFLIGHT_RUN,
    PreflightRunRequest,
    PreflightRunResponse,
)

STOP_GRACE_S = 1.0
"""Seconds the other ranks get to answer after one failed on its own before they are stopped: a
rank that died mid-collective and the peers that saw it die answer together, and all are named."""
STOPPED_REPLY_S = 10.0
"""Seconds a stopped rank's agent gets to answer after its probe was stopped."""


@dataclass(frozen=True)
class CollectiveReport:
    """What the collective proved and measured, in which environment."""

    host_ids: tuple[str, ...]
    backend: str
    members: tuple[dict[str, Any], ...] = ()
    bandwidth_gbps: dict[str, float] = field(default_factory=dict)
    """GB/s per link, keyed "hostA-hostB" (a measurement, never pass/fail)."""
    seconds: float = 0.0
    """Wall time of the whole phase, probe start-up included."""
    run_s: dict[str, float] = field(default_factory=dict)
    """Per host: seconds from its probe having the config (torch imported) to its result."""
    environment: str = "trainer"
    """Whose environment it ran in: "trainer" or an inference spec's name (several: comma-joined)."""
    python: str = ""
    """The interpreter it ran under ("" : each agent's own)."""


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
    environment: str = "trainer",
) -> CollectiveReport:
    """Run one probe rank per host in `host_ids` (rank = position) under `python` and check it.

    `environment` names whose environment `python` is (None: each agent's own interpreter);
    every error names it and the interpreter.

    Raises:
        PreflightError: a rank failed on its own (host, rank and its error; raised as soon as it
            answered, the other ranks' probes stopped), a rank did not arrive within `timeout_s`
            seconds (named), membership/order differ from the topology, or the ranks' torch
            versions differ.
    """
    started = time.monotonic()
    world = len(host_ids)
    label = environment_label(environment, python)
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
    by_host, stopped = await _await_ranks(clients, requests)
    _raise_for_failures(by_host, host_ids, timeout_s, stopped, label)
    results = {h: r.result for h, r in by_host.items() if isinstance(r, PreflightRunResponse) and r.result}
    members = tuple(results[host_ids[0]]["members"])
    for rank, member in enumerate(members):
        if (
            member.get("rank") != rank
            or member.get("host") != host_ids[rank]
            or member.get("backend") != backend
        ):
            raise PreflightError(
                f"preflight collective in {label}: rank {rank} reported {member}, expected host "
                f"{host_ids[rank]} on {backend}",
                (host_ids[rank],),
            )
    versions = {m.get("torch") for m in members}
    if len(versions) > 1:
        each = ", ".join(f"host {m['host']} has torch {m.get('torch')}" for m in members)
        raise PreflightError(
            f"preflight collective in {label}: the ranks' torch versions differ ({each}); "
            "install one torch version in that environment on every host",
            tuple(host_ids),
        )
    bandwidth: dict[str, float] = {}
    for result in results.values():
        for link, gbps in result.get("bandwidth_gbps", {}).items():
            i, j = (int(x) for x in link.split("-"))
            bandwidth[f"{host_ids[i]}-{host_ids[j]}"] = round(float(gbps), 3)
    run_s = {h: float(r.get("run_s", 0.0)) for h, r in results.items()}
    return CollectiveReport(
        tuple(host_ids),
        backend,
        members,
        bandwidth,
        time.monotonic() - started,
        run_s,
        environment,
        python or "",
    )


def environment_label(environment: str, python: str | None) -> str:
    """How errors name an environment: "the trainer environment (each agent's Python)" or
    "the vllm environment (.venv-vllm/bin/python)"."""
    interpreter = python or "each agent's Python"
    return f"the {environment} environment ({interpreter})"


async def _await_ranks(
    clients: Mapping[str, AgentClient], requests: Mapping[str, PreflightRunRequest]
) -> tuple[dict[str, PreflightRunResponse | BaseException], set[str]]:
    """Every rank's reply (or the exception of its request) and the hosts whose probes were
    stopped because another rank failed on its own first (their replies are not theirs)."""
    tasks = {
        h: asyncio.ensure_future(clients[h].call(PREFLIGHT_RUN, r, timeout_s=r.timeout_s + 30))
        for h, r in requests.items()
    }
    pending = set(tasks.values())
    try:
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if any(failed_on_its_own(_outcome(t)) for t in done):
                break
        stopped: set[str] = set()
        if pending:
            _, pending = await asyncio.wait(pending, timeout=STOP_GRACE_S)
            stopped = {h for h, t in tasks.items() if t in pending}
            await asyncio.gather(
                *(clients[h].call(PREFLIGHT_DISCARD) for h in stopped), return_exceptions=True
            )
            if pending:
                await asyncio.wait(pending, timeout=STOPPED_REPLY_S)
    finally:
        for task in tasks.values():
            task.cancel()  # no-op for the finished ones
    by_host = {h: _outcome(t) for h, t in tasks.items() if h not in stopped}
    return by_host, stopped


def _outcome(task: asyncio.Future) -> PreflightRunResponse | BaseException:
    if task.cancelled():
        return asyncio.CancelledError()
    return task.exception() or task.result()


def failed_on_its_own(reply: PreflightRunResponse | BaseException) -> bool:
    """True for a rank that failed for its own reasons, at once: its agent could not run it, its
    probe died without a result, or the probe reported an error. False for success and for the
    timeouts every rank sees alike (a rank missing at the rendezvous, a watchdog)."""
    if isinstance(reply, BaseException):
        return True
    if reply.timed_out:
        return False
    result = reply.result
    if result is None:
        return True
    if result.get("ok") or result.get("timed_out") or result.get("missing_ranks"):
        return False
    return result.get("phase") != "start"


def _raise_for_failures(
    by_host: Mapping[str, PreflightRunResponse | BaseException],
    host_ids: Sequence[str],
    timeout_s: float,
    stopped: Collection[str] = (),
    label: str = "the trainer environment (each agent's Python)",
) -> None:
    missing: set[int] = set()
    failures: list[tuple[int, str]] = []
    for rank, host in enumerate(host_ids):
        if host in stopped:
            continue
        reply = by_host[host]
        if isinstance(reply, BaseException):
            failures.append((rank, f"host {host} (rank {rank}): {reply}"))
            continue
        result = reply.result or {}
        if reply.timed_out or result.get("phase") == "start":
            missing.add(rank)
        elif result.get("missing_ranks"):
            missing.update(int(r) for r in result["missing_ranks"])
        elif not result.get("ok"):
            failures.append((rank, f"host {host} (rank {rank}): {_why_failed(reply)}"))
    if missing:
        names = ", ".join(f"host {host_ids[r]} (rank {r})" for r in sorted(missing))
        # a rank that failed at once (killed, bad config) is reported missing by the others; what
        # the waiting ranks saw (rank 0's store gone after its timeout) explains nothing
        own = [f.splitlines()[0] for r, f in failures if r in missing]
        why = f" ({'; '.join(own)})" if own else ""
        raise PreflightError(
            f"preflight collective in {label}: {names} did not arrive within {timeout_s:g} s; "
            f"every probe was stopped{why}",
            tuple(host_ids[r] for r in sorted(missing)),
        )
    if failures:
        # a rank stuck after rendezvous blames its whole group: name where each one was stuck
        rest = "; the other ranks' probes were stopped" if stopped else ""
        raise PreflightError(
            f"preflight collective in {label} failed on " + "; ".join(f for _, f in failures) + rest,
            tuple(host_ids[r] for r, _ in failures),
        )


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

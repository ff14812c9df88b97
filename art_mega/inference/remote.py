"""The controller's side of replica start/stop: ask each replica's head host's agent.

All replicas start concurrently; if one fails, the ones that came up are stopped again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from art_mega.errors import ReplicaStartError, UserError
from art_mega.inference.protocol import (
    INFERENCE_START,
    INFERENCE_STOP,
    INFERENCE_WARM,
    InferenceStartRequest,
    InferenceStartResponse,
    InferenceStopRequest,
    InferenceWarmRequest,
    ReplicaLaunch,
)
from art_mega.topology.compiled import ReplicaSpec

if TYPE_CHECKING:
    from art_mega.agent.client import AgentClient


def _launch_for(
    launch: ReplicaLaunch | Callable[[ReplicaSpec], ReplicaLaunch], spec: ReplicaSpec
) -> ReplicaLaunch:
    return launch(spec) if callable(launch) else launch


async def start_replica(
    client: AgentClient, spec: ReplicaSpec, launch: ReplicaLaunch
) -> InferenceStartResponse:
    """Start replica `spec` on the client's host and wait until it is ready; the wait is bounded
    by `launch.ready_timeout_s` (+ 30 s for the reply). A failed start comes back in the reply
    (`ok=False`, `error`).

    Raises:
        AgentError: the agent did not answer.
    """
    body = InferenceStartRequest(replica=spec, launch=launch)
    return await client.call(INFERENCE_START, body, timeout_s=launch.ready_timeout_s + 30)


def check_serving_mode(replicas: Sequence[ReplicaSpec]) -> None:
    """Refuse shared mode (replicas sleeping on the trainer's GPUs) for a replica without GPUs.

    Raises `UserError` naming the replica: on CPU only dedicated mode exists.
    """
    for spec in replicas:
        if spec.shared_gpus and not any(gpus for _, gpus in spec.gpu_ids):
            raise UserError(
                f"InferenceSpec(name={spec.name!r}).shared_gpus=True, but replica {spec.process_name} "
                "runs on CPU, where replicas cannot sleep and wake around training; set shared_gpus=False."
            )


async def start_replicas(
    clients: Mapping[str, AgentClient],
    replicas: Sequence[ReplicaSpec],
    launch: ReplicaLaunch | Callable[[ReplicaSpec], ReplicaLaunch],
) -> list[InferenceStartResponse]:
    """Start every replica through the agent of its head host (`host_ids[0]`), concurrently,
    and wait until each is ready (health + warm-up). `launch` is shared or made per replica.

    Returns the agents' answers (pid, log path, URL, seconds) in `replicas` order.

    Raises:
        UserError: shared mode asked for a CPU replica (see `check_serving_mode`).
        ReplicaStartError: a replica did not come up; names the host, replica and the agent's
            error (which carries the tail of the replica's log). The others are stopped.
        AgentError: an agent did not answer.
    """
    check_serving_mode(replicas)
    for spec in replicas:
        if spec.host_ids[0] not in clients:
            raise ReplicaStartError(
                f"replica {spec.process_name}: no agent client for host {spec.host_ids[0]}", spec.process_name
            )
        if len(spec.host_ids) > 1:
            raise ReplicaStartError(
                f"replica {spec.process_name} spans hosts {list(spec.host_ids)}; multi-host replicas "
                "are not started by art-mega yet",
                spec.process_name,
            )
    results = await asyncio.gather(
        *(start_replica(clients[s.host_ids[0]], s, _launch_for(launch, s)) for s in replicas),
        return_exceptions=True,
    )
    failed = [(s, r) for s, r in zip(replicas, results) if isinstance(r, BaseException) or not r.ok]
    if failed:
        await stop_replicas(clients, replicas)
        spec, result = failed[0]
        if isinstance(result, BaseException):
            raise result
        raise ReplicaStartError(f"host {spec.host_ids[0]}: {result.error}", spec.process_name)
    return list(results)  # type: ignore[arg-type]


async def stop_replicas(clients: Mapping[str, AgentClient], replicas: Sequence[ReplicaSpec]) -> None:
    """Stop the replicas (SIGTERM, SIGKILL after their grace) through their agents; an agent
    that does not answer is skipped (its own shutdown stops its children)."""
    by_host: dict[str, list[str]] = {}
    for spec in replicas:
        by_host.setdefault(spec.host_ids[0], []).append(spec.process_name)
    await asyncio.gather(
        *(
            clients[h].call(INFERENCE_STOP, InferenceStopRequest(names=tuple(names)))
            for h, names in by_host.items()
            if h in clients
        ),
        return_exceptions=True,
    )


def cpu_replica_hosts(clients: Mapping[str, AgentClient], replicas: Sequence[ReplicaSpec]) -> list[str]:
    """The head hosts of the CPU replicas among `replicas` that `clients` reach, sorted."""
    return sorted(
        {s.host_ids[0] for s in replicas if not any(g for _, g in s.gpu_ids) and s.host_ids[0] in clients}
    )


async def warm_replicas(
    clients: Mapping[str, AgentClient], hosts: Sequence[str], python: str, cache_dir: str | None = None
) -> None:
    """Ask the agent of each of `hosts` (`cpu_replica_hosts`) to warm `python`, the interpreter
    its CPU replica will run under (`inference.warm`: vLLM is imported while the cluster is
    proved; `cache_dir`, the hosts' cache root, keeps what the import read, read ahead the next
    time). An optimisation only: a host whose agent could not start it is logged (warning)
    and its replica starts fresh. `unwarm_replicas` (or `stop_replicas`) stops what this
    started."""
    answers = await asyncio.gather(
        *(
            clients[h].call(INFERENCE_WARM, InferenceWarmRequest(python=python, cache_dir=cache_dir))
            for h in hosts
        ),
        return_exceptions=True,
    )
    for host, answer in zip(hosts, answers):
        error = answer if isinstance(answer, BaseException) else (None if answer.ok else answer.error)
        if error is not None:
            logging.getLogger(__name__).warning(
                "host %s: no warm replica interpreter (%s); its replica starts fresh", host, error
            )


async def unwarm_replicas(clients: Mapping[str, AgentClient], hosts: Sequence[str]) -> None:
    """Stop the warm interpreters `warm_replicas` started on `hosts`; an agent that does not
    answer is skipped (its close stops it)."""
    await asyncio.gather(
        *(clients[h].call(INFERENCE_WARM, InferenceWarmRequest(python=None)) for h in hosts if h in clients),
        return_exceptions=True,
    )

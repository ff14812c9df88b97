"""The rollout executor: runs the user's async rollout functions on worker processes of any host.

Arguments and results travel as JSON (`wire`); functions travel as import references pinned by
their source hash (`InstalledAsyncCallable`). Nothing is pickled.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from art_mega.agent.client import AgentClient
from art_mega.errors import RemoteRolloutError, RemoteUserError, RolloutValueError, UserError
from art_mega.rollouts import wire
from art_mega.rollouts.installed import InstalledAsyncCallable
from art_mega.rollouts.protocol import (
    RUN_ROLLOUT,
    START_WORKERS,
    STOP_WORKERS,
    CallableRef,
    RemoteFailure,
    RunRolloutRequest,
    StartRolloutWorkersRequest,
    StartRolloutWorkersResponse,
    StopRolloutWorkersRequest,
)


def raise_failure(host: str, failure: RemoteFailure, worker_id: str = "") -> None:
    """Raise `RemoteUserError` (a `UserError`) for a user-kind failure, `RemoteRolloutError` otherwise."""
    if failure.kind == "user":
        raise RemoteUserError(failure.message, host, worker_id, failure.exc_type)
    raise RemoteRolloutError(host, worker_id, failure)


async def start_rollout_workers(
    client: AgentClient, count: int, sys_path: tuple[str, ...], callables: tuple[CallableRef, ...]
) -> StartRolloutWorkersResponse:
    """Start `count` workers on the client's host that have imported and hash-checked `callables`
    (all or none; no timeout: imports take as long as they take).

    Raises:
        UserError: a worker refused a callable (e.g. its source changed).
        RemoteRolloutError: a worker failed to start for another reason.
        AgentError: the agent did not answer.
    """
    body = StartRolloutWorkersRequest(count=count, sys_path=sys_path, callables=callables)
    reply = await client.call(START_WORKERS, body, timeout_s=None)
    if reply.failure is not None:
        raise_failure(client.host, reply.failure)
    return reply


async def run_rollout(
    client: AgentClient, worker_id: str, ref: CallableRef, args: list[Any], kwargs: dict[str, Any]
) -> Any:
    """Run one rollout on worker `worker_id` of the client's host and return its wire-encoded
    result (no timeout: a rollout runs as long as it does).

    Raises:
        UserError: the worker refused the callable (e.g. its source changed).
        RemoteRolloutError: the rollout raised.
        AgentError: the agent did not answer.
    """
    body = RunRolloutRequest(worker_id=worker_id, callable=ref, args=args, kwargs=kwargs)
    reply = await client.call(RUN_ROLLOUT, body, timeout_s=None)
    if not reply.ok:
        raise_failure(
            client.host, reply.failure or RemoteFailure(kind="error", message="unknown failure"), worker_id
        )
    return reply.result


class RolloutWorker(BaseModel):
    """One rollout worker process: its index in the executor, host, agent-local id and PID."""

    model_config = ConfigDict(frozen=True)

    index: int
    host_id: str
    worker_id: str
    pid: int


def module_root(module_name: str) -> str | None:
    """The sys.path entry from which `module_name` was imported (its file's top package parent)."""
    module = sys.modules.get(module_name)
    path = getattr(module, "__file__", None)
    if not path:
        return None
    root = Path(path).resolve().parent
    depth = module_name.count(".")
    if Path(path).name == "__init__.py":
        depth += 1
    for _ in range(depth):
        root = root.parent
    return str(root)


def plan_workers(slots: Sequence[tuple[str, int]], target_workers: int | None) -> list[tuple[str, int]]:
    """Spread `target_workers` over hosts round-robin, at most each host's slots.

    Args:
        slots: (host_id, cpu_slots) per rollout host, in order.
        target_workers: total workers wanted; None = every slot.

    Returns:
        (host_id, count) per host with count >= 1.

    Raises:
        UserError: target_workers < 1 or more than the slots available.
    """
    total = sum(n for _, n in slots)
    if target_workers is None:
        target_workers = total
    if target_workers < 1 or target_workers > total:
        raise UserError(
            f"target_workers={target_workers} is out of range: the rollout hosts have {total} cpu_slots; "
            f"pass 1..{total} or raise HostSpec.cpu_slots"
        )
    counts = {host: 0 for host, _ in slots}
    remaining = target_workers
    while remaining:
        for host, limit in slots:
            if remaining and counts[host] < limit:
                counts[host] += 1
                remaining -= 1
    return [(h, c) for h, c in counts.items() if c]


class RolloutExecutor:
    """Rollout worker processes across hosts; `run` executes one call on a chosen worker."""

    def __init__(self, clients: dict[str, AgentClient], workers: Sequence[RolloutWorker]) -> None:
        self._clients = clients
        self.workers: tuple[RolloutWorker, ...] = tuple(workers)
        self._installed: dict[Callable[..., Any], InstalledAsyncCallable] = {}
        self._load = [0] * len(self.workers)
        self._closed = False

    def _ref(self, fn: Callable[..., Any]) -> InstalledAsyncCallable:
        installed = self._installed.get(fn)
        if installed is None:
            installed = InstalledAsyncCallable.from_callable(fn)
            self._installed[fn] = installed
        return installed

    def _worker(self, worker: int | RolloutWorker) -> RolloutWorker:
        index = worker.index if isinstance(worker, RolloutWorker) else worker
        if not isinstance(index, int) or not 0 <= index < len(self.workers):
            raise UserError(
                f"worker={worker!r} is not a worker of this executor; use 0..{len(self.workers) - 1}"
            )
        return self.workers[index]

    async def run(
        self, worker: int | RolloutWorker, fn: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> Any:
        """Run `await fn(*args, **kwargs)` on `worker` (an index or a `RolloutWorker`).

        Returns the result decoded from JSON (pydantic models come back as their class; what
        travels and the conversions made are in `rollouts.wire`).

        Raises:
            RolloutValueError: an argument or the result holds a value JSON cannot carry (a set,
                bytes, a numpy array, ...), or the result cannot be rebuilt here; names the key
                path and the host.
            UserError: bad worker, `fn` not a top-level async def, or the worker refused `fn`
                (its source changed).
            RemoteRolloutError: `fn` raised on the worker (message and remote traceback kept).
            AgentError: the worker's agent did not answer.
        """
        if self._closed:
            raise RuntimeError("this rollout executor is closed")
        target = self._worker(worker)
        ref = self._ref(fn).ref()
        name, host = f"{ref.module}:{ref.qualname}", target.host_id
        where = f"host {host} (worker {target.worker_id})"
        try:
            payload_args = wire.encode(list(args), "args")
            payload_kwargs = wire.encode(dict(kwargs), "kwargs")
        except wire.WireError as exc:
            raise RolloutValueError(
                f"an argument of rollout {name} cannot travel to {where}: {exc}", name, host, str(exc)
            ) from None
        self._load[target.index] += 1
        try:
            result = await run_rollout(
                self._clients[host], target.worker_id, ref, payload_args, payload_kwargs
            )
        except RemoteUserError as exc:
            if exc.exc_type != wire.WireError.__name__:
                raise
            raise RolloutValueError(f"rollout {name} on {where} {exc}", name, host, str(exc)) from None
        finally:
            self._load[target.index] -= 1
        try:
            return wire.decode(result)
        except wire.WireError as exc:
            raise RolloutValueError(
                f"the result of rollout {name} from {where} cannot be rebuilt here: {exc}",
                name,
                host,
                str(exc),
            ) from None

    async def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run on the worker with the fewest calls in flight (ties: lowest index)."""
        index = min(range(len(self.workers)), key=lambda i: self._load[i])
        return await self.run(index, fn, *args, **kwargs)

    async def close(self, timeout_s: float = 30.0) -> None:
        """Stop every worker process of this executor (idempotent)."""
        if self._closed:
            return
        self._closed = True
        by_host: dict[str, list[str]] = {}
        for w in self.workers:
            by_host.setdefault(w.host_id, []).append(w.worker_id)

        async def stop(host: str, ids: list[str]) -> None:
            try:
                stopping = self._clients[host].call(
                    STOP_WORKERS, StopRolloutWorkersRequest(worker_ids=tuple(ids))
                )
                await asyncio.wait_for(stopping, timeout_s)
            except Exception:  # a lost host has no workers left to stop
                pass

        await asyncio.gather(*(stop(h, ids) for h, ids in by_host.items()))


async def start_executor(
    clients: dict[str, AgentClient],
    slots: Sequence[tuple[str, int]],
    callables: Sequence[Callable[..., Any]],
    target_workers: int | None,
    sys_path: Sequence[str] = (),
) -> RolloutExecutor:
    """Start rollout workers on the rollout hosts; each imports and hash-checks `callables` first.

    All or nothing: if one host fails, workers already started elsewhere are stopped.
    """
    installed = [InstalledAsyncCallable.from_callable(fn) for fn in callables]
    roots = [r for r in (module_root(i.module) for i in installed) if r]
    path = tuple(dict.fromkeys([*sys_path, *roots]))
    refs = tuple(i.ref() for i in installed)
    plan = plan_workers(slots, target_workers)
    results = await asyncio.gather(
        *(start_rollout_workers(clients[host], count, path, refs) for host, count in plan),
        return_exceptions=True,
    )
    failures = [r for r in results if isinstance(r, BaseException)]
    if failures:
        await asyncio.gather(
            *(
                clients[host].call(STOP_WORKERS, StopRolloutWorkersRequest(worker_ids=r.worker_ids))
                for (host, _), r in zip(plan, results)
                if not isinstance(r, BaseException)
            ),
            return_exceptions=True,
        )
        raise failures[0]
    workers: list[RolloutWorker] = []
    for (host, _), reply in zip(plan, results):
        for worker_id, pid in zip(reply.worker_ids, reply.pids):
            workers.append(RolloutWorker(index=len(workers), host_id=host, worker_id=worker_id, pid=pid))
    executor = RolloutExecutor(clients, workers)
    for fn, inst in zip(callables, installed):
        executor._installed[fn] = inst
    return executor

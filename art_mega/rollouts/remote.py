"""The rollout executor: runs the user's async rollout functions on worker processes of any host.

Arguments and results travel as JSON (`wire`); functions travel as import references pinned by
their source hash (`InstalledAsyncCallable`). Nothing is pickled.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Generator, Sequence
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
        UserError: target_workers not an int (or None), < 1 or more than the slots available.
    """
    total = sum(n for _, n in slots)
    if target_workers is None:
        target_workers = total
    if type(target_workers) is not int:
        raise UserError(
            f"target_workers={target_workers!r} is not a number of worker processes; pass an int "
            f"1..{total} or None for every cpu_slot"
        )
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
    """Rollout worker processes across hosts; `run` executes one call on a chosen worker.

    `ArtRuntime.rollout_executor` returns it before any process exists (ART's executor is used
    without await): the processes start on `await executor` (or `await executor.start()`), else
    on the first `run` or `submit`. A worker id names one process: ids 0..target_workers-1 name
    the processes in order until `set_workers` gives ART's own worker ids.
    """

    def __init__(
        self,
        clients: dict[str, AgentClient],
        slots: Sequence[tuple[str, int]],
        callables: Sequence[Callable[..., Any] | InstalledAsyncCallable],
        target_workers: int | None = None,
        sys_path: Sequence[str] = (),
    ) -> None:
        """Plan the workers of `target_workers` over `slots` ((host_id, cpu_slots) per rollout
        host, in order; None = every slot) for `callables`; nothing starts here.

        Raises:
            UserError: a callable `InstalledAsyncCallable.from_callable` refuses; target_workers
                not an int or out of range (see `plan_workers`).
        """
        installed = [InstalledAsyncCallable.from_callable(fn) for fn in callables]
        self._plan = plan_workers(slots, target_workers)
        self._clients = clients
        self.target_workers = sum(count for _, count in self._plan)
        """Number of worker processes (started or to start)."""
        roots = [r for r in (module_root(i.module) for i in installed) if r]
        self._sys_path = tuple(dict.fromkeys([*sys_path, *roots]))
        self._refs = tuple(i.ref() for i in installed)
        self._installed: dict[Any, InstalledAsyncCallable] = dict(zip(callables, installed))
        self._workers: tuple[RolloutWorker, ...] | None = None
        self._starting: asyncio.Future[None] | None = None
        self._assigned: dict[int, int] = {i: i for i in range(self.target_workers)}
        """worker id -> process index"""
        self._load = [0] * self.target_workers
        self._closed = False

    @property
    def workers(self) -> tuple[RolloutWorker, ...]:
        """The worker processes in index order (host by host as planned).

        Raises:
            UserError: they are not started yet.
        """
        if self._workers is None:
            raise UserError(
                "this rollout executor's workers are not started yet; `await executor` (or "
                "`await executor.start()`) first, or run a rollout, which starts them"
            )
        return self._workers

    @property
    def worker_ids(self) -> tuple[int, ...]:
        """The ids `run` takes, ascending (0..target_workers-1 until `set_workers`)."""
        return tuple(sorted(self._assigned))

    def set_workers(self, worker_ids: Sequence[int]) -> None:
        """Give the processes ART's worker ids: `run(worker_id, ...)` then runs on that id's process.

        An id kept from the previous assignment keeps its process; new ids, ascending, take the
        processes no kept id holds, lowest index first. Ids are any ints; ids left out are no
        longer accepted by `run`, and `submit` picks among the processes of the ids given. The
        processes themselves do not change (there are `target_workers` of them).

        Raises:
            UserError: `worker_ids` is not a tuple or list of ints, names an id twice, or names
                more ids than `target_workers`.
        """
        if not isinstance(worker_ids, (tuple, list)) or any(type(i) is not int for i in worker_ids):
            raise UserError(
                f"set_workers(worker_ids={worker_ids!r}) takes a tuple of int worker ids; pass e.g. "
                f"tuple(range({self.target_workers}))"
            )
        # the count first: the duplicate scan below is quadratic, so a huge list is refused before it
        if len(worker_ids) > self.target_workers:
            raise UserError(
                f"set_workers(worker_ids={worker_ids!r}) names {len(worker_ids)} workers, but the executor "
                f"has target_workers={self.target_workers} processes; pass at most {self.target_workers} "
                "ids or raise target_workers"
            )
        twice = sorted({i for i in worker_ids if worker_ids.count(i) > 1})
        if twice:
            raise UserError(
                f"set_workers(worker_ids={worker_ids!r}) names worker {twice[0]} more than once; "
                "give each id once"
            )
        kept = {i: self._assigned[i] for i in worker_ids if i in self._assigned}
        held = set(kept.values())
        free = iter(p for p in range(self.target_workers) if p not in held)
        new = {i: next(free) for i in sorted(set(worker_ids) - set(kept))}
        self._assigned = {i: kept[i] if i in kept else new[i] for i in worker_ids}

    def _ref(self, fn: Callable[..., Any] | InstalledAsyncCallable) -> InstalledAsyncCallable:
        installed = self._installed.get(fn)
        if installed is None:
            installed = InstalledAsyncCallable.from_callable(fn)
            self._installed[fn] = installed
        return installed

    def _index(self, worker: int | RolloutWorker) -> int:
        """The process index of a worker id or of one of `workers`."""
        if isinstance(worker, RolloutWorker):
            if self._workers is not None and worker in self._workers:
                return worker.index
        elif type(worker) is int and worker in self._assigned:
            return self._assigned[worker]
        ids = self.worker_ids
        named = f"0..{len(ids) - 1}" if ids == tuple(range(len(ids))) else str(list(ids))
        raise UserError(
            f"worker={worker!r} is not a worker of this executor; use a worker id ({named}, as "
            "set_workers gives them) or one of executor.workers"
        )

    async def start(self) -> RolloutExecutor:
        """Start the worker processes (once; a later call waits for that start) and return self.

        Each worker imports and hash-checks the executor's callables before it counts as
        started. All or nothing: if one host fails, the workers started elsewhere are stopped.

        Raises:
            UserError: a worker refused a callable (its module cannot be imported there, or
                changed since hashed); every later call raises it again.
            RemoteRolloutError: a worker failed to start for another reason.
            AgentError: an agent did not answer.
            RuntimeError: the executor is closed (or was closed while its workers started).
        """
        if self._closed:
            raise RuntimeError("this rollout executor is closed")
        if self._starting is None:
            self._starting = asyncio.ensure_future(self._start())
            # its waiters get its exception; one left with none (all cancelled) is not an error
            self._starting.add_done_callback(lambda task: task.cancelled() or task.exception())
        # shielded: one caller cancelled (e.g. one rollout of a gather) must not stop the start
        # the other callers wait for
        try:
            await asyncio.shield(self._starting)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if self._closed and not (current is not None and current.cancelling()):
                raise RuntimeError(
                    "this rollout executor was closed while its workers were starting"
                ) from None
            raise
        return self

    def __await__(self) -> Generator[Any, None, RolloutExecutor]:
        return self.start().__await__()

    async def _start(self) -> None:
        plan, clients = self._plan, self._clients
        starts = [
            asyncio.ensure_future(start_rollout_workers(clients[host], count, self._sys_path, self._refs))
            for host, count in plan
        ]
        try:
            results = await asyncio.gather(*starts, return_exceptions=True)
        except asyncio.CancelledError:  # closed while starting: stop what the hosts did start
            await self._stop_started(starts)
            raise
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            await self._stop_started(starts)
            raise failures[0]
        workers: list[RolloutWorker] = []
        for (host, _), reply in zip(plan, results):
            for worker_id, pid in zip(reply.worker_ids, reply.pids):
                workers.append(RolloutWorker(index=len(workers), host_id=host, worker_id=worker_id, pid=pid))
        self._workers = tuple(workers)

    async def _stop_started(self, starts: Sequence[asyncio.Future[StartRolloutWorkersResponse]]) -> None:
        """Stop the workers of the hosts whose start (in plan order) finished with a reply."""
        await asyncio.gather(
            *(
                self._clients[host].call(
                    STOP_WORKERS, StopRolloutWorkersRequest(worker_ids=start.result().worker_ids)
                )
                for (host, _), start in zip(self._plan, starts)
                if start.done() and not start.cancelled() and start.exception() is None
            ),
            return_exceptions=True,
        )

    async def run(
        self,
        worker: int | RolloutWorker,
        fn: Callable[..., Any] | InstalledAsyncCallable,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        """Run `await fn(*args, **kwargs)` on `worker` (a worker id or one of `workers`),
        starting the workers first if they are not.

        `fn` is a top-level async def or its `InstalledAsyncCallable`. Returns the result
        decoded from JSON (pydantic models come back as their class; what travels and the
        conversions made are in `rollouts.wire`).

        Raises:
            RolloutValueError: an argument or the result holds a value JSON cannot carry (a set,
                bytes, a numpy array, ...), or the result cannot be rebuilt here; names the key
                path and the host.
            UserError: an unknown worker, `fn` not a top-level async def, or the worker refused
                `fn` (its source changed).
            RemoteRolloutError: `fn` raised on the worker (message and remote traceback kept).
            AgentError: the worker's agent did not answer.
            What `start` raises.
        """
        if self._closed:
            raise RuntimeError("this rollout executor is closed")
        index = self._index(worker)
        return await self._run(index, fn, args, kwargs)

    async def _run(
        self,
        index: int,
        fn: Callable[..., Any] | InstalledAsyncCallable,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        ref = self._ref(fn).ref()
        await self.start()
        target = self.workers[index]
        name, host = f"{ref.module}:{ref.qualname}", target.host_id
        where = f"host {host} (worker {target.worker_id})"
        try:
            payload_args = wire.encode(list(args), "args")
            payload_kwargs = wire.encode(dict(kwargs), "kwargs")
        except wire.WireError as exc:
            raise RolloutValueError(
                f"an argument of rollout {name} cannot travel to {where}: {exc}", name, host, str(exc)
            ) from None
        self._load[index] += 1
        try:
            result = await run_rollout(
                self._clients[host], target.worker_id, ref, payload_args, payload_kwargs
            )
        except RemoteUserError as exc:
            if exc.exc_type != wire.WireError.__name__:
                raise
            raise RolloutValueError(f"rollout {name} on {where} {exc}", name, host, str(exc)) from None
        finally:
            self._load[index] -= 1
        try:
            return wire.decode(result)
        except wire.WireError as exc:
            raise RolloutValueError(
                f"the result of rollout {name} from {where} cannot be rebuilt here: {exc}",
                name,
                host,
                str(exc),
            ) from None

    async def submit(self, fn: Callable[..., Any] | InstalledAsyncCallable, *args: Any, **kwargs: Any) -> Any:
        """Run on the process of a worker id with the fewest calls in flight (ties: lowest index).

        Raises:
            UserError: `set_workers(())` left no worker id; what `run` raises.
        """
        if self._closed:
            raise RuntimeError("this rollout executor is closed")
        indices = sorted(set(self._assigned.values()))
        if not indices:
            raise UserError(
                "submit has no worker to run on: set_workers(()) named none; name at least one id"
            )
        index = min(indices, key=lambda i: self._load[i])
        return await self._run(index, fn, args, kwargs)

    async def close(self, timeout_s: float = 30.0) -> None:
        """Stop every worker process of this executor (idempotent; a start in progress is
        cancelled and stops what it started, within `timeout_s` seconds)."""
        if self._closed:
            return
        self._closed = True
        if self._starting is not None:
            # a start in progress is cancelled, which stops what it started (a failed one did)
            self._starting.cancel()
            await asyncio.wait({self._starting}, timeout=timeout_s)
        by_host: dict[str, list[str]] = {}
        for w in self._workers or ():
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

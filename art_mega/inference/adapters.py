"""Adapter publication: load step N's LoRA on every replica, then advance the served step.

Each step is loaded from its own new path as `<model>@<step>` (vLLM's prefix cache is keyed by
adapter name and path: new weights at a reused path would be served mixed with stale state).
Steps outside the keep window are unloaded afterwards; `unload` takes given steps out of service
(before `model.delete_checkpoints` deletes them).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass, field

from art_mega.errors import AdapterPublishError, ReplicaHTTPError
from art_mega.inference.router import PolicyRouter, ReplicaEndpoint, inference_name
from art_mega.inference.server_api import DEFAULT_TIMEOUT_S, ReplicaClient

log = logging.getLogger(__name__)

DEFAULT_KEEP = 2
RETRY_DELAY_S = 0.5


@dataclass
class PublishReport:
    """What one publication did. Times in seconds: `load_s` per replica (retry included),
    `total_s` from the first load request to the end of the unloads."""

    step: int
    model: str
    load_s: dict[str, float] = field(default_factory=dict)
    attempts: dict[str, int] = field(default_factory=dict)
    unloaded: dict[str, list[str]] = field(default_factory=dict)
    unload_errors: list[str] = field(default_factory=list)
    total_s: float = 0.0


class AdapterPublisher:
    """Publishes each step's adapter to every replica of `router`, then advances its served step.

    `keep` (>= 1) is how many of the newest published steps stay loaded, so requests that
    started on the previous step finish on it. `timeout_s` bounds each HTTP call to a replica;
    `retry_delay_s` is the pause before the one retry of a failed load. `stage`, when given,
    turns one exported adapter path into replica -> path before loading (e.g.
    `transfer.remote.AdapterTransport` for host-local artifact roots; its errors
    propagate and the served step stays). `prune`, when given, is awaited after each
    publication's unloads with the steps some replica may still load (the window plus any step
    a replica still holds), so staged copies of every other step can be deleted (e.g.
    `AdapterTransport.prune`); it must not raise. Publications are serialised. Use as an async
    context manager or call `aclose()`.
    """

    def __init__(
        self,
        router: PolicyRouter,
        keep: int = DEFAULT_KEEP,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        retry_delay_s: float = RETRY_DELAY_S,
        stage: Callable[[int, str], Awaitable[Mapping[str, str]]] | None = None,
        prune: Callable[[set[int]], Awaitable[object]] | None = None,
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep={keep} must be >= 1: the served step itself stays loaded")
        self.router = router
        self.keep = keep
        self.retry_delay_s = retry_delay_s
        self.stage = stage  # host-local artifact_root: copies the adapter to each replica host
        self.prune = prune  # ... and deletes the copies no replica loads any more
        self._clients = {r.name: ReplicaClient(r.name, r.url, timeout_s) for r in router.replicas}
        self._loaded: dict[str, dict[int, str]] = {r.name: {} for r in router.replicas}
        self._paths: dict[str, int] = {}
        self._published: dict[int, dict[str, str]] = {}
        self._lock = asyncio.Lock()

    async def __aenter__(self) -> AdapterPublisher:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await asyncio.gather(*(c.aclose() for c in self._clients.values()))

    def loaded(self, replica: str) -> dict[int, str]:
        """Step -> adapter path of what `replica` has loaded (as far as this publisher knows)."""
        return dict(self._loaded[replica])

    def _paths_for(
        self, step: int, adapter_dir: str | os.PathLike[str] | Mapping[str, str]
    ) -> dict[str, str]:
        if isinstance(adapter_dir, Mapping):
            missing = [r.name for r in self.router.replicas if r.name not in adapter_dir]
            if missing:
                raise ValueError(f"step {step}: no adapter path for replicas {missing}")
            paths = {r.name: os.fspath(adapter_dir[r.name]) for r in self.router.replicas}
        else:
            paths = {r.name: os.fspath(adapter_dir) for r in self.router.replicas}
        for path in paths.values():
            if not os.path.isabs(path):
                raise ValueError(f"step {step}: adapter path {path!r} must be absolute (replicas resolve it)")
            used = self._paths.get(os.path.normpath(path))
            if used is not None and used != step:
                raise ValueError(
                    f"step {step}: adapter path {path} was already published for step {used}; every step "
                    "needs a new path (vLLM caches by adapter name and path, a reused path serves stale state)"
                )
        return paths

    async def _load(self, replica: ReplicaEndpoint, model: str, path: str) -> tuple[float, int]:
        """Load on one replica, retrying once; (seconds, attempts). Raises the last HTTP error.

        The retry loads in place: if the first attempt did land (e.g. its answer was lost to a
        timeout), the name exists already and an ordinary load would be refused. Same name,
        same path and same files: no stale prefix-cache state can come of it.
        """
        client = self._clients[replica.name]
        started = time.monotonic()
        try:
            await client.load_adapter(model, path)
            return time.monotonic() - started, 1
        except ReplicaHTTPError as first:
            log.warning("%s; retrying once in %.1f s", first, self.retry_delay_s)
        await asyncio.sleep(self.retry_delay_s)
        await client.load_adapter(model, path, inplace=True)
        return time.monotonic() - started, 2

    async def publish(
        self, step: int, adapter_dir: str | os.PathLike[str] | Mapping[str, str]
    ) -> PublishReport:
        """Load `adapter_dir` (an HF PEFT directory) on every replica as `<model>@<step>`; when
        all have it, advance the served step to `step`; then unload steps outside the window.

        `adapter_dir` is one absolute path every replica reads (a shared artifact_root), or a
        mapping replica name -> the path on that replica's host. Replicas load concurrently.

        Raises:
            ValueError: `step` is not above the served step, or a path is relative, missing for
                a replica, or was published before for another step.
            AdapterPublishError: a replica failed twice; names each such replica with the
                server's answer. The served step stays; replicas that did load the step unload
                it again (best effort), so the same step can be published again.
        """
        async with self._lock:
            served = self.router.served_step
            if step < 0 or (served is not None and step <= served):
                raise ValueError(f"step {step} must be >= 0 and above the served step {served}")
            if self.stage is not None and not isinstance(adapter_dir, Mapping):
                adapter_dir = await self.stage(step, os.fspath(adapter_dir))
            paths = self._paths_for(step, adapter_dir)
            model = inference_name(self.router.model_name, step)
            report = PublishReport(step=step, model=model)
            started = time.monotonic()
            replicas = self.router.up()  # a replica that is down gets the window on `restore`
            results = await asyncio.gather(
                *(self._load(r, model, paths[r.name]) for r in replicas), return_exceptions=True
            )
            failures: dict[str, ReplicaHTTPError] = {}
            for replica, result in zip(replicas, results):
                if isinstance(result, ReplicaHTTPError):
                    failures[replica.name] = result
                elif isinstance(result, BaseException):
                    raise result
                else:
                    report.load_s[replica.name], report.attempts[replica.name] = result
                    self._loaded[replica.name][step] = paths[replica.name]
            for name in set(failures) & set(self.router.down()):
                del failures[name]  # it crashed meanwhile; `restore` loads the step before it serves
            if failures:
                await self._unload_step(step, model, [r for r in replicas if r.name not in failures])
                raise AdapterPublishError(step, model, failures)
            self._published[step] = paths
            for path in paths.values():
                self._paths[os.path.normpath(path)] = step
            self.router.advance(step)
            await self._unload_outside_window(report)
            report.total_s = time.monotonic() - started
            return report

    async def _unload_step(self, step: int, model: str, replicas: list[ReplicaEndpoint]) -> None:
        for replica in replicas:
            try:
                await self._clients[replica.name].unload_adapter(model)
            except ReplicaHTTPError as exc:
                log.warning("rolling back %s: %s", model, exc)
            self._loaded[replica.name].pop(step, None)

    async def unload(self, steps: Collection[int]) -> dict[int, list[ReplicaHTTPError]]:
        """Stop serving `steps` (`model.delete_checkpoints` calls it before it deletes their
        files): unload each from every replica that is up and holds it, and take it out of the
        window, so that `restore` never loads it again. A 404 counts as unloaded; a replica that
        is down is skipped (it restarts empty). Then `prune` runs, as after a publication.

        Returns:
            step -> the errors of the replicas that could not unload it (the step then stays
            recorded as loaded there, and the next publication's unloads try again); {} when
            every step is gone from every replica.

        Raises:
            ValueError: a step of `steps` is the served step (the policy itself).
        """
        async with self._lock:
            served = self.router.served_step
            if served in steps:
                raise ValueError(
                    f"step {served} is the served step; publish a newer step before unloading it"
                )
            down = self.router.down()
            failures: dict[int, list[ReplicaHTTPError]] = {}

            async def unload(replica: str, step: int) -> None:
                try:
                    await self._clients[replica].unload_adapter(inference_name(self.router.model_name, step))
                except ReplicaHTTPError as exc:
                    if exc.status != 404:
                        failures.setdefault(step, []).append(exc)
                        return
                self._loaded[replica].pop(step, None)

            await asyncio.gather(
                *(
                    unload(replica, step)
                    for replica, loaded in self._loaded.items()
                    for step in sorted(loaded)
                    if step in steps and replica not in down
                )
            )
            for step in steps:
                self._published.pop(step, None)
            if self.prune is not None:
                await self.prune(set(self.window()) | {s for loaded in self._loaded.values() for s in loaded})
            return failures

    def window(self) -> list[int]:
        """The published steps that stay loaded: the newest `keep` of them, oldest first."""
        return sorted(self._published)[-self.keep :]

    async def _unload_outside_window(self, report: PublishReport) -> None:
        """Unload every loaded step outside the window; an unknown name (404) counts as done.

        Other failures are logged and kept in `report.unload_errors`; the step stays recorded
        as loaded, so the next publication tries again.
        """
        keep = set(self.window())
        down = self.router.down()  # restarted empty: `restore` resets what they hold

        async def unload(replica: str, step: int) -> None:
            model = inference_name(self.router.model_name, step)
            try:
                await self._clients[replica].unload_adapter(model)
            except ReplicaHTTPError as exc:
                if exc.status != 404:
                    log.warning("%s", exc)
                    report.unload_errors.append(str(exc))
                    return
            self._loaded[replica].pop(step, None)
            report.unloaded.setdefault(replica, []).append(model)

        await asyncio.gather(
            *(
                unload(replica, step)
                for replica, steps in self._loaded.items()
                for step in sorted(steps)
                if step not in keep and replica not in down
            )
        )
        for step in [s for s in self._published if s not in keep]:
            del self._published[step]
        if self.prune is not None:
            await self.prune(keep | {s for steps in self._loaded.values() for s in steps})

    async def restore(self, replica: str) -> list[str]:
        """Load every step of the window onto `replica` (e.g. after it restarted empty), oldest
        first, from the paths they were published with, then route to it again (`mark_up`);
        returns the model names loaded. Publications wait meanwhile, so the replica takes
        traffic only once it has the newest served step.

        Raises `ValueError` for an unknown replica and `ReplicaHTTPError` (after one retry)
        naming the replica and the server's answer; the replica then stays as it was (down or up).
        """
        endpoint = self.router.endpoint(replica)
        async with self._lock:
            self._loaded[replica] = {}
            names = []
            for step in self.window():
                model = inference_name(self.router.model_name, step)
                path = self._published[step][replica]
                await self._load(endpoint, model, path)
                self._loaded[replica][step] = path
                names.append(model)
            self.router.mark_up(replica)
            return names

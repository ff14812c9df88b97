"""Shared mode: replicas on the trainer's GPUs sleep while it trains and wake before the new adapter.

Per `backend.train` step, for every replica whose `ReplicaSpec.shared_gpus` is set (GPU hosts
only; `remote.check_serving_mode` refuses it on CPU):

1. sleep, level 1 with mode "wait": vLLM lets in-flight requests finish, then offloads the
   weights (and the loaded adapters) to CPU memory and discards the KV cache;
2. the trainer ranks run the step on the freed GPU memory;
3. wake up (also after a failed step, so the runtime stays usable for a retry, and after a
   sleep that failed on some replica: vLLM pauses a replica's scheduler before it sleeps);
4. the publisher loads the new adapter (`inference.adapters`).

Reference: vLLM sleep mode (`--enable-sleep-mode`, routes in
vllm/entrypoints/serve/dev/sleep/api_router.py, served when `VLLM_SERVER_DEV_MODE=1`), the
same cycle verl and OpenRLHF use for colocated rollout engines. `EngineCore.sleep` pauses the
scheduler before the executor sleeps and `EngineCore.wake_up` resumes it once fully awake
(vllm/v1/engine/core.py:959-1019 in vLLM 0.32), so a replica whose sleep failed half-way
queues every new request until it is woken.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Sequence

import httpx

from art_mega.errors import ReplicaHTTPError, ReplicaSleepError
from art_mega.inference.router import ReplicaEndpoint
from art_mega.inference.server_api import ReplicaClient

SLEEP_LEVEL = 1
"""Level 1 keeps a CPU copy of the weights: the base model does not change between steps."""


class SharedGpuReplicas:
    """The replicas that share the trainer's GPUs, put to sleep around each train step.

    Args:
        replicas: the shared replicas (empty: every call is a no-op that takes 0 s).
        timeout_s: bound in seconds on each sleep (which waits for in-flight requests) or wake
            call (httpx's per-operation timeout: connect, each read, each write).
        is_up: whether a replica (by name) is up in the router; `asleep` leaves the others alone
            (a dead replica cannot answer; crash recovery restarts it once the step is over,
            see `wait_awake`). None: every replica counts as up.
    """

    def __init__(
        self,
        replicas: Sequence[ReplicaEndpoint],
        timeout_s: float = 600.0,
        is_up: Callable[[str], bool] | None = None,
    ) -> None:
        self.replicas = tuple(replicas)
        self.timeout_s = timeout_s
        self.is_up = is_up or (lambda _name: True)
        self.names = frozenset(r.name for r in self.replicas)
        self._awake = asyncio.Event()
        self._awake.set()

    async def wait_awake(self, replica: str) -> None:
        """Return once no train step holds the GPUs `replica` shares (at once for a replica that
        does not share them): crash recovery restarts a shared replica only then, so that it does
        not take its GPU memory while the trainer runs."""
        if replica in self.names:
            await self._awake.wait()

    async def _each(self, what: str, call: str, replicas: Sequence[ReplicaEndpoint]) -> float:
        """`call` ("sleep" or "wake") on every replica in `replicas` at once; seconds taken."""
        started = time.perf_counter()

        async def one(replica: ReplicaEndpoint) -> None:
            async with ReplicaClient(replica.name, replica.url, self.timeout_s) as client:
                if call == "sleep":
                    await client.sleep(SLEEP_LEVEL)
                else:
                    await client.wake_up()

        results = await asyncio.gather(*(one(r) for r in replicas), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, ReplicaHTTPError):
                raise result
        failures = [r for r in results if isinstance(r, ReplicaHTTPError)]
        if failures:
            detail = "; ".join(self._describe(f) for f in failures)
            raise ReplicaSleepError(
                f"{what} the replicas that share the trainer's GPUs failed: {detail}", failures
            )
        return time.perf_counter() - started

    def _describe(self, failure: ReplicaHTTPError) -> str:
        """The refusal plus what it most likely means (404: no sleep mode; no answer: timeout)."""
        if failure.status == 404:
            hint = (
                "no sleep routes: a replica with InferenceSpec.shared_gpus=True must run on a GPU "
                "host with vLLM sleep mode"
            )
        elif isinstance(failure.__cause__, httpx.TimeoutException):
            hint = f"no answer within timeout_s={self.timeout_s:g} s; see its log"
        else:
            hint = "see its log"
        return f"{failure} ({hint})"

    async def sleep(self) -> float:
        """Put every shared replica that is up to sleep; seconds taken.

        Raises:
            ReplicaSleepError: a replica refused or did not answer within `timeout_s` (named);
                the others may be asleep then (`asleep` wakes them again).
        """
        up = [r for r in self.replicas if self.is_up(r.name)]
        return await self._each("putting to sleep", "sleep", up) if up else 0.0

    async def wake(self) -> float:
        """Wake every shared replica that is up; seconds taken. Raises `ReplicaSleepError` naming
        the replica."""
        up = [r for r in self.replicas if self.is_up(r.name)]
        return await self._each("waking", "wake", up) if up else 0.0

    async def _wake_after_failed_sleep(self, error: ReplicaSleepError) -> ReplicaSleepError:
        """Wake every replica that may have paused or slept: all but those without sleep routes
        (404). vLLM pauses its scheduler before it sleeps, and a paused replica queues every new
        request until woken. Returns `error`, extended with the replicas that did not wake."""
        no_routes = {f.replica for f in error.failures if f.status == 404}
        again = [r for r in self.replicas if r.name not in no_routes and self.is_up(r.name)]
        try:
            if again:
                await self._each("waking", "wake", again)
        except ReplicaSleepError as wake_error:
            return ReplicaSleepError(
                f"{error}; waking them again failed too: {wake_error}", error.failures + wake_error.failures
            )
        return error

    @contextlib.asynccontextmanager
    async def asleep(self, metrics: dict[str, float]) -> AsyncIterator[None]:
        """Sleep on entry, wake on exit (even when the body raised); records `time/sleep_s` and
        `time/wake_s` in `metrics` when there are shared replicas.

        Raises:
            ReplicaSleepError: a replica did not sleep (the body does not run, and every replica is
                woken again first), or one did not wake. When the body raised and a wake failed
                too, the message names both and the body's error is its cause.
        """
        if not self.replicas:
            yield
            return
        self._awake.clear()
        try:
            async with self._cycle(metrics):
                yield
        finally:
            self._awake.set()

    @contextlib.asynccontextmanager
    async def _cycle(self, metrics: dict[str, float]) -> AsyncIterator[None]:
        """Sleep, run the body, wake (see `asleep`)."""
        try:
            metrics["time/sleep_s"] = await self.sleep()
        except ReplicaSleepError as exc:
            raise await self._wake_after_failed_sleep(exc) from None
        try:
            yield
        except BaseException as step_error:
            try:
                metrics["time/wake_s"] = await self.wake()
            except ReplicaSleepError as wake_error:
                raise ReplicaSleepError(
                    f"{wake_error}; the train step had failed first: {type(step_error).__name__}: {step_error}",
                    wake_error.failures,
                ) from step_error
            raise
        metrics["time/wake_s"] = await self.wake()

"""The agent's inference routes: start and stop this host's vLLM replicas as supervised children.

`register(router, supervisor)` adds `POST /v1/inference/start`, `POST /v1/inference/stop` and
`POST /v1/inference/warm`; the router's signature check guards them like every other route.
"""

from __future__ import annotations

import asyncio

from art_mega.agent.protocol import ShutdownResponse
from art_mega.agent.routes import SignedRouter
from art_mega.agent.supervisor import DEFAULT_STOP_GRACE_S, Child, Supervisor
from art_mega.inference.protocol import (
    INFERENCE_START,
    INFERENCE_STOP,
    INFERENCE_WARM,
    InferenceStartRequest,
    InferenceStartResponse,
    InferenceStopRequest,
    InferenceWarmRequest,
    InferenceWarmResponse,
)
from art_mega.inference.warm import WarmInterpreters

ROLE = "inference"


def register(router: SignedRouter, supervisor: Supervisor) -> None:
    """Add the inference routes to the agent's `router`; replicas join `supervisor`'s children.

    Replicas are children like any other: the agent's shutdown stops them (SIGTERM, then
    SIGKILL) and its health lists them with their log paths and exit codes (how a crash is
    reported: see `recovery`). One replica name runs at most once per agent; starting it again
    while it runs is refused, starting it after it died first stops what is left of its group.
    A stop that arrives while a start spawns waits for the spawn, then stops that replica too.

    A warm interpreter (`INFERENCE_WARM`, see `inference.warm`) is this host's next CPU replica
    start's, when it matches; every stop, and the agent's close, stops it.
    """
    lock = asyncio.Lock()
    grace_s: dict[str, float] = {}
    warm = WarmInterpreters()
    supervisor.on_close(warm.drop)

    @router.serve(INFERENCE_WARM)
    async def inference_warm(body: InferenceWarmRequest) -> InferenceWarmResponse:
        from art_mega.inference.replica import warm_env

        if body.python is None:
            await warm.drop()
            return InferenceWarmResponse(ok=True)
        try:
            process = await warm.warm(body.python, warm_env(body.python, body.env), body.cache_dir)
        except OSError as exc:
            return InferenceWarmResponse(
                ok=False, error=f"cannot run {body.python!r} (InferenceSpec.python): {exc}"
            )
        return InferenceWarmResponse(ok=True, pid=process.process.pid)

    @router.serve(INFERENCE_START)
    async def inference_start(body: InferenceStartRequest) -> InferenceStartResponse:
        from art_mega.errors import ReplicaStartError
        from art_mega.inference.replica import spawn_replica

        name = body.replica.process_name
        async with lock:
            running = supervisor.get(name)
            if running is not None and running.process.returncode is None:
                return InferenceStartResponse(
                    ok=False,
                    name=name,
                    pid=running.pid,
                    error=f"replica {name} already runs (pid {running.pid})",
                )
            if running is not None:
                # It died (a restart after a crash): its engine processes may outlive the
                # server process; stopping the old group frees their memory and the port.
                await supervisor.stop([name], 2.0)
            try:
                replica = await spawn_replica(body.replica, body.launch, warm)
            except ReplicaStartError as exc:
                return InferenceStartResponse(ok=False, name=name, error=str(exc))
            grace_s[name] = body.launch.stop_grace_s
            supervisor.add(
                Child(child_id=name, role=ROLE, process=replica.process, log_path=str(replica.log_path))
            )
        response = dict(name=name, pid=replica.pid, log_path=str(replica.log_path), url=replica.url)
        try:
            seconds = await replica.wait_ready()
        except ReplicaStartError as exc:
            await supervisor.stop([name], 2.0)
            return InferenceStartResponse(ok=False, error=str(exc), **response)
        except BaseException:
            await supervisor.stop([name], 2.0)
            raise
        return InferenceStartResponse(ok=True, seconds=seconds, **response)

    @router.serve(INFERENCE_STOP)
    async def inference_stop(body: InferenceStopRequest) -> ShutdownResponse:
        # under the start's lock: a replica being spawned is a child by the time the lock is free,
        # so a stop that arrives during its spawn stops it instead of finding nothing
        async with lock:
            ours = [c.child_id for c in supervisor.children() if c.role == ROLE]
        await warm.drop()  # what only a start would have used
        names = [n for n in body.names if n in ours] if body.names else ours
        grace = max((grace_s.get(n, DEFAULT_STOP_GRACE_S) for n in names), default=DEFAULT_STOP_GRACE_S)
        return ShutdownResponse(stopped=await supervisor.stop(names, grace))

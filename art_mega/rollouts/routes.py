"""The agent's rollout routes: start and stop this host's rollout workers, run one rollout on one.

`register(router, supervisor)` adds `POST /v1/rollout-workers/start`, `/v1/rollout-workers/stop`
and `/v1/rollouts/run`; the router's signature check guards them like every other route. Each
worker is a supervised child (`python -m art_mega.rollouts.worker`, role "rollout") that speaks
newline-delimited JSON over an inherited socket. `/v1/rollouts/run`, the call made per rollout,
parses and answers by hand (one pydantic parse, no per-call model dumps of the callable).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import socket
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from art_mega.agent.protocol import ShutdownResponse
from art_mega.agent.routes import RouteError, SignedRouter, body_error, json_reply
from art_mega.agent.supervisor import Child, Supervisor, spawn_child
from art_mega.rollouts.protocol import (
    RUN_ROLLOUT,
    START_WORKERS,
    STOP_WORKERS,
    STREAM_LIMIT,
    CallableRef,
    RemoteFailure,
    RunRolloutRequest,
    RunRolloutResponse,
    StartRolloutWorkersRequest,
    StartRolloutWorkersResponse,
    StopRolloutWorkersRequest,
)

if TYPE_CHECKING:
    from starlette.requests import Request
    from starlette.responses import Response

WORKER_HELLO_TIMEOUT_S = 60.0
MAX_CACHED_CALLABLES = 1024
"""Distinct rollout callables whose worker-protocol form an agent keeps (more are dumped per call)."""


@dataclass
class _RolloutWorker:
    child: Child
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    pending: dict[int, asyncio.Future[dict[str, Any]]] = field(default_factory=dict)
    ids: itertools.count = field(default_factory=itertools.count)
    reader_task: asyncio.Task[None] | None = None

    async def read_loop(self) -> None:
        try:
            while True:
                line = await self.reader.readline()
                if not line:
                    break
                message = json.loads(line)
                future = self.pending.pop(int(message.get("id", -1)), None)
                if future is not None and not future.done():
                    future.set_result(message)
        finally:
            code = await self.child.process.wait()
            failure = RemoteFailure(
                kind="error",
                message=f"rollout worker {self.child.child_id} (pid {self.child.pid}) exited with code {code}",
            ).model_dump()
            for future in self.pending.values():
                if not future.done():
                    future.set_result({"ok": False, "failure": failure})
            self.pending.clear()

    async def call(self, message: dict[str, Any]) -> dict[str, Any]:
        request_id = next(self.ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.pending[request_id] = future
        try:
            self.writer.write(
                json.dumps({"id": request_id, **message}, separators=(",", ":")).encode() + b"\n"
            )
            await self.writer.drain()
        except (ConnectionError, RuntimeError):
            self.pending.pop(request_id, None)
            code = self.child.process.returncode
            return {
                "ok": False,
                "failure": RemoteFailure(
                    kind="error", message=f"rollout worker {self.child.child_id} is gone (exit code {code})"
                ).model_dump(),
            }
        return await future


class _WorkerStartError(Exception):
    def __init__(self, failure: RemoteFailure) -> None:
        super().__init__(failure.message)
        self.failure = failure


class RolloutWorkers:
    """One agent's rollout workers by worker id ("rollout-N"), children of `supervisor`."""

    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor
        self.workers: dict[str, _RolloutWorker] = {}
        self._ids = itertools.count()
        self._callables: dict[CallableRef, dict[str, Any]] = {}

    async def start(self, request: StartRolloutWorkersRequest) -> StartRolloutWorkersResponse:
        """Start `request.count` workers and wait for each one's hello (all or nothing).

        Raises `_WorkerStartError` with the failure of the first worker that exited or refused a
        callable before its hello; the workers started so far are stopped.
        """
        started: list[_RolloutWorker] = []
        env = dict(os.environ)
        env.pop("ART_MEGA_SECRET", None)
        env["ART_MEGA_SYS_PATH"] = os.pathsep.join(request.sys_path)
        env["PYTHONUNBUFFERED"] = "1"
        hello = {"op": "hello", "callables": [c.model_dump() for c in request.callables]}
        try:
            for _ in range(request.count):
                parent_sock, child_sock = socket.socketpair()
                try:
                    process = await spawn_child(
                        [
                            sys.executable,
                            "-m",
                            "art_mega.rollouts.worker",
                            "--fd",
                            str(child_sock.fileno()),
                        ],
                        env=env,
                        pass_fds=(child_sock.fileno(),),
                    )
                finally:
                    child_sock.close()
                child = Child(child_id=f"rollout-{next(self._ids)}", role="rollout", process=process)
                self.supervisor.add(child)
                reader, writer = await asyncio.open_connection(sock=parent_sock, limit=STREAM_LIMIT)
                worker = _RolloutWorker(child=child, reader=reader, writer=writer)
                started.append(worker)
                writer.write(json.dumps(hello).encode() + b"\n")
                await writer.drain()
            for worker in started:
                try:
                    line = await asyncio.wait_for(worker.reader.readline(), WORKER_HELLO_TIMEOUT_S)
                except ConnectionError:  # it died (or was stopped by a shutdown) before its hello
                    line = b""
                if not line:
                    code = await worker.child.process.wait()
                    raise _WorkerStartError(
                        RemoteFailure(
                            kind="error",
                            message=f"rollout worker {worker.child.child_id} exited with code {code} before it was ready",
                        )
                    )
                reply = json.loads(line)
                if reply.get("failure"):
                    raise _WorkerStartError(RemoteFailure.model_validate(reply["failure"]))
        except BaseException:
            await self.supervisor.stop([w.child.child_id for w in started])
            raise
        for worker in started:
            worker.reader_task = asyncio.create_task(worker.read_loop())
            self.workers[worker.child.child_id] = worker
        return StartRolloutWorkersResponse(
            worker_ids=tuple(w.child.child_id for w in started),
            pids=tuple(w.child.pid for w in started),
        )

    async def stop(self, worker_ids: tuple[str, ...]) -> ShutdownResponse:
        """Stop these workers (every one of this agent when empty)."""
        ids = list(worker_ids) if worker_ids else list(self.workers)
        for worker_id in ids:
            worker = self.workers.pop(worker_id, None)
            if worker is not None:
                worker.writer.close()
        return ShutdownResponse(stopped=await self.supervisor.stop(ids))

    async def close(self) -> None:
        """The agent closes: hang up on every worker (the supervisor then stops them)."""
        for worker in self.workers.values():
            worker.writer.close()
        self.workers.clear()

    def callable_message(self, ref: CallableRef) -> dict[str, Any]:
        """`ref` as the worker protocol sends it, dumped once per callable rather than per call."""
        dumped = self._callables.get(ref)
        if dumped is None:
            dumped = ref.model_dump()
            if len(self._callables) < MAX_CACHED_CALLABLES:
                self._callables[ref] = dumped
        return dumped

    async def run(self, run: RunRolloutRequest) -> RunRolloutResponse:
        """Run one rollout on its worker. Raises `RouteError` 404 for an unknown worker."""
        worker = self.workers.get(run.worker_id)
        if worker is None:
            raise RouteError(404, f"no rollout worker {run.worker_id!r} on this agent")
        reply = await worker.call(
            {"callable": self.callable_message(run.callable), "args": run.args, "kwargs": run.kwargs}
        )
        if reply.get("ok"):
            return RunRolloutResponse(ok=True, result=reply.get("result"))
        return RunRolloutResponse(ok=False, failure=RemoteFailure.model_validate(reply["failure"]))

    def add_routes(self, router: SignedRouter) -> None:
        """Serve the rollout routes over these workers on `router`; the agent's close hangs up
        on them."""
        self.supervisor.on_close(self.close)

        async def run_rollout(request: Request, body: bytes) -> Response:
            try:
                run = RunRolloutRequest.model_validate_json(body)
            except ValidationError as exc:
                raise body_error(exc) from None
            return json_reply(await self.run(run))

        router.raw(RUN_ROLLOUT, run_rollout)

        @router.serve(START_WORKERS)
        async def start_workers(body: StartRolloutWorkersRequest) -> StartRolloutWorkersResponse:
            try:
                return await self.start(body)
            except _WorkerStartError as exc:
                return StartRolloutWorkersResponse(failure=exc.failure)

        @router.serve(STOP_WORKERS)
        async def stop_workers(body: StopRolloutWorkersRequest) -> ShutdownResponse:
            return await self.stop(body.worker_ids)


def register(router: SignedRouter, supervisor: Supervisor) -> None:
    """Add the rollout routes to the agent's `router`; workers join `supervisor`'s children."""
    RolloutWorkers(supervisor).add_routes(router)

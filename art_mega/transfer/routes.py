"""The agent's adapter-transfer routes: offer an adapter, fetch one from another host, release,
prune received copies.

`register(router, supervisor)` adds `POST /v1/adapters/offer`,
`/v1/adapters/fetch`, `/v1/adapters/release` and `/v1/adapters/prune`; the router's signature check
guards them like every other route. Transfers run in this host's NIXL process
(`transfer.worker`), started on the first request as a supervised child (role "nixl"), so
NIXL never loads into the agent; prune is plain file deletion and runs in an agent thread.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import socket
import sys
from dataclasses import dataclass, field
from typing import Any

from art_mega.agent.routes import RouteError, SignedRouter
from art_mega.agent.supervisor import Child, Supervisor, spawn_child
from art_mega.transfer.nixl import remove_copies
from art_mega.transfer.protocol import (
    ADAPTERS_FETCH,
    ADAPTERS_OFFER,
    ADAPTERS_PRUNE,
    ADAPTERS_RELEASE,
    FetchRequest,
    FetchResponse,
    OfferRequest,
    OfferResponse,
    PruneRequest,
    PruneResponse,
    ReleaseRequest,
    ReleaseResponse,
)

ROLE = "nixl"
STREAM_LIMIT = 64 * 1024 * 1024
"""Largest single message (bytes) between the agent and its NIXL process."""


class NixlWorkerError(Exception):
    """The host's NIXL process could not run a request (it exited, or raised); names its pid."""


@dataclass
class _Link:
    """One NIXL process and the requests sent to it that await an answer."""

    child: Child
    writer: asyncio.StreamWriter
    pending: dict[int, asyncio.Future[dict[str, Any]]] = field(default_factory=dict)
    reader: asyncio.Task[None] | None = None

    async def read(self, reader: asyncio.StreamReader) -> None:
        while line := await reader.readline():
            message = json.loads(line)
            future = self.pending.pop(int(message["id"]), None)
            if future is not None and not future.done():
                future.set_result(message)
        code = await self.child.process.wait()
        for future in self.pending.values():
            if not future.done():
                future.set_exception(
                    NixlWorkerError(f"the NIXL process (pid {self.child.pid}) exited with code {code}")
                )
        self.pending.clear()


class NixlWorker:
    """The agent's handle on its NIXL process: started on first use, requests multiplexed by id.

    A process that exited is started again by the next request; requests in flight when it
    exits fail with `NixlWorkerError` naming its pid and exit code.
    """

    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor
        self._ids = itertools.count()
        self._link: _Link | None = None
        self._lock = asyncio.Lock()

    async def _running(self) -> _Link:
        async with self._lock:
            link = self._link
            if link is not None and link.child.process.returncode is None:
                return link
            parent, child = socket.socketpair()
            env = dict(os.environ)
            env.pop("ART_MEGA_SECRET", None)
            try:
                process = await spawn_child(
                    [sys.executable, "-m", "art_mega.transfer.worker", "--fd", str(child.fileno())],
                    env=env,
                    pass_fds=(child.fileno(),),
                    stdout=sys.stderr.fileno(),  # UCX logs to stdout; the agent's stdout is its launcher's
                )
            finally:
                child.close()
            record = Child(child_id=f"nixl-{process.pid}", role=ROLE, process=process)
            self.supervisor.add(record)
            reader, writer = await asyncio.open_connection(sock=parent, limit=STREAM_LIMIT)
            link = self._link = _Link(record, writer)
            link.reader = asyncio.create_task(link.read(reader))
            return link

    async def call(self, op: str, body: Any, model: type[Any]) -> Any:
        """Send one request to the NIXL process and return its reply as `model`.

        Raises `NixlWorkerError` when the process exits first or fails on the request.
        """
        link = await self._running()
        request_id = next(self._ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        link.pending[request_id] = future
        message = {"id": request_id, "op": op, "body": body.model_dump(mode="json")}
        link.writer.write(json.dumps(message).encode() + b"\n")
        await link.writer.drain()
        answer = await future
        if "error" in answer:
            raise NixlWorkerError(
                f"the NIXL process (pid {link.child.pid}) failed on {op}: {answer['error']}"
            )
        return model.model_validate(answer["reply"])


def register(router: SignedRouter, supervisor: Supervisor) -> None:
    """Add the adapter-transfer routes to the agent's `router`; the NIXL process joins `supervisor`'s
    children, so the agent's shutdown stops it (its offers die with it).

    Transfer failures come back in the reply (`ok=False`, `error` naming the host, transfer and
    file); a NIXL process that exits or raises answers HTTP 500 naming its pid.
    """
    worker = NixlWorker(supervisor)

    async def call(op: str, body: Any, model: type[Any]) -> Any:
        try:
            return await worker.call(op, body, model)
        except NixlWorkerError as exc:
            raise RouteError(500, str(exc)) from None

    @router.serve(ADAPTERS_OFFER)
    async def adapters_offer(body: OfferRequest) -> OfferResponse:
        return await call("offer", body, OfferResponse)

    @router.serve(ADAPTERS_FETCH)
    async def adapters_fetch(body: FetchRequest) -> FetchResponse:
        return await call("fetch", body, FetchResponse)

    @router.serve(ADAPTERS_RELEASE)
    async def adapters_release(body: ReleaseRequest) -> ReleaseResponse:
        return await call("release", body, ReleaseResponse)

    @router.serve(ADAPTERS_PRUNE)
    async def adapters_prune(body: PruneRequest) -> PruneResponse:
        return await asyncio.to_thread(remove_copies, body)

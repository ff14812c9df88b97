"""The per-host agent: an authenticated HTTP server (Starlette on uvicorn) that supervises this host's children.

It is the only long-lived art-mega process per host. Every request must carry a valid HMAC
signature made for this agent process (its address and incarnation, see `auth`); refused
requests execute nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response

from art_mega import __version__
from art_mega.agent.auth import (
    NONCE_HEADER,
    REPLY_SIGNATURE_HEADER,
    AgentIdentity,
    Verifier,
    new_incarnation,
)
from art_mega.agent.lease import DEFAULT_CONTROLLER_LEASE_S, ControllerLease
from art_mega.agent.protocol import (
    FREE_PORT,
    HEALTH,
    IDENTITY,
    LEASE,
    READY_PREFIX,
    SHUTDOWN,
    FreePortRequest,
    FreePortResponse,
    HealthResponse,
    LeaseRequest,
    ShutdownResponse,
)
from art_mega.agent.routes import SignedRouter, capped_head_protocol, json_reply
from art_mega.agent.supervisor import Supervisor

Service = Callable[[SignedRouter, Supervisor], object]
"""A service's `register(router, supervisor)`: it adds its routes to the agent's router, its
children to the supervisor, and what it must stop at the agent's close to `supervisor.on_close`
(what it returns is not used)."""


def boot_id() -> str:
    """The kernel's boot id (Linux), or "" where there is none."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


class AgentState:
    """What the agent itself owns: identity, verifier, lease, the supervisor of its children.

    The services keep their own state (rollout workers, trainer ranks, probes, etcd), made when
    they register and stopped through `supervisor.on_close`.
    """

    def __init__(
        self,
        launch_id: str,
        secret: bytes,
        address: str,
        controller_lease_s: float = DEFAULT_CONTROLLER_LEASE_S,
    ) -> None:
        self.launch_id = launch_id
        self.address = address
        self.identity = AgentIdentity(address=address, incarnation=new_incarnation())
        """Whom a request must be signed for: this address and this process's incarnation."""
        self.verifier = Verifier(secret, self.identity)
        self.supervisor = Supervisor(launch_id)
        self.started_at = time.time()
        self.boot_id = boot_id()
        self.shutdown_requested = asyncio.Event()
        self.lease = ControllerLease(controller_lease_s)
        self.closing = False
        """Set once `close` began: requests in flight may then lose their children and sockets."""
        self.read_ahead_listing: str | None = None
        """Where a shutdown request lists the files this agent read (`agent_main`)."""

    def health(self) -> HealthResponse:
        return HealthResponse(
            launch_id=self.launch_id,
            pid=os.getpid(),
            hostname=socket.gethostname(),
            address=self.address,
            boot_id=self.boot_id,
            python=sys.executable,
            art_mega_version=__version__,
            started_at=self.started_at,
            children=self.supervisor.statuses(),
            controller_lease_s=self.lease.lease_s,
        )

    async def close(self) -> ShutdownResponse:
        """Stop what every service holds, then every child; the children stopped."""
        self.closing = True
        return ShutdownResponse(stopped=await self.supervisor.close())


def create_app(state: AgentState, services: Sequence[Service]) -> Starlette:
    """Build the agent's app over `state`: its own routes, then each of `services` registers its
    own (in order). Every route requires a signed request (`routes`).

    `/v1/health`, the call made per heartbeat, answers by hand (no model parse);
    `/v1/identity` tells a client whom to sign for. A refused request gets 401 `{"detail": reason}`
    (413 for a body over its route's cap) and executes nothing.
    """
    router = SignedRouter(state.verifier, on_verified=state.lease.renew)

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        yield
        await state.close()

    async def health(request: Request, body: bytes) -> Response:
        return json_reply(state.health())

    async def identity(request: Request, body: bytes) -> Response:
        """Whom to sign for (see `auth`), with a reply signature over the request's nonce."""
        reply = state.identity.model_dump_json().encode()
        signature = state.verifier.sign_reply(request.headers[NONCE_HEADER], reply)
        return Response(reply, media_type="application/json", headers={REPLY_SIGNATURE_HEADER: signature})

    router.raw(HEALTH, health)
    router.raw(IDENTITY, identity, unbound=True)

    @router.serve(LEASE)
    async def lease(body: LeaseRequest) -> HealthResponse:
        if body.hold:
            state.lease.hold()
        else:
            state.lease.release()
        return state.health()

    @router.serve(FREE_PORT)
    async def free_port(body: FreePortRequest) -> FreePortResponse:
        from art_mega.agent.ports import free_port

        return FreePortResponse(port=free_port(body.host))

    @router.serve(SHUTDOWN)
    async def shutdown() -> ShutdownResponse:
        from art_mega.readahead import record

        record(state.read_ahead_listing)  # before the close: the launcher may SIGTERM after it
        stopped = await state.close()
        state.shutdown_requested.set()
        return stopped

    for register in services:
        register(router, state.supervisor)
    return router.app(lifespan)


def _watch_stdin_eof(loop: asyncio.AbstractEventLoop, event: asyncio.Event) -> None:
    """Set `event` when stdin reaches end of file (the launcher's SSH channel closed).

    The thread reads the file descriptor, not `sys.stdin`: at exit the interpreter would wait
    (a second, then abort) for the buffered reader's lock that a blocked `read1` holds.
    """

    def read() -> None:
        try:
            while os.read(sys.stdin.fileno(), 65536):
                pass
        except (OSError, ValueError):
            pass
        loop.call_soon_threadsafe(event.set)

    threading.Thread(target=read, name="art-mega-stdin-eof", daemon=True).start()


def _quiet_while_closing(app: Any, state: AgentState) -> Any:
    """`app`, except that a request which fails once the agent is closing logs no traceback.

    A shutdown (or an expired lease) stops the children and sockets that requests in flight
    wait on, e.g. a rollout worker still starting when the controller got SIGTERM: those
    requests fail by design, and one traceback per request and host would flood the terminal
    the launcher forwards agent output to. Their caller has already stopped listening.
    """

    async def guarded(scope: Any, receive: Any, send: Any) -> None:
        try:
            await app(scope, receive, send)
        except Exception:
            if not state.closing:
                raise

    return guarded


async def serve(
    sock: socket.socket,
    state: AgentState,
    services: Sequence[Service],
    on_ready: Any = None,
    exit_on_stdin_eof: bool = False,
) -> None:
    """Serve the agent with `services` on an already-listening socket until SIGTERM/SIGINT or
    /v1/shutdown.

    With `exit_on_stdin_eof`, end of file on stdin (the launcher's SSH channel closed) stops
    the agent and its children like a shutdown request. So does an expired controller lease
    (`state.lease.expired` is then True), after one line on stderr.
    """
    import uvicorn

    app = _quiet_while_closing(create_app(state, services), state)
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        proxy_headers=False,  # no proxy in front of an agent: skip X-Forwarded-* parsing per request
        http=capped_head_protocol(),  # an unsigned request's headers are not buffered without bound
        timeout_graceful_shutdown=2,
        # Idle connections are the client's to close (after `client.KEEPALIVE_S`): a controller
        # whose event loop the user's program blocked sends, once it runs again, on connections
        # it took from its pool before the block; closed here meanwhile, that request would fail.
        timeout_keep_alive=600,
        lifespan="on",
    )
    server = uvicorn.Server(config)

    async def watch_shutdown() -> None:
        await state.shutdown_requested.wait()
        await asyncio.sleep(0.05)  # let the shutdown response leave
        server.should_exit = True

    async def watch_lease() -> None:
        await state.lease.wait_expired()
        print(
            f"art-mega: agent {state.address}: its controller was not heard from for "
            f"{state.lease.lease_s:g} s (--controller-lease); stopping every child and exiting",
            file=sys.stderr,
            flush=True,
        )
        await state.close()
        state.shutdown_requested.set()

    async def watch_stdin(closed: asyncio.Event) -> None:
        await closed.wait()
        await state.close()  # the launcher is gone: stop the children before the server
        state.shutdown_requested.set()

    watchers = [asyncio.create_task(watch_shutdown()), asyncio.create_task(watch_lease())]
    if exit_on_stdin_eof:
        stdin_closed = asyncio.Event()
        _watch_stdin_eof(asyncio.get_running_loop(), stdin_closed)
        watchers.append(asyncio.create_task(watch_stdin(stdin_closed)))
    if on_ready is not None:
        on_ready()
    try:
        await server.serve(sockets=[sock])
    finally:
        for task in watchers:
            task.cancel()
        await state.close()


def agent_main(
    address: str,
    launch_id: str,
    secret: bytes,
    services: Sequence[Service],
    exit_on_stdin_eof: bool = False,
    controller_lease_s: float = DEFAULT_CONTROLLER_LEASE_S,
    read_ahead_listing: str | None = None,
) -> int:
    """Run an agent listening on `address` (tcp://HOST:PORT) that serves `services` (each one's
    `register`, see `Service`); prints the ready line on stdout.

    `controller_lease_s`: seconds the agent waits for a word from the controller that holds it
    before it stops its children and exits (see `lease`). `read_ahead_listing`: where a
    shutdown request first lists the files this agent read (`art_mega.readahead`; None: not
    listed), for the next agent's start to read ahead.

    Returns the process exit code: 0, or 1 when the controller lease expired. Raises
    `UserError` for an address already in use.
    """
    from art_mega.agent.listeners import bind_listener, is_address_in_use, listener_pids
    from art_mega.errors import UserError
    from art_mega.topology import EndpointSpec

    endpoint = EndpointSpec.parse(address)
    try:
        sock = bind_listener(endpoint.host, endpoint.port)
    except OSError as exc:
        if is_address_in_use(exc):
            raise UserError(
                f"worker address {address} is already in use: refusing to reuse a pre-existing listener; "
                "pick a free port"
            ) from None
        raise UserError(f"worker address {address} cannot be bound: {exc.strerror}") from None
    port = sock.getsockname()[1]
    bound = EndpointSpec(host=endpoint.host, port=port)
    state = AgentState(launch_id, secret, bound.address, controller_lease_s)
    state.read_ahead_listing = read_ahead_listing

    def announce() -> None:
        holders = listener_pids(port) if sys.platform.startswith("linux") else {os.getpid()}
        ready = {
            "launch_id": launch_id,
            "pid": os.getpid(),
            "address": bound.address,
            "port": port,
            "holds_listener": os.getpid() in holders,
            "platform": platform.system(),
        }
        sys.stdout.write(READY_PREFIX + json.dumps(ready) + "\n")
        sys.stdout.flush()

    asyncio.run(serve(sock, state, services, announce, exit_on_stdin_eof))
    return 1 if state.lease.expired else 0

"""The controller's signed HTTP client for one agent: one typed call per route, typed errors.

`AgentClient.call(route, body)` sends `body` (an instance of `route.request`) to `route` (an
`agent.routes.Route` declared in a service's protocol module) and returns the reply validated as
`route.response`; every failure is an `AgentError` subclass (`art_mega.errors`) with the host,
address, route, HTTP status and the agent's detail as fields. The client knows no service:
services call their own routes through it.

Every request is signed with the launch secret for exactly that agent process: its address and
incarnation, which the client learns from the agent on first use (`AgentClient.identity`, see
`agent.auth`). The transport is aiohttp: one keep-alive `ClientSession` for each `AgentClient`
(httpx cost about 1.6 ms of CPU per request here; see benchmarks/RESULTS.md).
"""

from __future__ import annotations

import asyncio
import json
from types import EllipsisType
from typing import Any

import aiohttp
from pydantic import ValidationError

from art_mega.agent.auth import (
    NONCE_HEADER,
    REPLY_SIGNATURE_HEADER,
    UNBOUND,
    AgentIdentity,
    reply_is_signed,
    sign,
)
from art_mega.agent.protocol import (
    FREE_PORT,
    HEALTH,
    IDENTITY,
    LEASE,
    SHUTDOWN,
    FreePortRequest,
    HealthResponse,
    LeaseRequest,
    ShutdownResponse,
)
from art_mega.agent.routes import API_PREFIX, Req, Resp, Route
from art_mega.errors import (
    AgentFailedError,
    AgentRefusedError,
    AgentReplyError,
    AgentUnauthorizedError,
    AgentUnreachableError,
    format_validation_error,
)

MAX_CONNECTIONS = 1024
"""Connections an `AgentClient` keeps open to its agent at most (one per request in flight)."""

KEEPALIVE_S = 4.0
"""How long an idle connection is kept for reuse: far below the agent's 600 s keep-alive, so that
the client, not the server, closes an idle connection (a POST is never retried on one that the
server closed meanwhile), even after the client's event loop was blocked for minutes."""


def _where(route: Route[Any, Any]) -> str:
    """The call as errors name it, e.g. "POST /v1/etcd/start"."""
    return f"{route.method} {API_PREFIX}{route.path}"


class AgentClient:
    """Signed async calls to one agent at `address` (tcp://HOST:PORT).

    Args:
        host: the host id, used in error messages.
        url: the agent's base URL (http://HOST:PORT).
        secret: the launch secret.
        timeout_s: the default per-request timeout in seconds (`call(..., timeout_s=None)` has
            none: a rollout runs as long as it does).
    """

    def __init__(self, host: str, address: str, url: str, secret: bytes, timeout_s: float = 30.0) -> None:
        self.host = host
        self.address = address
        self._url = url.rstrip("/")
        self._secret = secret
        self._timeout_s = timeout_s
        self._timeouts: dict[float | None, aiohttp.ClientTimeout] = {}
        self._session: aiohttp.ClientSession | None = None
        self._closed = False
        self._target: AgentIdentity | None = None
        self._target_lock: asyncio.Lock | None = None

    def _http(self) -> aiohttp.ClientSession:
        """The session, made on first use (aiohttp binds it to the running event loop)."""
        if self._session is None:
            if self._closed:
                raise RuntimeError(f"the client of host {self.host} ({self.address}) is closed")
            connector = aiohttp.TCPConnector(limit=MAX_CONNECTIONS, keepalive_timeout=KEEPALIVE_S)
            self._session = aiohttp.ClientSession(
                connector=connector,
                cookie_jar=aiohttp.DummyCookieJar(),
                timeout=self._timeout(self._timeout_s),
                trust_env=False,
            )
        return self._session

    def _timeout(self, seconds: float | None) -> aiohttp.ClientTimeout:
        """Like httpx's: `seconds` to get a connection and between reads; no limit on the whole call."""
        timeout = self._timeouts.get(seconds)
        if timeout is None:
            timeout = aiohttp.ClientTimeout(total=None, connect=seconds, sock_read=seconds)
            if len(self._timeouts) < 64:
                self._timeouts[seconds] = timeout
        return timeout

    async def call(
        self,
        route: Route[Req, Resp],
        body: Req | None = None,
        *,
        timeout_s: float | None | EllipsisType = ...,
    ) -> Resp:
        """Send `body` to `route` on this agent, signed; its reply as a `route.response`.

        Args:
            route: the route, declared in its service's protocol module.
            body: an instance of `route.request` (None when the route takes no body).
            timeout_s: seconds to connect and between reads; `...` (default): the client's
                timeout; None: no limit (the call lasts as long as the agent takes).

        Raises:
            TypeError: `body` is not a `route.request` (or is given to a route that takes none);
                nothing is sent.
            AgentUnreachableError: no answer (`timed_out` when the timeout passed).
            AgentUnauthorizedError: 401, the agent refused the signature (`detail` says why).
            AgentRefusedError: another 4xx, the agent refused the input (`status`, `detail`).
            AgentFailedError: 5xx, the route's handler failed on the agent.
            AgentReplyError: a 200 whose body is not a `route.response` (named with the route).
        """
        where = _where(route)
        if route.request is None:
            if body is not None:
                raise TypeError(f"{where} takes no body, got a {type(body).__name__}")
        elif not isinstance(body, route.request):
            raise TypeError(f"{where} takes a {route.request.__name__}, got {type(body).__name__}")
        full = API_PREFIX + route.path
        content = body.model_dump_json().encode() if body is not None else b""
        seconds = self._timeout_s if timeout_s is ... else timeout_s
        target = await self._identity(seconds)
        headers = sign(self._secret, route.method, full, content, target)
        payload, _ = await self._send(route, content, headers, seconds)
        return self._parse(route, payload)

    def _parse(self, route: Route[Any, Resp], payload: bytes) -> Resp:
        """`payload` as a `route.response`. Raises `AgentReplyError` naming the route and field."""
        try:
            return route.response.model_validate_json(payload)
        except ValidationError as exc:
            where = _where(route)
            raise AgentReplyError(
                self.host,
                self.address,
                f"{where} answered with a body that is not a {route.response.__name__}: "
                f"{format_validation_error(exc)}",
                status=200,
                route=where,
            ) from None

    async def _send(
        self, route: Route[Any, Any], content: bytes, headers: dict[str, str], seconds: float | None
    ) -> tuple[bytes, str | None]:
        """Send one signed request; its 200 body and reply signature header (if any).

        Raises:
            AgentError: the subclass for no answer or for the status answered (with its detail).
        """
        where = _where(route)
        headers["content-type"] = "application/json"
        try:
            async with self._http().request(
                route.method,
                self._url + API_PREFIX + route.path,
                data=content,
                headers=headers,
                timeout=self._timeout(seconds),
            ) as response:
                status = response.status
                payload = await response.read()
                reply_signature = response.headers.get(REPLY_SIGNATURE_HEADER)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise AgentUnreachableError(
                self.host,
                self.address,
                f"agent unreachable ({type(exc).__name__}: {exc})",
                route=where,
                timed_out=isinstance(exc, TimeoutError),
            ) from exc
        if status != 200:
            detail: Any = payload.decode(errors="replace")
            try:
                detail = json.loads(detail).get("detail", detail)
            except (ValueError, AttributeError):
                pass
            error = (
                AgentUnauthorizedError
                if status == 401
                else AgentRefusedError
                if 400 <= status < 500
                else AgentFailedError
            )
            raise error(
                self.host,
                self.address,
                f"HTTP {status}: {detail}",
                status=status,
                detail=detail if isinstance(detail, str) else str(detail),
                route=where,
            )
        return payload, reply_signature

    async def _identity(self, seconds: float | None) -> AgentIdentity:
        """`identity`, asked within `seconds` (a control call: the client's timeout when None)."""
        if self._target is None:
            if self._target_lock is None:
                self._target_lock = asyncio.Lock()
            async with self._target_lock:
                if self._target is None:
                    headers = sign(self._secret, IDENTITY.method, API_PREFIX + IDENTITY.path, b"", UNBOUND)
                    payload, reply_signature = await self._send(
                        IDENTITY, b"", headers, self._timeout_s if seconds is None else seconds
                    )
                    if not reply_is_signed(self._secret, headers[NONCE_HEADER], payload, reply_signature):
                        raise AgentReplyError(
                            self.host,
                            self.address,
                            "its identity answer is not signed with this launch's secret",
                            status=200,
                            route=_where(IDENTITY),
                        )
                    self._target = self._parse(IDENTITY, payload)
        return self._target

    async def identity(self, timeout_s: float | None = None) -> AgentIdentity:
        """The agent process this client signs every request for (its address and incarnation).

        Learnt once, on first use: `GET /v1/identity`, signed for no agent, answered with the
        agent's reply signature over that request's nonce. It is never learnt again, so a
        restarted agent (a new incarnation) refuses every later request of this client.

        Raises:
            AgentError: the agent did not answer, refused the secret, or its answer is not signed.
        """
        return await self._identity(self._timeout_s if timeout_s is None else timeout_s)

    async def health(self, timeout_s: float | None = None) -> HealthResponse:
        """The agent's identity and children (`timeout_s` None: the client's timeout).
        Raises `AgentError` when it does not answer."""
        return await self.call(HEALTH, timeout_s=... if timeout_s is None else timeout_s)

    async def lease(self, hold: bool = True, timeout_s: float | None = None) -> HealthResponse:
        """The controller's heartbeat: holds (or with `hold=False` releases) the agent's lease on
        this controller, and answers like `health`. Raises `AgentError` when it does not answer."""
        return await self.call(
            LEASE, LeaseRequest(hold=hold), timeout_s=... if timeout_s is None else timeout_s
        )

    async def free_port(self, host: str) -> int:
        """A TCP port that is free on this agent's host at `host` right now."""
        return (await self.call(FREE_PORT, FreePortRequest(host=host))).port

    async def shutdown(self, timeout_s: float | None = None) -> ShutdownResponse:
        """Stop every child of the agent, then the agent itself."""
        return await self.call(SHUTDOWN, timeout_s=... if timeout_s is None else timeout_s)

    def twin(self) -> AgentClient:
        """A new client of the same agent, secret and timeout, for another event loop (the
        monitor's heartbeat thread): it learns the agent's identity itself on first use."""
        return AgentClient(self.host, self.address, self._url, self._secret, self._timeout_s)

    @property
    def closed(self) -> bool:
        """Whether `aclose` was called (every later call raises RuntimeError)."""
        return self._closed

    async def aclose(self) -> None:
        """Close the session and its connections (idempotent); later calls raise RuntimeError."""
        self._closed = True
        session, self._session = self._session, None
        if session is not None:
            await session.close()

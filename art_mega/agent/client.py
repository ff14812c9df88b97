"""The controller's signed HTTP client for one agent.

Bodies are the pydantic models of `protocol`; every request is signed with the launch secret for
exactly that agent process: its address and incarnation, which the client learns from the agent
on first use (`AgentClient.identity`, see `agent.auth`).
The transport is aiohttp: one keep-alive `ClientSession` for each `AgentClient` (httpx cost
about 1.6 ms of CPU per request here; see benchmarks/RESULTS.md).
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any, TypeVar

import aiohttp
from pydantic import BaseModel

from art_mega.agent.auth import (
    NONCE_HEADER,
    REPLY_SIGNATURE_HEADER,
    UNBOUND,
    AgentIdentity,
    reply_is_signed,
    sign,
)
from art_mega.agent.protocol import (
    FreePortRequest,
    FreePortResponse,
    HealthResponse,
    LeaseRequest,
    ShutdownResponse,
)
from art_mega.agent.routes import API_PREFIX
from art_mega.errors import RemoteUserError
from art_mega.preflight.protocol import (
    FILES_PER_CHECK,
    EtcdCheckRequest,
    EtcdCheckResponse,
    EtcdStartRequest,
    EtcdStartResponse,
    FilesCheckRequest,
    FilesCheckResponse,
    FsOpRequest,
    FsOpResponse,
    HostFacts,
    PreflightPrepareRequest,
    PreflightPrepareResponse,
    PreflightRunRequest,
    PreflightRunResponse,
)
from art_mega.rollouts.protocol import (
    CallableRef,
    RemoteFailure,
    RunRolloutRequest,
    RunRolloutResponse,
    StartRolloutWorkersRequest,
    StartRolloutWorkersResponse,
    StopRolloutWorkersRequest,
)
from art_mega.trainer.protocol import (
    TrainerEventsRequest,
    TrainerEventsResponse,
    TrainerJobRequest,
    TrainerJobResponse,
    TrainerStartRequest,
    TrainerStartResponse,
)

if TYPE_CHECKING:
    from art_mega.inference.protocol import InferenceStartResponse, ReplicaLaunch
    from art_mega.topology.compiled import ReplicaSpec

M = TypeVar("M", bound=BaseModel)

MAX_CONNECTIONS = 1024
"""Connections an `AgentClient` keeps open to its agent at most (one per request in flight)."""

KEEPALIVE_S = 4.0
"""How long an idle connection is kept for reuse: far below the agent's 600 s keep-alive, so that
the client, not the server, closes an idle connection (a POST is never retried on one that the
server closed meanwhile), even after the client's event loop was blocked for minutes."""


class AgentError(Exception):
    """An agent could not be reached or answered with an error; names the host and address.

    `timed_out` is True when the call got no answer within its timeout (the agent may be alive
    but slow, or the network partitioned), False when it was refused, reset or answered badly.
    """

    def __init__(self, host: str, address: str, message: str, *, timed_out: bool = False) -> None:
        super().__init__(f"host {host} ({address}): {message}")
        self.host = host
        self.address = address
        self.timed_out = timed_out


class RemoteRolloutError(Exception):
    """A rollout raised on its worker; carries the remote type, message and traceback."""

    def __init__(self, host: str, worker_id: str, failure: RemoteFailure) -> None:
        super().__init__(f"rollout on host {host} worker {worker_id} failed: {failure.message}")
        self.host = host
        self.worker_id = worker_id
        self.failure = failure


def raise_failure(host: str, failure: RemoteFailure, worker_id: str = "") -> None:
    """Raise `RemoteUserError` (a `UserError`) for a user-kind failure, `RemoteRolloutError` otherwise."""
    if failure.kind == "user":
        raise RemoteUserError(failure.message, host, worker_id, failure.exc_type)
    raise RemoteRolloutError(host, worker_id, failure)


class AgentClient:
    """Signed async calls to one agent at `address` (tcp://HOST:PORT).

    Args:
        host: the host id, used in error messages.
        url: the agent's base URL (http://HOST:PORT).
        secret: the launch secret.
        timeout_s: per-request timeout in seconds (rollout calls have none: they run as long as
            the rollout does).
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

    async def _request(
        self,
        method: str,
        path: str,
        body: BaseModel | None,
        model: type[M],
        timeout_s: float | None | object = ...,
    ) -> M:
        full = API_PREFIX + path
        content = body.model_dump_json().encode() if body is not None else b""
        seconds = self._timeout_s if timeout_s is ... else timeout_s
        target = await self._identity(seconds)
        payload, _ = await self._send(
            method, full, content, sign(self._secret, method, full, content, target), seconds
        )
        return model.model_validate_json(payload)

    async def _send(
        self, method: str, full: str, content: bytes, headers: dict[str, str], seconds: float | None
    ) -> tuple[bytes, str | None]:
        """Send one signed request; its 200 body and reply signature header (if any).

        Raises:
            AgentError: the agent did not answer, or answered another status (with its detail).
        """
        headers["content-type"] = "application/json"
        try:
            async with self._http().request(
                method, self._url + full, data=content, headers=headers, timeout=self._timeout(seconds)
            ) as response:
                status = response.status
                payload = await response.read()
                reply_signature = response.headers.get(REPLY_SIGNATURE_HEADER)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise AgentError(
                self.host,
                self.address,
                f"agent unreachable ({type(exc).__name__}: {exc})",
                timed_out=isinstance(exc, TimeoutError),
            ) from exc
        if status != 200:
            detail = payload.decode(errors="replace")
            try:
                detail = json.loads(detail).get("detail", detail)
            except (ValueError, AttributeError):
                pass
            raise AgentError(self.host, self.address, f"HTTP {status}: {detail}")
        return payload, reply_signature

    async def _identity(self, seconds: float | None) -> AgentIdentity:
        """`identity`, asked within `seconds` (a control call: the client's timeout when None)."""
        if self._target is None:
            if self._target_lock is None:
                self._target_lock = asyncio.Lock()
            async with self._target_lock:
                if self._target is None:
                    full = API_PREFIX + "/identity"
                    headers = sign(self._secret, "GET", full, b"", UNBOUND)
                    payload, reply_signature = await self._send(
                        "GET", full, b"", headers, self._timeout_s if seconds is None else seconds
                    )
                    if not reply_is_signed(self._secret, headers[NONCE_HEADER], payload, reply_signature):
                        raise AgentError(
                            self.host,
                            self.address,
                            "its identity answer is not signed with this launch's secret",
                        )
                    self._target = AgentIdentity.model_validate_json(payload)
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
        """The agent's identity and children. Raises `AgentError` when it does not answer."""
        return await self._request(
            "GET", "/health", None, HealthResponse, timeout_s if timeout_s is not None else ...
        )

    async def lease(self, hold: bool = True, timeout_s: float | None = None) -> HealthResponse:
        """The controller's heartbeat: holds (or with `hold=False` releases) the agent's lease on
        this controller, and answers like `health`. Raises `AgentError` when it does not answer."""
        return await self._request(
            "POST",
            "/lease",
            LeaseRequest(hold=hold),
            HealthResponse,
            timeout_s if timeout_s is not None else ...,
        )

    async def start_rollout_workers(
        self, count: int, sys_path: tuple[str, ...], callables: tuple[CallableRef, ...]
    ) -> StartRolloutWorkersResponse:
        """Start `count` workers that have imported and hash-checked `callables`."""
        body = StartRolloutWorkersRequest(count=count, sys_path=sys_path, callables=callables)
        reply = await self._request("POST", "/rollout-workers/start", body, StartRolloutWorkersResponse, None)
        if reply.failure is not None:
            raise_failure(self.host, reply.failure)
        return reply

    async def stop_rollout_workers(self, worker_ids: tuple[str, ...] = ()) -> ShutdownResponse:
        return await self._request(
            "POST",
            "/rollout-workers/stop",
            StopRolloutWorkersRequest(worker_ids=worker_ids),
            ShutdownResponse,
        )

    async def run_rollout(
        self, worker_id: str, ref: CallableRef, args: list[Any], kwargs: dict[str, Any]
    ) -> Any:
        """Run one rollout and return its wire-encoded result.

        Raises:
            UserError: the worker refused the callable (e.g. its source changed).
            RemoteRolloutError: the rollout raised.
            AgentError: the agent did not answer.
        """
        body = RunRolloutRequest(worker_id=worker_id, callable=ref, args=args, kwargs=kwargs)
        reply = await self._request("POST", "/rollouts/run", body, RunRolloutResponse, None)
        if not reply.ok:
            raise_failure(
                self.host, reply.failure or RemoteFailure(kind="error", message="unknown failure"), worker_id
            )
        return reply.result

    async def facts(self) -> HostFacts:
        """The host's identity, software fingerprint, behaviour env and GPU inventory."""
        return await self._request("GET", "/facts", None, HostFacts)

    async def fs_op(self, request: FsOpRequest) -> FsOpResponse:
        """One filesystem-probe step on this host (see `preflight.fs_probe`)."""
        return await self._request("POST", "/fs/op", request, FsOpResponse)

    async def files_missing(self, paths: tuple[str, ...]) -> tuple[str, ...]:
        """Which of these absolute file paths this host cannot read (relative ones count as missing),
        in the given order; sent in requests of at most `FILES_PER_CHECK` paths."""
        missing: list[str] = []
        for start in range(0, len(paths), FILES_PER_CHECK):
            request = FilesCheckRequest(paths=paths[start : start + FILES_PER_CHECK])
            missing += (await self._request("POST", "/files/check", request, FilesCheckResponse)).missing
        return tuple(missing)

    async def etcd_start(self, request: EtcdStartRequest) -> EtcdStartResponse:
        """Start the managed etcd on this host (see `preflight.etcd`)."""
        return await self._request("POST", "/etcd/start", request, EtcdStartResponse, request.timeout_s + 30)

    async def etcd_stop(self) -> ShutdownResponse:
        """Stop this host's managed etcd and delete its data dir (no-op when none runs)."""
        return await self._request("POST", "/etcd/stop", None, ShutdownResponse)

    async def etcd_check(self, request: EtcdCheckRequest) -> EtcdCheckResponse:
        """From this host, check an etcd endpoint is healthy and serves put/get."""
        return await self._request(
            "POST", "/etcd/check", request, EtcdCheckResponse, request.timeout_s * 3 + 10
        )

    async def free_port(self, host: str) -> int:
        """A TCP port that is free on this agent's host at `host` right now."""
        return (await self._request("POST", "/free-port", FreePortRequest(host=host), FreePortResponse)).port

    async def preflight_prepare(self, python: str | None = None) -> bool:
        """Start a warm preflight probe here (see `preflight.probe`); True when one was started."""
        request = PreflightPrepareRequest(python=python)
        return (await self._request("POST", "/preflight/prepare", request, PreflightPrepareResponse)).started

    async def preflight_discard(self) -> None:
        """Stop this host's warm preflight probes that still wait for a config (none: no-op)."""
        await self._request("POST", "/preflight/discard", None, ShutdownResponse)

    async def preflight_run(self, request: PreflightRunRequest) -> PreflightRunResponse:
        """Run one preflight rank here; returns when it exits or after `timeout_s` (+ margin)."""
        return await self._request(
            "POST", "/preflight/run", request, PreflightRunResponse, request.timeout_s + 30
        )

    async def inference_start(self, replica: ReplicaSpec, launch: ReplicaLaunch) -> InferenceStartResponse:
        """Start a vLLM replica on this host and wait until it is ready (see `art_mega.inference`);
        the wait is bounded by `launch.ready_timeout_s` (+ margin). Failures come back in the reply."""
        from art_mega.inference.protocol import InferenceStartRequest, InferenceStartResponse

        body = InferenceStartRequest(replica=replica, launch=launch)
        return await self._request(
            "POST", "/inference/start", body, InferenceStartResponse, launch.ready_timeout_s + 30
        )

    async def inference_stop(self, names: tuple[str, ...] = ()) -> ShutdownResponse:
        """Stop these replicas of this host (empty: all); SIGTERM, then SIGKILL after their grace."""
        from art_mega.inference.protocol import InferenceStopRequest

        return await self._request(
            "POST", "/inference/stop", InferenceStopRequest(names=names), ShutdownResponse
        )

    async def trainer_start(self, request: TrainerStartRequest) -> TrainerStartResponse:
        """Start this host's trainer ranks (readiness arrives as events)."""
        reply = await self._request("POST", "/trainer/start", request, TrainerStartResponse)
        if reply.error:
            raise AgentError(self.host, self.address, f"trainer ranks did not start: {reply.error}")
        return reply

    async def trainer_job(self, job: dict[str, Any]) -> int:
        """Send a job to this host's trainer ranks; returns how many ranks it reached."""
        return (
            await self._request("POST", "/trainer/job", TrainerJobRequest(job=job), TrainerJobResponse)
        ).sent

    async def trainer_events(self, after: int, timeout_s: float) -> TrainerEventsResponse:
        """Long-poll this host's trainer events from index `after` (waits up to `timeout_s` s)."""
        body = TrainerEventsRequest(after=after, timeout_s=timeout_s)
        return await self._request("POST", "/trainer/events", body, TrainerEventsResponse, timeout_s + 30)

    async def trainer_stop(self) -> ShutdownResponse:
        """Stop this host's trainer ranks."""
        return await self._request("POST", "/trainer/stop", None, ShutdownResponse)

    async def shutdown(self, timeout_s: float | None = None) -> ShutdownResponse:
        """Stop every child of the agent, then the agent itself."""
        return await self._request(
            "POST", "/shutdown", None, ShutdownResponse, timeout_s if timeout_s is not None else ...
        )

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

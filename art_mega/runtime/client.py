"""The controller's signed HTTP client for one agent.

Bodies are the pydantic models of `protocol`; every request is signed with the launch secret.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel

from art_mega.errors import UserError
from art_mega.runtime.auth import sign
from art_mega.runtime.protocol import (
    API_PREFIX,
    CallableRef,
    EtcdCheckRequest,
    EtcdCheckResponse,
    EtcdStartRequest,
    EtcdStartResponse,
    FreePortRequest,
    FreePortResponse,
    FsOpRequest,
    FsOpResponse,
    HealthResponse,
    HostFacts,
    PreflightRunRequest,
    PreflightRunResponse,
    RemoteFailure,
    RunRolloutRequest,
    RunRolloutResponse,
    ShutdownResponse,
    StartRolloutWorkersRequest,
    StartRolloutWorkersResponse,
    StopRolloutWorkersRequest,
)

M = TypeVar("M", bound=BaseModel)


class AgentError(Exception):
    """An agent could not be reached or answered with an error; names the host and address."""

    def __init__(self, host: str, address: str, message: str) -> None:
        super().__init__(f"host {host} ({address}): {message}")
        self.host = host
        self.address = address


class RemoteRolloutError(Exception):
    """A rollout raised on its worker; carries the remote type, message and traceback."""

    def __init__(self, host: str, worker_id: str, failure: RemoteFailure) -> None:
        super().__init__(f"rollout on host {host} worker {worker_id} failed: {failure.message}")
        self.host = host
        self.worker_id = worker_id
        self.failure = failure


def raise_failure(host: str, failure: RemoteFailure, worker_id: str = "") -> None:
    """Raise `UserError` for a user-kind failure, `RemoteRolloutError` otherwise."""
    if failure.kind == "user":
        raise UserError(failure.message)
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
        self._secret = secret
        self._timeout_s = timeout_s
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
        self._http = httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout_s, trust_env=False)

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
        headers = sign(self._secret, method, full, content)
        headers["content-type"] = "application/json"
        timeout = self._timeout_s if timeout_s is ... else timeout_s
        try:
            response = await self._http.request(
                method, full, content=content, headers=headers, timeout=timeout
            )
        except httpx.HTTPError as exc:
            raise AgentError(
                self.host, self.address, f"agent unreachable ({type(exc).__name__}: {exc})"
            ) from exc
        if response.status_code != 200:
            detail = response.text
            try:
                detail = json.loads(detail).get("detail", detail)
            except (ValueError, AttributeError):
                pass
            raise AgentError(self.host, self.address, f"HTTP {response.status_code}: {detail}")
        return model.model_validate(response.json())

    async def health(self, timeout_s: float | None = None) -> HealthResponse:
        """The agent's identity and children. Raises `AgentError` when it does not answer."""
        return await self._request(
            "GET", "/health", None, HealthResponse, timeout_s if timeout_s is not None else ...
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
        """One filesystem-probe step on this host (see `runtime.fs_probe`)."""
        return await self._request("POST", "/fs/op", request, FsOpResponse)

    async def etcd_start(self, request: EtcdStartRequest) -> EtcdStartResponse:
        """Start the managed etcd on this host (see `runtime.etcd`)."""
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

    async def preflight_run(self, request: PreflightRunRequest) -> PreflightRunResponse:
        """Run one preflight rank here; returns when it exits or after `timeout_s` (+ margin)."""
        return await self._request(
            "POST", "/preflight/run", request, PreflightRunResponse, request.timeout_s + 30
        )

    async def shutdown(self, timeout_s: float | None = None) -> ShutdownResponse:
        """Stop every child of the agent, then the agent itself."""
        return await self._request(
            "POST", "/shutdown", None, ShutdownResponse, timeout_s if timeout_s is not None else ...
        )

    async def aclose(self) -> None:
        await self._http.aclose()

"""Bodies and routes of the rollout service: start and stop rollout workers, run one rollout.

Pydantic models, JSON on the wire; every body is validated against them on receipt.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from art_mega.agent.protocol import ShutdownResponse
from art_mega.agent.routes import Route

STREAM_LIMIT = 64 * 1024 * 1024
"""Largest single message (bytes) between agent and worker, and the body cap of a rollout run."""


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CallableRef(_Body):
    """An async callable named by import reference, pinned by the sha256 of its source file."""

    module: str
    qualname: str
    source_sha256: str


class RemoteFailure(_Body):
    """Why a remote call failed. `kind` "user" maps to a `UserError` on the controller."""

    kind: Literal["user", "error"]
    message: str
    exc_type: str = ""
    traceback: str = ""


class StartRolloutWorkersRequest(_Body):
    """Start `count` rollout worker processes with `sys_path` prepended to their import path."""

    count: int = Field(ge=1, le=1024)
    sys_path: tuple[str, ...] = ()
    callables: tuple[CallableRef, ...] = ()


class StartRolloutWorkersResponse(_Body):
    """The started workers, or why none was started (`failure`; all or nothing)."""

    worker_ids: tuple[str, ...] = ()
    pids: tuple[int, ...] = ()
    failure: RemoteFailure | None = None


class StopRolloutWorkersRequest(_Body):
    """Stop these workers (empty = every rollout worker of this agent)."""

    worker_ids: tuple[str, ...] = ()


class RunRolloutRequest(_Body):
    """Run `callable(*args, **kwargs)` on one rollout worker; args are wire-encoded JSON."""

    worker_id: str
    callable: CallableRef
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)


class RunRolloutResponse(_Body):
    ok: bool
    result: Any = None
    failure: RemoteFailure | None = None


START_WORKERS = Route(
    "POST", "/rollout-workers/start", StartRolloutWorkersRequest, StartRolloutWorkersResponse
)
STOP_WORKERS = Route("POST", "/rollout-workers/stop", StopRolloutWorkersRequest, ShutdownResponse)
RUN_ROLLOUT = Route("POST", "/rollouts/run", RunRolloutRequest, RunRolloutResponse, STREAM_LIMIT)

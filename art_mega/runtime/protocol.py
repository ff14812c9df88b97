"""Request and response bodies of the agent control plane (pydantic models, JSON on the wire).

Nothing received from the network is unpickled: every body is validated against these models.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

API_PREFIX = "/v1"
READY_PREFIX = "ART_MEGA_READY "
"""An agent prints this prefix and a JSON object on stdout once it listens."""


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ChildStatus(_Body):
    """One supervised child process of an agent."""

    child_id: str
    role: str
    pid: int
    returncode: int | None = None
    log_path: str | None = None


class HealthResponse(_Body):
    """What an agent says about itself; `pid` and `launch_id` prove which process answers."""

    launch_id: str
    pid: int
    hostname: str
    address: str
    boot_id: str
    python: str
    art_mega_version: str
    started_at: float
    children: tuple[ChildStatus, ...] = ()


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


class ShutdownResponse(_Body):
    stopped: tuple[ChildStatus, ...] = ()

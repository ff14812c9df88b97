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
    controller_lease_s: float | None = None
    """Seconds this agent waits for its controller before it stops its children and exits."""


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


class LeaseRequest(_Body):
    """The controller's heartbeat (`hold`) or its release of the agent (`hold=False`, at its end)."""

    hold: bool = True


class GpuInfo(_Body):
    """One GPU (or MIG slice) as NVML reports it."""

    index: int
    uuid: str
    pci_bus_id: str
    name: str
    memory_bytes: int
    mig_mode: bool = False
    parent_uuid: str | None = None
    """For a MIG slice: the UUID of the whole GPU it belongs to."""


class HostFacts(_Body):
    """What an agent reports about its host for admission (see `preflight.admission`)."""

    host_id: str = ""
    hostname: str
    boot_id: str
    python_version: str
    python_executable: str
    art_mega_version: str
    art_mega_files_sha256: str
    packages: dict[str, str]
    env: dict[str, str]
    gpus: tuple[GpuInfo, ...] = ()
    nvml_error: str = ""
    interfaces: tuple[str, ...] = ()
    """Network interface names of the host (its namespace); empty when not reported."""


class FsOpRequest(_Body):
    """One filesystem probe step on an agent, confined to `<root>/.art-mega-probe/`."""

    op: Literal["write", "read", "lock", "trylock", "unlock", "cleanup"]
    root: str
    name: str
    content: str = ""


class FsOpResponse(_Body):
    ok: bool
    content: str = ""
    exists: bool = False
    busy: bool = False
    error: str = ""


class EtcdStartRequest(_Body):
    """Start a single-member etcd on this agent's host, client URL on `advertise_host`."""

    advertise_host: str
    binary: str | None = None
    sha256: str | None = None
    timeout_s: float = Field(default=30.0, gt=0)


class EtcdStartResponse(_Body):
    ok: bool
    endpoint: str = ""
    pid: int = 0
    data_dir: str = ""
    version: str = ""
    error: str = ""


class EtcdCheckRequest(_Body):
    """From this host: check `endpoint` is healthy and serves a put/get of `key`."""

    endpoint: str
    key: str
    value: str
    timeout_s: float = Field(default=5.0, gt=0)


class EtcdCheckResponse(_Body):
    ok: bool
    error: str = ""
    seconds: float = 0.0


class FreePortRequest(_Body):
    host: str


FILES_PER_CHECK = 4096  # paths per /files/check request (AgentClient.files_missing sends more in turns)


class FilesCheckRequest(_Body):
    """Absolute paths of files this host's processes will read (a base model's files, say)."""

    paths: tuple[str, ...] = Field(max_length=FILES_PER_CHECK)


class FilesCheckResponse(_Body):
    """The requested paths that are not readable regular files on this host, in request order."""

    missing: tuple[str, ...] = ()


class FreePortResponse(_Body):
    port: int


class PreflightRunRequest(_Body):
    """Run one preflight-collective rank on this host (see `preflight.probe`)."""

    config: dict[str, Any]
    python: str | None = None
    timeout_s: float = Field(gt=0)


class PreflightPrepareRequest(_Body):
    """Start a warm preflight probe on this host (torch imported, waiting for its config)."""

    python: str | None = None


class PreflightPrepareResponse(_Body):
    started: bool
    """False when a warm probe for this Python was already waiting."""


class PreflightRunResponse(_Body):
    exit_code: int | None
    timed_out: bool = False
    result: dict[str, Any] | None = None
    stderr_tail: str = ""

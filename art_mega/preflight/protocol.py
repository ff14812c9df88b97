"""Bodies and routes of the preflight service: host facts, FS probe steps, file reach checks,
the managed etcd and the preflight-collective probe.

Pydantic models, JSON on the wire; every body is validated against them on receipt.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from art_mega.agent.protocol import ShutdownResponse
from art_mega.agent.routes import Route

FILES_PER_CHECK = 4096  # paths per /files/check request (fs_probe.files_missing sends more in turns)
FILES_CHECK_MAX_BODY_BYTES = 16 << 20
"""Body cap of /v1/files/check: `FILES_PER_CHECK` paths of up to 4 KiB each."""


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


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


class FilesCheckRequest(_Body):
    """Absolute paths of files this host's processes will read (a base model's files, say)."""

    paths: tuple[str, ...] = Field(max_length=FILES_PER_CHECK)


class FilesCheckResponse(_Body):
    """The requested paths that are not readable regular files on this host, in request order."""

    missing: tuple[str, ...] = ()


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


FACTS = Route("GET", "/facts", None, HostFacts)
FS_OP = Route("POST", "/fs/op", FsOpRequest, FsOpResponse)
FILES_CHECK = Route("POST", "/files/check", FilesCheckRequest, FilesCheckResponse, FILES_CHECK_MAX_BODY_BYTES)
ETCD_START = Route("POST", "/etcd/start", EtcdStartRequest, EtcdStartResponse)
ETCD_STOP = Route("POST", "/etcd/stop", None, ShutdownResponse)
ETCD_CHECK = Route("POST", "/etcd/check", EtcdCheckRequest, EtcdCheckResponse)
PREFLIGHT_PREPARE = Route("POST", "/preflight/prepare", PreflightPrepareRequest, PreflightPrepareResponse)
PREFLIGHT_DISCARD = Route("POST", "/preflight/discard", None, ShutdownResponse)
PREFLIGHT_RUN = Route("POST", "/preflight/run", PreflightRunRequest, PreflightRunResponse)

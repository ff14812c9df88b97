"""The machines of a launch: one `HostSpec` per host and the `ClusterSpec` that ties them.

Checks what can be checked from the hosts alone (ids, ranks, addresses, paths, timeouts).
"""

from __future__ import annotations

from pathlib import PurePosixPath

from pydantic import Field, field_validator, model_validator

from art_mega.errors import TopologyError
from art_mega.topology.base import Flag, GpuId, Integer, Number, SpecModel, check_identifier, unique_gpu_ids
from art_mega.topology.endpoint import EndpointSpec
from art_mega.topology.transport import NcclTransportSpec, NixlTransportSpec


class HostSpec(SpecModel):
    """One machine: its agent's address, how many rollout workers it runs and its GPUs.

    `node_rank` is the host's position in `ClusterSpec.hosts` (0, 1, ...). `worker_address` is
    where the controller reaches the host's agent. `cpu_slots` is the number of rollout worker
    processes. `gpu_ids` are CUDA indices (>= 0) or `GPU-`/`MIG-` UUIDs, each listed once; empty
    means a CPU-only host. Raises `ValidationError` when any of these rules is broken.
    """

    host_id: str
    node_rank: Integer = Field(ge=0)
    worker_address: EndpointSpec
    cpu_slots: Integer = Field(default=1, ge=1)
    gpu_ids: tuple[GpuId, ...] = ()

    @field_validator("host_id")
    @classmethod
    def _check_host_id(cls, value: str) -> str:
        return check_identifier(value, "host_id")

    @field_validator("gpu_ids")
    @classmethod
    def _check_gpu_ids(cls, value: tuple[int | str, ...]) -> tuple[int | str, ...]:
        return unique_gpu_ids(value, "gpu_ids")

    @property
    def has_gpus(self) -> bool:
        """True when the host lists at least one GPU."""
        return bool(self.gpu_ids)


def _check_absolute(value: str, what: str) -> str:
    if not value or "\x00" in value or not PurePosixPath(value).is_absolute():
        raise ValueError(f"{what} {value!r} must be an absolute path such as '/mnt/shared/art'")
    return value


class ClusterSpec(SpecModel):
    """Every host of a launch plus where artifacts live and how long to wait.

    Rules (each broken one raises `ValidationError` with one sentence): at least one host,
    unique `host_id`s, unique worker addresses (host and port), `hosts[i].node_rank == i`,
    `controller_host_id` names a listed host, `artifact_root` and `cache_root` are absolute
    paths. `artifact_root` holds batches and adapters; `shared_artifact_root` says whether every
    host sees it as one filesystem (proved later by the FS probe). `cache_root` holds per-host
    caches (converted weights, compiled kernels). Timeouts are in seconds: `startup_timeout_s`
    bounds how long a host or process may take to come up, `rpc_timeout_s` one control-plane
    call. `allow_shared_kernel` lets host admission accept hosts that report the same kernel
    boot id (network namespaces or several agents on one machine, as in CI).
    """

    hosts: tuple[HostSpec, ...] = Field(min_length=1)
    controller_host_id: str
    artifact_root: str
    shared_artifact_root: Flag = True
    cache_root: str
    nccl_transport: NcclTransportSpec | None = None
    nixl_transport: NixlTransportSpec = Field(default_factory=NixlTransportSpec)
    startup_timeout_s: Number = Field(default=60.0, gt=0, allow_inf_nan=False)
    rpc_timeout_s: Number = Field(default=30.0, gt=0, allow_inf_nan=False)
    allow_shared_kernel: Flag = False

    @field_validator("artifact_root")
    @classmethod
    def _check_artifact_root(cls, value: str) -> str:
        return _check_absolute(value, "artifact_root")

    @field_validator("cache_root")
    @classmethod
    def _check_cache_root(cls, value: str) -> str:
        return _check_absolute(value, "cache_root")

    @model_validator(mode="after")
    def _check_hosts(self) -> ClusterSpec:
        ids: set[str] = set()
        addresses: dict[tuple[str, int], str] = {}
        for index, host in enumerate(self.hosts):
            if host.host_id in ids:
                raise ValueError(
                    f"hosts[{index}].host_id {host.host_id!r} is used by an earlier host; "
                    "give every host its own id"
                )
            ids.add(host.host_id)
            key = (host.worker_address.host.lower(), host.worker_address.port)
            if key in addresses:
                raise ValueError(
                    f"hosts[{index}].worker_address {host.worker_address.address!r} is already "
                    f"used by host {addresses[key]!r}; give each agent its own host and port"
                )
            addresses[key] = host.host_id
            if host.node_rank != index:
                raise ValueError(
                    f"hosts[{index}].node_rank is {host.node_rank} but must be {index}: node "
                    "ranks count 0, 1, 2, ... in the order hosts are listed"
                )
        if self.controller_host_id not in ids:
            raise ValueError(
                f"controller_host_id {self.controller_host_id!r} is not one of the hosts "
                f"({_quoted(self.host_ids)}); name one of them"
            )
        return self

    @property
    def host_ids(self) -> tuple[str, ...]:
        """Host ids in node-rank order."""
        return tuple(host.host_id for host in self.hosts)

    @property
    def controller(self) -> HostSpec:
        """The host the controller (the user's program) runs on."""
        return self.host(self.controller_host_id)

    def host(self, host_id: str) -> HostSpec:
        """Return the host named `host_id`; raises `TopologyError` naming it if unknown."""
        for host in self.hosts:
            if host.host_id == host_id:
                return host
        raise TopologyError(
            f"host_id {host_id!r} is not in ClusterSpec.hosts ({_quoted(self.host_ids)}); "
            "use one of those ids.",
            "host_id",
        )


def _quoted(values: tuple[str, ...]) -> str:
    return ", ".join(repr(value) for value in values)

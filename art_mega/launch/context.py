"""ArtLaunchContext: what a launcher hands to the user's `main(launch)`.

It names the running agents (worker addresses) and builds a `ClusterSpec` over them; the launch
secret stays inside (never printed, never in repr).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from art_mega.errors import UserError
from art_mega.topology import ClusterSpec, EndpointSpec, HostSpec, NcclTransportSpec, NixlTransportSpec

if TYPE_CHECKING:
    from art_mega.runtime.runtime import ArtRuntime


def default_artifact_root() -> str:
    """`<cwd>/.art`, ART's default root: where runs (batches, checkpoints, adapters, history) go
    by default (`trainer.checkpoint.DEFAULT_ROOT`)."""
    from art_mega.trainer.checkpoint import DEFAULT_ROOT

    return os.path.abspath(DEFAULT_ROOT)


def default_cache_root() -> str:
    """`$ART_MEGA_CACHE` or `~/.cache/art-mega`: converted models and other caches."""
    return os.path.abspath(os.environ.get("ART_MEGA_CACHE") or os.path.expanduser("~/.cache/art-mega"))


@dataclass(frozen=True)
class HostMesh:
    """The agents of one launch, as `ArtRuntime.start` takes them (ART's `launch.host_mesh`).

    Attributes:
        worker_addresses: each agent's `tcp://HOST:PORT`, in node-rank order.
        launch_id: the id every agent of this launch reports.
        sys_path: import-path entries the program needs on every worker (its script folder).
    """

    worker_addresses: tuple[str, ...]
    launch_id: str
    sys_path: tuple[str, ...] = ()
    _secret: bytes = field(default=b"", repr=False, compare=False)
    _runtimes: list[Any] = field(default_factory=list, repr=False, compare=False)

    def _secret_bytes(self) -> bytes:
        return self._secret

    def _register(self, runtime: ArtRuntime) -> None:
        """Remember a runtime so the launcher can close it if the program did not."""
        self._runtimes.append(runtime)


@dataclass(frozen=True)
class ArtLaunchContext:
    """The agents of this launch, one per host, and the controller's place among them.

    Attributes:
        worker_addresses: each agent's `tcp://HOST:PORT`, in node-rank order.
        controller_rank: index in `worker_addresses` of the agent on the controller's host.
        launch_id: the id every agent of this launch reports.
        sys_path: import-path entries the program needs on every worker (its script folder).
    """

    worker_addresses: tuple[str, ...]
    launch_id: str
    controller_rank: int = 0
    sys_path: tuple[str, ...] = ()
    _secret: bytes = field(default=b"", repr=False, compare=False)
    _runtimes: list[Any] = field(default_factory=list, repr=False, compare=False)

    @property
    def host_count(self) -> int:
        """Number of hosts (agents) in this launch."""
        return len(self.worker_addresses)

    @property
    def host_mesh(self) -> HostMesh:
        """This launch's agents for `ArtRuntime.start` (a runtime started on it is closed by the
        launcher like one started on the context)."""
        return HostMesh(self.worker_addresses, self.launch_id, self.sys_path, self._secret, self._runtimes)

    def _secret_bytes(self) -> bytes:
        return self._secret

    def _register(self, runtime: ArtRuntime) -> None:
        """Remember a runtime so the launcher can close it if the program did not."""
        self._runtimes.append(runtime)

    def homogeneous_cluster(
        self,
        cpu_slots: int = 1,
        gpu_ids: tuple[int | str, ...] = (),
        artifact_root: str | None = None,
        cache_root: str | None = None,
        nccl_transport: NcclTransportSpec | None = None,
        nixl_transport: NixlTransportSpec | None = None,
        startup_timeout_s: float = 60.0,
        rpc_timeout_s: float = 30.0,
        shared_artifact_root: bool = True,
        allow_shared_kernel: bool = False,
    ) -> ClusterSpec:
        """A `ClusterSpec` with hosts `host0..N-1` on this launch's agents, all alike.

        Raises:
            UserError: `gpu_ids` that is not a tuple or list (a string was read as its letters).
            pydantic.ValidationError: a value breaks a `ClusterSpec`/`HostSpec` rule (the CLI
                prints it as one sentence); an empty `artifact_root` or `cache_root` is refused
                there, not replaced by the default (None is the default).
        """
        if not isinstance(gpu_ids, (tuple, list)):
            raise UserError(
                f"homogeneous_cluster(gpu_ids={gpu_ids!r}) lists each host's GPUs; pass a tuple such as "
                "(0, 1) or ('GPU-...',), or () for none"
            )
        hosts = tuple(
            HostSpec(
                host_id=f"host{i}",
                node_rank=i,
                worker_address=EndpointSpec.parse(address),
                cpu_slots=cpu_slots,
                gpu_ids=tuple(gpu_ids),
            )
            for i, address in enumerate(self.worker_addresses)
        )
        extra: dict[str, Any] = {}
        if nixl_transport is not None:
            extra["nixl_transport"] = nixl_transport
        return ClusterSpec(
            hosts=hosts,
            controller_host_id=f"host{self.controller_rank}",
            artifact_root=default_artifact_root() if artifact_root is None else artifact_root,
            shared_artifact_root=shared_artifact_root,
            cache_root=default_cache_root() if cache_root is None else cache_root,
            nccl_transport=nccl_transport,
            startup_timeout_s=startup_timeout_s,
            rpc_timeout_s=rpc_timeout_s,
            allow_shared_kernel=allow_shared_kernel,
            **extra,
        )

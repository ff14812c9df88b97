"""Host admission: the hosts are what the topology says, before anything is allocated.

Pure checks over the `HostFacts` every agent reported: one software fingerprint on all hosts,
distinct kernels (unless allowed), distinct GPUs, no GPU used whole and as a MIG slice, every GPU
the topology names present, and NCCL_NET equal to the spec's network where NCCL is configured.
"""

from __future__ import annotations

from collections.abc import Mapping

from art_mega.errors import UserError
from art_mega.runtime.protocol import GpuInfo, HostFacts
from art_mega.topology import CompiledTopology


class PreflightError(UserError):
    """The cluster failed a check before any model was allocated; names the host and the cause."""


FINGERPRINT_FIELDS = ("python_version", "art_mega_version", "art_mega_files_sha256", "packages")


def fingerprint(facts: HostFacts) -> tuple[tuple[str, str], ...]:
    """The software identity that must be equal on every host: (field, value) pairs."""
    items = [(f, str(getattr(facts, f))) for f in FINGERPRINT_FIELDS if f != "packages"]
    items += [(f"package {name}", ver) for name, ver in sorted(facts.packages.items())]
    return tuple(items)


def _short(value: str) -> str:
    return value[:12] if len(value) == 64 else value


def check_fingerprints(facts: Mapping[str, HostFacts]) -> None:
    """Raise `PreflightError` listing, host by host, every fingerprint field that differs."""
    prints = {host: dict(fingerprint(f)) for host, f in facts.items()}
    fields = sorted({k for p in prints.values() for k in p})
    differing = []
    for name in fields:
        values = {host: p.get(name, "(absent)") for host, p in prints.items()}
        if len(set(values.values())) > 1:
            per_host = ", ".join(f"{h}={_short(v)}" for h, v in values.items())
            differing.append(f"{name}: {per_host}")
    if differing:
        raise PreflightError(
            "hosts run different software (" + "; ".join(differing) + "); install the same art-mega "
            "and packages on every host"
        )


def check_kernels(facts: Mapping[str, HostFacts], allow_shared_kernel: bool) -> None:
    """Two hosts on one kernel (same boot_id) are refused unless `allow_shared_kernel` is set."""
    if allow_shared_kernel:
        return
    seen: dict[str, str] = {}
    for host, f in facts.items():
        if f.boot_id and f.boot_id in seen:
            raise PreflightError(
                f"hosts {seen[f.boot_id]} and {host} share one kernel (boot_id {f.boot_id[:8]}); they are one "
                "machine: list it once, or set ClusterSpec.allow_shared_kernel=True for test hosts"
            )
        seen[f.boot_id] = host


def check_gpu_identity(facts: Mapping[str, HostFacts], allow_shared_kernel: bool) -> None:
    """GPU UUIDs and PCI bus ids must be distinct across hosts (one GPU cannot be on two hosts)."""
    if allow_shared_kernel:
        return
    by_uuid: dict[str, str] = {}
    by_pci: dict[str, str] = {}
    for host, f in facts.items():
        for gpu in f.gpus:
            if gpu.parent_uuid is not None:
                continue
            if gpu.uuid in by_uuid and by_uuid[gpu.uuid] != host:
                raise PreflightError(f"GPU {gpu.uuid} is reported by both {by_uuid[gpu.uuid]} and {host}")
            if gpu.pci_bus_id in by_pci and by_pci[gpu.pci_bus_id] != host:
                # PCI ids repeat across machines legitimately only when the machines differ (boot ids)
                if facts[by_pci[gpu.pci_bus_id]].boot_id == f.boot_id:
                    raise PreflightError(
                        f"GPU at PCI {gpu.pci_bus_id} is reported by both {by_pci[gpu.pci_bus_id]} and {host}"
                    )
            by_uuid[gpu.uuid] = host
            by_pci.setdefault(gpu.pci_bus_id, host)


def _resolve(gpu_id: int | str, gpus: tuple[GpuInfo, ...]) -> GpuInfo | None:
    for gpu in gpus:
        if isinstance(gpu_id, int) and gpu.parent_uuid is None and gpu.index == gpu_id:
            return gpu
        if isinstance(gpu_id, str) and gpu.uuid == gpu_id:
            return gpu
    return None


def check_named_gpus(topology: CompiledTopology, facts: Mapping[str, HostFacts]) -> None:
    """Every GPU the topology names exists on its host; no GPU is used whole and as a MIG slice."""
    for host in topology.cluster.hosts:
        f = facts[host.host_id]
        used: list[GpuInfo] = []
        for gpu_id in host.gpu_ids:
            gpu = _resolve(gpu_id, f.gpus)
            if gpu is None:
                have = (
                    ", ".join(f"{g.index}:{g.uuid}" for g in f.gpus)
                    or f"no GPUs ({f.nvml_error or 'NVML found none'})"
                )
                raise PreflightError(
                    f"host {host.host_id}: GPU {gpu_id} named by the topology is not present (it has {have})"
                )
            used.append(gpu)
        wholes = {g.uuid for g in used if g.parent_uuid is None}
        for gpu in used:
            if gpu.parent_uuid in wholes:
                raise PreflightError(
                    f"host {host.host_id}: MIG slice {gpu.uuid} and its whole GPU {gpu.parent_uuid} are both in the "
                    "topology; use one or the other"
                )


def check_nccl_env(topology: CompiledTopology, facts: Mapping[str, HostFacts]) -> None:
    """Where an NCCL transport is configured, each host's NCCL_NET must equal its `net_name`."""
    transport = topology.cluster.nccl_transport
    if transport is None:
        return
    for host_id, f in facts.items():
        actual = f.env.get("NCCL_NET")
        if actual != transport.net_name:
            raise PreflightError(
                f"host {host_id}: NCCL_NET is {actual!r} but ClusterSpec.nccl_transport.net_name is "
                f"{transport.net_name!r}; set NCCL_NET={transport.net_name} on that host"
            )


def admit(topology: CompiledTopology, facts: Mapping[str, HostFacts]) -> None:
    """Run every admission check, in order; raise `PreflightError` at the first that fails."""
    missing = [h for h in topology.cluster.host_ids if h not in facts]
    if missing:
        raise PreflightError(f"hosts {missing} did not report their facts")
    allow = topology.cluster.allow_shared_kernel
    check_fingerprints(facts)
    check_kernels(facts, allow)
    check_gpu_identity(facts, allow)
    check_named_gpus(topology, facts)
    check_nccl_env(topology, facts)

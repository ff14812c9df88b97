"""Host admission: the hosts are what the topology says, before anything is allocated.

Pure checks over the `HostFacts` every agent reported: one software fingerprint on all hosts,
distinct kernels (unless allowed), distinct GPUs, every GPU the topology names present and named
once (an index and a UUID of one device are one GPU), no GPU used whole and as a MIG slice,
socket interface variables that select interfaces the host has, and NCCL_NET equal to the spec's
network where NCCL is configured.
"""

from __future__ import annotations

from collections.abc import Mapping

from art_mega.errors import HostMismatchError, PreflightError
from art_mega.preflight.netif import gloo_ifname_problem, nccl_ifname_problem
from art_mega.preflight.protocol import GpuInfo, HostFacts
from art_mega.topology import CompiledTopology

__all__ = ["HostMismatchError", "PreflightError", "admit", "fingerprint", "resolve_gpu"]

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
            "and packages on every host",
            tuple(facts),
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
                "machine: list it once, or set ClusterSpec.allow_shared_kernel=True for test hosts",
                (seen[f.boot_id], host),
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
                raise PreflightError(
                    f"GPU {gpu.uuid} is reported by both {by_uuid[gpu.uuid]} and {host}",
                    (by_uuid[gpu.uuid], host),
                )
            if gpu.pci_bus_id in by_pci and by_pci[gpu.pci_bus_id] != host:
                # PCI ids repeat across machines legitimately only when the machines differ (boot ids)
                if facts[by_pci[gpu.pci_bus_id]].boot_id == f.boot_id:
                    raise PreflightError(
                        f"GPU at PCI {gpu.pci_bus_id} is reported by both {by_pci[gpu.pci_bus_id]} and {host}",
                        (by_pci[gpu.pci_bus_id], host),
                    )
            by_uuid[gpu.uuid] = host
            by_pci.setdefault(gpu.pci_bus_id, host)


def _inventory(facts: HostFacts) -> str:
    wholes = [g for g in facts.gpus if g.parent_uuid is None]
    if not facts.gpus:
        return f"no GPUs ({facts.nvml_error or 'NVML found none'})"
    parts = [f"{g.index}: {g.uuid}" for g in wholes]
    parts += [f"MIG {g.uuid} of GPU {g.index}" for g in facts.gpus if g.parent_uuid is not None]
    return ", ".join(parts)


def resolve_gpu(host_id: str, gpu_id: int | str, facts: HostFacts) -> GpuInfo:
    """The physical device (whole GPU or MIG slice) that `gpu_id` names on host `host_id`.

    An int is an NVML index of a whole GPU (PCI bus order, what CUDA uses with
    CUDA_DEVICE_ORDER=PCI_BUS_ID); a `GPU-...` string is a whole GPU's UUID and a `MIG-...`
    string a MIG slice's, matched exactly as NVML reports them.

    Raises:
        HostMismatchError: an index out of range, a UUID the host does not have (the message
            lists what it has), or one it has written in another case.
    """
    have = _inventory(facts)
    wholes = [g for g in facts.gpus if g.parent_uuid is None]
    if isinstance(gpu_id, int):
        for gpu in wholes:
            if gpu.index == gpu_id:
                return gpu
        if not wholes:
            fix = "remove gpu_ids for a CPU-only host"
        else:
            fix = f"use an index 0..{len(wholes) - 1} or a UUID"
        raise HostMismatchError(
            f"host {host_id}: GPU {gpu_id} in gpu_ids is not present (index out of range; the host has "
            f"{have}); {fix}",
            host_id,
            "gpu_ids",
            gpu_id,
        )
    for gpu in facts.gpus:
        if gpu.uuid == gpu_id:
            return gpu
    for gpu in facts.gpus:  # CUDA_VISIBLE_DEVICES matches UUIDs as NVML writes them
        if gpu.uuid.lower() == gpu_id.lower():
            raise HostMismatchError(
                f"host {host_id}: GPU {gpu_id!r} in gpu_ids is written in another case than the host "
                f"reports it ({gpu.uuid!r}); write it as NVML does (nvidia-smi -L)",
                host_id,
                "gpu_ids",
                gpu_id,
            )
    raise HostMismatchError(
        f"host {host_id}: GPU {gpu_id} in gpu_ids is not present (the host has {have}); use one of its "
        "indices or UUIDs",
        host_id,
        "gpu_ids",
        gpu_id,
    )


def _check_index_order(host_id: str, gpu_ids: tuple[int | str, ...], facts: HostFacts) -> None:
    """An index means the same GPU to NVML and CUDA only in PCI order: CUDA's default order
    (CUDA_DEVICE_ORDER=FASTEST_FIRST) puts faster models first, so on a host with two GPU models
    index 0 can be another device than the one admission checked."""
    indices = [g for g in gpu_ids if isinstance(g, int)]
    models = sorted({g.name for g in facts.gpus if g.parent_uuid is None})
    order = facts.env.get("CUDA_DEVICE_ORDER")
    if indices and len(models) > 1 and order != "PCI_BUS_ID":
        raise HostMismatchError(
            f"host {host_id}: gpu_ids names GPU {indices[0]} by index on a host with {len(models)} GPU models "
            f"({', '.join(models)}) while CUDA_DEVICE_ORDER is {order!r}, so CUDA may number the GPUs "
            "differently from NVML; name GPUs by UUID or set CUDA_DEVICE_ORDER=PCI_BUS_ID on that host",
            host_id,
            "gpu_ids",
            gpu_ids,
        )


def check_named_gpus(topology: CompiledTopology, facts: Mapping[str, HostFacts]) -> None:
    """Every GPU the topology names exists on its host, once; no GPU is used whole and as a MIG slice.

    Raises:
        HostMismatchError: an unknown GPU (see `resolve_gpu`), two spellings (an index and a
            UUID) of one device, naming the host and both spellings, a whole GPU in MIG mode, or
            an index on a host with two GPU models whose CUDA_DEVICE_ORDER is not PCI_BUS_ID.
        PreflightError: a MIG slice listed together with its whole GPU.
    """
    for host in topology.cluster.hosts:
        f = facts[host.host_id]
        _check_index_order(host.host_id, host.gpu_ids, f)
        spelled: dict[str, int | str] = {}
        used: list[GpuInfo] = []
        for gpu_id in host.gpu_ids:
            gpu = resolve_gpu(host.host_id, gpu_id, f)
            if gpu.uuid in spelled:
                raise HostMismatchError(
                    f"host {host.host_id}: gpu_ids names one GPU twice, as {spelled[gpu.uuid]!r} and "
                    f"{gpu_id!r} (both are {gpu.uuid} at PCI {gpu.pci_bus_id}), which would put two "
                    "ranks on it; list each GPU once",
                    host.host_id,
                    "gpu_ids",
                    host.gpu_ids,
                )
            if gpu.parent_uuid is None and gpu.mig_mode:
                slices = [g.uuid for g in f.gpus if g.parent_uuid == gpu.uuid]
                raise HostMismatchError(
                    f"host {host.host_id}: GPU {gpu_id!r} in gpu_ids is in MIG mode, so CUDA runs nothing on "
                    f"it whole; name its MIG slices ({', '.join(slices) or 'none are configured'}) or "
                    f"disable MIG on it (nvidia-smi -i {gpu.index} -mig 0)",
                    host.host_id,
                    "gpu_ids",
                    gpu_id,
                )
            spelled[gpu.uuid] = gpu_id
            used.append(gpu)
        wholes = {g.uuid for g in used if g.parent_uuid is None}
        for gpu in used:
            if gpu.parent_uuid in wholes:
                raise PreflightError(
                    f"host {host.host_id}: MIG slice {gpu.uuid} and its whole GPU {gpu.parent_uuid} are both in the "
                    "topology; use one or the other",
                    (host.host_id,),
                )


def check_socket_interfaces(topology: CompiledTopology, facts: Mapping[str, HostFacts]) -> None:
    """GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME (host env or the spec's `socket_ifname`) name
    interfaces each host has, in the syntax each library takes.

    gloo takes a comma-separated list of exact names and runs on every host; NCCL also takes `^`
    (exclude) and `=` (exact) prefixes and runs only on hosts with GPUs, so only those are
    checked for it. The spec's `nccl_transport.socket_ifname` replaces the host's
    NCCL_SOCKET_IFNAME in every GPU process, so it is what is checked where it is set.

    Raises:
        HostMismatchError: naming the host, the variable, its value and why it cannot work.
    """
    transport = topology.cluster.nccl_transport
    spec_nccl = transport.socket_ifname if transport is not None else None
    gpu_hosts = {h.host_id for h in topology.cluster.hosts if h.gpu_ids}
    for host_id, f in facts.items():
        checks = []
        if f.env.get("GLOO_SOCKET_IFNAME"):  # empty is unset to torch and to netif
            value = f.env["GLOO_SOCKET_IFNAME"]
            checks.append(("GLOO_SOCKET_IFNAME", value, gloo_ifname_problem(value, f.interfaces)))
        nccl_value = spec_nccl if spec_nccl is not None else f.env.get("NCCL_SOCKET_IFNAME")
        if host_id in gpu_hosts and nccl_value:
            name = "NCCL_SOCKET_IFNAME"
            if spec_nccl is not None:
                name = "ClusterSpec.nccl_transport.socket_ifname (NCCL_SOCKET_IFNAME)"
            checks.append((name, nccl_value, nccl_ifname_problem(nccl_value, f.interfaces)))
        for name, value, problem in checks:
            if problem is not None:
                raise HostMismatchError(f"host {host_id}: {name}={value!r} {problem}", host_id, name, value)


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
                f"{transport.net_name!r}; set NCCL_NET={transport.net_name} on that host",
                (host_id,),
            )


def admit(topology: CompiledTopology, facts: Mapping[str, HostFacts]) -> None:
    """Run every admission check, in order; raise `PreflightError` at the first that fails."""
    missing = [h for h in topology.cluster.host_ids if h not in facts]
    if missing:
        raise PreflightError(f"hosts {missing} did not report their facts", tuple(missing))
    allow = topology.cluster.allow_shared_kernel
    check_fingerprints(facts)
    check_kernels(facts, allow)
    check_gpu_identity(facts, allow)
    check_named_gpus(topology, facts)
    check_socket_interfaces(topology, facts)
    check_nccl_env(topology, facts)

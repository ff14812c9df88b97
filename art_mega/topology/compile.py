"""`compile_topology`: place agents, rollout workers, trainer ranks and vLLM replicas on hosts.

Turns the declarative specs into a `CompiledTopology`, or one `TopologyError` sentence.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import cycle
from typing import NoReturn

from art_mega.errors import TopologyError
from art_mega.topology.cluster import ClusterSpec, HostSpec
from art_mega.topology.compiled import CompiledTopology, ProcessSpec, ReplicaSpec, TrainerRank
from art_mega.topology.endpoint import EndpointSpec
from art_mega.topology.groups import ParallelGroups, parallel_groups, rank_coordinates
from art_mega.topology.inference import InferenceSpec
from art_mega.topology.trainer import TrainerSpec

GpuId = int | str
Layout = list[list[tuple[HostSpec, tuple[GpuId, ...]]]]
"""Per replica: its (host, GPUs on that host) parts, head host first."""


def compile_topology(
    cluster: ClusterSpec,
    rollout_host_ids: Sequence[str] | None = None,
    trainer: TrainerSpec | None = None,
    inference: InferenceSpec | Sequence[InferenceSpec] = (),
) -> CompiledTopology:
    """Place every process of a launch and check that the whole fits together.

    One agent per host (listening on its worker port); `cpu_slots` rollout workers on each host
    of `rollout_host_ids` (None: all hosts); one trainer process per rank, ranks numbered host
    by host in node-rank order and GPU by GPU (or `cpu_ranks_per_host` per CPU-only host); one
    process per inference replica (one per host for a replica that spans hosts).

    Raises `TopologyError`, one sentence naming the field, the value and the fix, for: unknown
    host ids; a spec mixing GPU and CPU-only hosts; a GPU the host does not list; GPUs used by
    two processes (allowed only between the trainer and one inference spec with
    `shared_gpus=True`); two listeners on one port of one machine (agents, trainer master port,
    replica API ports); multi-host GPU work (trainer on several GPU hosts, a replica spanning
    hosts) without `ClusterSpec.nccl_transport` or with its `net_name` "Socket"; too few free
    GPUs for the replicas; trainer sizes that do not divide the world (tp*cp*pp, etp*ep*pp);
    tp*pp of a replica that spans hosts not a multiple of the GPUs per host; `cluster` that is
    not a `ClusterSpec`; trainer sizes art-mega cannot run yet (pp > 1 with cp > 1:
    `TrainerSpec.unsupported`).
    """
    if not isinstance(cluster, ClusterSpec):
        raise TopologyError(
            f"compile_topology(cluster={type(cluster).__name__}) needs a ClusterSpec; pass "
            "cluster=launch.homogeneous_cluster(...) or a ClusterSpec(hosts=...)",
            "cluster",
        )
    if trainer is not None and (refused := trainer.unsupported()) is not None:
        raise TopologyError(refused[1], refused[0])  # before any placement: nothing may start
    specs = (inference,) if isinstance(inference, InferenceSpec) else tuple(inference)
    names = Counter(spec.name for spec in specs)
    for name, count in names.items():
        if count > 1:
            raise TopologyError(
                f"InferenceSpec.name {name!r} is used by {count} inference specs; "
                "give each spec its own name.",
                "InferenceSpec.name",
            )
    rollout_hosts = _resolve_hosts(cluster, rollout_host_ids, "rollout_host_ids", gpu_role=False)
    processes = [
        ProcessSpec(
            role="agent",
            name=f"agent-{host.host_id}",
            host_id=host.host_id,
            ports=(host.worker_address.port,) if host.worker_address.port else (),
        )
        for host in cluster.hosts
    ]
    for host in rollout_hosts:
        processes += [
            ProcessSpec(
                role="rollout",
                name=f"rollout-{host.host_id}-{slot}",
                host_id=host.host_id,
                local_rank=slot,
            )
            for slot in range(host.cpu_slots)
        ]
    ranks: tuple[TrainerRank, ...] = ()
    groups: ParallelGroups | None = None
    if trainer is not None:
        ranks, groups = _place_trainer(cluster, trainer)
        processes += _trainer_processes(cluster, trainer, ranks)
    gpus = _GpuLedger(trainer=_trainer_gpus(ranks))
    replicas: list[ReplicaSpec] = []
    for spec in specs:
        placed = _place_replicas(cluster, spec, gpus)
        replicas += placed
        processes += _replica_processes(cluster, placed)
    _check_ports(cluster, trainer, ranks, replicas)
    return CompiledTopology(
        cluster=cluster,
        trainer=trainer,
        inference=specs,
        rollout_host_ids=tuple(host.host_id for host in rollout_hosts),
        processes=tuple(processes),
        trainer_ranks=ranks,
        trainer_groups=groups,
        replicas=tuple(replicas),
    )


def _trainer_gpus(ranks: Sequence[TrainerRank]) -> dict[tuple[str, GpuId], int]:
    return {(rank.host_id, rank.gpu_id): rank.rank for rank in ranks if rank.gpu_id is not None}


def _quoted(values: Sequence[object]) -> str:
    return ", ".join(repr(value) for value in values)


def _resolve_hosts(
    cluster: ClusterSpec, host_ids: Sequence[str] | None, where: str, *, gpu_role: bool
) -> tuple[HostSpec, ...]:
    """The hosts `host_ids` names, in node-rank order; None means all hosts.

    For a `gpu_role` (trainer, inference) None means the GPU hosts when any host has GPUs, and
    an explicit list may not mix GPU and CPU-only hosts.
    """
    if host_ids is None:
        if gpu_role and any(host.has_gpus for host in cluster.hosts):
            return tuple(host for host in cluster.hosts if host.has_gpus)
        return cluster.hosts
    if isinstance(host_ids, str):
        host_ids = (host_ids,)
    known = set(cluster.host_ids)
    for host_id, count in Counter(host_ids).items():
        if host_id not in known:
            raise TopologyError(
                f"{where} names host {host_id!r}, which is not in ClusterSpec.hosts "
                f"({_quoted(cluster.host_ids)}); use one of those ids.",
                where,
            )
        if count > 1:
            raise TopologyError(f"{where} lists host {host_id!r} {count} times; list it once.", where)
    wanted = set(host_ids)
    hosts = tuple(host for host in cluster.hosts if host.host_id in wanted)
    if gpu_role:
        gpu = [host.host_id for host in hosts if host.has_gpus]
        cpu = [host.host_id for host in hosts if not host.has_gpus]
        if gpu and cpu:
            raise TopologyError(
                f"{where} mixes GPU hosts ({_quoted(gpu)}) with CPU-only hosts ({_quoted(cpu)}); "
                "list hosts of one kind.",
                where,
            )
    return hosts


def _require_nccl(cluster: ClusterSpec, why: str) -> None:
    transport = cluster.nccl_transport
    if transport is None:
        raise TopologyError(
            f"ClusterSpec.nccl_transport is None but {why}; set nccl_transport="
            "NcclTransportSpec(net_name=...) to the NCCL net plugin of the hosts' fabric, "
            "e.g. 'IB'.",
            "ClusterSpec.nccl_transport",
        )
    if transport.is_socket:
        raise TopologyError(
            f"ClusterSpec.nccl_transport.net_name={transport.net_name!r} is refused because "
            f"{why} and TCP sockets are too slow for that; use the hosts' RDMA net plugin, "
            "e.g. net_name='IB'.",
            "ClusterSpec.nccl_transport.net_name",
        )


def _nccl_env(cluster: ClusterSpec) -> dict[str, str]:
    transport = cluster.nccl_transport
    if transport is None:
        return {}
    env = {"NCCL_NET": transport.net_name}
    if transport.socket_ifname is not None:
        env["NCCL_SOCKET_IFNAME"] = transport.socket_ifname
    return env


def _place_trainer(
    cluster: ClusterSpec, trainer: TrainerSpec
) -> tuple[tuple[TrainerRank, ...], ParallelGroups]:
    hosts = _resolve_hosts(cluster, trainer.host_ids, "TrainerSpec.host_ids", gpu_role=True)
    slots: list[tuple[HostSpec, int, GpuId | None]] = []
    for host in hosts:
        devices = _trainer_devices(trainer, host) or (None,) * trainer.cpu_ranks_per_host
        slots += [(host, local_rank, gpu) for local_rank, gpu in enumerate(devices)]
    world = len(slots)
    layout = ", ".join(
        f"{host.host_id!r} {len(_trainer_devices(trainer, host)) or trainer.cpu_ranks_per_host}"
        for host in hosts
    )
    dense = f"tp={trainer.tp} x cp={trainer.cp} x pp={trainer.pp}"
    expert = f"etp={trainer.etp} x ep={trainer.ep} x pp={trainer.pp}"
    for names, size in (
        (dense, trainer.model_parallel_size),
        (expert, trainer.expert_model_parallel_size),
    ):
        if world % size:
            raise TopologyError(
                f"TrainerSpec {names} = {size} does not divide the trainer world size {world} "
                f"(ranks per host: {layout}); choose sizes whose product divides {world}.",
                f"TrainerSpec({names})",
            )
    gpu_hosts = [host.host_id for host in hosts if host.has_gpus]
    if len(gpu_hosts) > 1:
        why = f"the trainer spans {len(gpu_hosts)} GPU hosts ({_quoted(gpu_hosts)})"
        _require_nccl(cluster, why)
    sizes = trainer.model_dump(include={"tp", "cp", "ep", "etp", "pp"})
    ranks = tuple(
        TrainerRank(
            rank=rank,
            host_id=host.host_id,
            local_rank=local_rank,
            gpu_id=gpu,
            **rank_coordinates(rank, world, **sizes),
        )
        for rank, (host, local_rank, gpu) in enumerate(slots)
    )
    return ranks, parallel_groups(world, **sizes)


def _trainer_devices(trainer: TrainerSpec, host: HostSpec) -> tuple[GpuId, ...]:
    """The GPUs of `host` that get a trainer rank: `trainer.gpu_ids` (each one the host must
    list) or every GPU the host lists; () on a CPU-only host."""
    if trainer.gpu_ids is None:
        return host.gpu_ids
    for gpu in trainer.gpu_ids:
        if gpu not in host.gpu_ids:
            listed = _quoted(host.gpu_ids) or "none"
            raise TopologyError(
                f"TrainerSpec.gpu_ids names GPU {gpu!r}, which host {host.host_id!r} does not list "
                f"(its gpu_ids: {listed}); name GPUs the host has.",
                "TrainerSpec.gpu_ids",
            )
    return trainer.gpu_ids


def _trainer_processes(
    cluster: ClusterSpec, trainer: TrainerSpec, ranks: tuple[TrainerRank, ...]
) -> list[ProcessSpec]:
    master_addr = cluster.host(ranks[0].host_id).worker_address.host
    per_host = Counter(rank.host_id for rank in ranks)
    processes = []
    for rank in ranks:
        env = {
            "RANK": str(rank.rank),
            "WORLD_SIZE": str(len(ranks)),
            "LOCAL_RANK": str(rank.local_rank),
            "LOCAL_WORLD_SIZE": str(per_host[rank.host_id]),
            "MASTER_ADDR": master_addr,
            **_nccl_env(cluster),
        }
        # an open master port (None) is chosen when the runtime starts (`topology.open_ports`)
        if trainer.master_port is not None:
            env["MASTER_PORT"] = str(trainer.master_port)
        if rank.gpu_id is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(rank.gpu_id)
        processes.append(
            ProcessSpec(
                role="trainer",
                name=f"trainer-{rank.rank}",
                host_id=rank.host_id,
                gpu_ids=() if rank.gpu_id is None else (rank.gpu_id,),
                ports=(trainer.master_port,) if rank.rank == 0 and trainer.master_port else (),
                env=env,
                rank=rank.rank,
                local_rank=rank.local_rank,
            )
        )
    return processes


@dataclass
class _GpuLedger:
    """Which process holds each (host id, GPU) while inference specs are placed."""

    trainer: dict[tuple[str, GpuId], int]
    replicas: dict[tuple[str, GpuId], str] = field(default_factory=dict)
    shared_with_trainer: str | None = None

    def may_use(self, spec: InferenceSpec, host_id: str, gpu: GpuId) -> bool:
        if (host_id, gpu) in self.replicas:
            return False
        if (host_id, gpu) not in self.trainer:
            return True
        return spec.shared_gpus and self.shared_with_trainer in (None, spec.name)

    def check_named(self, spec: InferenceSpec, host_id: str, gpu: GpuId) -> None:
        """Refuse a GPU listed in `spec.gpu_ids` that another process already holds."""
        where = f"InferenceSpec(name={spec.name!r}).gpu_ids"
        holder = self.replicas.get((host_id, gpu))
        if holder is not None:
            raise TopologyError(
                f"{where} names GPU {gpu!r} on host {host_id!r}, which replica {holder!r} "
                "already uses; give each inference spec its own GPUs.",
                where,
            )
        rank = self.trainer.get((host_id, gpu))
        if rank is None or self.may_use(spec, host_id, gpu):
            return
        if not spec.shared_gpus:
            raise TopologyError(
                f"{where} names GPU {gpu!r} on host {host_id!r}, which trainer rank {rank} "
                "uses; set shared_gpus=True to share the trainer's GPUs or name other GPUs.",
                where,
            )
        raise TopologyError(
            f"{where} names GPU {gpu!r} on host {host_id!r}, which trainer rank {rank} uses, "
            f"but InferenceSpec {self.shared_with_trainer!r} already shares the trainer's GPUs "
            "and only one spec may; name other GPUs.",
            where,
        )

    def take(self, spec: InferenceSpec, process: str, host_id: str, gpus: Sequence[GpuId]) -> None:
        for gpu in gpus:
            self.replicas[(host_id, gpu)] = process
            if (host_id, gpu) in self.trainer:
                self.shared_with_trainer = spec.name


def _usable_gpus(spec: InferenceSpec, host: HostSpec, gpus: _GpuLedger) -> tuple[GpuId, ...]:
    if spec.gpu_ids is None:
        return host.gpu_ids
    for gpu in spec.gpu_ids:
        if gpu not in host.gpu_ids:
            listed = _quoted(host.gpu_ids) or "none"
            raise TopologyError(
                f"InferenceSpec(name={spec.name!r}).gpu_ids names GPU {gpu!r}, which host "
                f"{host.host_id!r} does not list (its gpu_ids: {listed}); name GPUs the host has.",
                f"InferenceSpec(name={spec.name!r}).gpu_ids",
            )
        gpus.check_named(spec, host.host_id, gpu)
    return spec.gpu_ids


def _place_replicas(cluster: ClusterSpec, spec: InferenceSpec, gpus: _GpuLedger) -> list[ReplicaSpec]:
    where = f"InferenceSpec(name={spec.name!r})"
    hosts = _resolve_hosts(cluster, spec.host_ids, f"{where}.host_ids", gpu_role=True)
    if not hosts[0].has_gpus:
        if spec.gpu_ids is not None:
            _usable_gpus(spec, hosts[0], gpus)
        spread = cycle(hosts)
        return _replicas(cluster, spec, [[(next(spread), ())] for _ in range(spec.replicas)])
    usable = {host.host_id: _usable_gpus(spec, host, gpus) for host in hosts}

    def free(host: HostSpec) -> list[GpuId]:
        return [gpu for gpu in usable[host.host_id] if gpus.may_use(spec, host.host_id, gpu)]

    needed = spec.gpus_per_replica
    most = max(len(ids) for ids in usable.values())
    if spec.tp * spec.pp > most:
        return _place_spanning(cluster, spec, gpus, hosts, usable, free)
    if needed > most:
        raise TopologyError(
            f"{where} asks for tp*pp*dp = {needed} GPUs per replica but its hosts offer at "
            f"most {most}, and a replica spans hosts only when tp*pp exceeds one host; use "
            "more replicas with a smaller dp.",
            where,
        )
    layout: Layout = []
    start = 0
    for index in range(spec.replicas):
        for step in range(len(hosts)):
            host = hosts[(start + step) % len(hosts)]
            available = free(host)
            if len(available) >= needed:
                chosen = tuple(available[:needed])
                gpus.take(spec, f"{spec.name}-{index}", host.host_id, chosen)
                layout.append([(host, chosen)])
                start = (start + step + 1) % len(hosts)
                break
        else:
            _not_enough(spec, index, hosts, free, gpus)
    return _replicas(cluster, spec, layout)


def _place_spanning(
    cluster: ClusterSpec,
    spec: InferenceSpec,
    gpus: _GpuLedger,
    hosts: Sequence[HostSpec],
    usable: dict[str, tuple[GpuId, ...]],
    free: Callable[[HostSpec], list[GpuId]],
) -> list[ReplicaSpec]:
    where = f"InferenceSpec(name={spec.name!r})"
    counts = {host_id: len(ids) for host_id, ids in usable.items()}
    per_host = max(counts.values())
    model = spec.tp * spec.pp
    if len(set(counts.values())) > 1:
        shown = ", ".join(f"{host_id!r} {count}" for host_id, count in counts.items())
        raise TopologyError(
            f"{where} has tp*pp = {model}, more GPUs than one host offers, so its replicas span "
            f"whole hosts, which must offer equal GPU counts (got {shown}); list hosts alike "
            "in host_ids.",
            where,
        )
    if model % per_host:
        raise TopologyError(
            f"{where} has tp*pp = {model}, which spans hosts and so must be a multiple of the "
            f"{per_host} GPUs per host; choose tp*pp from {per_host * 2}, {per_host * 3}, ...",
            where,
        )
    _require_nccl(
        cluster,
        f"{where} has tp*pp = {model}, more than one host's {per_host} GPUs, so each replica spans hosts",
    )
    hosts_per_replica = spec.gpus_per_replica // per_host
    layout: Layout = []
    for index in range(spec.replicas):
        whole = [host for host in hosts if len(free(host)) == per_host][:hosts_per_replica]
        if len(whole) < hosts_per_replica:
            _not_enough(spec, index, hosts, free, gpus)
        for host in whole:
            gpus.take(spec, f"{spec.name}-{index}", host.host_id, usable[host.host_id])
        layout.append([(host, usable[host.host_id]) for host in whole])
    return _replicas(cluster, spec, layout)


def _not_enough(
    spec: InferenceSpec,
    placed: int,
    hosts: Sequence[HostSpec],
    free: Callable[[HostSpec], list[GpuId]],
    gpus: _GpuLedger,
) -> NoReturn:
    shown = ", ".join(f"{host.host_id!r} {len(free(host))}" for host in hosts)
    if not spec.shared_gpus and gpus.trainer:
        fix = "add hosts, lower replicas, tp, pp or dp, or set shared_gpus=True to share the trainer's GPUs"
    elif spec.shared_gpus and gpus.shared_with_trainer not in (None, spec.name):
        fix = (
            f"add hosts or lower replicas, tp, pp or dp (InferenceSpec "
            f"{gpus.shared_with_trainer!r} already shares the trainer's GPUs and only one spec may)"
        )
    else:
        fix = "add hosts or lower replicas, tp, pp or dp"
    raise TopologyError(
        f"InferenceSpec(name={spec.name!r}) has replicas={spec.replicas} of "
        f"{spec.gpus_per_replica} GPUs each but only {placed} fit (free GPUs per host: {shown}); "
        f"{fix}.",
        f"InferenceSpec(name={spec.name!r}).replicas",
    )


def _replicas(
    cluster: ClusterSpec,
    spec: InferenceSpec,
    layout: Layout,
) -> list[ReplicaSpec]:
    on_machine: Counter[str] = Counter()
    replicas = []
    for index, parts in enumerate(layout):
        head = parts[0][0]
        machine = head.worker_address.host.lower()
        # port 0: an open port, chosen on the head host when the runtime starts (`topology.open_ports`)
        port = 0 if spec.api_port is None else spec.api_port + on_machine[machine]
        on_machine[machine] += 1
        if port > 65535:
            raise TopologyError(
                f"InferenceSpec(name={spec.name!r}).api_port={spec.api_port} gives replica "
                f"{index} on host {head.host_id!r} port {port}, above 65535; lower api_port.",
                f"InferenceSpec(name={spec.name!r}).api_port",
            )
        replicas.append(
            ReplicaSpec(
                name=spec.name,
                index=index,
                host_ids=tuple(host.host_id for host, _ in parts),
                gpu_ids=tuple((host.host_id, ids) for host, ids in parts),
                endpoint=EndpointSpec(host=head.worker_address.host, port=port),
                tp=spec.tp,
                pp=spec.pp,
                dp=spec.dp,
                shared_gpus=spec.shared_gpus,
            )
        )
    return replicas


def _replica_processes(cluster: ClusterSpec, replicas: Sequence[ReplicaSpec]) -> list[ProcessSpec]:
    processes = []
    for replica in replicas:
        for node, (host_id, ids) in enumerate(replica.gpu_ids):
            env = {}
            if ids:
                env = {"CUDA_VISIBLE_DEVICES": ",".join(str(gpu) for gpu in ids)}
                env.update(_nccl_env(cluster))
            suffix = f"-node{node}" if node else ""
            processes.append(
                ProcessSpec(
                    role="inference",
                    name=f"{replica.process_name}{suffix}",
                    host_id=host_id,
                    gpu_ids=ids,
                    ports=(replica.endpoint.port,) if node == 0 and replica.endpoint.port else (),
                    env=env,
                    rank=node,
                )
            )
    return processes


def _check_ports(
    cluster: ClusterSpec,
    trainer: TrainerSpec | None,
    ranks: Sequence[TrainerRank],
    replicas: Sequence[ReplicaSpec],
) -> None:
    """Refuse two listeners on one port of one machine (hosts sharing an address are one).

    Open ports (port 0, a None master_port) are not checked here: the runtime chooses them
    apart from every listener of the topology (`runtime.open_ports`).
    """
    listeners: list[tuple[str, int, str]] = []
    for index, host in enumerate(cluster.hosts):
        listeners.append(
            (host.host_id, host.worker_address.port, f"ClusterSpec.hosts[{index}].worker_address")
        )
    if trainer is not None and ranks and trainer.master_port is not None:
        listeners.append((ranks[0].host_id, trainer.master_port, "TrainerSpec.master_port"))
    for replica in replicas:
        listeners.append(
            (
                replica.host_ids[0],
                replica.endpoint.port,
                f"InferenceSpec(name={replica.name!r}).api_port (replica {replica.index})",
            )
        )
    seen: dict[tuple[str, int], tuple[str, str]] = {}
    for host_id, port, owner in listeners:
        if port == 0:
            continue
        machine = cluster.host(host_id).worker_address.host.lower()
        earlier = seen.get((machine, port))
        if earlier is not None:
            raise TopologyError(
                f"port {port} at {machine} is taken by both {earlier[1]} (host {earlier[0]!r}) "
                f"and {owner} (host {host_id!r}); change one of them.",
                owner,
            )
        seen[(machine, port)] = (host_id, owner)

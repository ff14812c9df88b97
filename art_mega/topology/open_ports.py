"""Open ports: listeners whose port the user left None, and the topology once they are chosen.

`TrainerSpec.master_port` None and `InferenceSpec.api_port` None compile to open listeners (no
MASTER_PORT, replica endpoint port 0); `runtime.open_ports` asks each one's host for a free port
and `with_ports` writes the answers into every place that names the port.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from art_mega.errors import TopologyError
from art_mega.topology.compiled import CompiledTopology, ProcessSpec, ReplicaSpec


@dataclass(frozen=True)
class OpenPort:
    """One listener of a compiled topology whose port is chosen when the runtime starts.

    `process` is the process that listens ("trainer-0" for the rendezvous, "NAME-INDEX" for a
    replica's API server), `host_id` the host whose agent is asked, `bind_host` the address it
    binds there (the host's worker address host), `machine` that address lower-cased (hosts
    sharing an address are one machine) and `field` the spec field left None, for messages.
    """

    process: str
    host_id: str
    bind_host: str
    machine: str
    field: str


def _open(topology: CompiledTopology, process: str, host_id: str, field: str) -> OpenPort:
    host = topology.cluster.host(host_id).worker_address.host
    return OpenPort(process, host_id, host, host.lower(), field)


def open_ports(topology: CompiledTopology) -> tuple[OpenPort, ...]:
    """The listeners of `topology` without a port: the trainer's rendezvous on rank 0's host when
    `TrainerSpec.master_port` is None, then every replica head whose endpoint port is 0 (its
    spec's `api_port` is None), in replica order; () when every port is set."""
    wanted = []
    trainer = topology.trainer
    if trainer is not None and trainer.master_port is None and topology.trainer_ranks:
        wanted.append(
            _open(topology, "trainer-0", topology.trainer_ranks[0].host_id, "TrainerSpec.master_port")
        )
    for replica in topology.replicas:
        if replica.endpoint.port == 0:
            field = f"InferenceSpec(name={replica.name!r}).api_port"
            wanted.append(_open(topology, replica.process_name, replica.host_ids[0], field))
    return tuple(wanted)


def ports_in_use(topology: CompiledTopology) -> dict[str, set[int]]:
    """The ports `topology`'s set listeners (agents with a fixed port, a set master port, replicas
    with a set api_port) take, by machine (worker address host, lower-cased)."""
    taken: dict[str, set[int]] = {}
    for process in topology.processes:
        machine = topology.cluster.host(process.host_id).worker_address.host.lower()
        taken.setdefault(machine, set()).update(process.ports)
    return taken


def with_ports(topology: CompiledTopology, chosen: Mapping[str, int]) -> CompiledTopology:
    """`topology` with the port of every `open_ports` listener set from `chosen` (by process).

    The rendezvous port becomes `trainer.master_port`, every rank's MASTER_PORT and rank 0's
    listening port; a replica's becomes its endpoint port (so its URL) and its head process's
    listening port. The inference specs keep `api_port` None (a spec's replicas each have their own).

    Raises:
        TopologyError: `chosen` misses an open listener, names a process without one, gives a
            port outside 1..65535, or one that another listener of the machine takes.
    """
    wanted = {port.process: port for port in open_ports(topology)}
    if set(chosen) != set(wanted):
        raise TopologyError(
            f"ports were chosen for {sorted(chosen)} but the topology's open listeners are "
            f"{sorted(wanted)}; choose one port for each open listener.",
            "ports",
        )
    taken = ports_in_use(topology)
    for process, port in chosen.items():
        where = wanted[process]
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise TopologyError(
                f"the port chosen for {where.field} ({process} on host {where.host_id!r}) is {port!r}, "
                "not a TCP port in 1..65535; choose a port the host can bind.",
                where.field,
            )
        if port in taken.setdefault(where.machine, set()):
            raise TopologyError(
                f"the port {port} chosen for {where.field} ({process} on host {where.host_id!r}) is "
                f"already taken at {where.machine} by another listener of the topology; choose another.",
                where.field,
            )
        taken[where.machine].add(port)
    master = chosen.get("trainer-0")
    trainer = topology.trainer
    if master is not None and trainer is not None:
        trainer = trainer.model_copy(update={"master_port": master})
    processes = tuple(_process(p, master, chosen) for p in topology.processes)
    replicas = tuple(_replica(r, chosen) for r in topology.replicas)
    return topology.model_copy(update={"trainer": trainer, "processes": processes, "replicas": replicas})


def _process(process: ProcessSpec, master: int | None, chosen: Mapping[str, int]) -> ProcessSpec:
    if process.role == "trainer" and master is not None:
        env = tuple(sorted({**process.environ, "MASTER_PORT": str(master)}.items()))
        return process.model_copy(update={"env": env, "ports": (master,) if process.rank == 0 else ()})
    if process.role == "inference" and process.name in chosen:
        return process.model_copy(update={"ports": (chosen[process.name],)})
    return process


def _replica(replica: ReplicaSpec, chosen: Mapping[str, int]) -> ReplicaSpec:
    port = chosen.get(replica.process_name)
    if port is None:
        return replica
    return replica.model_copy(update={"endpoint": replica.endpoint.model_copy(update={"port": port})})

"""The output of `compile_topology`: every process to start, the trainer rank table, replicas.

Frozen data the runtime executes as is; nothing here decides placement.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, field_validator

from art_mega.errors import TopologyError
from art_mega.topology.base import GpuId, ListenPort, SpecModel
from art_mega.topology.cluster import ClusterSpec
from art_mega.topology.endpoint import EndpointSpec
from art_mega.topology.groups import ParallelGroups
from art_mega.topology.inference import InferenceSpec
from art_mega.topology.trainer import TrainerSpec

Role = Literal["agent", "rollout", "trainer", "inference"]


class ProcessSpec(SpecModel):
    """One process an agent starts and supervises.

    `name` is unique in the topology ("agent-HOST", "rollout-HOST-SLOT", "trainer-RANK",
    "NAME-INDEX" for replica INDEX of an inference spec, "NAME-INDEX-nodeK" for the K-th
    extra host of a replica that spans hosts). `ports` are the TCP ports it listens on.
    `env` holds the extra environment variables as sorted (name, value) pairs (a dict is
    accepted); `environ` gives them as a dict. `rank`/`local_rank`: the torch.distributed rank
    and the rank on its host for trainers; the node index within the replica for inference;
    the slot index (local_rank) for rollout workers; None for agents.
    """

    role: Role
    name: str
    host_id: str
    gpu_ids: tuple[GpuId, ...] = ()
    ports: tuple[ListenPort, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    rank: int | None = Field(default=None, ge=0)
    local_rank: int | None = Field(default=None, ge=0)

    @field_validator("env", mode="before")
    @classmethod
    def _env_pairs(cls, value: Any) -> Any:
        if isinstance(value, Mapping):
            return tuple(sorted(value.items()))
        return value

    @property
    def environ(self) -> dict[str, str]:
        """The extra environment variables as a fresh dict."""
        return dict(self.env)


class TrainerRank(SpecModel):
    """One Megatron rank: where it runs and its coordinate on every parallel axis.

    `gpu_id` is None for a CPU rank (gloo). Dense coordinates (tp, cp, dp, pp) and expert
    coordinates (etp, ep, expert_dp, pp) follow megatron-core's default "tp-cp-ep-dp-pp" order.
    """

    rank: int = Field(ge=0)
    host_id: str
    local_rank: int = Field(ge=0)
    gpu_id: GpuId | None = None
    tp_rank: int = Field(ge=0)
    cp_rank: int = Field(ge=0)
    ep_rank: int = Field(ge=0)
    etp_rank: int = Field(ge=0)
    pp_rank: int = Field(ge=0)
    dp_rank: int = Field(ge=0)
    expert_dp_rank: int = Field(ge=0)


class ReplicaSpec(SpecModel):
    """One vLLM server: replica `index` of the inference spec called `name`.

    `host_ids` lists its hosts (more than one only when tp*pp exceeds one host's GPUs; the
    first runs the API server). `gpu_ids` pairs each host id with the GPUs used there (empty on
    CPU hosts). `endpoint` is the OpenAI-compatible server's address.
    """

    name: str
    index: int = Field(ge=0)
    host_ids: tuple[str, ...] = Field(min_length=1)
    gpu_ids: tuple[tuple[str, tuple[GpuId, ...]], ...]
    endpoint: EndpointSpec
    tp: int = Field(ge=1)
    pp: int = Field(ge=1)
    dp: int = Field(ge=1)
    shared_gpus: bool

    @property
    def process_name(self) -> str:
        """The name of the replica's head process, "NAME-INDEX"."""
        return f"{self.name}-{self.index}"


class CompiledTopology(SpecModel):
    """A cluster with every process placed: what each agent starts, with GPUs, ports and env.

    Build it with `compile_topology`; constructing it by hand skips the placement checks.
    `trainer_ranks` is ordered by rank; `trainer_groups` is None when there is no trainer.
    """

    cluster: ClusterSpec
    trainer: TrainerSpec | None
    inference: tuple[InferenceSpec, ...]
    rollout_host_ids: tuple[str, ...]
    processes: tuple[ProcessSpec, ...]
    trainer_ranks: tuple[TrainerRank, ...]
    trainer_groups: ParallelGroups | None
    replicas: tuple[ReplicaSpec, ...]

    @property
    def trainer_world_size(self) -> int:
        """Number of trainer ranks (0 without a trainer)."""
        return len(self.trainer_ranks)

    def processes_on(self, host_id: str) -> tuple[ProcessSpec, ...]:
        """The processes host `host_id` runs, agent first; `TopologyError` for an unknown host."""
        self.cluster.host(host_id)
        return tuple(process for process in self.processes if process.host_id == host_id)

    def process(self, name: str) -> ProcessSpec:
        """The process called `name`; raises `TopologyError` if there is none."""
        for process in self.processes:
            if process.name == name:
                return process
        raise TopologyError(f"the topology has no process named {name!r}.", "name")

    def agent_endpoints(self) -> dict[str, EndpointSpec]:
        """Each host's agent address, keyed by host id in node-rank order."""
        return {host.host_id: host.worker_address for host in self.cluster.hosts}

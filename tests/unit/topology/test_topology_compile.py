"""compile_topology: process placement, trainer rank table, replicas and every rejection."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from art_mega.errors import TopologyError
from art_mega.topology import (
    ClusterSpec,
    CompiledTopology,
    EndpointSpec,
    HostSpec,
    InferenceSpec,
    NcclTransportSpec,
    ProcessSpec,
    TrainerSpec,
    compile_topology,
)

IB = NcclTransportSpec(net_name="IB")


def host(index: int, gpus: int = 0, **overrides: Any) -> HostSpec:
    fields: dict[str, Any] = {
        "host_id": f"h{index}",
        "node_rank": index,
        "worker_address": f"tcp://10.0.0.{index + 1}:22222",
        "gpu_ids": tuple(range(gpus)),
    }
    return HostSpec(**(fields | overrides))


def cluster(*hosts: HostSpec, **overrides: Any) -> ClusterSpec:
    fields: dict[str, Any] = {
        "hosts": hosts,
        "controller_host_id": hosts[0].host_id,
        "artifact_root": "/shared/art",
        "cache_root": "/var/cache/art",
    }
    return ClusterSpec(**(fields | overrides))


def names(processes: tuple[ProcessSpec, ...], role: str) -> list[str]:
    return [process.name for process in processes if process.role == role]


# Agents and rollouts


def test_agents_and_rollouts_on_cpu_hosts() -> None:
    spec = cluster(host(0, cpu_slots=2), host(1, cpu_slots=3))
    topology = compile_topology(spec)
    assert names(topology.processes, "agent") == ["agent-h0", "agent-h1"]
    assert names(topology.processes, "rollout") == [
        "rollout-h0-0",
        "rollout-h0-1",
        "rollout-h1-0",
        "rollout-h1-1",
        "rollout-h1-2",
    ]
    assert topology.rollout_host_ids == ("h0", "h1")
    agent = topology.process("agent-h1")
    assert (agent.host_id, agent.ports, agent.gpu_ids, agent.env) == ("h1", (22222,), (), ())
    rollout = topology.process("rollout-h1-2")
    assert (rollout.ports, rollout.local_rank, rollout.rank) == ((), 2, None)
    assert (topology.trainer_ranks, topology.trainer_groups, topology.replicas) == ((), None, ())
    assert topology.trainer_world_size == 0


def test_rollout_host_ids_subset_and_unknown() -> None:
    spec = cluster(host(0), host(1))
    topology = compile_topology(spec, rollout_host_ids=["h1"])
    assert names(topology.processes, "rollout") == ["rollout-h1-0"]
    assert compile_topology(spec, rollout_host_ids=()).rollout_host_ids == ()
    with pytest.raises(TopologyError, match="rollout_host_ids names host 'h7', which is not in"):
        compile_topology(spec, rollout_host_ids=["h1", "h7"])
    with pytest.raises(TopologyError, match="rollout_host_ids lists host 'h1' 2 times"):
        compile_topology(spec, rollout_host_ids=["h1", "h1"])


def test_helpers() -> None:
    topology = compile_topology(cluster(host(0), host(1)), rollout_host_ids=["h0"])
    assert [p.name for p in topology.processes_on("h1")] == ["agent-h1"]
    assert [p.name for p in topology.processes_on("h0")] == ["agent-h0", "rollout-h0-0"]
    assert topology.agent_endpoints() == {
        "h0": EndpointSpec(host="10.0.0.1", port=22222),
        "h1": EndpointSpec(host="10.0.0.2", port=22222),
    }
    with pytest.raises(TopologyError, match="host_id 'h5'"):
        topology.processes_on("h5")
    with pytest.raises(TopologyError, match="no process named 'trainer-0'"):
        topology.process("trainer-0")


def test_compiled_topology_is_frozen() -> None:
    topology = compile_topology(cluster(host(0)))
    assert isinstance(topology, CompiledTopology)
    with pytest.raises(ValidationError):
        topology.processes = ()  # type: ignore[misc]
    assert hash(topology) == hash(compile_topology(cluster(host(0))))


def test_process_env_accepts_a_dict() -> None:
    process = ProcessSpec(role="agent", name="a", host_id="h0", env={"B": "2", "A": "1"})
    assert process.env == (("A", "1"), ("B", "2"))
    assert process.environ == {"A": "1", "B": "2"}


# Trainer


def test_gpu_trainer_two_hosts_rank_table_and_env() -> None:
    spec = cluster(host(0, gpus=4), host(1, gpus=4), nccl_transport=IB)
    topology = compile_topology(spec, trainer=TrainerSpec(tp=2, cp=2, master_port=29600))
    assert topology.trainer_world_size == 8
    rank5 = topology.trainer_ranks[5]
    assert (rank5.rank, rank5.host_id, rank5.local_rank, rank5.gpu_id) == (5, "h1", 1, 1)
    # megatron-core's tp-cp-ep-dp-pp order: 5 = tp 1 + 2 * (cp 0) + 4 * (dp 1)
    assert (rank5.tp_rank, rank5.cp_rank, rank5.dp_rank, rank5.pp_rank) == (1, 0, 1, 0)
    assert (rank5.ep_rank, rank5.etp_rank, rank5.expert_dp_rank) == (0, 0, 5)
    assert topology.trainer_groups is not None
    assert topology.trainer_groups.dp == ((0, 4), (1, 5), (2, 6), (3, 7))
    trainer5 = topology.process("trainer-5")
    assert trainer5.environ == {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29600",
        "CUDA_VISIBLE_DEVICES": "1",
        "NCCL_NET": "IB",
    }
    assert (trainer5.host_id, trainer5.gpu_ids, trainer5.ports) == ("h1", (1,), ())
    assert topology.process("trainer-0").ports == (29600,)


def test_cpu_trainer_uses_cpu_ranks_per_host_and_no_nccl() -> None:
    spec = cluster(host(0), host(1))
    topology = compile_topology(spec, trainer=TrainerSpec(cpu_ranks_per_host=2, tp=2, master_port=29500))
    assert names(topology.processes, "trainer") == [f"trainer-{r}" for r in range(4)]
    rank2 = topology.trainer_ranks[2]
    assert (rank2.host_id, rank2.local_rank, rank2.gpu_id, rank2.dp_rank) == ("h1", 0, None, 1)
    env = topology.process("trainer-3").environ
    assert env == {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
    }
    assert topology.process("trainer-3").gpu_ids == ()


def test_nccl_env_on_cpu_trainer_when_transport_exists() -> None:
    spec = cluster(host(0), nccl_transport=NcclTransportSpec(net_name="IB", socket_ifname="eth1"))
    env = compile_topology(spec, trainer=TrainerSpec()).process("trainer-0").environ
    assert (env["NCCL_NET"], env["NCCL_SOCKET_IFNAME"]) == ("IB", "eth1")
    assert "CUDA_VISIBLE_DEVICES" not in env


def test_trainer_ranks_follow_node_order_and_host_ids() -> None:
    spec = cluster(host(0), host(1), host(2))
    topology = compile_topology(spec, trainer=TrainerSpec(host_ids=["h2", "h1"]))
    assert [rank.host_id for rank in topology.trainer_ranks] == ["h1", "h2"]
    assert topology.process("trainer-1").environ["MASTER_ADDR"] == "10.0.0.2"


def test_trainer_defaults_to_gpu_hosts_in_a_mixed_cluster() -> None:
    spec = cluster(host(0), host(1, gpus=2))
    topology = compile_topology(spec, trainer=TrainerSpec())
    assert [(r.host_id, r.gpu_id) for r in topology.trainer_ranks] == [("h1", 0), ("h1", 1)]
    with pytest.raises(TopologyError, match=r"TrainerSpec.host_ids mixes GPU hosts \('h1'\)"):
        compile_topology(spec, trainer=TrainerSpec(host_ids=["h0", "h1"]))


def test_trainer_unknown_host() -> None:
    with pytest.raises(TopologyError, match=r"TrainerSpec\.host_ids names host 'h3'"):
        compile_topology(cluster(host(0)), trainer=TrainerSpec(host_ids=["h3"]))


def test_trainer_dense_divisibility() -> None:
    spec = cluster(host(0, gpus=4), host(1, gpus=2), nccl_transport=IB)
    assert compile_topology(spec, trainer=TrainerSpec(tp=2, cp=3)).trainer_world_size == 6
    with pytest.raises(TopologyError) as info:
        compile_topology(spec, trainer=TrainerSpec(tp=4))
    message = str(info.value)
    assert "TrainerSpec tp=4 x cp=1 x pp=1 = 4 does not divide the trainer world size 6" in message
    assert "ranks per host: 'h0' 4, 'h1' 2" in message


def test_trainer_expert_divisibility() -> None:
    spec = cluster(host(0, gpus=4))
    topology = compile_topology(spec, trainer=TrainerSpec(tp=2, ep=2, etp=1))
    assert topology.trainer_groups is not None
    assert topology.trainer_groups.ep == ((0, 1), (2, 3))
    assert topology.trainer_groups.expert_dp == ((0, 2), (1, 3))
    with pytest.raises(TopologyError, match=r"etp=1 x ep=3 x pp=1 = 3 does not divide .* size 4"):
        compile_topology(spec, trainer=TrainerSpec(ep=3))


PP_REFUSED = (
    "TrainerSpec.pp=2 with cp=2 is not supported yet (pipeline stages do not split context-parallel "
    "rows); use cp=1 with pp, or pp=1 with cp."
)


@pytest.mark.parametrize(("trainer", "field", "sentence"), [(TrainerSpec(cp=2, pp=2), "TrainerSpec.pp", PP_REFUSED)])
def test_sizes_the_trainer_cannot_run_are_refused_at_compile(trainer, field, sentence) -> None:
    # sizes that divide the world (8 GPUs): before, these compiled and failed on every started rank
    spec = cluster(host(0, gpus=4), host(1, gpus=4), nccl_transport=IB)
    with pytest.raises(TopologyError) as info:
        compile_topology(spec, trainer=trainer)
    assert (str(info.value), info.value.field) == (sentence, field)
    assert info.value.exit_code == 2


def test_expert_tensor_parallel_compiles() -> None:
    # etp=2 x ep=2 over 8 GPUs with tp=2: expert-TP pairs are adjacent ranks (etp-ep-dp-pp order)
    spec = cluster(host(0, gpus=4), host(1, gpus=4), nccl_transport=IB)
    topology = compile_topology(spec, trainer=TrainerSpec(tp=2, ep=2, etp=2))
    assert topology.trainer_groups is not None
    assert topology.trainer_groups.ep == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert [rank.etp_rank for rank in topology.trainer_ranks] == [0, 1] * 4


def test_pipeline_stages_compile_across_hosts() -> None:
    # pp=2 over two 4-GPU hosts: each host one stage of tp=2 x dp=2 (megatron-core's tp-cp-ep-dp-pp order)
    spec = cluster(host(0, gpus=4), host(1, gpus=4), nccl_transport=IB)
    topology = compile_topology(spec, trainer=TrainerSpec(tp=2, pp=2))
    assert topology.trainer_groups is not None
    assert topology.trainer_groups.pp == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert [rank.pp_rank for rank in topology.trainer_ranks] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [rank.host_id for rank in topology.trainer_ranks[::4]] == ["h0", "h1"]


def test_multi_host_gpu_trainer_needs_nccl_transport() -> None:
    hosts = (host(0, gpus=2), host(1, gpus=2))
    with pytest.raises(TopologyError) as info:
        compile_topology(cluster(*hosts), trainer=TrainerSpec())
    assert str(info.value).startswith(
        "ClusterSpec.nccl_transport is None but the trainer spans 2 GPU hosts ('h0', 'h1')"
    )
    socket = NcclTransportSpec(net_name="Socket")
    with pytest.raises(TopologyError, match="net_name='Socket' is refused because the trainer"):
        compile_topology(cluster(*hosts, nccl_transport=socket), trainer=TrainerSpec())
    # One GPU host needs no inter-host transport, and CPU hosts use gloo.
    assert compile_topology(cluster(hosts[0]), trainer=TrainerSpec()).trainer_world_size == 2
    cpu = cluster(host(0), host(1), nccl_transport=socket)
    assert compile_topology(cpu, trainer=TrainerSpec()).trainer_world_size == 2


# Inference placement


def test_dedicated_replicas_round_robin_with_ports() -> None:
    spec = cluster(host(0, gpus=4), host(1, gpus=4))
    topology = compile_topology(spec, inference=InferenceSpec(replicas=4, api_port=9000))
    assert [(r.index, r.host_ids, r.gpu_ids) for r in topology.replicas] == [
        (0, ("h0",), (("h0", (0,)),)),
        (1, ("h1",), (("h1", (0,)),)),
        (2, ("h0",), (("h0", (1,)),)),
        (3, ("h1",), (("h1", (1,)),)),
    ]
    assert [r.endpoint.url for r in topology.replicas] == [
        "http://10.0.0.1:9000",
        "http://10.0.0.2:9000",
        "http://10.0.0.1:9001",
        "http://10.0.0.2:9001",
    ]
    process = topology.process("vllm-3")
    assert (process.host_id, process.gpu_ids, process.ports) == ("h1", (1,), (9001,))
    assert process.environ == {"CUDA_VISIBLE_DEVICES": "1"}


def test_replica_with_tp_takes_consecutive_free_gpus() -> None:
    spec = cluster(host(0, gpus=8), nccl_transport=IB)
    topology = compile_topology(spec, inference=InferenceSpec(replicas=2, tp=2, dp=2))
    assert [r.gpu_ids for r in topology.replicas] == [
        (("h0", (0, 1, 2, 3)),),
        (("h0", (4, 5, 6, 7)),),
    ]
    assert topology.process("vllm-1").environ == {
        "CUDA_VISIBLE_DEVICES": "4,5,6,7",
        "NCCL_NET": "IB",
    }


def test_dedicated_inference_beside_the_trainer() -> None:
    spec = cluster(host(0, gpus=4), host(1, gpus=2))
    topology = compile_topology(
        spec, trainer=TrainerSpec(host_ids=["h0"]), inference=InferenceSpec(replicas=2)
    )
    assert [r.gpu_ids for r in topology.replicas] == [(("h1", (0,)),), (("h1", (1,)),)]


def test_shared_inference_uses_trainer_gpus() -> None:
    spec = cluster(host(0, gpus=4))
    topology = compile_topology(
        spec, trainer=TrainerSpec(), inference=InferenceSpec(replicas=2, tp=2, shared_gpus=True)
    )
    assert [r.gpu_ids for r in topology.replicas] == [(("h0", (0, 1)),), (("h0", (2, 3)),)]
    assert all(r.shared_gpus for r in topology.replicas)
    assert [p.gpu_ids for p in topology.processes if p.role == "trainer"] == [
        (0,),
        (1,),
        (2,),
        (3,),
    ]


def test_not_enough_free_gpus_beside_the_trainer() -> None:
    spec = cluster(host(0, gpus=4))
    with pytest.raises(TopologyError) as info:
        compile_topology(spec, trainer=TrainerSpec(), inference=InferenceSpec())
    assert str(info.value) == (
        "InferenceSpec(name='vllm') has replicas=1 of 1 GPUs each but only 0 fit (free GPUs "
        "per host: 'h0' 0); add hosts, lower replicas, tp, pp or dp, or set shared_gpus=True "
        "to share the trainer's GPUs."
    )


def test_not_enough_free_gpus_for_replicas() -> None:
    spec = cluster(host(0, gpus=4))
    assert len(compile_topology(spec, inference=InferenceSpec(replicas=2, tp=2)).replicas) == 2
    with pytest.raises(TopologyError, match="replicas=3 of 2 GPUs each but only 2 fit"):
        compile_topology(spec, inference=InferenceSpec(replicas=3, tp=2))


def test_dp_beyond_one_host_is_refused() -> None:
    spec = cluster(host(0, gpus=4), host(1, gpus=4), nccl_transport=IB)
    with pytest.raises(TopologyError, match="tp\\*pp\\*dp = 8 GPUs per replica but its hosts"):
        compile_topology(spec, inference=InferenceSpec(tp=2, dp=4))


def test_inference_gpu_ids_select_gpus() -> None:
    spec = cluster(host(0, gpus=4))
    topology = compile_topology(spec, inference=InferenceSpec(replicas=2, gpu_ids=[3, 1]))
    assert [r.gpu_ids for r in topology.replicas] == [(("h0", (3,)),), (("h0", (1,)),)]


def test_inference_gpu_the_host_does_not_list() -> None:
    spec = cluster(host(0, gpus=2))
    with pytest.raises(TopologyError) as info:
        compile_topology(spec, inference=InferenceSpec(gpu_ids=[1, 5]))
    assert str(info.value) == (
        "InferenceSpec(name='vllm').gpu_ids names GPU 5, which host 'h0' does not list (its "
        "gpu_ids: 0, 1); name GPUs the host has."
    )
    cpu = cluster(host(0))
    with pytest.raises(TopologyError, match=r"names GPU 0, which host 'h0' does not list .*none"):
        compile_topology(cpu, inference=InferenceSpec(gpu_ids=[0]))


def test_dedicated_gpu_overlap_with_trainer_refused() -> None:
    spec = cluster(host(0, gpus=4))
    with pytest.raises(TopologyError) as info:
        compile_topology(spec, trainer=TrainerSpec(), inference=InferenceSpec(gpu_ids=[2]))
    assert str(info.value) == (
        "InferenceSpec(name='vllm').gpu_ids names GPU 2 on host 'h0', which trainer rank 2 "
        "uses; set shared_gpus=True to share the trainer's GPUs or name other GPUs."
    )
    shared = InferenceSpec(gpu_ids=[2], shared_gpus=True)
    topology = compile_topology(spec, trainer=TrainerSpec(), inference=shared)
    assert topology.replicas[0].gpu_ids == (("h0", (2,)),)


def test_only_one_inference_spec_shares_the_trainer() -> None:
    spec = cluster(host(0, gpus=4))
    first = InferenceSpec(name="policy", gpu_ids=[0, 1], replicas=2, shared_gpus=True)
    second = InferenceSpec(name="judge", gpu_ids=[2], shared_gpus=True, api_port=8100)
    with pytest.raises(TopologyError) as info:
        compile_topology(spec, trainer=TrainerSpec(), inference=[first, second])
    assert str(info.value) == (
        "InferenceSpec(name='judge').gpu_ids names GPU 2 on host 'h0', which trainer rank 2 "
        "uses, but InferenceSpec 'policy' already shares the trainer's GPUs and only one spec "
        "may; name other GPUs."
    )
    any_gpu = InferenceSpec(name="judge", shared_gpus=True, api_port=8100)
    with pytest.raises(TopologyError, match="'policy' already shares the trainer's GPUs"):
        compile_topology(spec, trainer=TrainerSpec(), inference=[first, any_gpu])


def test_inference_specs_never_share_gpus() -> None:
    spec = cluster(host(0, gpus=4))
    first = InferenceSpec(name="policy", gpu_ids=[0, 1], replicas=2)
    second = InferenceSpec(name="judge", gpu_ids=[1], api_port=8100)
    with pytest.raises(TopologyError) as info:
        compile_topology(spec, inference=[first, second])
    assert str(info.value) == (
        "InferenceSpec(name='judge').gpu_ids names GPU 1 on host 'h0', which replica "
        "'policy-1' already uses; give each inference spec its own GPUs."
    )
    free = InferenceSpec(name="judge", api_port=8100, replicas=2)
    topology = compile_topology(spec, inference=[first, free])
    assert [r.gpu_ids for r in topology.replicas if r.name == "judge"] == [
        (("h0", (2,)),),
        (("h0", (3,)),),
    ]


def test_inference_unknown_host_and_mixed_hosts() -> None:
    spec = cluster(host(0), host(1, gpus=1))
    with pytest.raises(TopologyError, match=r"InferenceSpec\(name='vllm'\).host_ids names host"):
        compile_topology(spec, inference=InferenceSpec(host_ids=["nope"]))
    with pytest.raises(TopologyError, match="mixes GPU hosts"):
        compile_topology(spec, inference=InferenceSpec(host_ids=["h0", "h1"]))
    assert compile_topology(spec, inference=InferenceSpec()).replicas[0].host_ids == ("h1",)


def test_cpu_replicas_spread_one_process_each() -> None:
    spec = cluster(host(0), host(1))
    topology = compile_topology(spec, inference=InferenceSpec(replicas=3, tp=2, api_port=8000))
    assert [(r.host_ids, r.endpoint.port) for r in topology.replicas] == [
        (("h0",), 8000),
        (("h1",), 8000),
        (("h0",), 8001),
    ]
    process = topology.process("vllm-2")
    assert (process.host_id, process.gpu_ids, process.ports, process.env) == ("h0", (), (8001,), ())


def test_duplicate_inference_names() -> None:
    with pytest.raises(TopologyError, match=r"InferenceSpec\.name 'vllm' is used by 2"):
        compile_topology(cluster(host(0)), inference=[InferenceSpec(), InferenceSpec()])


# Replicas spanning hosts


def test_replica_spans_hosts_when_tp_exceeds_one_host() -> None:
    spec = cluster(host(0, gpus=4), host(1, gpus=4), nccl_transport=IB)
    topology = compile_topology(spec, inference=InferenceSpec(tp=4, pp=2, api_port=8000))
    (replica,) = topology.replicas
    assert replica.host_ids == ("h0", "h1")
    assert replica.gpu_ids == (("h0", (0, 1, 2, 3)), ("h1", (0, 1, 2, 3)))
    assert replica.endpoint.address == "tcp://10.0.0.1:8000"
    head, worker = topology.process("vllm-0"), topology.process("vllm-0-node1")
    assert (head.host_id, head.ports, head.rank) == ("h0", (8000,), 0)
    assert (worker.host_id, worker.ports, worker.rank) == ("h1", (), 1)
    assert worker.environ == {"CUDA_VISIBLE_DEVICES": "0,1,2,3", "NCCL_NET": "IB"}


def test_spanning_replica_needs_a_real_transport() -> None:
    hosts = (host(0, gpus=4), host(1, gpus=4))
    with pytest.raises(TopologyError, match=r"nccl_transport is None but .* spans hosts"):
        compile_topology(cluster(*hosts), inference=InferenceSpec(tp=8))
    socket = NcclTransportSpec(net_name="socket")
    with pytest.raises(TopologyError, match="net_name='socket' is refused"):
        compile_topology(cluster(*hosts, nccl_transport=socket), inference=InferenceSpec(tp=8))


def test_spanning_replica_divisibility() -> None:
    spec = cluster(host(0, gpus=4), host(1, gpus=4), nccl_transport=IB)
    with pytest.raises(TopologyError) as info:
        compile_topology(spec, inference=InferenceSpec(tp=6))
    assert str(info.value) == (
        "InferenceSpec(name='vllm') has tp*pp = 6, which spans hosts and so must be a multiple "
        "of the 4 GPUs per host; choose tp*pp from 8, 12, ..."
    )


def test_spanning_replica_needs_equal_hosts_and_enough_of_them() -> None:
    uneven = cluster(host(0, gpus=4), host(1, gpus=2), nccl_transport=IB)
    with pytest.raises(TopologyError, match="equal GPU counts \\(got 'h0' 4, 'h1' 2\\)"):
        compile_topology(uneven, inference=InferenceSpec(tp=6))
    spec = cluster(host(0, gpus=4), host(1, gpus=4), nccl_transport=IB)
    with pytest.raises(TopologyError, match="replicas=2 of 8 GPUs each but only 1 fit"):
        compile_topology(spec, inference=InferenceSpec(tp=8, replicas=2))


# Ports


def test_trainer_master_port_collides_with_agent() -> None:
    spec = cluster(host(0, worker_address="tcp://10.0.0.1:29500"))
    with pytest.raises(TopologyError) as info:
        compile_topology(spec, trainer=TrainerSpec(master_port=29500))
    assert str(info.value) == (
        "port 29500 at 10.0.0.1 is taken by both ClusterSpec.hosts[0].worker_address (host "
        "'h0') and TrainerSpec.master_port (host 'h0'); change one of them."
    )
    assert compile_topology(spec, trainer=TrainerSpec(master_port=29501)).trainer_world_size == 1


def test_replica_port_collides_with_agent_or_other_spec() -> None:
    spec = cluster(host(0))
    with pytest.raises(TopologyError, match=r"port 22222 at 10\.0\.0\.1 is taken by both"):
        compile_topology(spec, inference=InferenceSpec(api_port=22222))
    first = InferenceSpec(name="policy", replicas=2, api_port=8000)
    second = InferenceSpec(name="judge", api_port=8001)
    with pytest.raises(TopologyError) as info:
        compile_topology(spec, inference=[first, second])
    assert str(info.value) == (
        "port 8001 at 10.0.0.1 is taken by both InferenceSpec(name='policy').api_port "
        "(replica 1) (host 'h0') and InferenceSpec(name='judge').api_port (replica 0) (host "
        "'h0'); change one of them."
    )


def test_hosts_sharing_an_address_share_ports() -> None:
    spec = cluster(
        host(0, worker_address="tcp://127.0.0.1:22222"),
        host(1, worker_address="tcp://127.0.0.1:22223"),
        allow_shared_kernel=True,
    )
    topology = compile_topology(spec, inference=InferenceSpec(replicas=2, api_port=8000))
    assert [(r.host_ids, r.endpoint.port) for r in topology.replicas] == [
        (("h0",), 8000),
        (("h1",), 8001),
    ]
    with pytest.raises(TopologyError) as info:
        compile_topology(spec, trainer=TrainerSpec(master_port=22223))
    assert str(info.value) == (
        "port 22223 at 127.0.0.1 is taken by both ClusterSpec.hosts[1].worker_address (host "
        "'h1') and TrainerSpec.master_port (host 'h0'); change one of them."
    )


def test_api_port_past_65535() -> None:
    spec = cluster(host(0))
    with pytest.raises(TopologyError, match="api_port=65535 gives replica 1 on host 'h0' port"):
        compile_topology(spec, inference=InferenceSpec(replicas=2, api_port=65535))

"""Which Python environments the cluster proof runs its collective in, and on which hosts."""

from __future__ import annotations

from art_mega.runtime.runtime import ArtRuntime, ProofEnvironment
from art_mega.topology import InferenceSpec, TrainerSpec, compile_topology
from tests.helpers import loopback_cluster

VLLM = "/opt/vllm/bin/python"


def environments(n_hosts: int, requested: bool | None = None, trainer_hosts=None, *inference):
    cluster = loopback_cluster(n_hosts, cpu_slots=2)
    trainer = TrainerSpec(host_ids=trainer_hosts, cpu_ranks_per_host=1) if trainer_hosts else None
    topology = compile_topology(cluster, trainer=trainer, inference=inference or None)
    return ArtRuntime(topology, {}, "launch").proof_environments(requested)


def test_each_environment_on_the_hosts_it_uses():
    found = environments(
        3,
        None,
        ("host0", "host1"),
        InferenceSpec(replicas=2, host_ids=("host1", "host2"), python=VLLM),
    )
    assert found == (
        ProofEnvironment(("trainer",), None, ("host0", "host1")),
        ProofEnvironment(("vllm",), VLLM, ("host1", "host2")),
    )


def test_one_host_proves_only_the_replica_environment_unless_asked():
    # the agents run the trainer's interpreter already; the replicas' one must import torch.distributed
    spec = InferenceSpec(replicas=1, python=VLLM)
    assert environments(1, None, ("host0",), spec) == (ProofEnvironment(("vllm",), VLLM, ("host0",)),)
    assert environments(1, True, ("host0",), spec) == (
        ProofEnvironment(("trainer",), None, ("host0",)),
        ProofEnvironment(("vllm",), VLLM, ("host0",)),
    )
    assert environments(2, False, ("host0", "host1"), spec) == ()


def test_one_interpreter_on_covered_hosts_is_proved_once_for_both():
    found = environments(
        2,
        True,
        None,
        InferenceSpec(name="big", replicas=2, python=VLLM),
        InferenceSpec(name="small", replicas=1, host_ids=("host1",), python=VLLM, api_port=8100),
    )
    assert found == (
        ProofEnvironment(("trainer",), None, ("host0", "host1")),
        ProofEnvironment(("big", "small"), VLLM, ("host0", "host1")),
    )


def test_a_spec_without_python_is_left_to_the_backend():
    # its interpreter is the backend's vLLM one; single-host replicas add nothing to prove
    assert environments(2, None, None, InferenceSpec(replicas=2)) == ()

"""Field rules of HostSpec, the transports, ClusterSpec, TrainerSpec and InferenceSpec."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from art_mega.errors import TopologyError, format_validation_error
from art_mega.topology import (
    ClusterSpec,
    HostSpec,
    InferenceSpec,
    NcclTransportSpec,
    NixlTransportSpec,
    TrainerSpec,
)


def host(index: int = 0, **overrides: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "host_id": f"h{index}",
        "node_rank": index,
        "worker_address": f"tcp://10.0.0.{index + 1}:22222",
    }
    return fields | overrides


def cluster(*hosts: dict[str, Any], **overrides: Any) -> ClusterSpec:
    fields: dict[str, Any] = {
        "hosts": hosts or (host(0),),
        "controller_host_id": "h0",
        "artifact_root": "/shared/art",
        "cache_root": "/var/cache/art",
    }
    return ClusterSpec(**(fields | overrides))


def one_error(info: pytest.ExceptionInfo[ValidationError], model: str) -> str:
    message = format_validation_error(info.value, model)
    assert "\n" not in message
    assert message.endswith(".")
    return message


# HostSpec


def test_host_defaults_and_gpu_ids() -> None:
    spec = HostSpec(**host(0, gpu_ids=[0, "3", "GPU-8a1b-22", "MIG-GPU-8a1b/1/0"]))
    assert spec.cpu_slots == 1
    assert spec.gpu_ids == (0, 3, "GPU-8a1b-22", "MIG-GPU-8a1b/1/0")
    assert spec.has_gpus
    assert not HostSpec(**host(0)).has_gpus
    assert spec.worker_address.port == 22222


@pytest.mark.parametrize("host_id", ["", "a b", "a/b", "h\n"])
def test_host_id_must_be_simple(host_id: str) -> None:
    with pytest.raises(ValidationError) as info:
        HostSpec(**host(0, host_id=host_id))
    message = one_error(info, "HostSpec")
    assert message.startswith("HostSpec.host_id:")
    assert repr(host_id) in message


def test_node_rank_and_cpu_slots_bounds() -> None:
    with pytest.raises(ValidationError) as info:
        HostSpec(**host(0, node_rank=-1))
    assert one_error(info, "HostSpec").startswith("HostSpec.node_rank=-1 is invalid")
    with pytest.raises(ValidationError) as info:
        HostSpec(**host(0, cpu_slots=0))
    assert one_error(info, "HostSpec").startswith("HostSpec.cpu_slots=0 is invalid")
    assert HostSpec(**host(0, cpu_slots=8)).cpu_slots == 8


@pytest.mark.parametrize("gpu", [-1, True, "gpu-1", "GPU-", "GPU-a b", "1,2", 1.5])
def test_bad_gpu_ids(gpu: object) -> None:
    with pytest.raises(ValidationError) as info:
        HostSpec(**host(0, gpu_ids=[gpu]))
    message = one_error(info, "HostSpec")
    assert message.startswith("HostSpec.gpu_ids[0]:")
    assert repr(gpu) in message or str(gpu) in message


def test_gpu_ids_unique_per_host() -> None:
    with pytest.raises(ValidationError, match="lists GPU 1 twice") as info:
        HostSpec(**host(0, gpu_ids=[0, 1, "1"]))
    assert one_error(info, "HostSpec").startswith("HostSpec.gpu_ids:")


# Transports


@pytest.mark.parametrize("net_name", ["IB", "Socket", "socket", "AWS Libfabric"])
def test_nccl_net_name_accepted(net_name: str) -> None:
    assert NcclTransportSpec(net_name=net_name).net_name == net_name


def test_nccl_is_socket_any_case() -> None:
    assert NcclTransportSpec(net_name="SOCKET").is_socket
    assert not NcclTransportSpec(net_name="IB").is_socket


@pytest.mark.parametrize("net_name", ["", " IB", "IB ", "I\nB", "I\rB", "I\x00B"])
def test_nccl_net_name_rejected(net_name: str) -> None:
    with pytest.raises(ValidationError) as info:
        NcclTransportSpec(net_name=net_name)
    message = one_error(info, "NcclTransportSpec")
    assert message.startswith("NcclTransportSpec.net_name:")
    assert repr(net_name) in message


def test_nccl_socket_ifname() -> None:
    assert NcclTransportSpec(net_name="IB", socket_ifname="eth0").socket_ifname == "eth0"
    with pytest.raises(ValidationError, match="socket_ifname ' eth0'"):
        NcclTransportSpec(net_name="IB", socket_ifname=" eth0")


def test_nixl_defaults_to_managed_etcd() -> None:
    spec = NixlTransportSpec()
    assert spec.metadata_store is None
    assert spec.backend == "UCX"


def test_nixl_routable_store_accepted_from_string() -> None:
    spec = NixlTransportSpec(metadata_store="tcp://10.0.0.9:2379")
    assert spec.metadata_store is not None
    assert (spec.metadata_store.host, spec.metadata_store.port) == ("10.0.0.9", 2379)


@pytest.mark.parametrize("store", ["tcp://127.0.0.1:2379", "tcp://0.0.0.0:2379", "tcp://[fe80::1]:2"])
def test_nixl_store_must_be_routable(store: str) -> None:
    with pytest.raises(ValidationError, match="not reachable from other hosts") as info:
        NixlTransportSpec(metadata_store=store)
    message = one_error(info, "NixlTransportSpec")
    assert message.startswith("NixlTransportSpec.metadata_store:")
    assert store in message


def test_nixl_backend_name() -> None:
    assert NixlTransportSpec(backend="GDS").backend == "GDS"
    with pytest.raises(ValidationError, match="backend ''"):
        NixlTransportSpec(backend="")


# ClusterSpec


def test_cluster_defaults() -> None:
    spec = cluster(host(0), host(1))
    assert spec.host_ids == ("h0", "h1")
    assert spec.shared_artifact_root is True
    assert spec.nccl_transport is None
    assert spec.nixl_transport == NixlTransportSpec()
    assert (spec.startup_timeout_s, spec.rpc_timeout_s) == (60.0, 30.0)
    assert spec.allow_shared_kernel is False
    assert spec.controller.host_id == "h0"
    assert spec.host("h1").node_rank == 1


def test_cluster_host_lookup_names_unknown_id() -> None:
    with pytest.raises(TopologyError, match=r"host_id 'h9' is not in ClusterSpec.hosts \('h0'\)"):
        cluster().host("h9")


def test_cluster_needs_hosts() -> None:
    with pytest.raises(ValidationError) as info:
        cluster(hosts=())
    assert one_error(info, "ClusterSpec").startswith("ClusterSpec.hosts=() is invalid")


def test_cluster_unique_host_ids() -> None:
    with pytest.raises(ValidationError) as info:
        cluster(host(0), host(1, host_id="h0"))
    message = one_error(info, "ClusterSpec")
    assert "hosts[1].host_id 'h0' is used by an earlier host" in message


def test_cluster_unique_worker_addresses() -> None:
    same = "tcp://10.0.0.1:22222"
    assert cluster(host(0), host(1, worker_address="tcp://10.0.0.1:22223")).hosts[1]
    with pytest.raises(ValidationError) as info:
        cluster(host(0, worker_address=same), host(1, worker_address=same))
    message = one_error(info, "ClusterSpec")
    assert f"hosts[1].worker_address {same!r} is already used by host 'h0'" in message


def test_cluster_node_ranks_follow_order() -> None:
    with pytest.raises(ValidationError) as info:
        cluster(host(0), host(1, node_rank=2))
    message = one_error(info, "ClusterSpec")
    assert "hosts[1].node_rank is 2 but must be 1" in message
    with pytest.raises(ValidationError, match=r"hosts\[0\]\.node_rank is 1 but must be 0"):
        cluster(host(1), host(0), controller_host_id="h1")


def test_cluster_controller_must_be_a_host() -> None:
    assert cluster(host(0), host(1), controller_host_id="h1").controller.host_id == "h1"
    with pytest.raises(ValidationError) as info:
        cluster(controller_host_id="boss")
    message = one_error(info, "ClusterSpec")
    assert "controller_host_id 'boss' is not one of the hosts ('h0')" in message


@pytest.mark.parametrize("field", ["artifact_root", "cache_root"])
@pytest.mark.parametrize("path", ["", "relative/dir", "./x", "~/x"])
def test_cluster_roots_must_be_absolute(field: str, path: str) -> None:
    with pytest.raises(ValidationError) as info:
        cluster(**{field: path})
    message = one_error(info, "ClusterSpec")
    assert message.startswith(f"ClusterSpec.{field}: {field} {path!r} must be an absolute path")


@pytest.mark.parametrize("field", ["startup_timeout_s", "rpc_timeout_s"])
@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf")])
def test_cluster_timeouts_positive_and_finite(field: str, value: float) -> None:
    assert getattr(cluster(**{field: 0.5}), field) == 0.5
    with pytest.raises(ValidationError) as info:
        cluster(**{field: value})
    assert one_error(info, "ClusterSpec").startswith(f"ClusterSpec.{field}={value!r} is invalid")


def test_cluster_nested_errors_name_the_path() -> None:
    with pytest.raises(ValidationError) as info:
        cluster(host(0), host(1, worker_address="tcp://10.0.0.2"))
    message = one_error(info, "ClusterSpec")
    assert message.startswith("ClusterSpec.hosts[1].worker_address: address 'tcp://10.0.0.2'")
    with pytest.raises(ValidationError) as info:
        cluster(nixl_transport={"metadata_store": "tcp://localhost:2379"})
    message = one_error(info, "ClusterSpec")
    assert message.startswith("ClusterSpec.nixl_transport.metadata_store:")


def test_format_validation_error_missing_and_extra_fields() -> None:
    with pytest.raises(ValidationError) as info:
        ClusterSpec(hosts=[host(0)], controller_host_id="h0", artifact_root="/a")  # type: ignore[call-arg]
    assert one_error(info, "ClusterSpec") == "ClusterSpec.cache_root is required; set it."
    with pytest.raises(ValidationError) as info:
        cluster(host(0, gpus=[0]))
    assert one_error(info, "ClusterSpec") == (
        "ClusterSpec.hosts[0].gpus=[0] is not a known field; remove it or correct its name."
    )


def test_cluster_is_frozen_and_hashable() -> None:
    spec = cluster()
    with pytest.raises(ValidationError):
        spec.controller_host_id = "h1"  # type: ignore[misc]
    assert hash(spec) == hash(cluster())


# TrainerSpec


def test_trainer_defaults() -> None:
    spec = TrainerSpec()
    assert (spec.tp, spec.cp, spec.ep, spec.etp, spec.pp) == (1, 1, 1, 1, 1)
    assert spec.host_ids is None
    assert (spec.cpu_ranks_per_host, spec.master_port) == (1, None)  # None: chosen at the start
    spec = TrainerSpec(tp=2, cp=3, pp=4, ep=5, etp=6)
    assert (spec.model_parallel_size, spec.expert_model_parallel_size) == (24, 120)


@pytest.mark.parametrize("field", ["tp", "cp", "ep", "etp", "pp", "cpu_ranks_per_host"])
def test_trainer_sizes_at_least_one(field: str) -> None:
    assert getattr(TrainerSpec(**{field: 2}), field) == 2
    with pytest.raises(ValidationError) as info:
        TrainerSpec(**{field: 0})
    assert one_error(info, "TrainerSpec").startswith(f"TrainerSpec.{field}=0 is invalid")


def test_trainer_host_ids() -> None:
    assert TrainerSpec(host_ids=["h1", "h0"]).host_ids == ("h1", "h0")
    with pytest.raises(ValidationError, match="host_ids is empty"):
        TrainerSpec(host_ids=[])
    with pytest.raises(ValidationError, match="host_ids lists 'h0' twice"):
        TrainerSpec(host_ids=["h0", "h0"])


@pytest.mark.parametrize("port", [0, 65536])
def test_trainer_master_port(port: int) -> None:
    with pytest.raises(ValidationError) as info:
        TrainerSpec(master_port=port)
    assert one_error(info, "TrainerSpec").startswith(f"TrainerSpec.master_port={port} is invalid")


# InferenceSpec


def test_inference_defaults() -> None:
    spec = InferenceSpec()
    assert (spec.name, spec.replicas, spec.tp, spec.pp, spec.dp) == ("vllm", 1, 1, 1, 1)
    assert (spec.host_ids, spec.gpu_ids, spec.api_port) == (None, None, None)  # None: chosen at the start
    assert (spec.shared_gpus, spec.python) == (False, None)
    assert InferenceSpec(tp=2, pp=3, dp=4).gpus_per_replica == 24


@pytest.mark.parametrize("name", ["", "my vllm", "trainer", "agent", "rollout"])
def test_inference_name(name: str) -> None:
    with pytest.raises(ValidationError) as info:
        InferenceSpec(name=name)
    message = one_error(info, "InferenceSpec")
    assert message.startswith(f"InferenceSpec.name: name {name!r}")


@pytest.mark.parametrize("field", ["replicas", "tp", "pp", "dp"])
def test_inference_sizes_at_least_one(field: str) -> None:
    assert getattr(InferenceSpec(**{field: 3}), field) == 3
    with pytest.raises(ValidationError) as info:
        InferenceSpec(**{field: 0})
    assert one_error(info, "InferenceSpec").startswith(f"InferenceSpec.{field}=0 is invalid")


def test_inference_gpu_ids_and_host_ids() -> None:
    assert InferenceSpec(gpu_ids=["2", 3]).gpu_ids == (2, 3)
    with pytest.raises(ValidationError, match="gpu_ids lists GPU 2 twice"):
        InferenceSpec(gpu_ids=[2, 2])
    with pytest.raises(ValidationError, match="gpu_ids is empty"):
        InferenceSpec(gpu_ids=[])
    with pytest.raises(ValidationError, match="GPU id -1"):
        InferenceSpec(gpu_ids=[-1])
    with pytest.raises(ValidationError, match="host_ids lists 'h1' twice"):
        InferenceSpec(host_ids=["h1", "h1"])


def test_inference_api_port_and_python() -> None:
    assert InferenceSpec(api_port=9000, python="/opt/vllm/bin/python").api_port == 9000
    with pytest.raises(ValidationError) as info:
        InferenceSpec(api_port=0)
    assert one_error(info, "InferenceSpec").startswith("InferenceSpec.api_port=0 is invalid")
    with pytest.raises(ValidationError, match="python ' '"):
        InferenceSpec(python=" ")

"""`LocalBackend()`'s topology from synthetic host facts: CPU, ART's shared mode, dedicated GPUs,
MIG slices and UUIDs, and every refused GPU id list or engine argument."""

from __future__ import annotations

from typing import Any

import pytest

from art_mega.errors import HyperParameterError, TopologyError
from art_mega.launch.local_topology import LocalPlan, local_plan, visible_gpus
from art_mega.preflight.admission import check_named_gpus
from art_mega.preflight.protocol import GpuInfo, HostFacts
from art_mega.topology import ReplicaSpec, TrainerSpec

H200 = "NVIDIA H200"


def whole(index: int, name: str = H200, mig: bool = False) -> GpuInfo:
    return GpuInfo(
        index=index,
        uuid=f"GPU-{index:08d}-aaaa",
        pci_bus_id=f"00000000:{index + 10:02X}:00.0",
        name=name,
        memory_bytes=141 << 30,
        mig_mode=mig,
    )


def mig_slice(parent: GpuInfo, slot: int) -> GpuInfo:
    return GpuInfo(
        index=parent.index,
        uuid=f"MIG-{parent.index}{slot}-bbbb",
        pci_bus_id=parent.pci_bus_id,
        name=f"{parent.name} MIG 1g.18gb",
        memory_bytes=18 << 30,
        mig_mode=True,
        parent_uuid=parent.uuid,
    )


def facts(*gpus: GpuInfo, env: dict[str, str] | None = None, nvml_error: str = "") -> HostFacts:
    return HostFacts(
        host_id="local",
        hostname="box",
        boot_id="b",
        python_version="3.11.9",
        python_executable="/usr/bin/python3",
        art_mega_version="0",
        art_mega_files_sha256="0" * 64,
        packages={},
        env=env or {},
        gpus=gpus,
        nvml_error=nvml_error,
    )


def gpus(count: int, **kw: Any) -> HostFacts:
    return facts(*(whole(i) for i in range(count)), **kw)


def plan(host: HostFacts, config: dict[str, Any] | None = None) -> LocalPlan:
    return local_plan(
        host,
        config,
        artifact_root="/tmp/art",
        cache_root="/tmp/cache",
        vllm_python="/opt/vllm/bin/python",
        master_port=29511,
        api_port=8311,
    )


def ranks(p: LocalPlan) -> list[tuple[int, Any]]:
    return [(r.rank, r.gpu_id) for r in p.topology.trainer_ranks]


def replicas(p: LocalPlan) -> list[tuple[tuple[Any, ...], int, bool]]:
    out = []
    for r in p.topology.replicas:
        assert isinstance(r, ReplicaSpec)
        ((host_id, ids),) = r.gpu_ids
        assert host_id == "local"
        out.append((ids, r.tp, r.shared_gpus))
    return out


def env_of(p: LocalPlan, name: str) -> dict[str, str]:
    (process,) = [proc for proc in p.topology.processes if proc.name == name]
    return process.environ


def admitted(p: LocalPlan, host: HostFacts) -> None:
    """The host's agent would admit the topology (every GPU named exists, once, not MIG whole)."""
    check_named_gpus(p.topology, {"local": host})


# ------------------------------------------------------------------ CPU


def test_no_gpu_is_todays_cpu_layout():
    host = facts(nvml_error="NVML unavailable: no driver")
    p = plan(host)
    assert p.mode == "cpu"
    assert ranks(p) == [(0, None)]
    assert replicas(p) == [((), 1, False)]
    (h,) = p.topology.cluster.hosts
    assert (h.host_id, h.cpu_slots, h.gpu_ids, h.worker_address.address) == (
        "local",
        2,
        (),
        "tcp://127.0.0.1:0",
    )
    assert p.topology.trainer.master_port == 29511 and p.topology.trainer.cpu_ranks_per_host == 1
    assert p.topology.replicas[0].endpoint.port == 8311
    assert p.topology.inference[0].python == "/opt/vllm/bin/python"
    assert (p.max_seq_length, p.max_model_len, p.gpu_memory_utilization) == (None, None, None)


def test_an_empty_cuda_visible_devices_hides_every_gpu():
    p = plan(gpus(2, env={"CUDA_VISIBLE_DEVICES": ""}))
    assert p.mode == "cpu" and ranks(p) == [(0, None)]


def test_gpu_ids_on_a_host_without_gpus_are_refused_with_nvml_reason():
    with pytest.raises(HyperParameterError) as info:
        plan(
            facts(nvml_error="NVML unavailable: no driver"),
            {"trainer_gpu_ids": [0], "inference_gpu_ids": [1]},
        )
    assert info.value.name == "trainer_gpu_ids"
    assert "no GPU CUDA can use (NVML unavailable: no driver)" in str(info.value)


@pytest.mark.parametrize(
    ("engine", "field"),
    [
        ({"tensor_parallel_size": 2}, "engine_args.tensor_parallel_size"),
        ({"enable_sleep_mode": True}, "engine_args.enable_sleep_mode"),
    ],
)
def test_gpu_only_engine_args_are_refused_on_cpu(engine, field):
    with pytest.raises(HyperParameterError) as info:
        plan(facts(), {"engine_args": engine})
    assert info.value.name == field


# ------------------------------------------------------------------ shared (ART's default)


@pytest.mark.parametrize("count", [1, 2, 8])
def test_shared_mode_trains_on_every_gpu_and_serves_asleep_on_gpu_0(count):
    host = gpus(count)
    p = plan(host)
    assert p.mode == "shared"
    assert ranks(p) == [(i, i) for i in range(count)]
    assert replicas(p) == [((0,), 1, True)]
    assert p.topology.trainer_groups.dp_size == count
    assert env_of(p, "trainer-0")["CUDA_VISIBLE_DEVICES"] == "0"
    assert env_of(p, f"trainer-{count - 1}")["CUDA_VISIBLE_DEVICES"] == str(count - 1)
    assert env_of(p, "vllm-0")["CUDA_VISIBLE_DEVICES"] == "0"
    admitted(p, host)


def test_shared_mode_replica_takes_tensor_parallel_size_gpus():
    p = plan(gpus(8), {"engine_args": {"tensor_parallel_size": 4}})
    assert replicas(p) == [((0, 1, 2, 3), 4, True)]
    assert len(ranks(p)) == 8


def test_shared_mode_uses_only_what_cuda_visible_devices_shows_in_its_order():
    host = gpus(8, env={"CUDA_VISIBLE_DEVICES": "6,2"})
    p = plan(host)
    assert ranks(p) == [(0, 6), (1, 2)]
    assert replicas(p) == [((6,), 1, True)]
    admitted(p, host)


def test_cuda_visible_devices_by_uuid_is_kept_as_uuids():
    host = gpus(2, env={"CUDA_VISIBLE_DEVICES": "GPU-00000001-aaaa"})
    p = plan(host)
    assert ranks(p) == [(0, "GPU-00000001-aaaa")]
    assert env_of(p, "vllm-0")["CUDA_VISIBLE_DEVICES"] == "GPU-00000001-aaaa"
    admitted(p, host)


def test_mig_gpus_are_used_as_their_slices():
    mig_gpu = whole(0, mig=True)
    host = facts(mig_gpu, mig_slice(mig_gpu, 0), mig_slice(mig_gpu, 1), whole(1))
    assert visible_gpus(host) == ("MIG-00-bbbb", "MIG-01-bbbb", 1)
    p = plan(host)
    assert ranks(p) == [(0, "MIG-00-bbbb"), (1, "MIG-01-bbbb"), (2, 1)]
    assert replicas(p) == [(("MIG-00-bbbb",), 1, True)]
    admitted(p, host)


def test_one_mig_slice_in_cuda_visible_devices_is_the_whole_box():
    mig_gpu = whole(0, mig=True)
    host = facts(
        mig_gpu, mig_slice(mig_gpu, 0), mig_slice(mig_gpu, 1), env={"CUDA_VISIBLE_DEVICES": "MIG-01-bbbb"}
    )
    p = plan(host)
    assert ranks(p) == [(0, "MIG-01-bbbb")]
    assert replicas(p) == [(("MIG-01-bbbb",), 1, True)]
    admitted(p, host)


def test_two_gpu_models_without_pci_order_are_named_by_uuid():
    host = facts(whole(0, "NVIDIA H200"), whole(1, "NVIDIA L4"))
    p = plan(host)
    assert ranks(p) == [(0, "GPU-00000000-aaaa"), (1, "GPU-00000001-aaaa")]
    admitted(p, host)
    pci = facts(whole(0, "NVIDIA H200"), whole(1, "NVIDIA L4"), env={"CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    assert ranks(plan(pci)) == [(0, 0), (1, 1)]


@pytest.mark.parametrize(
    ("visible", "says"),
    [
        ("3", "names '3', which is not a GPU of this host"),
        ("GPU-nope", "names 'GPU-nope'"),
        ("0", "in MIG mode"),
    ],
)
def test_cuda_visible_devices_naming_what_cuda_cannot_use_is_refused(visible, says):
    mig_gpu = whole(0, mig=True)
    host = facts(mig_gpu, mig_slice(mig_gpu, 0), whole(1), env={"CUDA_VISIBLE_DEVICES": visible})
    with pytest.raises(TopologyError) as info:
        plan(host)
    assert info.value.field == "CUDA_VISIBLE_DEVICES"
    assert says in str(info.value)


def test_shared_mode_refuses_sleep_mode_off_and_too_wide_a_replica():
    with pytest.raises(HyperParameterError) as info:
        plan(gpus(2), {"engine_args": {"enable_sleep_mode": False}})
    assert info.value.name == "engine_args.enable_sleep_mode" and "set both GPU id lists" in str(info.value)
    with pytest.raises(HyperParameterError) as info:
        plan(gpus(2), {"engine_args": {"tensor_parallel_size": 4}})
    assert info.value.name == "engine_args.tensor_parallel_size" and "use at most 2" in str(info.value)
    assert plan(gpus(2), {"engine_args": {"enable_sleep_mode": True}}).mode == "shared"


# ------------------------------------------------------------------ dedicated


def test_dedicated_mode_on_two_gpus():
    host = gpus(2)
    p = plan(host, {"trainer_gpu_ids": [0], "inference_gpu_ids": [1]})
    assert p.mode == "dedicated"
    assert ranks(p) == [(0, 0)]
    assert replicas(p) == [((1,), 1, False)]
    assert p.topology.cluster.hosts[0].gpu_ids == (0, 1)
    assert env_of(p, "vllm-0")["CUDA_VISIBLE_DEVICES"] == "1"
    admitted(p, host)


def test_dedicated_mode_on_eight_gpus_one_replica_per_inference_gpu():
    host = gpus(8)
    p = plan(host, {"trainer_gpu_ids": [0, 1, 2, 3, 4, 5], "inference_gpu_ids": [7, 6]})
    assert ranks(p) == [(i, i) for i in range(6)]
    assert replicas(p) == [((7,), 1, False), ((6,), 1, False)]
    assert [r.endpoint.port for r in p.topology.replicas] == [8311, 8312]
    assert p.topology.cluster.hosts[0].gpu_ids == tuple(range(8))
    admitted(p, host)


def test_dedicated_mode_replicas_of_tensor_parallel_size():
    p = plan(
        gpus(8),
        {
            "trainer_gpu_ids": [0, 1, 2, 3],
            "inference_gpu_ids": [4, 5, 6, 7],
            "engine_args": {"tensor_parallel_size": 2},
        },
    )
    assert replicas(p) == [((4, 5), 2, False), ((6, 7), 2, False)]


def test_dedicated_ids_are_checked_against_cuda_visible_devices():
    p = plan(gpus(4, env={"CUDA_VISIBLE_DEVICES": "2,3"}), {"trainer_gpu_ids": [2], "inference_gpu_ids": [3]})
    assert ranks(p) == [(0, 2)] and replicas(p) == [((3,), 1, False)]
    with pytest.raises(HyperParameterError) as info:
        plan(gpus(4, env={"CUDA_VISIBLE_DEVICES": "2,3"}), {"trainer_gpu_ids": [0], "inference_gpu_ids": [3]})
    assert info.value.name == "trainer_gpu_ids" and "usable: 2, 3" in str(info.value)


@pytest.mark.parametrize(
    ("config", "field", "says"),
    [
        ({"trainer_gpu_ids": [0]}, "trainer_gpu_ids", "but not inference_gpu_ids"),
        ({"inference_gpu_ids": [1]}, "inference_gpu_ids", "but not trainer_gpu_ids"),
        ({"trainer_gpu_ids": [], "inference_gpu_ids": [1]}, "trainer_gpu_ids", "non-empty list"),
        ({"trainer_gpu_ids": [0], "inference_gpu_ids": []}, "inference_gpu_ids", "non-empty list"),
        ({"trainer_gpu_ids": 0, "inference_gpu_ids": [1]}, "trainer_gpu_ids", "non-empty list"),
        ({"trainer_gpu_ids": [0, 0], "inference_gpu_ids": [1]}, "trainer_gpu_ids", "lists GPU 0 twice"),
        ({"trainer_gpu_ids": [0, 1], "inference_gpu_ids": [1]}, "inference_gpu_ids", "shares GPU 1"),
        (
            {"trainer_gpu_ids": ["0"], "inference_gpu_ids": [1]},
            "trainer_gpu_ids",
            "entry '0' is not a CUDA device index",
        ),
        ({"trainer_gpu_ids": [True], "inference_gpu_ids": [1]}, "trainer_gpu_ids", "entry True"),
        ({"trainer_gpu_ids": [0.0], "inference_gpu_ids": [1]}, "trainer_gpu_ids", "entry 0.0"),
        ({"trainer_gpu_ids": [-1], "inference_gpu_ids": [1]}, "trainer_gpu_ids", "entry -1"),
        (
            {"trainer_gpu_ids": [0], "inference_gpu_ids": [2]},
            "inference_gpu_ids",
            "GPU 2 is not one CUDA can use",
        ),
        (
            {"trainer_gpu_ids": [0], "inference_gpu_ids": [1], "engine_args": {"enable_sleep_mode": True}},
            "engine_args.enable_sleep_mode",
            "incompatible with dedicated GPUs",
        ),
    ],
)
def test_bad_gpu_id_lists_are_refused_naming_the_field(config, field, says):
    with pytest.raises(HyperParameterError) as info:
        plan(gpus(2), config)
    assert info.value.name == field
    assert says in str(info.value)
    assert str(info.value).replace("e.g. ", "").count(". ") == 0  # one sentence


def test_dedicated_ids_refuse_a_mig_gpu_by_index_and_an_indivisible_tensor_parallel_size():
    mig_gpu = whole(0, mig=True)
    with pytest.raises(HyperParameterError) as info:
        plan(
            facts(mig_gpu, mig_slice(mig_gpu, 0), whole(1)),
            {"trainer_gpu_ids": [0], "inference_gpu_ids": [1]},
        )
    assert info.value.name == "trainer_gpu_ids" and "usable: 1" in str(info.value)
    with pytest.raises(HyperParameterError) as info:
        plan(
            gpus(4),
            {
                "trainer_gpu_ids": [0],
                "inference_gpu_ids": [1, 2, 3],
                "engine_args": {"tensor_parallel_size": 2},
            },
        )
    assert info.value.name == "engine_args.tensor_parallel_size" and "does not divide the 3 GPU(s)" in str(
        info.value
    )


# ------------------------------------------------------------------ init_args / engine_args


def test_sequence_length_and_engine_args_are_carried():
    p = plan(
        gpus(1),
        {
            "init_args": {"max_seq_length": 4096},
            "engine_args": {"max_model_len": 8192, "gpu_memory_utilization": 0.5},
        },
    )
    assert (p.max_seq_length, p.max_model_len, p.gpu_memory_utilization) == (4096, 8192, 0.5)


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"init_args": {"max_seq_length": 0}}, "init_args.max_seq_length"),
        ({"init_args": {"max_seq_length": 2048.0}}, "init_args.max_seq_length"),
        ({"init_args": {"max_seq_length": True}}, "init_args.max_seq_length"),
        ({"engine_args": {"max_model_len": 8}}, "engine_args.max_model_len"),
        ({"engine_args": {"gpu_memory_utilization": 0}}, "engine_args.gpu_memory_utilization"),
        ({"engine_args": {"gpu_memory_utilization": 1.5}}, "engine_args.gpu_memory_utilization"),
        ({"engine_args": {"gpu_memory_utilization": "0.5"}}, "engine_args.gpu_memory_utilization"),
        ({"engine_args": {"tensor_parallel_size": 0}}, "engine_args.tensor_parallel_size"),
        ({"engine_args": {"enable_sleep_mode": 1}}, "engine_args.enable_sleep_mode"),
        ({"engine_args": {"enforce_eagr": True}}, "engine_args.enforce_eagr"),
        ({"engine_args": {"enforce_eager": 1}}, "engine_args.enforce_eager"),
        ({"init_args": {"load_in_4bit": True}}, "init_args.load_in_4bit"),
    ],
)
def test_bad_or_unimplemented_engine_args_are_refused_by_name(config, field):
    with pytest.raises(HyperParameterError) as info:
        plan(gpus(1), config)
    assert info.value.name == field
    assert f"sets {field}=" in str(info.value)


def test_trainer_spec_gpu_ids_must_be_on_the_host():
    from art_mega.topology import ClusterSpec, HostSpec, compile_topology

    cluster = ClusterSpec(
        hosts=(HostSpec(host_id="a", node_rank=0, worker_address="tcp://127.0.0.1:0", gpu_ids=(0, 1)),),
        controller_host_id="a",
        artifact_root="/tmp/a",
        cache_root="/tmp/c",
    )
    with pytest.raises(TopologyError) as info:
        compile_topology(cluster, trainer=TrainerSpec(gpu_ids=(2,)))
    assert info.value.field == "TrainerSpec.gpu_ids" and "does not list" in str(info.value)
    with pytest.raises(ValueError, match="gpu_ids is empty"):
        TrainerSpec(gpu_ids=())
    with pytest.raises(ValueError, match="lists GPU 1 twice"):
        TrainerSpec(gpu_ids=(1, 1))


# ------------------------------------------------------------------ the backend


class _GivenRuntime:
    """A started runtime as far as `MegatronBackend.__init__` looks (register refuses first)."""

    topology = clients = health = None


def _model(config: dict[str, Any]) -> Any:
    import art_mega as art

    return art.TrainableModel(name="m", project="p", base_model="tiny", _internal_config=config)


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"trainer_gpu_ids": [0], "inference_gpu_ids": [1]}, "trainer_gpu_ids"),
        ({"engine_args": {"tensor_parallel_size": 2}}, "engine_args.tensor_parallel_size"),
    ],
)
async def test_a_backend_given_a_runtime_refuses_gpu_placement_before_anything_starts(config, field):
    from art_mega.backend import MegatronBackend

    backend = MegatronBackend(_GivenRuntime())
    with pytest.raises(HyperParameterError) as info:
        await backend.register(_model(config))
    assert info.value.name == field
    assert "but the given runtime's topology places the trainer and replicas; set GPUs in that" in str(
        info.value
    )


def test_register_takes_sequence_length_and_engine_args_from_the_model():
    from art_mega.backend import MegatronBackend

    backend = MegatronBackend(_GivenRuntime(), seq_len=1024, max_model_len=1024)
    config = {
        "init_args": {"max_seq_length": 3072},
        "engine_args": {"max_model_len": 4096, "gpu_memory_utilization": 0.6},
    }
    backend._apply_model_config(_model(config))  # what register does first
    assert (backend.seq_len, backend.max_model_len, backend.gpu_memory_utilization) == (3072, 4096, 0.6)


def test_a_local_runtime_placed_for_one_config_refuses_another_until_closed():
    from art_mega.backend import MegatronBackend

    backend = MegatronBackend()
    backend._runtime = _GivenRuntime()  # as _start_local leaves it for a dedicated-mode model
    backend._placement = {"trainer_gpu_ids": [0], "inference_gpu_ids": [1]}
    backend._apply_model_config(_model({"trainer_gpu_ids": [0], "inference_gpu_ids": [1]}))
    with pytest.raises(HyperParameterError) as info:
        backend._apply_model_config(_model({}))
    assert info.value.name == "trainer_gpu_ids"
    assert "local runtime was placed for {'trainer_gpu_ids': [0], 'inference_gpu_ids': [1]}" in str(
        info.value
    )
    assert "close() the backend first" in str(info.value)

"""The topology of a backend without a runtime (`LocalBackend()`): from this host's facts and the
model's `InternalModelConfig`, as ART's LocalBackend places its trainer and vLLM.

Pure: the caller collects the facts (`preflight.host_facts.collect_host_facts`, what the local
agent reports) and picks the ports; nothing here does I/O.

Three layouts:
- no GPU CUDA can use: one CPU trainer rank and one CPU vLLM replica (art-mega's CPU layout);
- GPUs and no GPU ids (ART's shared mode): a trainer rank on every visible GPU and one vLLM
  replica on the first `tensor_parallel_size` of them, asleep while the trainer steps (ART's
  MegatronService: torchrun over every visible GPU, vLLM with `enable_sleep_mode` on the same
  GPUs, which with vLLM's default tensor parallel size 1 means GPU 0);
- `trainer_gpu_ids` and `inference_gpu_ids` (ART's dedicated mode): trainer ranks on those
  GPUs and replicas of `tensor_parallel_size` GPUs each on the others, never asleep.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from art_mega.agent.ports import free_port
from art_mega.dev.settings import WHERE, engine_settings
from art_mega.errors import HyperParameterError, TopologyError
from art_mega.preflight.protocol import GpuInfo, HostFacts
from art_mega.topology import (
    ClusterSpec,
    CompiledTopology,
    HostSpec,
    InferenceSpec,
    TrainerSpec,
    compile_topology,
)

Mode = Literal["cpu", "shared", "dedicated"]
GpuId = int | str


@dataclass(frozen=True)
class LocalPlan:
    """What `LocalBackend()` runs for one model.

    `mode`: "cpu", "shared" or "dedicated" (module docstring). `max_seq_length`: the trainer's
    sequence limit in tokens (`init_args.max_seq_length`; None: the backend's `seq_len`).
    `max_model_len`: the replicas' context in tokens (`engine_args.max_model_len`; None: the
    backend's `max_model_len`). `gpu_memory_utilization`: fraction (0, 1] of each GPU vLLM takes
    (None: the backend's, else vLLM's 0.9).
    """

    topology: CompiledTopology
    mode: Mode
    max_seq_length: int | None = None
    max_model_len: int | None = None
    gpu_memory_utilization: float | None = None


def _refuse(field: str, value: Any, why: str) -> HyperParameterError:
    return HyperParameterError(f"{WHERE} sets {field}={value!r}, {why}", field, value)


def placement_of(config: Mapping[str, Any] | None) -> dict[str, Any]:
    """The fields of `config` that decide where the trainer and vLLM run (GPU id lists,
    `engine_args.tensor_parallel_size` and `enable_sleep_mode`) that are set, by dotted name: a
    runtime's topology decides them instead, so a backend given a runtime refuses them."""
    config = config or {}
    placement = {name: config[name] for name in ("trainer_gpu_ids", "inference_gpu_ids") if name in config}
    engine = config.get("engine_args") or {}
    for key in ("tensor_parallel_size", "enable_sleep_mode"):
        if key in engine:
            placement[f"engine_args.{key}"] = engine[key]
    return placement


def gpu_ids_of(config: Mapping[str, Any]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """`(trainer_gpu_ids, inference_gpu_ids)` of `config`, checked; None when neither is set.

    Raises:
        HyperParameterError: only one of the two set, an empty list, an entry that is not a whole
            number >= 0, an id listed twice, or an id in both lists (one sentence naming the field).
    """
    has = [name for name in ("trainer_gpu_ids", "inference_gpu_ids") if name in config]
    if not has:
        return None
    if len(has) == 1:
        other = "inference_gpu_ids" if has[0] == "trainer_gpu_ids" else "trainer_gpu_ids"
        raise _refuse(
            has[0],
            config[has[0]],
            f"but not {other}; set both for dedicated GPUs (as ART requires) or neither for shared GPUs",
        )
    lists: list[tuple[int, ...]] = []
    for name in has:
        value = config[name]
        if not isinstance(value, (list, tuple)) or not value:
            raise _refuse(name, value, "which must be a non-empty list of CUDA device indices, e.g. [0]")
        ids: list[int] = []
        for entry in value:
            if isinstance(entry, bool) or not isinstance(entry, int) or entry < 0:
                raise _refuse(
                    name, value, f"whose entry {entry!r} is not a CUDA device index (a whole number >= 0)"
                )
            if entry in ids:
                raise _refuse(name, value, f"which lists GPU {entry} twice; list each GPU once")
            ids.append(entry)
        lists.append(tuple(ids))
    trainer, inference = lists
    shared = sorted(set(trainer) & set(inference))
    if shared:
        raise _refuse(
            "inference_gpu_ids",
            list(inference),
            f"which shares GPU {shared[0]} with trainer_gpu_ids={list(trainer)}; dedicated GPUs must not "
            "overlap (leave both out to share all GPUs, inference asleep while training)",
        )
    return trainer, inference


def _slices(facts: HostFacts, whole: GpuInfo) -> list[GpuInfo]:
    return [gpu for gpu in facts.gpus if gpu.parent_uuid == whole.uuid]


def visible_gpus(facts: HostFacts) -> tuple[GpuId, ...]:
    """The devices CUDA programs started on this host can use, as `HostSpec.gpu_ids` names them.

    Without CUDA_VISIBLE_DEVICES: every whole GPU by its NVML index, and each GPU in MIG mode as
    its MIG slices' UUIDs. With it: its entries, in its order (an index, a `GPU-` or a `MIG-`
    UUID); an empty value hides every GPU. On a host with two GPU models whose
    CUDA_DEVICE_ORDER is not PCI_BUS_ID, whole GPUs are named by UUID (NVML's index order and
    CUDA's differ there).

    Raises:
        TopologyError: CUDA_VISIBLE_DEVICES names a device the host does not have, or a GPU in MIG
            mode by index (field "CUDA_VISIBLE_DEVICES").
    """
    wholes = [gpu for gpu in facts.gpus if gpu.parent_uuid is None]
    models = {gpu.name for gpu in wholes}
    by_uuid = len(models) > 1 and facts.env.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID"
    visible = facts.env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        devices: list[GpuId] = []
        for gpu in wholes:
            if gpu.mig_mode:
                devices += [mig.uuid for mig in _slices(facts, gpu)]
            else:
                devices.append(gpu.uuid if by_uuid else gpu.index)
        return tuple(devices)
    shown = ", ".join(f"{gpu.index} ({gpu.uuid})" for gpu in wholes) or "none"
    devices = []
    for entry in (part.strip() for part in visible.split(",")):
        if not entry:
            continue
        if entry.isdigit():
            found = [gpu for gpu in wholes if gpu.index == int(entry)]
        else:
            found = [gpu for gpu in facts.gpus if gpu.uuid == entry]
        if not found:
            raise TopologyError(
                f"CUDA_VISIBLE_DEVICES={visible!r} names {entry!r}, which is not a GPU of this host "
                f"(NVML lists: {shown}{'; ' + facts.nvml_error if facts.nvml_error else ''}); name its "
                "GPUs by index or by UUID as nvidia-smi -L prints them, or unset it",
                "CUDA_VISIBLE_DEVICES",
            )
        gpu = found[0]
        if gpu.parent_uuid is None and gpu.mig_mode:
            slices = ", ".join(mig.uuid for mig in _slices(facts, gpu)) or "none are configured"
            raise TopologyError(
                f"CUDA_VISIBLE_DEVICES={visible!r} names GPU {entry!r}, which is in MIG mode, so CUDA runs "
                f"nothing on it whole; name its MIG slices ({slices}) instead",
                "CUDA_VISIBLE_DEVICES",
            )
        devices.append(int(entry) if entry.isdigit() else entry)
    return tuple(devices)


def local_plan(
    facts: HostFacts,
    config: Mapping[str, Any] | None,
    *,
    artifact_root: str,
    cache_root: str,
    vllm_python: str,
    master_port: int | None = None,
    api_port: int | None = None,
    startup_timeout_s: float = 900.0,
) -> LocalPlan:
    """The topology and engine settings `LocalBackend()` uses on the host `facts` describes.

    `config` is the model's `InternalModelConfig` (None or {}: ART's defaults). The host is
    "local" on loopback (its agent on a free port), with 2 CPU slots; the trainer's rendezvous
    is `master_port` and the first replica serves on `api_port`. A port left None is a free one
    on 127.0.0.1 (`agent.ports.free_port`, never one this process handed out before), so two
    local runs on one machine do not meet on a fixed default; a port given is used as given
    (a replica refuses to start when it is taken: `inference.replica.check_port_free`).

    Raises:
        HyperParameterError: a bad GPU id list (see `gpu_ids_of`), a GPU id CUDA cannot use on this
            host, GPU ids or tensor_parallel_size > 1 without a GPU, inference GPUs that do not
            divide into replicas of tensor_parallel_size, enable_sleep_mode contrary to the mode
            (True with dedicated GPUs or without GPU, False with shared GPUs), or an `init_args` /
            `engine_args` key or value art-mega does not implement (`engine_settings`).
        TopologyError: CUDA_VISIBLE_DEVICES names a device the host lacks (`visible_gpus`).
    """
    config = config or {}
    settings = engine_settings(config)
    chosen = gpu_ids_of(config)
    master_port = free_port() if master_port is None else master_port
    api_port = free_port() if api_port is None else api_port
    devices = visible_gpus(facts)
    tp = settings.tensor_parallel_size
    if not devices:
        mode: Mode = "cpu"
        if chosen is not None:
            why = facts.nvml_error or "NVML lists none"
            raise _refuse(
                "trainer_gpu_ids",
                list(chosen[0]),
                f"but this host has no GPU CUDA can use ({why}); leave trainer_gpu_ids and "
                "inference_gpu_ids out to train on CPU",
            )
        if tp != 1:
            raise _refuse(
                "engine_args.tensor_parallel_size",
                tp,
                "but this host has no GPU; a CPU replica is one process, so use 1",
            )
        if settings.enable_sleep_mode:
            raise _refuse(
                "engine_args.enable_sleep_mode",
                True,
                "but this host has no GPU, and a CPU replica cannot sleep; leave it out",
            )
        topology = cpu_topology(
            artifact_root, cache_root, vllm_python, master_port, api_port, startup_timeout_s
        )
        return LocalPlan(
            topology=topology,
            mode=mode,
            max_seq_length=settings.max_seq_length,
            max_model_len=settings.max_model_len,
            gpu_memory_utilization=settings.gpu_memory_utilization,
        )
    if chosen is None:
        mode = "shared"
        if settings.enable_sleep_mode is False:
            raise _refuse(
                "engine_args.enable_sleep_mode",
                False,
                "but without trainer_gpu_ids/inference_gpu_ids vLLM shares the trainer's GPUs and must "
                "sleep while it trains; set both GPU id lists for dedicated GPUs, or leave it out",
            )
        if tp > len(devices):
            raise _refuse(
                "engine_args.tensor_parallel_size",
                tp,
                f"but CUDA sees {len(devices)} GPU(s) here ({_listed(devices)}); use at most {len(devices)}",
            )
        host_gpus = devices
        trainer = TrainerSpec(master_port=master_port)
        inference = InferenceSpec(replicas=1, tp=tp, api_port=api_port, shared_gpus=True, python=vllm_python)
    else:
        mode = "dedicated"
        trainer_ids, inference_ids = chosen
        usable = [device for device in devices if isinstance(device, int)]
        for name, ids in (("trainer_gpu_ids", trainer_ids), ("inference_gpu_ids", inference_ids)):
            for gpu in ids:
                if gpu not in usable:
                    raise _refuse(
                        name,
                        list(ids),
                        f"but GPU {gpu} is not one CUDA can use here by index (usable: {_listed(usable)}; "
                        f"CUDA_VISIBLE_DEVICES={facts.env.get('CUDA_VISIBLE_DEVICES')!r}); name GPUs from that list",
                    )
        if settings.enable_sleep_mode:
            raise _refuse(
                "engine_args.enable_sleep_mode",
                True,
                "which is incompatible with dedicated GPUs (as in ART): vLLM sleeps only when it shares the "
                "trainer's GPUs; leave it out",
            )
        if len(inference_ids) % tp:
            raise _refuse(
                "engine_args.tensor_parallel_size",
                tp,
                f"which does not divide the {len(inference_ids)} GPU(s) of inference_gpu_ids="
                f"{list(inference_ids)}; each replica takes tensor_parallel_size of them, so choose a divisor",
            )
        host_gpus = tuple(sorted((*trainer_ids, *inference_ids)))
        trainer = TrainerSpec(gpu_ids=trainer_ids, master_port=master_port)
        inference = InferenceSpec(
            replicas=len(inference_ids) // tp,
            tp=tp,
            gpu_ids=inference_ids,
            api_port=api_port,
            python=vllm_python,
        )
    return LocalPlan(
        topology=_compiled(host_gpus, trainer, inference, artifact_root, cache_root, startup_timeout_s),
        mode=mode,
        max_seq_length=settings.max_seq_length,
        max_model_len=settings.max_model_len,
        gpu_memory_utilization=settings.gpu_memory_utilization,
    )


def cpu_topology(
    artifact_root: str,
    cache_root: str,
    vllm_python: str,
    master_port: int,
    api_port: int,
    startup_timeout_s: float = 900.0,
) -> CompiledTopology:
    """art-mega's CPU layout: the loopback host "local" (2 CPU slots) with one CPU trainer rank
    (rendezvous on `master_port`) and one vLLM replica run by `vllm_python` on `api_port`."""
    return _compiled(
        (),
        TrainerSpec(cpu_ranks_per_host=1, master_port=master_port),
        InferenceSpec(replicas=1, api_port=api_port, python=vllm_python),
        artifact_root,
        cache_root,
        startup_timeout_s,
    )


def _compiled(
    gpu_ids: tuple[GpuId, ...],
    trainer: TrainerSpec,
    inference: InferenceSpec,
    artifact_root: str,
    cache_root: str,
    startup_timeout_s: float,
) -> CompiledTopology:
    host = HostSpec(
        host_id="local", node_rank=0, worker_address="tcp://127.0.0.1:0", cpu_slots=2, gpu_ids=gpu_ids
    )
    cluster = ClusterSpec(
        hosts=(host,),
        controller_host_id="local",
        artifact_root=artifact_root,
        cache_root=cache_root,
        startup_timeout_s=startup_timeout_s,
    )
    return compile_topology(cluster, trainer=trainer, inference=inference)


def _listed(devices: Any) -> str:
    return ", ".join(str(device) for device in devices) or "none"

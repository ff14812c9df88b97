"""Megatron's parallel state for one trainer rank, initialised from the compiled rank table.

gloo and the CPU compatibility layer on CPU ranks, NCCL on GPU ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from art_mega.errors import TopologyError
from art_mega.topology.compiled import TrainerRank
from art_mega.topology.trainer import TrainerSpec

_COORDINATES = ("tp_rank", "cp_rank", "dp_rank", "pp_rank", "ep_rank", "etp_rank", "expert_dp_rank")


@dataclass(frozen=True)
class ParallelState:
    """What a rank knows after `init_parallel`: its device, backend and place on every axis.

    `device` is "cpu" or "cuda:0" (a GPU rank sees only its own GPU through
    CUDA_VISIBLE_DEVICES); `backend` is "gloo" or "nccl". Sizes and coordinates follow
    `TrainerRank` and megatron-core's "tp-cp-ep-dp-pp" order.
    """

    rank: int
    world_size: int
    device: str
    backend: str
    tp: int
    cp: int
    ep: int
    etp: int
    pp: int
    dp: int
    tp_rank: int
    cp_rank: int
    dp_rank: int
    pp_rank: int
    ep_rank: int
    etp_rank: int
    expert_dp_rank: int
    recompute: str = "none"
    recompute_modules: tuple[str, ...] = ("core_attn",)
    recompute_layers: int | None = None
    """The trainer's activation recomputation (`TrainerSpec.recompute*`), for the model build."""


def _check_supported(trainer: TrainerSpec) -> None:
    """`compile_topology` refuses these first; a rank given a spec compiled elsewhere refuses again."""
    refused = trainer.unsupported()
    if refused is not None:
        raise TopologyError(refused[1], refused[0])


def _megatron_coordinates() -> dict[str, int]:
    from megatron.core import parallel_state as mpu

    return {
        "tp_rank": mpu.get_tensor_model_parallel_rank(),
        "cp_rank": mpu.get_context_parallel_rank(),
        "dp_rank": mpu.get_data_parallel_rank(),
        "pp_rank": mpu.get_pipeline_model_parallel_rank(),
        "ep_rank": mpu.get_expert_model_parallel_rank(),
        "etp_rank": mpu.get_expert_tensor_parallel_rank(),
        "expert_dp_rank": mpu.get_expert_data_parallel_rank(),
    }


def init_parallel(
    rank: TrainerRank,
    trainer: TrainerSpec,
    world_size: int,
    *,
    master_addr: str,
    master_port: int | None = None,
    seed: int = 0,
    timeout_s: float = 600.0,
) -> ParallelState:
    """Join the trainer world as `rank` and initialise megatron-core's process groups and seeds.

    `rank` is this process's row of `CompiledTopology.trainer_ranks`, `trainer` the spec it was
    compiled from, `world_size` the number of trainer ranks. The rendezvous is
    `tcp://master_addr:master_port` (default port: `trainer.master_port`); every rank must call
    this within `timeout_s` seconds. A CPU rank (`gpu_id` None) gets the CPU compatibility
    layer, gloo and the CPU; a GPU rank NCCL and cuda:0. Megatron's data-parallel, tensor-
    and model-parallel RNG states are seeded from `seed` (`model_parallel_cuda_manual_seed`).

    Raises `TopologyError` for sizes the trainer cannot run (`TrainerSpec.unsupported`), `ValueError` when neither
    `master_port` nor `trainer.master_port` gives a port, and `RuntimeError` when the coordinates megatron-core derives differ from the rank table's
    (the table and megatron's RankGenerator disagree: a bug, not a user error).
    """
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel

    on_cpu = rank.gpu_id is None
    _check_supported(trainer)
    if on_cpu:
        from art_mega.trainer.rank.cpu_compat import apply_cpu_compat

        apply_cpu_compat()
        device, backend = "cpu", "gloo"
    else:
        torch.cuda.set_device(0)
        device, backend = "cuda:0", "nccl"
    port = master_port if master_port is not None else trainer.master_port
    if port is None:
        raise ValueError("init_parallel needs a master_port: the argument or trainer.master_port")
    dist.init_process_group(
        backend,
        init_method=f"tcp://{master_addr}:{port}",
        rank=rank.rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=trainer.tp,
        pipeline_model_parallel_size=trainer.pp,
        context_parallel_size=trainer.cp,
        expert_model_parallel_size=trainer.ep,
        expert_tensor_parallel_size=trainer.etp,
        distributed_timeout_minutes=max(1, round(timeout_s / 60)),
    )
    coordinates = _megatron_coordinates()
    expected = {name: getattr(rank, name) for name in _COORDINATES}
    if coordinates != expected:
        raise RuntimeError(
            f"megatron-core placed rank {rank.rank} at {coordinates} but the rank table says {expected}"
        )
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return ParallelState(
        rank=rank.rank,
        world_size=world_size,
        device=device,
        backend=backend,
        tp=trainer.tp,
        cp=trainer.cp,
        ep=trainer.ep,
        etp=trainer.etp,
        pp=trainer.pp,
        dp=mpu.get_data_parallel_world_size(),
        **coordinates,
        recompute=trainer.recompute,
        recompute_modules=trainer.recompute_modules,
        recompute_layers=trainer.recompute_layers,
    )


def destroy_parallel() -> None:
    """Tear down megatron-core's groups and the default process group (no-op if not initialised)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    mpu.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()

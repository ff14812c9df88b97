"""`art-mega plan`'s side of the memory plan: a layout on a stated GPU inventory, without any host
or process (`StatedLayout`, read by `memory_plan.plan_memory` as it reads a `CompiledTopology`), the
GPU names it takes (`GPU_MEMORY_MIB`) and every trainer layout that fits them (`layouts_that_fit`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from art_mega.trainer.prepare.memory_plan import rank_terms
from art_mega.trainer.prepare.model_shape import ModelShape, _Plan

GPU_MEMORY_MIB = {
    "H100-80GB": 81_559,
    "H100-94GB": 95_830,
    "H200-141GB": 143_771,
    "B200-180GB": 183_359,
    "A100-80GB": 81_920,
    "A100-40GB": 40_960,
    "L40S-48GB": 46_068,
    "A10G-24GB": 23_028,
    "L4-24GB": 23_034,
    "RTX4090-24GB": 24_564,
}
"""Total memory NVML reports (`nvmlDeviceGetMemoryInfo().total`, MiB) for each GPU name
`art-mega plan --gpu` takes: the figures `nvidia-smi` prints on these boards (NVIDIA's datasheets
give the marketed GB: 80 GB HBM3 is 81,559 MiB on an H100 SXM)."""


class _Rank(_Plan):
    rank: int
    host_id: str
    gpu_id: int | str | None
    pp_rank: int = 0


class _Replica(_Plan):
    name: str = "vllm"
    index: int
    host_ids: tuple[str, ...]
    gpu_ids: tuple[tuple[str, tuple[int | str, ...]], ...]
    shared_gpus: bool


class _Trainer(_Plan):
    tp: int
    cp: int
    ep: int
    pp: int = 1
    recompute: str = "none"
    recompute_modules: tuple[str, ...] = ("core_attn",)
    recompute_layers: int | None = None


class StatedLayout(_Plan):
    """A layout on `hosts` x `gpus` GPUs that `plan_memory` reads as it reads a
    `CompiledTopology` (its `trainer`, `trainer_ranks` and `replicas`): `replicas` vLLM replicas
    of `replica_tp` GPUs each on the first GPUs of host0 (`shared_gpus`: beside trainer ranks,
    which then take every GPU; else on their own GPUs, the trainer on the rest), trainer ranks
    numbered host by host, GPU by GPU; `gpus` 0: CPU ranks, one a host."""

    trainer: _Trainer
    trainer_ranks: tuple[_Rank, ...]
    replicas: tuple[_Replica, ...]

    @classmethod
    def build(
        cls,
        *,
        hosts: int,
        gpus: int,
        tp: int,
        cp: int,
        ep: int,
        replicas: int,
        replica_tp: int,
        shared_gpus: bool,
        pp: int = 1,
        recompute: str = "none",
    ) -> StatedLayout:
        """Raises `UserError` (one sentence) for a layout that cannot be placed: replicas that
        need more GPUs than host0 has, no GPU left for the trainer, or a trainer world that
        tp x cp (and ep) does not divide."""
        from art_mega.errors import UserError

        host_ids = [f"host{i}" for i in range(hosts)]
        replica_gpus = replicas * replica_tp if gpus else 0
        if gpus and replica_gpus > gpus:
            raise UserError(
                f"--replicas {replicas} x --inference-tp {replica_tp} needs {replica_gpus} GPUs on host0, "
                f"which has {gpus} (--gpus); use fewer replicas or a smaller --inference-tp"
            )
        taken = 0 if shared_gpus or not gpus else replica_gpus
        slots = [
            (host, gpu if gpus else None)
            for i, host in enumerate(host_ids)
            for gpu in (range(taken if i == 0 else 0, gpus) if gpus else (None,))
        ]
        world = len(slots)
        if world == 0:
            raise UserError(
                f"the replicas take all {gpus} GPUs of host0 and --hosts 1 leaves the trainer none; "
                "pass --shared-gpus, --hosts 2 or fewer --replicas"
            )
        if world % (tp * cp * pp) or (world // (cp * pp)) % ep:
            less = ", less the replicas' GPUs" if taken else ""
            raise UserError(
                f"trainer tp={tp} x cp={cp} x pp={pp} (ep={ep}) does not divide its {world} ranks "
                f"({hosts} host(s) x {gpus or 1} slot(s){less}); "
                "pick sizes that divide it, or --replicas and --inference-tp that leave the trainer a multiple of tp x cp GPUs, or --shared-gpus"
            )
        # megatron-core's "tp-cp-ep-dp-pp" order: the pipeline stage is the outermost coordinate
        ranks = tuple(
            _Rank(rank=i, host_id=h, gpu_id=g, pp_rank=i // (world // pp)) for i, (h, g) in enumerate(slots)
        )
        replica_specs = tuple(
            _Replica(
                index=i,
                host_ids=(host_ids[0],),
                gpu_ids=((host_ids[0], tuple(range(i * replica_tp, (i + 1) * replica_tp))),) if gpus else (),
                shared_gpus=shared_gpus,
            )
            for i in range(replicas)
        )
        return cls(
            trainer=_Trainer(tp=tp, cp=cp, ep=ep, pp=pp, recompute=recompute),
            trainer_ranks=ranks,
            replicas=replica_specs,
        )


def layouts_that_fit(
    shape: ModelShape,
    valid_tp: Sequence[int],
    *,
    world: int,
    gpus_per_host: int,
    gpu_bytes: int,
    **terms: Any,
) -> list[tuple[int, int, int, int, int]]:
    """(tp, ep, dp, pp, needed bytes) of every trainer layout of `world` GPU ranks whose ranks
    fit `gpu_bytes` (the largest pipeline stage's): tp among the model's `valid_tp` within one
    host (NVLink), pp dividing the layers and the ranks left, ep dividing the experts and the
    data-parallel ranks (MoE only), cp 1. `terms`: `rank_terms`'s keyword arguments but tp, ep,
    dp, pp and stage."""
    fits = []
    for tp in sorted(t for t in valid_tp if t <= max(gpus_per_host, 1) and world % t == 0):
        for pp in (
            p for p in range(1, world // tp + 1) if (world // tp) % p == 0 and shape.num_layers % p == 0
        ):
            dp = world // (tp * pp)
            eps = (
                [e for e in range(1, dp + 1) if dp % e == 0 and shape.num_experts % e == 0]
                if shape.num_experts
                else [1]
            )
            for ep in eps:
                needed = max(
                    sum(rank_terms(shape, tp=tp, ep=ep, dp=dp, pp=pp, stage=stage, **terms).values())
                    for stage in range(pp)
                )
                if needed <= gpu_bytes:
                    fits.append((tp, ep, dp, pp, needed))
    return fits

"""`art-mega plan`: the memory plan of a model on a stated layout, before anything starts.

From a model's config.json alone (a local folder, a name in art-mega's model cache, or a Hugging
Face repo id read from the HF cache, downloading only config.json where the network is allowed),
LoRA settings, the row length, the micro-batch, the trainer and inference layout and a GPU
inventory (`--gpu H100-80GB --gpus 8 --hosts 2`, `--gpu-memory-gib`, or this machine's GPUs as
NVML reports them), print what each trainer rank and each vLLM replica needs
(`trainer.prepare.memory_plan`'s formulas, their sources in its docstring) and every trainer layout of
the same GPUs that fits; a layout that does not fit is refused with one sentence
(`MemoryPlanError`, exit code 2) naming the process, the GiB needed and available, and the
layouts that would.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from art_mega.errors import BaseModelError, MemoryPlanError, UserError

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class PlanRequest:
    """What `art-mega plan` was asked (the CLI's options; sizes already checked >= 1)."""

    model: str
    hosts: int = 1
    gpus: int = 0
    gpu_bytes: int | None = None
    gpu_name: str | None = None
    tp: int = 1
    cp: int = 1
    ep: int = 1
    pp: int = 1
    recompute: str = "none"
    replicas: int = 1
    inference_tp: int = 1
    shared_gpus: bool = False
    lora_rank: int = 8
    seq_len: int = 4096
    micro_batch_rows: int = 1
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    dtype: str | None = None


def gpu_bytes_of(name: str) -> int:
    """Bytes of a GPU named as `stated_layout.GPU_MEMORY_MIB` names it (case-insensitive), or
    `NAME-<N>GB` for another board (N GiB).

    Raises:
        UserError: a name of neither form (names the known ones).
    """
    from art_mega.trainer.prepare.stated_layout import GPU_MEMORY_MIB

    known = {k.lower(): v for k, v in GPU_MEMORY_MIB.items()}
    if name.lower() in known:
        return known[name.lower()] << 20
    match = re.fullmatch(r"[A-Za-z0-9_]+-([0-9]{1,4})GB", name, re.I)
    if match and int(match[1]) > 0:
        return int(match[1]) << 30
    raise UserError(
        f"--gpu {name!r} is not a GPU art-mega knows; give one of {', '.join(GPU_MEMORY_MIB)}, "
        "a NAME-<GiB>GB such as RTX6000-48GB, or --gpu-memory-gib"
    )


def local_gpus() -> tuple[int, int | None, str | None]:
    """(count, bytes of the smallest, its name) of this machine's GPUs as NVML reports them
    (the preflight's host facts); (0, None, None) without NVML or GPUs."""
    try:
        import pynvml
    except ImportError:
        return 0, None, None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return 0, None, None
    try:
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        if not handles:
            return 0, None, None
        memory = [int(pynvml.nvmlDeviceGetMemoryInfo(h).total) for h in handles]
        name = pynvml.nvmlDeviceGetName(handles[memory.index(min(memory))])
        return len(handles), min(memory), name.decode() if isinstance(name, bytes) else str(name)
    finally:
        pynvml.nvmlShutdown()


def model_config_dir(model: str) -> Path:
    """The folder whose config.json describes `model`: a local folder, a name in art-mega's model
    cache (`resolve_base_model`), or a Hugging Face repo id whose config.json alone is taken from
    the HF cache (downloaded first where the network is allowed; HF_HUB_OFFLINE=1 reads only
    the cache).

    Raises:
        BaseModelError: none of these (one sentence naming what was tried).
    """
    path = Path(model).expanduser()
    if (path / "config.json").is_file():
        return path
    if _HUB_ID.match(model) and not path.exists():
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

        try:
            return Path(hf_hub_download(model, "config.json")).parent
        except (LocalEntryNotFoundError, HfHubHTTPError, OSError, ValueError) as exc:
            reason = " ".join(str(exc).split())[:160]
            raise BaseModelError(
                f"model {model!r}: its config.json is neither in the Hugging Face cache nor downloadable "
                f"({reason}); pass a local folder holding config.json",
                model,
            ) from None
    from art_mega.basemodels.resolve import resolve_base_model
    from art_mega.launch.context import default_cache_root

    return Path(resolve_base_model(model, default_cache_root()).model_dir)


def default_lora_targets(model_dir: Path) -> tuple[str, ...]:
    """The Megatron LoRA targets a backend without `lora_targets` trains on the model at
    `model_dir` (its family's default, ART's for that model: `LoraNames.default_targets`)."""
    from art_mega.trainer.families import lora_names_of
    from art_mega.trainer.hf_checkpoint import read_hf_config

    return lora_names_of(read_hf_config(model_dir)).default_targets


def plan_text(request: PlanRequest) -> str:
    """The plan `art-mega plan` prints for `request`.

    Raises:
        MemoryPlanError: a trainer rank or a replica of the stated layout does not fit its GPUs.
        UserError: a model config art-mega cannot read, a layout that cannot be placed or that
            the model does not allow (tp its heads do not divide, ep its experts do not).
    """
    from art_mega.trainer.prepare import memory_plan as mp
    from art_mega.trainer.prepare import stated_layout

    model_dir = model_config_dir(request.model)
    shape, valid_tp = mp.ModelShape.from_model_dir(model_dir)
    targets = default_lora_targets(model_dir)
    if request.tp not in valid_tp:
        raise UserError(
            f"--tp {request.tp} does not divide {request.model}'s heads evenly; the model allows tp "
            f"{', '.join(map(str, valid_tp))}"
        )
    if shape.num_experts and shape.num_experts % request.ep:
        raise UserError(f"--ep {request.ep} does not divide {request.model}'s {shape.num_experts} experts")
    if not shape.num_experts and request.ep != 1:
        raise UserError(f"--ep {request.ep} needs an MoE model; {request.model} is dense, use --ep 1")
    if shape.num_layers % request.pp:
        raise UserError(
            f"--pp {request.pp} does not divide {request.model}'s {shape.num_layers} layers into equal stages"
        )
    if request.recompute not in ("none", "selective", "full"):
        raise UserError(f"--recompute {request.recompute!r} is not one of none, selective, full")
    gpus, gpu_bytes, gpu_name = request.gpus, request.gpu_bytes, request.gpu_name
    if gpu_bytes is None and gpus == 0:
        gpus, gpu_bytes, gpu_name = local_gpus()
    if gpu_bytes is not None and gpus == 0:
        gpus = 1
    on_gpu = gpu_bytes is not None
    dtype = request.dtype or ("bfloat16" if on_gpu else "float32")
    max_model_len = request.max_model_len or request.seq_len
    layout = stated_layout.StatedLayout.build(
        hosts=request.hosts,
        gpus=gpus if on_gpu else 0,
        tp=request.tp,
        cp=request.cp,
        ep=request.ep,
        replicas=request.replicas,
        replica_tp=request.inference_tp,
        shared_gpus=request.shared_gpus,
        pp=request.pp,
        recompute=request.recompute,
    )
    memory = {
        (host, gpu): gpu_bytes
        for host, gpu in [(r.host_id, r.gpu_id) for r in layout.trainer_ranks]
        + [(h, g) for replica in layout.replicas for h, ids in replica.gpu_ids for g in ids]
        if gpu is not None and gpu_bytes is not None
    }
    plan = mp.plan_memory(
        shape,
        layout,
        memory,
        model=request.model,
        trainer_dtype=dtype,
        replica_dtype=dtype,
        lora_rank=request.lora_rank,
        lora_targets=targets,
        row_tokens=request.seq_len,
        seq_len=request.seq_len,
        micro_batch_rows=request.micro_batch_rows,
        max_model_len=max_model_len,
        gpu_memory_utilization=request.gpu_memory_utilization,
    )
    rank = max(plan.ranks, key=lambda r: r.needed_bytes)
    stage = layout.trainer_ranks[rank.rank].pp_rank
    activations = {
        setting: mp.activation_bytes(
            shape,
            tp=plan.tp,
            cp=plan.cp,
            pp=request.pp,
            stage=stage,
            dtype=dtype,
            lora_rank=request.lora_rank,
            lora_targets=targets,
            row_tokens=request.seq_len,
            micro_batch_rows=request.micro_batch_rows,
            recompute=setting,
        )
        for setting in ("none", "selective", "full")
    }
    where = (
        f"{request.hosts} host(s) x {gpus} {gpu_name or 'GPU'} ({mp._gib(gpu_bytes)} GiB)"
        if on_gpu
        else f"{request.hosts} CPU host(s)"
    )
    g = mp._gib
    lines = [
        f"model {request.model}: {shape.model_type}, {shape.parameters() / 1e9:.2f}B parameters, "
        f"{shape.num_layers} layers, hidden {shape.hidden_size}"
        + (f", {shape.num_experts} experts (top {shape.top_k})" if shape.num_experts else ""),
        f"layout: {plan.layout}, {len(plan.ranks)} trainer rank(s) and {len(plan.replicas)} replica(s)"
        + (f" of {request.inference_tp} GPU(s)" if on_gpu else "")
        + (" sharing the ranks' GPUs" if request.shared_gpus and on_gpu else "")
        + f" on {where}",
        f"trainer rank {rank.rank}"
        + (f" (pipeline stage {stage} of {request.pp})" if request.pp > 1 else "")
        + f" ({dtype}, LoRA rank {request.lora_rank}, {request.micro_batch_rows} x "
        f"{request.seq_len}-token rows), GiB:",
        f"  weights                           {g(rank.weights_bytes):>8}",
        f"  LoRA + grads + Adam               {g(rank.lora_bytes + rank.lora_grad_bytes + rank.optimizer_bytes):>8}"
        f"   ({plan.lora_parameters:,} LoRA parameters, optimizer"
        f"{' sharded over dp=' + str(plan.dp) if plan.distributed_optimizer else ' whole'})",
        *(
            f"  activations, {label:<20} {g(activations[setting]):>8}"
            + ("   (what the trainer runs: --recompute)" if setting == plan.recompute else "")
            for setting, label in (
                ("none", "no recomputation"),
                ("selective", "selective recompute"),
                ("full", "full recomputation"),
            )
        ),
        f"  logits                            {g(rank.logits_bytes):>8}",
        f"  reserve                           {g(rank.reserve_bytes):>8}",
        f"  total                             {g(rank.needed_bytes):>8}   of "
        + (f"{g(rank.available_bytes)} GiB" if rank.available_bytes else "CPU memory"),
    ]
    if plan.replicas:
        replica = plan.replicas[0]
        lines += [
            f"vLLM replica ({f'{replica.gpus} GPU(s)' if replica.gpus else 'CPU'}, {dtype}, max_model_len {max_model_len}), GiB:",
            f"  weights                           {g(replica.weights_bytes):>8}"
            + ("   (experts in MXFP4)" if shape.mxfp4_experts else ""),
            f"  LoRA slots                        {g(replica.lora_slot_bytes):>8}",
            f"  KV cache, one full sequence       {g(replica.kv_min_bytes):>8}",
            f"  reserve                           {g(replica.reserve_bytes):>8}",
            f"  total                             {g(replica.needed_bytes):>8}   of "
            + (
                f"{g(replica.available_bytes)} GiB at gpu_memory_utilization {plan.gpu_memory_utilization:g}, "
                f"KV cache {g(replica.kv_cache_bytes)} GiB "
                f"(~{(replica.kv_cache_bytes or 0) // max(shape.kv_bytes_per_token(mp.DTYPE_BYTES[dtype]), 1):,} tokens)"
                if replica.available_bytes is not None
                else "CPU memory"
            ),
        ]
    fits: list[tuple[int, int, int, int, int]] = []
    if on_gpu and gpu_bytes is not None:
        fits = stated_layout.layouts_that_fit(
            shape,
            valid_tp,
            world=len(plan.ranks),
            gpus_per_host=gpus,
            gpu_bytes=gpu_bytes,
            cp=1,
            dtype=dtype,
            lora_rank=request.lora_rank,
            lora_targets=targets,
            row_tokens=request.seq_len,
            micro_batch_rows=request.micro_batch_rows,
            recompute=request.recompute,
        )
        if request.shared_gpus and plan.replicas:
            fits = _beside_replicas(fits, shape, gpu_bytes, request, dtype, targets)
        lines.append(
            f"trainer layouts of these {len(plan.ranks)} GPU(s) that fit: "
            + (", ".join(_layout(tp, ep, dp, pp) + f" ({g(n)} GiB)" for tp, ep, dp, pp, n in fits) or "none")
        )
    try:
        mp.check_plan(plan, shape, valid_tp)
    except MemoryPlanError as exc:
        if exc.process.startswith("replica"):
            alternatives = (
                ", ".join(_replica_tps_that_fit(plan, shape, gpus)) or "no --inference-tp on these GPUs"
            )
        else:
            alternatives = (
                ", ".join(_layout(tp, ep, dp, pp) for tp, ep, dp, pp, _ in fits) or "none on these GPUs"
            )
        raise MemoryPlanError(
            f"{request.model}: {exc.process} does not fit: it needs {g(exc.needed_bytes)} GiB and has {g(exc.available_bytes)} GiB "
            f"at {plan.layout}; layouts that fit: {alternatives}",
            exc.model,
            exc.process,
            exc.host_id,
            exc.needed_bytes,
            exc.available_bytes,
        ) from None
    return "\n".join(lines)


def _beside_replicas(
    fits: list[tuple[int, int, int, int, int]],
    shape: Any,
    gpu_bytes: int,
    request: PlanRequest,
    dtype: str,
    targets: tuple[str, ...],
) -> list[tuple[int, int, int, int, int]]:
    """The layouts of `fits` whose ranks also leave a replica on their GPU (`--shared-gpus`) its
    gpu_memory_utilization share: what the largest pipeline stage's rank holds between steps
    (weights, LoRA with its gradient and Adam, reserve: `TrainerRankMemory.resident_bytes`) within
    gpu_bytes minus that share, as `memory_plan.check_plan` requires of a shared-GPU rank."""
    from art_mega.trainer.prepare import memory_plan as mp

    left = gpu_bytes - int(gpu_bytes * request.gpu_memory_utilization)
    kept = []
    for tp, ep, dp, pp, needed in fits:
        resident = 0
        for stage in range(pp):
            terms = mp.rank_terms(
                shape,
                tp=tp,
                ep=ep,
                dp=dp,
                pp=pp,
                stage=stage,
                dtype=dtype,
                lora_rank=request.lora_rank,
                lora_targets=targets,
                row_tokens=request.seq_len,
                micro_batch_rows=request.micro_batch_rows,
            )
            resident = max(
                resident, sum(terms[k] for k in ("weights", "lora", "lora_grad", "optimizer", "reserve"))
            )
        if resident <= left:
            kept.append((tp, ep, dp, pp, needed))
    return kept


def _replica_tps_that_fit(plan: Any, shape: Any, gpus: int) -> list[str]:
    """`--inference-tp T` for each T (a power of two within one host) whose replica fits: the
    same weights, LoRA slots and full-length KV cache over T GPUs at the plan's utilization."""
    replica = plan.replicas[0]
    per_gpu = (replica.available_bytes or 0) / max(replica.gpus, 1)
    out = []
    t = 1
    while t <= gpus:
        needed = (
            replica.needed_bytes - replica.reserve_bytes + replica.reserve_bytes // max(replica.gpus, 1) * t
        )
        if t != replica.gpus and needed <= per_gpu * t:
            out.append(f"--inference-tp {t}")
        t *= 2
    return out


def _layout(tp: int, ep: int, dp: int, pp: int = 1) -> str:
    return (
        f"--tp {tp}" + (f" --pp {pp}" if pp > 1 else "") + (f" --ep {ep}" if ep > 1 else "") + f" (dp={dp})"
    )


def request_of(**options: Any) -> PlanRequest:
    """A `PlanRequest` from the CLI's options, `gpu`/`gpu_memory_gib` turned into bytes.

    Raises:
        UserError: both --gpu and --gpu-memory-gib, or a GPU name `gpu_bytes_of` refuses.
    """
    gpu, gib = options.pop("gpu"), options.pop("gpu_memory_gib")
    if gpu is not None and gib is not None:
        raise UserError("--gpu and --gpu-memory-gib both name the GPU's memory; pass one")
    if gpu is not None:
        options.update(gpu_bytes=gpu_bytes_of(gpu), gpu_name=gpu)
    elif gib is not None:
        options.update(gpu_bytes=int(gib * (1 << 30)), gpu_name=f"{gib:g}-GiB GPU")
    if options.get("gpu_bytes") is not None and options.get("gpus") == 0:
        options["gpus"] = 8 if gpu is not None else 1
    return PlanRequest(**options)

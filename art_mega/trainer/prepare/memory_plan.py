"""The memory plan: bytes each trainer rank and each vLLM replica needs, from config.json alone,
checked against each GPU's memory (NVML, `preflight.protocol.GpuInfo.memory_bytes`) by
`MegatronBackend.register` before any rank or replica starts.

Torch-free: parameter counts are analytic from the family's architecture arguments
(`families.*.model_args`), equal to what megatron-core builds on the meta device and to the
published counts (`tests/unit/trainer/test_memory_plan.py` checks them against
`tests/trainer/test_real_size_mapping.py`'s figures).

A trainer rank (TP size t, CP size c, EP size e, DP size d, PP size pp; parameter bytes w: 2 for bfloat16, 4 for
float32; one micro-batch of b packed rows of s tokens; L layers, hidden h, heads a of width k, g KV
heads, FFN f, E experts of FFN i with top_k routed per token, LoRA rank r):

- weights: the frozen base model's parameters on the rank x w. Megatron splits attention, the dense
  MLP and the (padded) vocabulary t ways, experts e ways (whole experts), and keeps the norms and the
  router whole (Shoeybi et al. 2019, "Megatron-LM", section 3; megatron-core's layer shapes, as
  `FamilySpec.megatron_state_dict` maps them). Pipeline stage p of pp holds L/pp layers, the
  embedding if first, the final norm and LM head if last (with tied embeddings its own copy at
  pp > 1: `ModelShape.stage_parameters`); LoRA, its gradient and Adam scale with its layers.
- LoRA: r x (in + out) per wrapped linear, the sharded factor split t ways (`trainer/rank/lora.py`'s
  docstring), times w; its gradient in float32 (DDP's `grad_reduce_in_fp32` buffer, 4 bytes); Adam's
  two float32 moments (8 bytes) plus a float32 master copy where the parameters are bfloat16
  (4 bytes): 18 bytes a parameter in bfloat16, 16 in float32, the optimizer's part divided by d
  under the distributed optimizer (ZeRO stage 1: Rajbhandari et al. 2020, "ZeRO", section 3, K = 12
  for mixed-precision Adam; Megatron's `theoretical_memory_usage.py`: 18 bytes, or 6 + 12/d).
- activations (`activation_bytes`): what autograd keeps at the step's peak, counted from this
  trainer's graph (a `saved_tensors_hooks` census of SmolLM2's layer, benchmarks/RESULTS.md) in the
  manner of Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models", section 4 (Megatron's own estimate `compute_activation_memory` is sbh(18 + 4f/h)
  bytes): per token a layer the two norms' inputs, 1/rms and outputs (4h + 2, the h terms split
  t ways under sequence parallelism, which the MoE family uses at t > 1), RoPE's cos and sin
  (4k), the SDPA's q, repeated keys and values, output and log-sum-exp ((4ak + a)/t), Qwen3's
  q/k-norm inputs ((a + g)k/t), the MLP's fc1 output, SwiGLU halves and product (5f/t; an MoE
  layer: top_k x (h + 5i) plus E router logits, and a shared expert's 5 x its width) and r per
  LoRA-wrapped linear (its x A^T); per row a softmax-attention layer the SDPA's additive mask
  (s x s/c in w bytes: PyTorch turns the boolean packed-row mask into one and keeps it), or the
  scores explicit attention keeps (GPT-OSS's sinks; MLA on CPU: `ModelShape.scores_bytes`, whose
  transient joins the peak where the logits' does not cover it); the final norm's input (h + 1 a
  token) on the last stage, less what the first layer, whose input needs no gradient, does not
  keep (`ModelShape.first_layer_unkept_elements`: the census of benchmarks/RESULTS.md). Times
  s/c x b x L/pp, times the micro-batches a pipeline stage holds under 1F1B (pp - stage: Narayanan
  et al. 2021, section 2.2.1). Recomputation (`TrainerSpec.recompute`): "selective" drops its
  modules' terms ("core_attn" keeps the checkpoint's q, k, v; "mlp" the norm output only), "full"
  keeps each recomputed layer's input (h) plus one layer rebuilt in the backward (Korthikanti
  et al., section 5).
- logits (`logits_bytes`, the last stage): the LM head's output [b, s/c, V/t] in w bytes (every
  position in the worst case) and the entropy's working set on it (`logprobs.token_entropy`: 21
  bytes an element, plus a float32 copy of 16-bit logits; Gemma 4's logit cap keeps its tanh, w
  bytes more), which is above the cross entropy's
  (megatron-core's works in place on float32 logits), planned unchunked: with
  `logprob_calculation_chunk_size` both run over chunks of positions and the plan is an upper bound.
- checked against CPU ranks (`benchmarks/memory_plan.py`): torch's own accounting of the tensors
  a rank allocates (the profiler's allocator events), which is what `torch.cuda.max_memory_allocated`
  counts on a GPU; the CPU allocator's slack (glibc keeps freed blocks: resident-set growth is
  2-3x the tensors on the tiny models) is not planned, as the GPU caching allocator's is in
  `TRAINER_RESERVE_BYTES`.
- reserve: `TRAINER_RESERVE_BYTES` for the CUDA context, NCCL buffers and the allocator's slack.

A replica (TP x PP GPUs of one replica, dtype bytes w'): its weights (the whole model x w' across its
GPUs), vLLM's LoRA slots (`max_loras` adapters of `max_lora_rank` on every LoRA-able linear,
preallocated), the KV cache one sequence of `max_model_len` tokens needs
(2 x L x g x k x w' a token: vLLM refuses to start when its cache holds less) and
`REPLICA_ACTIVATION_RESERVE_BYTES` a GPU for vLLM's profile run, against `gpu_memory_utilization` x
the smallest of its GPUs x their count (vLLM sizes its cache from that budget: `Worker.
determine_available_memory`); what is left over is the KV cache the replica gets.

These are estimates from the formulas above, not measurements: they are refused on only where the
smallest trainable row (`PACKED_ROW_TOKENS`, or the fixed rows of `MegatronBackend(seq_len=)`) or one
full-length sequence of a replica does not fit; a longer row limit than fits is one logged line.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from art_mega.errors import MemoryPlanError
from art_mega.trainer.prepare.model_shape import _LORA_TARGETS, ModelShape, _Plan

GIB = 1 << 30
TRAINER_RESERVE_BYTES = GIB
"""A GPU rank's memory beside its tensors: the CUDA context, NCCL's buffers, the caching
allocator's fragmentation (an estimate; a CPU rank's plan counts it too)."""
REPLICA_ACTIVATION_RESERVE_BYTES = GIB
"""What a GPU replica keeps a GPU for vLLM's profile-run activations (an estimate, as
`MegatronBackend._gpu_kv_bytes` sizes the default context)."""
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes of one element of each parameter dtype the trainer and vLLM use."""
PLAN_FILE = "memory_plan.json"
"""The plan in a run folder (`write_plan`; this module is its one owner)."""


class RankMemory(_Plan):
    """Bytes one trainer rank needs (see the module docstring for each term); `available_bytes`
    its GPU's memory (None on a CPU rank); `max_row_tokens` the longest packed row whose
    micro-batch fits (None on a CPU rank)."""

    rank: int
    host_id: str
    gpu_id: int | str | None
    weights_bytes: int
    lora_bytes: int
    lora_grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    logits_bytes: int
    reserve_bytes: int
    needed_bytes: int
    available_bytes: int | None
    shared_with_replica: bool = False
    max_row_tokens: int | None = None

    @property
    def resident_bytes(self) -> int:
        """What the rank holds between steps: weights, LoRA with its gradient and Adam, reserve."""
        return (
            self.weights_bytes
            + self.lora_bytes
            + self.lora_grad_bytes
            + self.optimizer_bytes
            + self.reserve_bytes
        )


class ReplicaMemory(_Plan):
    """Bytes one vLLM replica needs over its GPUs; `available_bytes` is gpu_memory_utilization x
    its smallest GPU x its GPU count (None on CPU), `kv_cache_bytes` what is left of it for the KV
    cache (None on CPU)."""

    name: str
    index: int
    host_id: str
    gpus: int
    weights_bytes: int
    lora_slot_bytes: int
    kv_min_bytes: int
    reserve_bytes: int
    needed_bytes: int
    available_bytes: int | None
    kv_cache_bytes: int | None


class MemoryPlan(_Plan):
    """A run's memory plan: the layout it is for and every rank's and replica's bytes.

    `row_tokens` x `micro_batch_rows` is the micro-batch the ranks' activations and logits are
    planned at (the smallest trainable rows: `PACKED_ROW_TOKENS`, or the fixed rows); `seq_len`
    the longest row a step may pack; `activation_factor` the activation elements a token a layer
    divided by hidden; `recompute` "none" (the trainer keeps every activation)."""

    model: str
    trainer_dtype: str
    replica_dtype: str
    tp: int
    cp: int
    ep: int
    dp: int
    distributed_optimizer: bool
    lora_rank: int
    lora_parameters: int
    row_tokens: int
    seq_len: int
    micro_batch_rows: int
    logprob_chunk: int | None
    activation_factor: float
    recompute: str = "none"
    pp: int = 1
    max_model_len: int
    gpu_memory_utilization: float
    ranks: tuple[RankMemory, ...]
    replicas: tuple[ReplicaMemory, ...]

    @property
    def layout(self) -> str:
        """The trainer layout as the sentences name it."""
        pp = f", pp={self.pp}" if self.pp > 1 else ""
        recompute = f", recompute={self.recompute}" if self.recompute != "none" else ""
        return f"TrainerSpec tp={self.tp}, cp={self.cp}, ep={self.ep}{pp}{recompute} (dp={self.dp})"

    def line(self) -> str:
        """The plan in one log line: the largest rank's and replica's needs against the smallest
        memory they get."""
        rank = max(self.ranks, key=lambda r: r.needed_bytes)
        parts = [
            f"memory plan for {self.model} at {self.layout}, {self.trainer_dtype}, "
            f"{self.micro_batch_rows} x {self.row_tokens}-token rows: trainer rank {rank.rank} needs "
            f"{_gib(rank.needed_bytes)} GiB (weights {_gib(rank.weights_bytes)}, LoRA "
            f"{_gib(rank.lora_bytes + rank.lora_grad_bytes + rank.optimizer_bytes)} with grads and Adam, "
            f"activations {_gib(rank.activation_bytes)} (factor {self.activation_factor:.1f}, recomputation {self.recompute}), "
            f"logits {_gib(rank.logits_bytes)}, reserve {_gib(rank.reserve_bytes)}) of "
            + (
                f"{_gib(rank.available_bytes)} GiB, rows up to {rank.max_row_tokens} tokens fit"
                if rank.available_bytes
                else "CPU memory"
            )
        ]
        if self.replicas:
            replica = max(self.replicas, key=lambda r: r.needed_bytes)
            parts.append(
                f"replica {replica.name}/{replica.index} needs {_gib(replica.needed_bytes)} GiB on {replica.gpus} "
                f"GPU(s) (weights {_gib(replica.weights_bytes)}, LoRA slots {_gib(replica.lora_slot_bytes)}, "
                f"one {self.max_model_len}-token sequence's KV cache {_gib(replica.kv_min_bytes)}, reserve "
                f"{_gib(replica.reserve_bytes)}) of "
                + (
                    f"{_gib(replica.available_bytes)} GiB at gpu_memory_utilization "
                    f"{self.gpu_memory_utilization:g}, KV cache {_gib(replica.kv_cache_bytes or 0)} GiB"
                    if replica.available_bytes is not None
                    else "CPU memory"
                )
            )
        return "; ".join(parts)

    def warnings(self) -> list[str]:
        """Lines to log for what fits only in part: a row limit longer than the rows that fit."""
        lines = []
        short = [r for r in self.ranks if r.max_row_tokens is not None and r.max_row_tokens < self.seq_len]
        if short:
            rank = min(short, key=lambda r: r.max_row_tokens or 0)
            lines.append(
                f"trainer rank {rank.rank} on host {rank.host_id} fits {self.micro_batch_rows} packed row(s) of up to "
                f"{rank.max_row_tokens} tokens of {self.model} in {_gib(rank.available_bytes)} GiB, but rows may "
                f"pack up to {self.seq_len} tokens: a step with longer rows runs out of GPU memory; set "
                "max_seq_length (or MegatronBackend(seq_len=)) at most that, set TrainerSpec.recompute, "
                "or use more TP"
            )
        return lines


def _gib(value: int | None) -> str:
    return "?" if value is None else f"{value / GIB:.1f}"


def rank_terms(
    shape: ModelShape,
    *,
    tp: int,
    cp: int = 1,
    ep: int = 1,
    dp: int = 1,
    pp: int = 1,
    stage: int = 0,
    dtype: str,
    lora_rank: int,
    lora_targets: Sequence[str] = _LORA_TARGETS,
    distributed_optimizer: bool | None = None,
    row_tokens: int,
    micro_batch_rows: int = 1,
    logprob_chunk: int | None = None,
    recompute: str = "none",
    recompute_modules: Sequence[str] = ("core_attn",),
    recompute_layers: int | None = None,
    microbatches: int | None = None,
    cpu: bool = False,
) -> dict[str, int]:
    """The byte terms of the rank of pipeline stage `stage` of `pp` (the module docstring's
    formulas): weights, lora, lora_grad, optimizer, activations, logits, reserve. `cpu`: the
    rank runs on CPU, whose SDPA kernels differ (`ModelShape.scores_bytes`).
    `distributed_optimizer` None: when dp > 1 (`OptimizerConfig.distributed`'s default);
    `recompute*` as `TrainerSpec`'s; `microbatches` the step's micro-batches (None: enough to fill
    the pipeline, the 1F1B worst case)."""
    w = DTYPE_BYTES[dtype]
    lora = -(
        -shape.lora_parameters(lora_rank, lora_targets, tp, ep) * shape.stage_layers(pp) // shape.num_layers
    )
    distributed = dp > 1 if distributed_optimizer is None else distributed_optimizer
    adam = (8 + (4 if w < 4 else 0)) * lora
    last = stage == pp - 1
    logits = (
        logits_bytes(
            shape,
            tp=tp,
            cp=cp,
            dtype=dtype,
            row_tokens=row_tokens,
            micro_batch_rows=micro_batch_rows,
            logprob_chunk=logprob_chunk,
        )
        if last
        else 0
    )
    tokens = math.ceil(row_tokens / cp)
    transient = shape.scores_transient(tp, w, micro_batch_rows, tokens, lora_rank, lora_targets, cpu)
    return {
        "weights": shape.stage_parameters(tp, ep, pp, stage) * w,
        "lora": lora * w,
        "lora_grad": lora * 4,
        "optimizer": math.ceil(adam / dp) if distributed else adam,
        "activations": activation_bytes(
            shape,
            tp=tp,
            cp=cp,
            pp=pp,
            stage=stage,
            dtype=dtype,
            lora_rank=lora_rank,
            lora_targets=lora_targets,
            row_tokens=row_tokens,
            micro_batch_rows=micro_batch_rows,
            recompute=recompute,
            recompute_modules=recompute_modules,
            recompute_layers=recompute_layers,
            microbatches=microbatches,
            cpu=cpu,
        )
        + max(transient - logits, 0),
        "logits": logits,
        "reserve": TRAINER_RESERVE_BYTES,
    }


def in_flight(pp: int, stage: int, microbatches: int | None) -> int:
    """Micro-batches whose activations stage `stage` of `pp` holds at once under 1F1B: its
    pp - stage - 1 warm-up forwards and the one in its steady state (Narayanan et al. 2021,
    "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", section
    2.2.1; megatron-core `forward_backward_pipelining_without_interleaving`'s
    `num_warmup_microbatches`), at most the step's `microbatches`."""
    return max(1, min(pp - stage, microbatches or pp))


def activation_bytes(
    shape: ModelShape,
    *,
    tp: int,
    cp: int,
    dtype: str,
    lora_rank: int,
    lora_targets: Sequence[str],
    row_tokens: int,
    micro_batch_rows: int,
    recompute: str = "none",
    recompute_modules: Sequence[str] = ("core_attn",),
    recompute_layers: int | None = None,
    pp: int = 1,
    stage: int = 0,
    microbatches: int | None = None,
    cpu: bool = False,
) -> int:
    """Activations a rank keeps at the peak of its step, in bytes: `in_flight` micro-batches of
    tokens = rows x `row_tokens` / cp, each keeping over the stage's `stage_layers` layers the
    layers' elements a token (`layers_activation_elements`, scaled to the stage) in dtype bytes,
    SDPA's additive mask (PyTorch converts the boolean mask to one of the query's dtype and keeps
    it for the backward: rows x s x s/cp a softmax-attention layer, in dtype bytes; a layer with
    sinks keeps its scores instead, `ModelShape.scores_bytes`) and the packed-row boolean mask
    (rows x s x s/cp bytes, shared by the layers); the last stage also keeps the final norm's
    input and reciprocal RMS (h + 1 a token); the first stage's first layer keeps less
    (`ModelShape.first_layer_unkept_elements`, without recomputation). `rank_terms` adds the
    scores' transient beyond the logits (they peak at different times).

    `recompute` "selective": `recompute_modules` drop their terms (`layers_activation_elements`;
    "core_attn" drops the SDPA mask too) and one layer's "mlp" is rebuilt at a time in the
    backward (5 f / tp a token). "full": the recomputed layers (`recompute_layers` of the stage,
    None: all) keep their input only (`layer_input_elements`), plus one layer's whole activations
    and mask while the backward recomputes it (Korthikanti et al. 2022, section 5)."""
    w = DTYPE_BYTES[dtype]
    tokens = math.ceil(row_tokens / cp) * micro_batch_rows
    layers = shape.stage_layers(pp)
    modules = tuple(recompute_modules) if recompute == "selective" else ()
    per_layer = shape.layers_activation_elements(tp, lora_rank, lora_targets, modules) / shape.num_layers
    mask = micro_batch_rows * row_tokens * math.ceil(row_tokens / cp)
    softmax_share = (shape.num_layers - shape.delta_layers) / shape.num_layers
    scores = shape.scores_bytes(tp, w, micro_batch_rows, math.ceil(row_tokens / cp), cpu)[0]
    attention_bytes = scores if scores else (0 if "core_attn" in modules else mask * w)
    layer_bytes = per_layer * tokens * w + softmax_share * attention_bytes
    kept = layers * layer_bytes
    if recompute == "full":
        recomputed = layers if recompute_layers is None else min(recompute_layers, layers)
        kept = (layers - recomputed) * layer_bytes + recomputed * shape.layer_input_elements(tp) * tokens * w
        kept += layer_bytes if recomputed else 0
    elif recompute == "none" and stage == 0:
        kept -= shape.first_layer_unkept_elements(tp, lora_targets) * tokens * w
        kept -= attention_bytes if shape.mla_frozen_first_layer(lora_targets) else 0
    if "mlp" in modules:
        kept += (
            (
                5 * shape.expert_ffn_hidden_size * shape.top_k
                if shape.num_experts
                else 5 * shape.ffn_hidden_size // tp
            )
            * tokens
            * w
        )
    outside = mask + ((shape.hidden_size + 1) * tokens * w if stage == pp - 1 else 0)
    return math.ceil(in_flight(pp, stage, microbatches) * (kept + outside))


ENTROPY_WORKING_SET_BYTES = 21
"""Bytes `logprobs.token_entropy` holds an element of the logits at its peak, all float32 but one
bool: the max-shifted logits, their exp, `exp > 0` (1 byte), `exp * shifted`, `zeros_like(exp)`
and the `torch.where` result, live together while the where runs (counted from its code)."""


def logits_bytes(
    shape: ModelShape,
    *,
    tp: int,
    cp: int,
    dtype: str,
    row_tokens: int,
    micro_batch_rows: int,
    logprob_chunk: int | None,
) -> int:
    """The last stage's logits at the step's peak: the LM head's output [rows, row_tokens / cp,
    V/tp] in dtype bytes (every position in the worst case: `forward_logits(needed=)` keeps only
    the trained ones) and the entropy's working set on it, `ENTROPY_WORKING_SET_BYTES` an element
    plus a float32 copy of non-float32 logits (`logits.float()`). The entropy (no gradient) runs
    on the whole logits before the cross entropy, whose working set is smaller: float32 logits it
    works on in place (megatron-core `VocabParallelCrossEntropy`), others it copies to float32
    ([rows, chunk or row_tokens / cp, V/tp] x 4 with `logprob_chunk`); the gradient it returns
    is that copy. The peak is therefore the entropy's. With `logprob_chunk` both run over chunks
    of positions (`token_entropy(chunk_size=)`); this stays the unchunked bound, an upper one.
    A final logit cap (Gemma 4, `logit_softcapping`: cap x tanh(logits / cap)) keeps the tanh's
    output for its backward beside the capped logits: w more bytes an element."""
    del logprob_chunk  # planned unchunked: an upper bound when the logprobs run in chunks
    positions = math.ceil(row_tokens / cp)
    vocab = math.ceil(shape.vocab_size / tp)
    w = DTYPE_BYTES[dtype]
    per_element = w * (2 if shape.logit_softcapping else 1) + ENTROPY_WORKING_SET_BYTES + (4 if w != 4 else 0)
    return micro_batch_rows * positions * vocab * per_element


MXFP4_BYTES = 17 / 32
"""Bytes an MXFP4 element takes: a 4-bit e2m1 code plus one 8-bit e8m0 scale a block of 32 (OCP
Microscaling Formats (MX) v1.0, section 5.3); vLLM serves GPT-OSS's MXFP4 experts as stored."""


def replica_weight_bytes(shape: ModelShape, dtype_bytes: int) -> int:
    """A replica's weights over all its GPUs: every parameter in `dtype_bytes`, but the routed
    experts of an MXFP4 checkpoint (GPT-OSS) at `MXFP4_BYTES` an element."""
    if not shape.mxfp4_experts:
        return shape.parameters() * dtype_bytes
    experts = shape.expert_parameters()
    return (shape.parameters() - experts) * dtype_bytes + math.ceil(experts * MXFP4_BYTES)


def _row_tokens_that_fit(
    room: int, seq_len: int, shape: ModelShape, stage: int, common: dict[str, Any]
) -> int:
    """The longest row (at most `seq_len` tokens, a multiple of cp) whose activations and logits
    fit `room` bytes on stage `stage` (`rank_terms`'s `common` arguments): a bisection, the
    terms growing with the row (linearly, and quadratically through the attention masks)."""

    def fits(tokens: int) -> bool:
        terms = rank_terms(shape, row_tokens=tokens, stage=stage, **common)
        return terms["activations"] + terms["logits"] <= room

    cp = common["cp"]
    low, high = 0, seq_len // cp
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid * cp):
            low = mid
        else:
            high = mid - 1
    return low * cp


def plan_memory(
    shape: ModelShape,
    topology: Any,
    gpu_memory: Mapping[tuple[str, int | str], int],
    *,
    model: str,
    trainer_dtype: str,
    replica_dtype: str,
    lora_rank: int,
    lora_targets: Sequence[str] = _LORA_TARGETS,
    row_tokens: int,
    seq_len: int,
    micro_batch_rows: int = 1,
    logprob_chunk: int | None = None,
    distributed_optimizer: bool | None = None,
    max_model_len: int,
    gpu_memory_utilization: float | None = None,
    max_loras: int = 1,
    max_lora_rank: int | None = None,
) -> MemoryPlan:
    """The plan of `topology` (a `CompiledTopology`) for the model of `shape`.

    `gpu_memory` maps (host id, GPU id as the topology names it) to that GPU's bytes
    (`gpu_memory_of`); a GPU not in it (a CPU rank or replica) gets `available_bytes` None.
    `row_tokens` x `micro_batch_rows` is the micro-batch planned, `seq_len` the longest row a step
    may pack; `gpu_memory_utilization` None is vLLM's 0.9.
    """
    trainer = topology.trainer
    tp, cp, ep = trainer.tp, trainer.cp, trainer.ep
    dp = max(len(topology.trainer_ranks) // (tp * cp * trainer.pp), 1)
    common = {
        "tp": tp,
        "cp": cp,
        "ep": ep,
        "dp": dp,
        "pp": trainer.pp,
        "dtype": trainer_dtype,
        "lora_rank": lora_rank,
        "lora_targets": lora_targets,
        "distributed_optimizer": distributed_optimizer,
        "micro_batch_rows": micro_batch_rows,
        "logprob_chunk": logprob_chunk,
        "recompute": getattr(trainer, "recompute", "none"),
        "recompute_modules": getattr(trainer, "recompute_modules", ("core_attn",)),
        "recompute_layers": getattr(trainer, "recompute_layers", None),
        "cpu": all(rank.gpu_id is None for rank in topology.trainer_ranks),
    }
    stages = [rank_terms(shape, row_tokens=row_tokens, stage=stage, **common) for stage in range(trainer.pp)]
    util = 0.9 if gpu_memory_utilization is None else gpu_memory_utilization
    ranks = _rank_memories(shape, topology, gpu_memory, stages, seq_len=seq_len, common=common)
    replicas = _replica_memories(
        shape,
        topology,
        gpu_memory,
        replica_dtype=replica_dtype,
        lora_slot_rank=max_lora_rank or lora_rank,
        max_loras=max_loras,
        max_model_len=max_model_len,
        util=util,
    )
    return MemoryPlan(
        model=model,
        trainer_dtype=trainer_dtype,
        replica_dtype=replica_dtype,
        tp=tp,
        cp=cp,
        ep=ep,
        dp=dp,
        distributed_optimizer=dp > 1 if distributed_optimizer is None else distributed_optimizer,
        lora_rank=lora_rank,
        lora_parameters=shape.lora_parameters(lora_rank, lora_targets, tp, ep),
        row_tokens=row_tokens,
        seq_len=seq_len,
        micro_batch_rows=micro_batch_rows,
        logprob_chunk=logprob_chunk,
        activation_factor=shape.activation_elements(tp, lora_rank, lora_targets) / shape.hidden_size,
        recompute=common["recompute"],
        pp=trainer.pp,
        max_model_len=max_model_len,
        gpu_memory_utilization=util,
        ranks=tuple(ranks),
        replicas=tuple(replicas),
    )


def _rank_memories(
    shape: ModelShape,
    topology: Any,
    gpu_memory: Mapping[tuple[str, int | str], int],
    stages: Sequence[dict[str, int]],
    *,
    seq_len: int,
    common: dict[str, Any],
) -> list[RankMemory]:
    """Every trainer rank of `topology`: the terms of its pipeline stage (`stages[pp_rank]`,
    `rank_terms`, bytes), its GPU's bytes from `gpu_memory` (None on CPU), whether a shared-GPU
    replica sits on that GPU, and the longest row (tokens, at most `seq_len`) whose activations and
    logits fit beside what the rank holds between steps (`_row_tokens_that_fit` with `common`,
    `rank_terms`'s arguments)."""
    shared = {
        (host, gpu)
        for replica in topology.replicas
        if replica.shared_gpus
        for host, gpus in replica.gpu_ids
        for gpu in gpus
    }
    ranks = []
    for rank in topology.trainer_ranks:
        stage = getattr(rank, "pp_rank", 0)
        terms = stages[stage]
        needed = sum(terms.values())
        resident = needed - terms["activations"] - terms["logits"]
        available = gpu_memory.get((rank.host_id, rank.gpu_id)) if rank.gpu_id is not None else None
        ranks.append(
            RankMemory(
                rank=rank.rank,
                host_id=rank.host_id,
                gpu_id=rank.gpu_id,
                weights_bytes=terms["weights"],
                lora_bytes=terms["lora"],
                lora_grad_bytes=terms["lora_grad"],
                optimizer_bytes=terms["optimizer"],
                activation_bytes=terms["activations"],
                logits_bytes=terms["logits"],
                reserve_bytes=terms["reserve"],
                needed_bytes=needed,
                available_bytes=available,
                shared_with_replica=(rank.host_id, rank.gpu_id) in shared,
                max_row_tokens=(
                    None
                    if available is None
                    else _row_tokens_that_fit(available - resident, seq_len, shape, stage, common)
                ),
            )
        )
    return ranks


def _replica_memories(
    shape: ModelShape,
    topology: Any,
    gpu_memory: Mapping[tuple[str, int | str], int],
    *,
    replica_dtype: str,
    lora_slot_rank: int,
    max_loras: int,
    max_model_len: int,
    util: float,
) -> list[ReplicaMemory]:
    """Every vLLM replica of `topology` (bytes over its GPUs, the module docstring's terms):
    weights, `max_loras` LoRA slots of `lora_slot_rank`, one `max_model_len`-token sequence's KV
    cache and the profile-run reserve, against `util` x its smallest GPU x its GPU count (None
    where a GPU's memory is unknown: CPU)."""
    w = DTYPE_BYTES[replica_dtype]
    replicas = []
    for replica in topology.replicas:
        gpus = sum(len(ids) for _, ids in replica.gpu_ids)
        memories = [gpu_memory.get((host, gpu)) for host, ids in replica.gpu_ids for gpu in ids]
        weights = replica_weight_bytes(shape, w)
        lora_slots = max_loras * shape.lora_parameters(lora_slot_rank) * w
        kv_min = shape.kv_bytes_per_token(w) * max_model_len + shape.delta_state_bytes(w)
        reserve = REPLICA_ACTIVATION_RESERVE_BYTES * max(gpus, 1)
        available = (
            None if not memories or None in memories else int(util * min(m for m in memories if m) * gpus)
        )
        replicas.append(
            ReplicaMemory(
                name=replica.name,
                index=replica.index,
                host_id=replica.host_ids[0],
                gpus=gpus,
                weights_bytes=weights,
                lora_slot_bytes=lora_slots,
                kv_min_bytes=kv_min,
                reserve_bytes=reserve,
                needed_bytes=weights + lora_slots + kv_min + reserve,
                available_bytes=available,
                kv_cache_bytes=None
                if available is None
                else max(available - weights - lora_slots - reserve, 0),
            )
        )
    return replicas


def gpu_memory_of(topology: Any, host_facts: Mapping[str, Any]) -> dict[tuple[str, int | str], int]:
    """(host id, GPU id) -> bytes of every GPU the topology's trainer ranks and replicas name,
    from the hosts' NVML facts (`preflight.protocol.HostFacts`, `admission.resolve_gpu`); a host
    without facts or GPUs is left out (its ranks and replicas are planned, never refused)."""
    from art_mega.preflight.admission import resolve_gpu

    named = {(r.host_id, r.gpu_id) for r in topology.trainer_ranks if r.gpu_id is not None}
    named |= {(host, gpu) for replica in topology.replicas for host, ids in replica.gpu_ids for gpu in ids}
    memory = {}
    for host, gpu in sorted(named, key=str):
        facts = host_facts.get(host)
        if facts is not None and facts.gpus:
            memory[(host, gpu)] = resolve_gpu(host, gpu, facts).memory_bytes
    return memory


def check_plan(plan: MemoryPlan, shape: ModelShape, valid_tp: Sequence[int] = ()) -> None:
    """Raise `MemoryPlanError` (one sentence: the model, the layout, the process, the GiB needed
    and available, a fix) for the first trainer rank or replica that does not fit its GPU memory;
    a shared-GPU rank must leave the replica its gpu_memory_utilization share while it holds its
    weights (the replica starts after the ranks and sizes itself from free memory). Ranks and
    replicas without GPU memory (CPU) are never refused. `valid_tp`: the tp sizes the model
    allows, for the fix (the smallest one that fits)."""
    for rank in plan.ranks:
        if rank.available_bytes is None:
            continue
        if rank.needed_bytes > rank.available_bytes:
            raise MemoryPlanError(
                f"{plan.model} does not fit trainer rank {rank.rank} on host {rank.host_id} (GPU {rank.gpu_id}, "
                f"{_gib(rank.available_bytes)} GiB) at {plan.layout}: it needs {_gib(rank.needed_bytes)} GiB "
                f"({plan.trainer_dtype} weights {_gib(rank.weights_bytes)}, LoRA with grads and Adam "
                f"{_gib(rank.lora_bytes + rank.lora_grad_bytes + rank.optimizer_bytes)}, activations of "
                f"{plan.micro_batch_rows} x {plan.row_tokens}-token rows {_gib(rank.activation_bytes)}, logits "
                f"{_gib(rank.logits_bytes)}, reserve {_gib(rank.reserve_bytes)}); "
                f"{_rank_fix(plan, shape, rank, valid_tp)}",
                plan.model,
                f"trainer rank {rank.rank}",
                rank.host_id,
                rank.needed_bytes,
                rank.available_bytes,
            )
        left = rank.available_bytes - int(rank.available_bytes * plan.gpu_memory_utilization)
        if rank.shared_with_replica and rank.resident_bytes > left:
            fits = math.floor((1 - rank.resident_bytes / rank.available_bytes) * 100) / 100
            fix = f"set gpu_memory_utilization={fits:.2f} or lower" if fits > 0 else "use more TP"
            raise MemoryPlanError(
                f"{plan.model} does not fit trainer rank {rank.rank} on host {rank.host_id} (GPU {rank.gpu_id}) "
                f"beside its replica at {plan.layout}: the rank holds {_gib(rank.resident_bytes)} GiB between "
                f"steps, and the replica, which starts after it, needs gpu_memory_utilization="
                f"{plan.gpu_memory_utilization:g} of {_gib(rank.available_bytes)} GiB free, which leaves the rank "
                f"{_gib(left)} GiB; {fix}, or give the replicas their own GPUs",
                plan.model,
                f"trainer rank {rank.rank}",
                rank.host_id,
                rank.resident_bytes,
                left,
            )
    for replica in plan.replicas:
        if replica.available_bytes is None or replica.needed_bytes <= replica.available_bytes:
            continue
        raise MemoryPlanError(
            f"{plan.model} does not fit replica {replica.name}/{replica.index} on host {replica.host_id} "
            f"({replica.gpus} GPU(s), {_gib(replica.available_bytes)} GiB at gpu_memory_utilization="
            f"{plan.gpu_memory_utilization:g}): it needs {_gib(replica.needed_bytes)} GiB ({plan.replica_dtype} "
            f"weights {_gib(replica.weights_bytes)}, LoRA slots {_gib(replica.lora_slot_bytes)}, the KV cache of "
            f"one {plan.max_model_len}-token sequence {_gib(replica.kv_min_bytes)}, reserve "
            f"{_gib(replica.reserve_bytes)}); use a larger InferenceSpec.tp, a smaller max_model_len, or a "
            "higher gpu_memory_utilization",
            plan.model,
            f"replica {replica.name}/{replica.index}",
            replica.host_id,
            replica.needed_bytes,
            replica.available_bytes,
        )


def _rank_fix(plan: MemoryPlan, shape: ModelShape, rank: RankMemory, valid_tp: Sequence[int]) -> str:
    """The fix of a rank that does not fit: the smallest larger tp that fits the same GPU, else
    fewer rows a micro-batch when the activations and logits are what does not fit, else larger
    GPUs."""
    available = rank.available_bytes or 0
    for tp in sorted(t for t in valid_tp if t > plan.tp):
        terms = rank_terms(
            shape,
            tp=tp,
            cp=plan.cp,
            ep=plan.ep,
            dp=plan.dp,
            dtype=plan.trainer_dtype,
            lora_rank=plan.lora_rank,
            distributed_optimizer=plan.distributed_optimizer,
            row_tokens=plan.row_tokens,
            micro_batch_rows=plan.micro_batch_rows,
            logprob_chunk=plan.logprob_chunk,
        )
        if sum(terms.values()) <= available:
            return (
                f"use TrainerSpec.tp={tp} ({tp * plan.cp} such GPUs a model copy; {_gib(sum(terms.values()))} GiB "
                "a rank), or larger GPUs"
            )
    if rank.resident_bytes < available and plan.micro_batch_rows > 1:
        return "use micro_batch_rows=1, more TP, or larger GPUs"
    if rank.resident_bytes < available:
        return 'set TrainerSpec.recompute="full", use more TP, or larger GPUs'
    return (
        f"no tp up to {max(valid_tp, default=plan.tp)} fits it on {_gib(available)} GiB GPUs; use larger GPUs"
    )


def write_plan(run_dir: str | os.PathLike[str], plan: MemoryPlan) -> Path:
    """Write `plan` as `<run_dir>/memory_plan.json` (replaced at each register) and return its path."""
    path = Path(run_dir) / PLAN_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = path.with_name(f".{PLAN_FILE}.{os.getpid()}.tmp")
    staged.write_text(json.dumps(plan.model_dump(mode="json"), indent=1) + "\n")
    staged.replace(path)
    return path


def read_plan(run_dir: str | os.PathLike[str]) -> MemoryPlan:
    """The plan `write_plan` wrote in `run_dir`."""
    return MemoryPlan.model_validate_json((Path(run_dir) / PLAN_FILE).read_text())


def log_plan(plan: MemoryPlan, logger: logging.Logger | None = None) -> None:
    """Log the plan's one line (info) and its `warnings` (warning)."""
    logger = logger or logging.getLogger("art_mega.memory_plan")
    logger.info("%s", plan.line())
    for line in plan.warnings():
        logger.warning("%s", line)

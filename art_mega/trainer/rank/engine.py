"""One trainer rank's training engine: Megatron model + LoRA, Megatron DDP and optimizer, GRPO/SFT steps.

Built once per rank after `init_parallel`; the rank's main loop calls `train_step` per job and
`export_adapter` / `save_state` for checkpoints. Every public method is collective: all ranks
of the trainer world call it, in the same order.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from art_mega.errors import NonFiniteStepError
from art_mega.trainer import checkpoint
from art_mega.trainer.batch import TrainBatch
from art_mega.trainer.behaviour import (
    CONSTRAINED,
    CONSTRAINED_FRACTION,
    GAP_MEAN,
    GAP_P95,
    PROCESSED,
    PROCESSED_FRACTION,
    UNTAGGED,
    UNTAGGED_FRACTION,
)
from art_mega.trainer.protocol import GRPOLossConfig, LoraConfig, OptimizerConfig
from art_mega.trainer.rank.logprobs import SamplingRows, forward_logits, token_entropy, token_logprobs
from art_mega.trainer.rank.lora import apply_lora, lora_disabled, lora_parameters
from art_mega.trainer.rank.loss import grpo_loss, known_logprobs, sft_loss
from art_mega.trainer.rank.parallel import ParallelState

STATE_FORMAT = 2
"""Version of the per-rank state file written by `save_state` (2 adds the layout-free Adam
moments, `named_adam`, and pp to the layout; a format-1 file still loads on its own layout)."""

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Microbatch:
    """One microbatch's tensors (rows of the rank's batch) and the loss inputs computed beforehand."""

    tensors: dict[str, torch.Tensor]
    ref_logprobs: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    inference_logprobs: torch.Tensor | None = None


def _document_layout(segment_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Index tensors that lay packed rows out as one document per row.

    Returns (rows, cols, valid), each [D, L] with D the documents of all rows and L the longest:
    `values[rows, cols]` is document d's token j (valid[d, j] False past its end, where the
    indices point at token 0 of its row). Lets sequence-level terms (GSPO) see documents, not rows.
    """
    starts = []
    for row in range(segment_ids.shape[0]):
        seg = segment_ids[row]
        for doc in torch.unique(seg[seg > 0]).tolist():
            cols = (seg == doc).nonzero().flatten()
            starts.append((row, int(cols[0]), len(cols)))
    if not starts:
        empty = torch.zeros(0, 1, dtype=torch.long)
        return empty, empty, empty.bool()
    longest = max(length for _, _, length in starts)
    offsets = torch.arange(longest)
    rows = torch.tensor([row for row, _, _ in starts])[:, None].expand(-1, longest)
    valid = offsets[None, :] < torch.tensor([length for _, _, length in starts])[:, None]
    cols = torch.tensor([start for _, start, _ in starts])[:, None] + offsets[None, :]
    cols = torch.where(valid, cols, torch.zeros_like(cols))
    return rows.contiguous(), cols, valid


def _token_ratios(new: torch.Tensor, old: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """The importance ratios `grpo_loss` uses, at trained tokens only (1-D, detached)."""
    log_ratio = (new - old).detach()
    token = torch.exp(log_ratio)
    per_doc = (log_ratio * mask).sum(dim=1) / mask.sum(dim=1).clamp_min(1.0)
    sequence = torch.exp(per_doc)[:, None].expand_as(new)
    ratios = {
        "token": token,
        "sequence": sequence,
        "average": (token + sequence) / 2,
        "geometric_average": (token * sequence) ** 0.5,
    }[level]
    return ratios[mask > 0]


class TrainerEngine:
    """A trainer rank's model, LoRA adapter, optimizer and training steps.

    `TrainerEngine(model_dir, parallel_state, lora=..., optimizer=...)` builds this rank's
    GPTModel from the HF directory (`build_megatron_model`), freezes it and adds LoRA
    (`apply_lora`), wraps it in Megatron's DDP (fp32 gradient buffers; the distributed optimizer
    layout when `OptimizerConfig.distributed`) and builds Megatron's Adam over the LoRA
    parameters only (`get_megatron_optimizer`). Forward/backward runs through Megatron's
    `get_forward_backward_func()` schedule and `finalize_model_grads` (DP all-reduce or
    reduce-scatter). The model uses Megatron's local layer spec on CPU and GPU alike (see
    `__init__`).

    Loss normalisation: the loss of a step is sum_t w_t m_t l_t / sum_t w_t m_t over every token of
    every microbatch on every DP rank (w = `TrainBatch.weights`, m = `loss_mask`): each
    microbatch contributes its numerator divided by the global denominator (one all-reduce
    before the step), the schedule runs with `calculate_per_token_loss` (no division by the
    number of microbatches, gradients summed over DP) and finalize does not rescale. The step is
    therefore the same for any split of the batch into microbatches and DP ranks.

    Only what the loss reads is computed: each microbatch's rows are cut after the last real
    token of its longest row (`_real_columns`), and the output layer (LM head), the entropy and
    the vocabulary cross entropy run on the positions predicting trained tokens only
    (`logprobs.forward_logits`'s `needed`, from `loss_mask` > 0), in the step and in the
    reference / old-policy recomputations alike. `logprobs` (the public one) computes every
    position unless asked for `trained_only`.

    Context parallelism (CP > 1): every CP rank of a DP rank gets the same whole rows.
    `forward_logits` runs the rank's share of each row (Megatron's two-chunk split, padded to a
    multiple of 2*cp; `cp_attention.py`) and `token_logprobs` all-gathers the per-token
    logprobs back into whole rows, so every CP rank computes the same loss over all tokens
    (GSPO's per-document terms included); the gather's backward keeps each rank's own
    positions, so the rank's gradients are its share of the total, and DDP sums them over the
    DP x CP group (`dp_cp_group`, `distributed/distributed_data_parallel.py:79`). Loss and
    metric sums stay over DP: a CP rank's loss is already the whole rows'.

    Args:
        model_dir: HF model directory (config.json, safetensors), readable by every rank.
        parallel_state: this rank's `init_parallel` result.
        lora: LoRA hyper-parameters.
        optimizer: optimizer hyper-parameters.
        dtype: "float32" or "bfloat16" parameters.
        micro_batch_rows: packed rows per microbatch (the batch's rows are split in order).
        compute_entropy: report the policy entropy (one more pass over the vocab-parallel logits).
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        parallel_state: ParallelState,
        *,
        lora: LoraConfig = LoraConfig(),
        optimizer: OptimizerConfig = OptimizerConfig(),
        dtype: str = "float32",
        micro_batch_rows: int = 1,
        compute_entropy: bool = True,
    ) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
        from megatron.core.optimizer import get_megatron_optimizer

        from art_mega.trainer.model_builder import build_megatron_model

        if micro_batch_rows < 1:
            raise ValueError(f"micro_batch_rows={micro_batch_rows} must be at least 1")
        self.model_dir = str(model_dir)
        self.state = parallel_state
        self.lora_config = lora
        self.optimizer_settings = optimizer
        self.micro_batch_rows = micro_batch_rows
        self.compute_entropy = compute_entropy
        # The local layer spec on every device for now: LoRA cannot wrap TransformerEngine's
        # fused-norm linears yet, and TE's causal attention ignores the packed-row mask.
        self.model = build_megatron_model(
            model_dir, device=parallel_state.device, dtype=dtype, use_te=False, recompute=parallel_state
        )
        module = self.model.module
        self.lora_layers = apply_lora(module, lora)
        config = module.config
        # Read by DDP's constructor (gradient scaling) and by the schedule (loss scaling).
        config.calculate_per_token_loss = True
        distributed = parallel_state.dp > 1 if optimizer.distributed is None else optimizer.distributed
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=distributed,
        )
        self.ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=module)
        config.no_sync_func = self.ddp.no_sync
        config.finalize_model_grads_func = _finalize_without_token_scaling
        self.optimizer = get_megatron_optimizer(
            MegatronOptimizerConfig(
                optimizer="adam",
                lr=optimizer.lr,
                weight_decay=optimizer.weight_decay,
                adam_beta1=optimizer.beta1,
                adam_beta2=optimizer.beta2,
                adam_eps=optimizer.eps,
                clip_grad=optimizer.clip_grad,
                bf16=dtype == "bfloat16",
                params_dtype=torch.bfloat16 if dtype == "bfloat16" else torch.float32,
                use_distributed_optimizer=distributed,
            ),
            [self.ddp],
        )
        self.steps = 0
        self._reference_adapter: tuple[str, dict[str, torch.Tensor]] | None = None
        """The last `kl_ref_adapter_path` and its LoRA weights (this rank's shards)."""

    # ------------------------------------------------------------------ helpers

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    def _dp_group(self) -> Any:
        from megatron.core import parallel_state as mpu

        return mpu.get_data_parallel_group()

    def _dp_sum(self, values: list[float]) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64, device=self.state.device)
        torch.distributed.all_reduce(tensor, group=self._dp_group())
        return tensor.tolist()

    def _dp_gather(self, values: torch.Tensor) -> torch.Tensor:
        """Concatenate a 1-D float tensor of any length from every DP rank."""
        group = self._dp_group()
        size = torch.distributed.get_world_size(group)
        if size == 1:
            return values
        device = self.state.device
        length = torch.tensor([values.numel()], device=device)
        lengths = [torch.zeros_like(length) for _ in range(size)]
        torch.distributed.all_gather(lengths, length, group=group)
        longest = max(int(n) for n in lengths)
        padded = torch.zeros(longest, dtype=torch.float32, device=device)
        padded[: values.numel()] = values.float()
        pieces = [torch.zeros_like(padded) for _ in range(size)]
        torch.distributed.all_gather(pieces, padded, group=group)
        return torch.cat([piece[: int(n)] for piece, n in zip(pieces, lengths)]).cpu()

    def _microbatches(
        self, batch: TrainBatch, extra: dict[str, np.ndarray] | None = None
    ) -> list[dict[str, torch.Tensor]]:
        """`micro_batch_rows` rows of `batch` at a time (with `extra`'s [B, S] arrays, by name),
        each [b, L] with its padding columns cut (`_real_columns`)."""
        tensors = batch.to_torch(self.state.device)
        for name, values in (extra or {}).items():
            tensors[name] = torch.from_numpy(np.ascontiguousarray(values)).to(self.state.device)
        rows = batch.shape[0]
        step = self.micro_batch_rows
        micro = []
        for i in range(0, rows, step):
            length = self._real_columns(tensors["segment_ids"][i : i + step])
            micro.append({k: v[i : i + step, :length] for k, v in tensors.items()})
        return micro

    def _real_columns(self, segment_ids: torch.Tensor) -> int:
        """The columns of a microbatch's rows (`segment_ids` int [b, S]) that the model runs: up to
        the last real token of its longest row, rounded up to what the layout requires (a multiple
        of 2*cp under CP, of tp where the sequence is split over TP), at most S.

        The columns after every row's last token are padding (segment 0), which no real token
        attends to and whose values are 0.0, so cutting them changes no result. Except where
        padding takes part in a loss of its own: an MoE load-balancing (aux / z) loss routes
        every token, so with one the rows keep all S columns.
        """
        config = self.model.module.config
        length = segment_ids.shape[1]
        if config.num_moe_experts and (config.moe_aux_loss_coeff or config.moe_z_loss_coeff):
            return length
        real = (segment_ids > 0).any(dim=0).nonzero()
        last = int(real[-1]) + 1 if real.numel() else 1
        unit = (2 * self.state.cp if self.state.cp > 1 else 1) * (
            self.state.tp if config.sequence_parallel else 1
        )
        return min(length, -(-last // unit) * unit)

    @torch.no_grad()
    def _forward_logprobs(
        self, tensors: dict[str, torch.Tensor], chunk_size: int | None = None, *, trained_only: bool = False
    ) -> torch.Tensor:
        """Logprobs float32 [b, L] of one microbatch; with `trained_only` at its trained tokens
        (`loss_mask` > 0) only, 0.0 elsewhere (the LM head runs on the positions predicting them).
        One pipeline stage only (the whole model on this rank)."""
        needed = tensors["loss_mask"] > 0 if trained_only else None
        logits = forward_logits(
            self.ddp, tensors["input_ids"], tensors["position_ids"], tensors["segment_ids"], needed=needed
        )
        return self._logprobs_of_logits(logits, tensors, chunk_size, needed)

    def _logprobs_of_logits(
        self,
        logits: torch.Tensor,
        tensors: dict[str, torch.Tensor],
        chunk_size: int | None,
        needed: torch.Tensor | None,
    ) -> torch.Tensor:
        return token_logprobs(
            logits,
            tensors["input_ids"],
            vocab_size=self.vocab_size,
            segment_ids=tensors["segment_ids"],
            chunk_size=chunk_size,
            needed=needed,
            sampling=SamplingRows.from_tensors(tensors),
        )

    @property
    def _pipelined(self) -> bool:
        return self.state.pp > 1

    def _all_logprobs(
        self,
        micro: list[dict[str, torch.Tensor]],
        chunk_size: int | None = None,
        *,
        trained_only: bool = False,
    ) -> list[torch.Tensor]:
        """`_forward_logprobs` of every microbatch in `micro`, on every rank.

        Under pipeline parallelism the microbatches run through megatron-core's 1F1B schedule
        forward only (`get_forward_backward_func`, `collect_non_loss_data`): the last stage computes
        the logprobs and broadcasts them over the pipeline group, so every stage returns the same
        [b, L] tensors (float32), as every rank does without pipelining.
        """
        if not self._pipelined:
            return [self._forward_logprobs(t, chunk_size, trained_only=trained_only) for t in micro]
        from megatron.core import parallel_state as mpu
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def step(data_iterator: Iterator[dict[str, torch.Tensor]], model: Any) -> tuple[torch.Tensor, Any]:
            t = next(data_iterator)
            needed = t["loss_mask"] > 0 if trained_only else None
            out = forward_logits(model, t["input_ids"], t["position_ids"], t["segment_ids"], needed=needed)

            def collect(logits: torch.Tensor, non_loss_data: bool = True) -> torch.Tensor:
                return self._logprobs_of_logits(logits, t, chunk_size, needed)

            return out, collect

        with torch.no_grad():
            outputs = get_forward_backward_func()(
                forward_step_func=step,
                data_iterator=iter(micro),
                model=[self.ddp],
                num_microbatches=len(micro),
                seq_length=max(t["input_ids"].shape[1] for t in micro),
                micro_batch_size=self.micro_batch_rows,
                forward_only=True,
                collect_non_loss_data=True,
            )
        shapes = [tuple(t["input_ids"].shape) for t in micro]
        if mpu.is_pipeline_last_stage():
            flat = torch.cat([o.float().reshape(-1) for o in outputs])
        else:
            flat = torch.empty(sum(a * b for a, b in shapes), dtype=torch.float32, device=self.state.device)
        torch.distributed.broadcast(
            flat, src=mpu.get_pipeline_model_parallel_last_rank(), group=mpu.get_pipeline_model_parallel_group()
        )
        pieces = flat.split([a * b for a, b in shapes])
        return [piece.reshape(shape) for piece, shape in zip(pieces, shapes, strict=True)]

    # ------------------------------------------------------------------ public API

    def logprobs(
        self, batch: TrainBatch, *, reference: bool = False, trained_only: bool = False
    ) -> np.ndarray:
        """Per-token logprobs of `batch.input_ids` under the current policy, float32 [B, S].

        Position t holds log p(token t | tokens < t of its document) under the distribution token
        t was sampled from (the batch's temperature, top_k, top_p, min_p; `logprobs.SamplingRows`);
        the first token of each document and padding hold 0. `reference=True` uses the base model (LoRA disabled).
        `trained_only=True`: only the trained tokens (`loss_mask` > 0) get theirs, the others
        hold 0 too (what a loss reads, at a fraction of the LM head's cost).
        Collective over the TP and CP groups (every rank of them returns the same whole rows).
        """
        out = np.zeros(batch.shape, dtype=np.float32)
        context = lora_disabled(self.ddp.module) if reference else contextlib.nullcontext()
        with context:
            first = 0
            for tensor in self._all_logprobs(self._microbatches(batch), trained_only=trained_only):
                values = tensor.cpu().numpy()
                out[first : first + values.shape[0], : values.shape[1]] = values
                first += values.shape[0]
        return out

    def train_step(
        self,
        batch: TrainBatch,
        loss: Literal["grpo", "sft"] = "grpo",
        loss_config: GRPOLossConfig = GRPOLossConfig(),
        learning_rate: float | None = None,
        weight_decay: float | None = None,
        clip_grad: float | None = None,
        old_policy_logprobs: np.ndarray | None = None,
    ) -> dict[str, float]:
        """One optimizer step on this DP rank's packed `batch` (every rank calls it with its own).

        `learning_rate`, `weight_decay` (AdamW's, decoupled) and `clip_grad` (the global
        gradient-norm clip, 0 disables it) apply to this step; None: the engine's
        `OptimizerConfig` (ART trains RL and SFT with different decay and clip).

        GRPO (`loss.grpo_loss`): `batch.old_logprobs` are the sampling policy's logprobs and
        `batch.advantages` the per-token advantages. With `loss_config.kl_beta > 0` or
        `kl_penalty_coef > 0` the reference is the base model (LoRA disabled, computed before the
        step). With `loss_config.tis_cap` or `precalculate_logprobs` the batch's logprobs are
        taken as the inference engine's: the trainer recomputes the old policy's logprobs itself
        (before the step; `old_policy_logprobs`, float32 [B, S] as `logprobs` returns them: taken
        instead, computed before the first of several steps as ART precalculates them once per
        train call) and a TIS cap applies to their ratio. SFT (`loss.sft_loss`):
        cross-entropy on `loss_mask` tokens weighted by `weights`.

        A step whose batches (over all DP ranks) have no trained token with non-zero weight
        does not touch the optimizer; it returns `loss/nothing_trainable` = 1.0.

        Returns metrics (the same on every rank): `loss/policy` (GRPO) or `loss/sft`,
        `loss/grad_norm` (before clipping), `loss/tokens` (trained tokens, all DP ranks),
        `loss/nothing_trainable`, `loss/learning_rate`, `loss/entropy` (nats per token, when
        computed) and for GRPO `loss/kl`, `loss/ratio_mean`, `loss/ratio_p95`, `loss/ratio_p99`,
        `loss/clipped_fraction` and, with `kl_penalty_coef`, ART's `loss/kl_policy_ref`; for GRPO
        also the behaviour-policy metrics of `trainer.behaviour` (`offpolicy/sampler_logprob_gap_mean`
        and `_p95`, from this step's forward pass, before its update; the constrained, processed
        and untagged token fractions).

        Behaviour policy: every logprob pass computes each token's logprob under the distribution
        it was sampled from (the batch's temperature / top_k / top_p / min_p). A token sampled
        under a constraint or with processed logits (`TrainBatch.sampling`) has an unknown
        behaviour logprob: the trainer's own, detached, stands in (ratio 1; with a recomputed old
        policy its TIS weight is 1).

        The step is aborted before the optimizer update when the loss or the gradient norm
        (both the same on every rank: summed over DP, the norm over every rank's shards) is NaN
        or +-inf: the LoRA weights, the optimizer state and `steps` are then as before the call
        (the gradient buffers are zeroed by the next step).

        Raises:
            ValueError: an unknown loss.
            NonFiniteStepError: the loss (`loss/policy` or `loss/sft`, checked first) or
                `loss/grad_norm` is not finite (on every rank alike; `step` not set).
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if loss not in ("grpo", "sft"):
            raise ValueError(f"loss={loss!r} must be 'grpo' or 'sft'")
        lr = self.optimizer_settings.lr if learning_rate is None else learning_rate
        trained = batch.loss_mask > 0
        local_denominator = float((batch.weights * trained).sum())
        denominator, tokens = self._dp_sum([local_denominator, float(trained.sum())])
        metrics = {"loss/tokens": tokens, "loss/learning_rate": lr, "loss/nothing_trainable": 0.0}
        if denominator <= 0.0:
            metrics["loss/nothing_trainable"] = 1.0
            return metrics

        old_policy = None if old_policy_logprobs is None else {"old_policy": old_policy_logprobs}
        microbatches = self._prepare(self._microbatches(batch, old_policy), loss, loss_config)
        decay = self.optimizer_settings.weight_decay if weight_decay is None else weight_decay
        for group in self.optimizer.param_groups:
            group["lr"] = lr
            group["weight_decay"] = decay * group.get("wd_mult", 1.0)  # Megatron's no-decay groups keep 0
        clip = self.optimizer_settings.clip_grad if clip_grad is None else clip_grad
        for sub in [self.optimizer, *_sub_optimizers(self.optimizer)]:
            if getattr(sub, "config", None) is not None:
                sub.config.clip_grad = clip
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        step = functools.partial(
            self._forward_step, loss=loss, loss_config=loss_config, denominator=denominator
        )
        outputs = get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=iter(microbatches),
            model=[self.ddp],
            num_microbatches=len(microbatches),
            seq_length=batch.shape[1],
            micro_batch_size=self.micro_batch_rows,
            forward_only=False,
        )
        metrics.update(
            self._stage_metrics(outputs, loss, tokens, loss == "grpo" and loss_config.kl_penalty_coef > 0)
        )
        # Megatron's step() clips with the norm and updates in one call (and only fp16's loss
        # scaler checks for inf), so the norm is computed here first: `prepare_grads` hands the
        # gradients to the main parameters (a copy that step() repeats), nothing is updated yet.
        self.optimizer.prepare_grads()
        metrics["loss/grad_norm"] = float(self.optimizer.get_grad_norm())
        for quantity in ("loss/policy" if loss == "grpo" else "loss/sft", "loss/grad_norm"):
            if not np.isfinite(metrics[quantity]):
                raise NonFiniteStepError(quantity, metrics[quantity])
        self.optimizer.step()
        self.steps += 1
        return metrics

    def first_nonfinite_tensor(self) -> str | None:
        """The name of this rank's first LoRA parameter or optimizer-state tensor (Adam moments,
        fp32 main weights) holding NaN or +-inf, None when all are finite. Not collective.

        An optimizer tensor is named by its LoRA parameter where the optimizer holds that
        parameter itself (fp32 without the distributed optimizer), else by its index."""
        lora = lora_parameters(self.ddp.module)
        for name, param in lora.items():
            if not bool(torch.isfinite(param.detach()).all()):
                return f"LoRA parameter {name}"
        names = {id(param): name for name, param in lora.items()}
        for k, sub in enumerate(_sub_optimizers(self.optimizer)):
            inner = getattr(sub, "optimizer", None)
            if inner is None:
                continue
            for g, group in enumerate(inner.param_groups):
                for i, param in enumerate(group["params"]):
                    label = names.get(id(param), f"main parameter {i} of optimizer {k} group {g}")
                    if not bool(torch.isfinite(param.detach()).all()):
                        return label
                    for key, value in inner.state.get(param, {}).items():
                        if torch.is_tensor(value) and value.is_floating_point():
                            if not bool(torch.isfinite(value).all()):
                                return f"optimizer state {key!r} of {label}"
        return None

    def _prepare(
        self, micro: list[dict[str, torch.Tensor]], loss: str, loss_config: GRPOLossConfig
    ) -> list[_Microbatch]:
        """Each microbatch with the loss inputs that need their own forward pass before the step
        (reference, TIS), computed for all microbatches at once (`_all_logprobs`)."""
        if loss != "grpo":
            return [_Microbatch(tensors) for tensors in micro]
        none: list[torch.Tensor | None] = [None] * len(micro)
        refs, olds, inferences = list(none), list(none), list(none)
        chunk_size = loss_config.logprob_calculation_chunk_size
        if loss_config.needs_reference:
            with self._reference(loss_config.kl_ref_adapter_path):
                refs = list(self._all_logprobs(micro, chunk_size, trained_only=True))
        if loss_config.recomputes_old:
            if "old_policy" in micro[0]:
                olds = [tensors["old_policy"] for tensors in micro]
            else:
                olds = list(self._all_logprobs(micro, chunk_size, trained_only=True))
            inferences = [tensors["old_logprobs"] for tensors in micro]
        return [
            _Microbatch(tensors, ref_logprobs=ref, old_logprobs=old, inference_logprobs=inference)
            for tensors, ref, old, inference in zip(micro, refs, olds, inferences, strict=True)
        ]

    @contextlib.contextmanager
    def _reference(self, adapter_dir: str | None) -> Iterator[None]:
        """Within the block the model is the reference policy: the base model (LoRA disabled),
        or with `adapter_dir` the base model with that PEFT adapter (its weights read once and
        kept for the next steps; the trained LoRA's own values are put back after the block).

        Raises:
            UserError: the adapter does not fit the trainer's LoRA (`peft_io.import_adapter`).
        """
        if adapter_dir is None:
            with lora_disabled(self.ddp.module):
                yield
            return
        params = lora_parameters(self.ddp.module)
        own = {name: p.detach().clone() for name, p in params.items()}
        try:  # a failed read leaves the trained LoRA as it was, too
            if self._reference_adapter is None or self._reference_adapter[0] != adapter_dir:
                from art_mega.trainer.peft_io import import_adapter

                import_adapter(
                    self.ddp.module,
                    self.lora_config,
                    adapter_dir,
                    num_heads=self.model.args.num_heads,
                    num_query_groups=self.model.args.num_query_groups,
                    names=self.model.family.lora_names(self.model.args),
                )
                self._reference_adapter = (adapter_dir, {n: p.detach().clone() for n, p in params.items()})
            with torch.no_grad():
                for name, p in params.items():
                    p.copy_(self._reference_adapter[1][name])
            yield
        finally:
            with torch.no_grad():
                for name, p in params.items():
                    p.copy_(own[name])

    def _forward_step(
        self,
        data_iterator: Iterator[_Microbatch],
        model: Any,
        *,
        loss: str,
        loss_config: GRPOLossConfig,
        denominator: float,
    ) -> tuple[torch.Tensor, Any]:
        """Megatron's forward_step_func: logprobs of one microbatch and its loss function.

        The loss and the step metrics read the trained tokens only (`loss_mask` > 0): the LM head,
        the entropy and the cross entropy run on the positions predicting them (`needed`); the
        other tokens' logprobs and entropies are 0.0, as they would be once masked.
        """
        micro = next(data_iterator)
        t = micro.tensors
        needed = t["loss_mask"] > 0
        logits = forward_logits(model, t["input_ids"], t["position_ids"], t["segment_ids"], needed=needed)
        if self._pipelined:
            from megatron.core import parallel_state as mpu

            if not mpu.is_pipeline_last_stage():  # hidden states for the next stage; no loss here
                return logits, None
        entropy = None
        if self.compute_entropy:
            entropy = token_entropy(
                logits, vocab_size=self.vocab_size, segment_ids=t["segment_ids"], needed=needed
            )
        logprobs = token_logprobs(
            logits,
            t["input_ids"],
            vocab_size=self.vocab_size,
            segment_ids=t["segment_ids"],
            chunk_size=loss_config.logprob_calculation_chunk_size,
            needed=needed,
            sampling=SamplingRows.from_tensors(t),
        )
        loss_fn = functools.partial(
            self._loss,
            micro=micro,
            entropy=entropy,
            loss=loss,
            loss_config=loss_config,
            denominator=denominator,
        )
        return logprobs, loss_fn

    def _loss(
        self,
        logprobs: torch.Tensor,
        *,
        micro: _Microbatch,
        entropy: torch.Tensor | None,
        loss: str,
        loss_config: GRPOLossConfig,
        denominator: float,
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """This microbatch's share of the step loss, its trained-token count and diagnostics."""
        t = micro.tensors
        rows, cols, valid = _document_layout(t["segment_ids"].cpu())
        rows, cols, valid = rows.to(logprobs.device), cols.to(logprobs.device), valid.to(logprobs.device)

        def docs(values: torch.Tensor) -> torch.Tensor:
            # masked, not multiplied: past a document's end the indices repeat its row's token
            # 0, whose old logprob may be NaN (unknown), and NaN * 0 would poison the loss
            return values[rows, cols].masked_fill(~valid, 0.0)

        mask = docs(t["loss_mask"])
        weights = docs(t["weights"])
        new = docs(logprobs)
        local_denominator = (weights * mask).sum()
        tokens = (mask > 0).sum()
        info: dict[str, Any] = {}
        if entropy is not None:
            info["entropy_sum"] = float((docs(entropy) * (mask > 0)).sum())
        if loss == "sft":
            value = sft_loss(new, mask, weights) * local_denominator / denominator
            info["loss_sum"] = float(value.detach())
            return value, tokens.to(torch.int), info
        sampler = docs(t["old_logprobs"])
        code = docs(t["sampling"].long())
        trained = mask > 0
        # the behaviour-policy rule (trainer.behaviour): a sampler logprob of a distribution the
        # trainer cannot compute (grammar mask, processed logits) is unknown, like a NaN one
        opaque = trained & ((code == CONSTRAINED) | (code == PROCESSED))
        nan = torch.full_like(sampler, float("nan"))
        inference = None
        if micro.old_logprobs is not None:
            old = docs(micro.old_logprobs)
            inference = torch.where(opaque, nan, docs(micro.inference_logprobs))
        else:
            old = torch.where(opaque, nan, sampler)
        old = known_logprobs(old, new, mask)  # unknown (NaN) ones: the ratio metrics see 1 too
        sampled = trained & torch.isfinite(sampler)
        info.update(
            sampler_gaps=(sampler - new.detach())[sampled].abs().cpu(),
            constrained_count=float((trained & (code == CONSTRAINED)).sum()),
            processed_count=float((trained & (code == PROCESSED)).sum()),
            untagged_count=float((trained & (code == UNTAGGED)).sum()),
        )
        out = grpo_loss(
            new,
            old,
            docs(t["advantages"]),
            mask,
            weights,
            config=loss_config,
            ref_logprobs=None if micro.ref_logprobs is None else docs(micro.ref_logprobs),
            inference_logprobs=inference,
            packed_rows=rows[:, 0],
        )
        value = out.loss * local_denominator / denominator
        count = float(tokens)
        info.update(
            loss_sum=float(value.detach()),
            kl_policy_ref_sum=(out.kl_policy_ref or 0.0) * count,
            kl_sum=out.kl * count,
            clipped_sum=out.clipped_fraction * count,
            ratios=_token_ratios(new, old, mask, loss_config.importance_sampling_level).cpu(),
        )
        return value, tokens.to(torch.int), info

    def _stage_metrics(
        self, outputs: list[dict[str, Any]], loss: str, tokens: float, kl_policy_ref: bool
    ) -> dict[str, float]:
        """`_reduce_metrics`; under pipeline parallelism computed on the last stage (the only one
        with losses) and broadcast over the pipeline group, so every rank returns the same."""
        if not self._pipelined:
            return self._reduce_metrics(outputs, loss, tokens, kl_policy_ref)
        from megatron.core import parallel_state as mpu

        box: list[Any] = [None]
        if mpu.is_pipeline_last_stage():
            box[0] = self._reduce_metrics(outputs, loss, tokens, kl_policy_ref)
        torch.distributed.broadcast_object_list(
            box, src=mpu.get_pipeline_model_parallel_last_rank(), group=mpu.get_pipeline_model_parallel_group()
        )
        return box[0]

    def _reduce_metrics(
        self, outputs: list[dict[str, Any]], loss: str, tokens: float, kl_policy_ref: bool = False
    ) -> dict[str, float]:
        """Step metrics from every microbatch's diagnostics, summed over DP ranks
        (`kl_policy_ref`: report ART's `loss/kl_policy_ref`, the token mean of new - ref)."""
        keys = ["loss_sum", "entropy_sum", "kl_sum", "clipped_sum", "kl_policy_ref_sum"]
        keys += ["constrained_count", "processed_count", "untagged_count"]
        local = [sum(float(out.get(key, 0.0)) for out in outputs) for key in keys]
        loss_sum, entropy_sum, kl_sum, clipped_sum, kl_policy_ref_sum, *counts = self._dp_sum(local)
        count = max(tokens, 1.0)
        metrics = {"loss/policy" if loss == "grpo" else "loss/sft": loss_sum}
        if self.compute_entropy:
            metrics["loss/entropy"] = entropy_sum / count
        if loss == "grpo":
            ratios = self._dp_gather(torch.cat([out["ratios"] for out in outputs]))
            ratios = ratios if ratios.numel() else torch.ones(1)
            metrics.update(
                {
                    "loss/kl": kl_sum / count,
                    "loss/clipped_fraction": clipped_sum / count,
                    "loss/ratio_mean": float(ratios.mean()),
                    "loss/ratio_p95": float(torch.quantile(ratios.double(), 0.95)),
                    "loss/ratio_p99": float(torch.quantile(ratios.double(), 0.99)),
                }
            )
            if kl_policy_ref:
                metrics["loss/kl_policy_ref"] = kl_policy_ref_sum / count
            gaps = self._dp_gather(torch.cat([out["sampler_gaps"] for out in outputs]))
            if gaps.numel():
                metrics[GAP_MEAN] = float(gaps.double().mean())
                metrics[GAP_P95] = float(torch.quantile(gaps.double(), 0.95))
            for name, value in zip((CONSTRAINED_FRACTION, PROCESSED_FRACTION, UNTAGGED_FRACTION), counts):
                metrics[name] = value / count
        return metrics

    # ------------------------------------------------------------------ adapters and state

    def export_adapter(self, out_dir: str | os.PathLike[str]) -> Any:
        """Write the adapter as an HF PEFT directory (`peft_io.export_adapter`; collective, rank 0
        writes). Returns `AdapterFiles` on global rank 0, None on the others."""
        from art_mega.trainer.peft_io import export_adapter

        return export_adapter(
            self.ddp.module,
            self.lora_config,
            out_dir,
            num_heads=self.model.args.num_heads,
            num_query_groups=self.model.args.num_query_groups,
            names=self.model.family.lora_names(self.model.args),
            base_model_name_or_path=self.model_dir,
        )

    def load_adapter(self, adapter_dir: str | os.PathLike[str]) -> None:
        """Warm start: load an HF PEFT LoRA directory into this rank's shards (`peft_io.import_adapter`).

        The optimizer's state is kept; its main parameters are refreshed from the model.
        Raises `UserError` for an adapter of another rank, alpha or target set.
        """
        from art_mega.trainer.peft_io import import_adapter

        import_adapter(
            self.ddp.module,
            self.lora_config,
            adapter_dir,
            num_heads=self.model.args.num_heads,
            num_query_groups=self.model.args.num_query_groups,
            names=self.model.family.lora_names(self.model.args),
        )
        self.optimizer.reload_model_params()

    def _layout(self) -> dict[str, int]:
        s = self.state
        return {
            "world_size": s.world_size,
            "tp": s.tp,
            "dp": s.dp,
            "pp": s.pp,
            "tp_rank": s.tp_rank,
            "dp_rank": s.dp_rank,
            "pp_rank": s.pp_rank,
        }

    def state_file(self, directory: str | os.PathLike[str]) -> Path:
        """This rank's state file in `directory` (a checkpoint or its staging folder):
        `checkpoint.rank_state_file` of this global rank."""
        return checkpoint.rank_state_file(directory, self.state.rank)

    def save_state(self, directory: str | os.PathLike[str]) -> Path:
        """Write this rank's LoRA shards, optimizer state and step count to `state_file(directory)`.

        Collective only in that every rank writes its own file (`checkpoint.atomic_write`: temp
        file, fsync, rename). The distributed optimizer's parameter state is this rank's shard
        (`get_parameter_state_dp_reshardable`). Returns the path.
        """
        path = self.state_file(directory)
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "format": STATE_FORMAT,
            "layout": self._layout(),
            "steps": self.steps,
            "lora": {name: p.detach().cpu().clone() for name, p in lora_parameters(self.ddp.module).items()},
            "optimizers": [_optimizer_state(sub) for sub in _sub_optimizers(self.optimizer)],
            "named_adam": self._named_adam(),
        }
        with checkpoint.atomic_write(path) as handle:
            torch.save(payload, handle)
        return path

    @torch.no_grad()
    def load_state(self, directory: str | os.PathLike[str]) -> None:
        """Restore a checkpoint `directory` written by `save_state` on every rank of a trainer.

        On the layout it was written with (world size, tp, dp, pp and this rank's coordinates):
        this rank's file as it was (LoRA shards, Megatron optimizer state, step count), exactly.
        On another layout (a lost node, a bigger allocation; `load_portable`): the LoRA from
        the checkpoint's PEFT adapter and the Adam moments re-sharded from every old rank's
        layout-free record.

        Raises `RuntimeError` when the file holds other LoRA parameters than this engine
        (another model or LoRA config).
        """
        path = self.state_file(directory)
        payload = torch.load(path, map_location=self.state.device, weights_only=False) if path.exists() else None
        if payload is None or _saved_layout(payload) != self._layout():
            self.load_portable(directory)
            return
        params = lora_parameters(self.ddp.module)
        if set(payload["lora"]) != set(params):
            raise RuntimeError(f"{path} holds other LoRA parameters than this model")
        for name, param in params.items():
            param.copy_(payload["lora"][name])
        subs = _sub_optimizers(self.optimizer)
        for sub, saved in zip(subs, payload["optimizers"], strict=True):
            _load_optimizer_state(sub, saved)
        self.optimizer.reload_model_params()
        self.steps = payload["steps"]

    @torch.no_grad()
    def load_portable(self, directory: str | os.PathLike[str]) -> None:
        """Resume a checkpoint written on another parallel layout (TP, PP, EP, DP, distributed
        optimizer or not): the LoRA weights from its PEFT adapter (`load_adapter`, layout-free),
        the step count from its rank files, and Adam's moments and step re-sharded from the
        `named_adam` records of every old rank (`_assemble_adam`): each parameter's full
        moments are rebuilt from the old shards, then this rank's shard is cut from them.

        Where the moments cannot be rebuilt (rank files of format 1, a bf16 optimizer without
        the distributed layout, a parameter missing from the records) the optimizer restarts
        from zero moments, said in one logged line on global rank 0. Not collective.
        """
        from art_mega.trainer.peft_io import import_adapter

        files = sorted(Path(directory).glob("rank*.pt"))
        saved = [torch.load(f, map_location="cpu", weights_only=False) for f in files]
        import_adapter(
            self.ddp.module,
            self.lora_config,
            checkpoint.adapter_dir(directory),
            num_heads=self.model.args.num_heads,
            num_query_groups=self.model.args.num_query_groups,
            names=self.model.family.lora,
        )
        self.optimizer.reload_model_params()
        self.steps = saved[0]["steps"] if saved else 0
        old = _saved_layout(saved[0]) if saved else None
        problem = None
        if not saved or any("named_adam" not in payload for payload in saved):
            problem = "its rank files hold no layout-free optimizer state (written before format 2)"
        else:
            moments = _assemble_adam([payload["named_adam"] for payload in saved])
            problem = self._set_named_adam(moments)
        if self.state.rank == 0:
            if problem is None:
                log.info("resumed %s written on layout %s at %s, optimizer state re-sharded", directory, old, self._layout())
            else:
                log.warning(
                    "resumed %s (layout %s) at layout %s with its LoRA weights; the optimizer state "
                    "restarts from zero because %s",
                    directory,
                    old,
                    self._layout(),
                    problem,
                )

    def _named_adam(self) -> dict[str, dict[str, Any]] | None:
        """This rank's Adam state per LoRA parameter, in a form any layout can read back:
        {name: {"exp_avg", "exp_avg_sq" (float32, this rank's part, flattened when the
        distributed optimizer holds a slice), "step", "shape" (the rank's shard), "full" (the
        unsharded shape), "split" (the TP-split dimension or None), "tp_rank", "range" (the
        flat [start, end) of the shard that this rank's slice covers, None for all of it)}}.
        None before the first step, or where the per-parameter state is not reachable (a bf16
        optimizer without the distributed layout)."""
        from art_mega.trainer.rank.lora import lora_layers

        out: dict[str, dict[str, Any]] = {}
        for layer_name, layer in lora_layers(self.ddp.module).items():
            for matrix in ("lora_A", "lora_B"):
                param = getattr(layer, matrix)
                place = self._main_of(param)
                if place is _NOT_HERE:
                    continue
                if place is None or not place[0].state.get(place[1]):
                    return None
                inner, main, span = place
                state = inner.state[main]
                split = _split_dim(layer, matrix)
                full = list(param.shape)
                if split is not None:
                    full[split] *= layer.tp_size
                out[f"{layer_name}.{matrix}"] = {
                    "exp_avg": state["exp_avg"].detach().float().cpu().clone(),
                    "exp_avg_sq": state["exp_avg_sq"].detach().float().cpu().clone(),
                    "step": float(state["step"]),
                    "shape": tuple(param.shape),
                    "full": tuple(full),
                    "split": split,
                    "tp_rank": layer.tp_rank if split is not None else 0,
                    "range": span,
                }
        return out

    def _set_named_adam(self, moments: dict[str, dict[str, Any]]) -> str | None:
        """Put full moments (`_assemble_adam`) into this rank's optimizer; None, or why not."""
        from art_mega.trainer.rank.lora import lora_layers

        targets = []
        for layer_name, layer in lora_layers(self.ddp.module).items():
            for matrix in ("lora_A", "lora_B"):
                name = f"{layer_name}.{matrix}"
                if name not in moments:
                    return f"the records have no state for {name}"
                param = getattr(layer, matrix)
                place = self._main_of(param)
                if place is None:
                    return "this optimizer keeps no fp32 main copy per LoRA parameter (bf16 without the distributed optimizer)"
                if place is _NOT_HERE:
                    continue
                targets.append((name, layer, matrix, *place))
        for name, layer, matrix, inner, main, span in targets:
            record = moments[name]
            state = {}
            for key in ("exp_avg", "exp_avg_sq"):
                shard = _tp_shard(record[key], _split_dim(layer, matrix), layer.tp_size, layer.tp_rank)
                flat = shard.reshape(-1)
                if span is not None:
                    flat = flat[span[0] : span[1]]
                state[key] = flat.reshape(main.shape).to(device=main.device, dtype=main.dtype).clone()
            state["step"] = torch.tensor(record["step"], dtype=torch.float32)
            inner.state[main] = state
        return None

    def _main_of(self, param: torch.Tensor) -> tuple[Any, torch.Tensor, tuple[int, int] | None] | None | Any:
        """(inner torch optimizer, main parameter, flat range) of `param` on this rank;
        `_NOT_HERE` where the distributed optimizer gives this rank no slice; None where no
        fp32 main copy is reachable."""
        distributed = False
        for sub in _sub_optimizers(self.optimizer):
            inner = getattr(sub, "optimizer", None)
            if inner is None:
                continue
            if _is_distributed(sub):
                distributed = True
                if param in sub.model_param_group_index_map:
                    group, order = sub.model_param_group_index_map[param]
                    span = sub._get_model_param_range_map(param)["param"]
                    return inner, inner.param_groups[group]["params"][order], (span.start, span.end)
                continue
            for group in inner.param_groups:
                if any(p is param for p in group["params"]):
                    return inner, param, None
        return _NOT_HERE if distributed else None

_NOT_HERE = object()
"""A parameter whose distributed-optimizer state lives on other DP ranks only."""


def _saved_layout(payload: dict[str, Any]) -> dict[str, int]:
    """The layout of a rank file, with pp = 1 for a format-1 file (written before pipelines)."""
    return {"pp": 1, "pp_rank": 0, **payload.get("layout", {})}


def _split_dim(layer: Any, matrix: str) -> int | None:
    """The dimension of `layer`'s `matrix` ("lora_A" / "lora_B") split over its TP group: B's
    rows in a column-parallel layer, A's columns in a row-parallel one (`lora.LoraLinear`)."""
    if layer.tp_size == 1:
        return None
    if layer.kind == "column":
        return 0 if matrix == "lora_B" else None
    return 1 if matrix == "lora_A" else None


def _tp_shard(full: torch.Tensor, dim: int | None, size: int, rank: int) -> torch.Tensor:
    return full if dim is None else full.chunk(size, dim=dim)[rank]


def _assemble_adam(records: list[dict[str, dict[str, Any]] | None]) -> dict[str, dict[str, Any]]:
    """Full (unsharded) Adam moments per LoRA parameter from every old rank's `_named_adam`.

    Each record holds a rank's part: its TP shard (`split`, `tp_rank`) and, under the distributed
    optimizer, a flat slice of that shard (`range`). Parts of the same shard from several DP
    ranks fill it together; DP replicas write the same values. Returns {name: {"exp_avg",
    "exp_avg_sq" (float32, `full` shape), "step"}}; a name with no record is absent."""
    shards: dict[tuple[str, int], dict[str, Any]] = {}
    for record in records:
        for name, part in (record or {}).items():
            key = (name, part["tp_rank"])
            numel = int(np.prod(part["shape"]))
            entry = shards.setdefault(
                key,
                {
                    **{m: torch.zeros(numel) for m in ("exp_avg", "exp_avg_sq")},
                    "record": part,
                },
            )
            start, end = part["range"] if part["range"] is not None else (0, numel)
            for m in ("exp_avg", "exp_avg_sq"):
                entry[m][start:end] = part[m].reshape(-1)
    out: dict[str, dict[str, Any]] = {}
    for (name, tp_rank), entry in shards.items():
        part = entry["record"]
        full = out.setdefault(
            name,
            {
                "exp_avg": torch.zeros(part["full"]),
                "exp_avg_sq": torch.zeros(part["full"]),
                "step": part["step"],
            },
        )
        for m in ("exp_avg", "exp_avg_sq"):
            shard = entry[m].reshape(part["shape"])
            if part["split"] is None:
                full[m].copy_(shard)
            else:
                size = part["full"][part["split"]] // part["shape"][part["split"]]
                full[m].chunk(size, dim=part["split"])[tp_rank].copy_(shard)
    return out


def _finalize_without_token_scaling(model: list[Any], num_tokens: Any = None, **kwargs: Any) -> None:
    """Megatron's `finalize_model_grads` without its division by the token count.

    The engine's loss is already normalised by the global weighted token count, so the
    gradients are complete once summed over DP ranks.
    """
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads(model, None, **kwargs)


def _sub_optimizers(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _is_distributed(optimizer: Any) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return isinstance(optimizer, DistributedOptimizer)


def _optimizer_state(optimizer: Any) -> dict[str, Any] | None:
    """One (non-chained) Megatron optimizer's state on this rank; None before its first step."""
    inner = getattr(optimizer, "optimizer", None)
    if inner is None or not inner.state:
        return None
    if _is_distributed(optimizer):
        param_state = optimizer.get_parameter_state_dp_reshardable()
        # The loader skips entries marked as padding and expects the mark on every entry
        # (`distrib_optimizer.py` load_parameter_state_from_dp_reshardable); this rank's own
        # entries are never padding.
        for key, per_dtype in param_state.items():
            if isinstance(key, int):
                for buckets in per_dtype.values():
                    for bucket in buckets:
                        for entry in bucket:
                            entry.setdefault("padding", False)
        return {"state": optimizer.state_dict(), "param_state": param_state}
    return {"state": optimizer.state_dict()}


def _load_optimizer_state(optimizer: Any, saved: dict[str, Any] | None) -> None:
    if saved is None:
        return
    optimizer.load_state_dict(saved["state"])
    if _is_distributed(optimizer):
        optimizer.load_parameter_state_from_dp_reshardable(saved["param_state"])
        # Without apex/TE, `DistributedOptimizer.load_state_dict` gives every parameter the same
        # `step` tensor object; torch's foreach Adam then adds 1 to it once per parameter per
        # step, and the bias correction goes wrong. Each parameter gets its own copy.
        for state in optimizer.optimizer.state.values():
            if "step" in state:
                state["step"] = state["step"].clone()

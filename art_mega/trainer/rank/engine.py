"""One trainer rank's training engine: Megatron model + LoRA, Megatron DDP and optimizer, GRPO/SFT steps.

Built once per rank after `init_parallel`; the rank's main loop calls `train_step` per job and
`export_adapter` / `save_state` for checkpoints. Every public method is collective: all ranks
of the trainer world call it, in the same order.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from typing import Any, Literal

import numpy as np
import torch

from art_mega.errors import NonFiniteStepError
from art_mega.trainer.batch import TrainBatch
from art_mega.trainer.protocol import GRPOLossConfig, LoraConfig, OptimizerConfig
from art_mega.trainer.rank.logprobs import SamplingRows, forward_logits, token_entropy, token_logprobs
from art_mega.trainer.rank.lora import apply_lora, lora_disabled, lora_parameters
from art_mega.trainer.rank.parallel import ParallelState
from art_mega.trainer.rank.saved_state import SavedState, _sub_optimizers
from art_mega.trainer.rank.step_loss import Objective, StepLoss, _Microbatch, loss_metric, objective_of


class TrainerEngine(SavedState, StepLoss):
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
        lora: LoRA hyper-parameters; its targets, when not set, the model family's default
            (`LoraNames.default_targets`). Raises `UserError` for a target the family lacks.
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
        self.optimizer_settings = optimizer
        self.micro_batch_rows = micro_batch_rows
        self.compute_entropy = compute_entropy
        # The local layer spec on every device for now: LoRA cannot wrap TransformerEngine's
        # fused-norm linears yet, and TE's causal attention ignores the packed-row mask.
        self.model = build_megatron_model(
            model_dir, device=parallel_state.device, dtype=dtype, use_te=False, recompute=parallel_state
        )
        module = self.model.module
        names = self.model.family.lora_names(self.model.args)
        if "targets" in lora.model_fields_set:
            names.normalise(lora.targets)  # a target this family lacks (q_proj on MLA): one sentence
        else:  # the model's own default, as ART's (`LoraNames.default_targets`)
            lora = lora.model_copy(update={"targets": names.default_targets})
        self.lora_config = lora
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
        loss: Objective | Literal["grpo", "sft"] = "grpo",
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

        `loss`: the step's objective, dispatched on by its type: a `GRPOLossConfig` (GRPO, an
        `RLJob`'s `loss`) or `step_loss.SFT_LOSS` (SFT), as `jobs` passes them from the job's type.
        The names "grpo" (with `loss_config`) and "sft" stand for them where no job is at hand
        (tests, benchmarks; `step_loss.objective_of`).

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

        objective = objective_of(loss, loss_config)
        lr = self.optimizer_settings.lr if learning_rate is None else learning_rate
        trained = batch.loss_mask > 0
        local_denominator = float((batch.weights * trained).sum())
        denominator, tokens = self._dp_sum([local_denominator, float(trained.sum())])
        metrics = {"loss/tokens": tokens, "loss/learning_rate": lr, "loss/nothing_trainable": 0.0}
        if denominator <= 0.0:
            metrics["loss/nothing_trainable"] = 1.0
            return metrics

        old_policy = None if old_policy_logprobs is None else {"old_policy": old_policy_logprobs}
        microbatches = self._prepare(self._microbatches(batch, old_policy), objective)
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
        step = functools.partial(self._forward_step, objective=objective, denominator=denominator)
        outputs = get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=iter(microbatches),
            model=[self.ddp],
            num_microbatches=len(microbatches),
            seq_length=batch.shape[1],
            micro_batch_size=self.micro_batch_rows,
            forward_only=False,
        )
        metrics.update(self._stage_metrics(outputs, objective, tokens))
        # Megatron's step() clips with the norm and updates in one call (and only fp16's loss
        # scaler checks for inf), so the norm is computed here first: `prepare_grads` hands the
        # gradients to the main parameters (a copy that step() repeats), nothing is updated yet.
        self.optimizer.prepare_grads()
        metrics["loss/grad_norm"] = float(self.optimizer.get_grad_norm())
        for quantity in (loss_metric(objective), "loss/grad_norm"):
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

    def _prepare(self, micro: list[dict[str, torch.Tensor]], objective: Objective) -> list[_Microbatch]:
        """Each microbatch with the loss inputs that need their own forward pass before the step
        (reference, TIS), computed for all microbatches at once (`_all_logprobs`)."""
        if not isinstance(objective, GRPOLossConfig):
            return [_Microbatch(tensors) for tensors in micro]
        loss_config = objective
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
                self._import_lora(adapter_dir)
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
        objective: Objective,
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
                logits,
                vocab_size=self.vocab_size,
                segment_ids=t["segment_ids"],
                needed=needed,
                chunk_size=objective.logprob_calculation_chunk_size,
            )
        logprobs = token_logprobs(
            logits,
            t["input_ids"],
            vocab_size=self.vocab_size,
            segment_ids=t["segment_ids"],
            chunk_size=objective.logprob_calculation_chunk_size,
            needed=needed,
            sampling=SamplingRows.from_tensors(t),
        )
        loss_fn = functools.partial(
            self._loss,
            micro=micro,
            entropy=entropy,
            objective=objective,
            denominator=denominator,
        )
        return logprobs, loss_fn


def _finalize_without_token_scaling(model: list[Any], num_tokens: Any = None, **kwargs: Any) -> None:
    """Megatron's `finalize_model_grads` without its division by the token count.

    The engine's loss is already normalised by the global weighted token count, so the
    gradients are complete once summed over DP ranks.
    """
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads(model, None, **kwargs)

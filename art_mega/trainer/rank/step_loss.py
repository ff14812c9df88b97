"""A microbatch's share of a trainer step's loss and the step's metrics: the loss function
Megatron's schedule calls after each microbatch's forward pass (`StepLoss._loss`) and the
reduction of every microbatch's diagnostics over DP (and over the pipeline, `_stage_metrics`).

`StepLoss` is a part of `engine.TrainerEngine` (its base class), kept here by concern: it reads the
engine's `compute_entropy`, `_pipelined`, `_dp_sum` and `_dp_gather`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

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
from art_mega.trainer.protocol import GRPOLossConfig
from art_mega.trainer.rank.loss import grpo_loss, known_logprobs, sft_loss


@dataclass(frozen=True)
class SFTLoss:
    """The SFT objective (`loss.sft_loss`): cross entropy on the `loss_mask` tokens weighted by
    `weights`. Its one option is the logprobs' vocabulary chunk (None: whole rows), which the
    SFT job does not set."""

    logprob_calculation_chunk_size: int | None = None


SFT_LOSS = SFTLoss()
Objective = GRPOLossConfig | SFTLoss
"""A step's objective: the step dispatches on its type (`GRPOLossConfig`: GRPO, `SFTLoss`: SFT)."""


def objective_of(loss: Objective | Literal["grpo", "sft"], loss_config: GRPOLossConfig) -> Objective:
    """`loss` itself when it is an objective; else the objective its name stands for ("grpo":
    `loss_config`, "sft": `SFT_LOSS`). Raises `ValueError` for another name."""
    if isinstance(loss, (GRPOLossConfig, SFTLoss)):
        return loss
    if loss == "grpo":
        return loss_config
    if loss == "sft":
        return SFT_LOSS
    raise ValueError(f"loss={loss!r} must be 'grpo' or 'sft'")


def loss_metric(objective: Objective) -> str:
    """The metric of `objective`'s loss: `loss/policy` (GRPO) or `loss/sft`."""
    return "loss/policy" if isinstance(objective, GRPOLossConfig) else "loss/sft"


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


class StepLoss:
    """`TrainerEngine`'s loss function and step metrics (a base class of it; see the module docstring)."""

    def _loss(
        self,
        logprobs: torch.Tensor,
        *,
        micro: _Microbatch,
        entropy: torch.Tensor | None,
        objective: Objective,
        denominator: float,
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """This microbatch's share of the step loss (SFT or GRPO, by `objective`'s type), its
        trained-token count and diagnostics."""
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
        if isinstance(objective, SFTLoss):
            value = sft_loss(new, mask, weights) * local_denominator / denominator
            info["loss_sum"] = float(value.detach())
            return value, tokens.to(torch.int), info
        loss_config: GRPOLossConfig = objective
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
        self, outputs: list[dict[str, Any]], objective: Objective, tokens: float
    ) -> dict[str, float]:
        """`_reduce_metrics`; under pipeline parallelism computed on the last stage (the only one
        with losses) and broadcast over the pipeline group, so every rank returns the same."""
        if not self._pipelined:
            return self._reduce_metrics(outputs, objective, tokens)
        from megatron.core import parallel_state as mpu

        box: list[Any] = [None]
        if mpu.is_pipeline_last_stage():
            box[0] = self._reduce_metrics(outputs, objective, tokens)
        torch.distributed.broadcast_object_list(
            box,
            src=mpu.get_pipeline_model_parallel_last_rank(),
            group=mpu.get_pipeline_model_parallel_group(),
        )
        return box[0]

    def _reduce_metrics(
        self, outputs: list[dict[str, Any]], objective: Objective, tokens: float
    ) -> dict[str, float]:
        """Step metrics from every microbatch's diagnostics, summed over DP ranks (a GRPO
        objective with `kl_penalty_coef` > 0 also reports ART's `loss/kl_policy_ref`, the token
        mean of new - ref)."""
        keys = ["loss_sum", "entropy_sum", "kl_sum", "clipped_sum", "kl_policy_ref_sum"]
        keys += ["constrained_count", "processed_count", "untagged_count"]
        local = [sum(float(out.get(key, 0.0)) for out in outputs) for key in keys]
        loss_sum, entropy_sum, kl_sum, clipped_sum, kl_policy_ref_sum, *counts = self._dp_sum(local)
        count = max(tokens, 1.0)
        metrics = {loss_metric(objective): loss_sum}
        if self.compute_entropy:
            metrics["loss/entropy"] = entropy_sum / count
        if isinstance(objective, GRPOLossConfig):
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
            if objective.kl_penalty_coef > 0:
                metrics["loss/kl_policy_ref"] = kl_policy_ref_sum / count
            gaps = self._dp_gather(torch.cat([out["sampler_gaps"] for out in outputs]))
            if gaps.numel():
                metrics[GAP_MEAN] = float(gaps.double().mean())
                metrics[GAP_P95] = float(torch.quantile(gaps.double(), 0.95))
            for name, value in zip((CONSTRAINED_FRACTION, PROCESSED_FRACTION, UNTAGGED_FRACTION), counts):
                metrics[name] = value / count
        return metrics

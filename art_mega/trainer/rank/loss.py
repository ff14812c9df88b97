"""The GRPO policy loss and the SFT loss, each term with its source. Pure torch; readable in one file.

Shapes: B sequences of S tokens; every per-token tensor is float32 [B, S] and aligned so that
position t holds the logprob of token t given tokens < t. `mask` is 1.0 on assistant (trained)
tokens and 0.0 elsewhere; `weights` is each token's weight (art-mega uses 1 / the number of
assistant tokens of its trajectory, so each trajectory counts once). An old (or inference)
logprob that is NaN on a trained token is unknown (a plain assistant message trained with
`allow_training_without_logprobs`, see `trainer.prepare.tokenize.UNKNOWN_LOGPROB`): the current policy's
logprob, detached, stands in for it, as in ART (`art/loss.py`), so that token's ratio is 1.

GRPO (Shao et al. 2024, "DeepSeekMath", eq. 3) with PPO's clipped surrogate (Schulman et al.
2017, eq. 7) or ART's default CISPO objective (MiniMax 2025, "MiniMax-M1", eq. 4: the clipped,
detached ratio weighing the REINFORCE term), each option as ART's `art/loss.py` applies it, asymmetric clip bounds as in DAPO (Yu et al. 2025, "clip-higher"), the k3 KL
estimator (Schulman 2020, "Approximating KL divergence"; GRPO eq. 4), sequence-level importance
ratios as in GSPO (Zheng et al. 2025, eq. 7-10), and truncated importance sampling against the
inference engine's logprobs (Yao et al. 2025, "Your efficient RL framework secretly brings you
off-policy RL training").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from art_mega.trainer.protocol import GRPOLossConfig


@dataclass(frozen=True)
class LossOutput:
    """The scalar loss (differentiable) and detached diagnostics over assistant tokens."""

    loss: torch.Tensor
    ratio_mean: float
    ratio_p95: float
    ratio_p99: float
    clipped_fraction: float
    kl: float
    entropy: float | None
    kl_policy_ref: float | None = None
    """ART's `loss/kl_policy_ref`: the mean of new - ref over trained tokens (with `kl_penalty_coef`)."""


def _masked_mean(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (values * weights).sum() / weights.sum().clamp_min(1e-12)


def known_logprobs(logprobs: torch.Tensor, current: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`logprobs` (old or inference, [B, S]) detached, with each NaN on a trained token (`mask`
    > 0) replaced by `current` (the policy's logprob, [B, S]) detached: an unknown sampling
    logprob is taken to be the current policy's.

    A NaN on an untrained token is kept: no tokenization writes one, so it is a real NaN, and
    the loss turns NaN for the engine's non-finite check to refuse the step.
    """
    logprobs = logprobs.detach()
    return torch.where(torch.isnan(logprobs) & (mask > 0), current.detach(), logprobs)


def _sequence_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """exp(mean of `log_ratio` over each row's trained tokens), [B, 1], with its gradient (ART's
    `group_aggregate(..., reduce="mean")` over a sequence)."""
    lengths = mask.sum(dim=1, keepdim=True).clamp_min(1.0)
    return torch.exp((log_ratio * mask).sum(dim=1, keepdim=True) / lengths)


def _ratio(new: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """The importance ratio of each token at `level` (see `GRPOLossConfig`)."""
    if level == "token":
        return torch.exp(log_ratio)
    if level == "sequence":
        # GSPO eq. 10: the value s_i, the gradient of s_i * new_t per token
        return _sequence_ratio(log_ratio, mask).detach() * torch.exp(new - new.detach())
    sequence = _sequence_ratio(log_ratio, mask)
    if level == "average":
        return (torch.exp(log_ratio) + sequence) / 2
    return torch.exp(log_ratio) ** 0.5 * sequence**0.5


def grpo_loss(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor | None = None,
    config: GRPOLossConfig = GRPOLossConfig(),
    ref_logprobs: torch.Tensor | None = None,
    inference_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    packed_rows: torch.Tensor | None = None,
) -> LossOutput:
    """GRPO policy loss, token-mean over assistant tokens with `weights`.

    Args:
        new_logprobs: [B, S] logprobs of the sampled tokens under the policy being trained.
        old_logprobs: [B, S] logprobs under the policy that sampled them (no gradient); NaN on
            a trained token: unknown, the current policy's is used (`known_logprobs`).
        advantages: [B] per sequence, or [B, S] per token.
        mask: [B, S] 1.0 on assistant tokens.
        weights: [B, S] per-token weights (default 1.0).
        config: see `GRPOLossConfig`.
        ref_logprobs: [B, S] reference-policy logprobs, needed when `config.kl_beta > 0` or
            `config.kl_penalty_coef > 0`.
        inference_logprobs: [B, S] the inference engine's logprobs, needed when `config.tis_cap`
            (and read by `config.truncated_importance_sampling` when given); NaN on a trained
            token: unknown, the old logprob is used (TIS weight 1 there).
        entropy: [B, S] per-token policy entropy, reported only.
        packed_rows: [B] int64, the packed row each sequence came from: `kl_penalty_coef`'s
            mean_kl is taken per packed row, as ART takes it per packed sequence (default: all
            B sequences are one row).

    Per token t of sequence i (ART's `art/loss.py` in this order), with A the advantage:
        ratio r_t:  token: exp(new_t - old_t); sequence: s_i = exp(mean_{t in y_i}(new_t - old_t))
                    (GSPO eq. 7, 10); average: (r_tok + s_i) / 2; geometric_average:
                    sqrt(r_tok s_i); then min(r_t, max_negative_...) and, with mask_prob_ratio,
                    0 outside (1 - eps_low, 1 + eps_high)
        A_t -= tau (new_t - old_t), no gradient                              (kimi_k2_tau)
        A_t += coef (mean_kl - kl_t), kl_t = sg[new_t] - ref_t (kl_penalty_source "sample":
               old_t - ref_t), mean_kl over the trained tokens of the sequence's packed
               row                                                           (kl_penalty_coef)
        ppo:   l_t = -min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t)   (PPO eq. 7)
        cispo: l_t = -clip(sg[r_t], 1 - eps_low, 1 + eps_high) A_t new_t       (ART's default)
        l_t *= min(q_t, C), no gradient, q_t = exp(old_t - inference_t) (tis_cap, or
               truncated_importance_sampling with inference logprobs) else r_t  (TIS)
        k3_t = exp(ref_t - new_t) - (ref_t - new_t) - 1                      (kl_beta; GRPO eq. 4)
        loss = sum_t w_t m_t (l_t + beta k3_t) / sum_t w_t m_t
    where a NaN old_t on a trained token is sg[new_t] (r_t = 1) and a NaN inference_t is old_t.

    Raises:
        ValueError: shapes disagree, or a term is enabled without its input.
    """
    if new_logprobs.shape != old_logprobs.shape or new_logprobs.shape != mask.shape:
        raise ValueError(
            f"new_logprobs {tuple(new_logprobs.shape)}, old_logprobs {tuple(old_logprobs.shape)} and mask "
            f"{tuple(mask.shape)} must have the same [B, S] shape"
        )
    if config.kl_beta > 0 and ref_logprobs is None:
        raise ValueError("kl_beta > 0 needs ref_logprobs")
    if config.kl_penalty_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_penalty_coef > 0 needs ref_logprobs")
    if config.tis_cap is not None and inference_logprobs is None:
        raise ValueError("tis_cap needs inference_logprobs")
    mask = mask.to(new_logprobs.dtype)
    # Untrained positions of the policy's (and reference's) logprobs never enter the loss, not
    # even as NaN * 0: zeroed first, their gradient is 0 (ART's loss does the same).
    new_logprobs = torch.where(mask > 0, new_logprobs, torch.zeros_like(new_logprobs))
    if ref_logprobs is not None:
        ref_logprobs = torch.where(mask > 0, ref_logprobs, torch.zeros_like(ref_logprobs))
    if entropy is not None:
        entropy = torch.where(mask > 0, entropy, torch.zeros_like(entropy))
    weights = mask if weights is None else weights.to(new_logprobs.dtype) * mask
    adv = advantages if advantages.dim() == 2 else advantages[:, None].expand_as(new_logprobs)
    old = known_logprobs(old_logprobs, new_logprobs, mask)
    log_ratio = new_logprobs - old
    ratio = _ratio(new_logprobs, log_ratio, mask, config.importance_sampling_level)
    eps_high = config.epsilon_low if config.epsilon_high is None else config.epsilon_high
    low, high = 1.0 - config.epsilon_low, 1.0 + eps_high
    if config.max_negative_advantage_importance_sampling_weight is not None:
        ratio = torch.clamp(ratio, max=config.max_negative_advantage_importance_sampling_weight)
    if config.mask_prob_ratio:
        ratio = torch.where((ratio > low) & (ratio < high), ratio, torch.zeros_like(ratio))
    if config.kimi_k2_tau is not None:
        adv = adv - config.kimi_k2_tau * log_ratio.detach()
    kl_policy_ref = None
    if config.kl_penalty_coef > 0:
        assert ref_logprobs is not None
        if config.kl_penalty_source == "sample":  # ART 0.5.23: the sampling policy's KL to ref
            kl_token = torch.where(mask > 0, old - ref_logprobs.detach(), torch.zeros_like(old)) * mask
        else:
            kl_token = (new_logprobs - ref_logprobs).detach() * mask
        rows = torch.zeros(mask.shape[0], dtype=torch.long) if packed_rows is None else packed_rows
        rows = rows.to(mask.device)
        count = int(rows.max()) + 1 if rows.numel() else 1
        row_kl = torch.zeros(count, dtype=mask.dtype, device=mask.device).index_add_(
            0, rows, kl_token.sum(dim=1)
        )
        row_tokens = torch.zeros(count, dtype=mask.dtype, device=mask.device).index_add_(
            0, rows, mask.sum(dim=1)
        )
        mean_kl = (row_kl / (row_tokens + 1e-6))[rows][:, None]
        adv = adv + config.kl_penalty_coef * (mean_kl - kl_token) * mask
        kl_policy_ref = float(kl_token.sum() / (mask.sum() + 1e-6))
    if config.loss_fn == "ppo":
        per_token = -torch.minimum(ratio * adv, torch.clamp(ratio, low, high) * adv)
    else:
        per_token = -(torch.clamp(ratio.detach(), low, high) * adv * new_logprobs)
    cap = config.tis_cap if config.tis_cap is not None else config.truncated_importance_sampling
    if cap is not None:
        if inference_logprobs is not None:
            inference = known_logprobs(inference_logprobs, old, mask)
            weight = torch.exp(old - inference)
        else:
            weight = ratio.detach()
        per_token = per_token * torch.clamp(weight, max=cap)
    kl = torch.zeros_like(new_logprobs)
    if ref_logprobs is not None:
        delta = ref_logprobs.detach() - new_logprobs
        kl = torch.exp(delta) - delta - 1.0
        per_token = per_token + config.kl_beta * kl
    loss = _masked_mean(per_token, weights)
    with torch.no_grad():
        selected = ratio.detach()[mask > 0]
        if selected.numel() == 0:
            selected = torch.ones(1, dtype=ratio.dtype)
        outside = ((ratio.detach() < low) | (ratio.detach() > high)).to(mask.dtype)
        return LossOutput(
            loss=loss,
            ratio_mean=float(selected.mean()),
            ratio_p95=float(torch.quantile(selected.float(), 0.95)),
            ratio_p99=float(torch.quantile(selected.float(), 0.99)),
            clipped_fraction=float(_masked_mean(outside, mask)),
            kl=float(_masked_mean(kl.detach(), mask)),
            entropy=None if entropy is None else float(_masked_mean(entropy.detach(), mask)),
            kl_policy_ref=kl_policy_ref,
        )


def sft_loss(logprobs: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Cross-entropy on assistant tokens: -sum(w m logp) / sum(w m).

    Args:
        logprobs: [B, S] logprobs of the target tokens under the model.
        mask: [B, S] 1.0 on the assistant tokens to learn (see `assistant_turns` in tokenization).
        weights: [B, S] optional per-token weights (default 1.0).
    """
    mask = mask.to(logprobs.dtype)
    weights = mask if weights is None else weights.to(logprobs.dtype) * mask
    return -_masked_mean(logprobs, weights)

"""The GRPO policy loss and the SFT loss, each term with its source. Pure torch; readable in one file.

Shapes: B sequences of S tokens; every per-token tensor is float32 [B, S] and aligned so that
position t holds the logprob of token t given tokens < t. `mask` is 1.0 on assistant (trained)
tokens and 0.0 elsewhere; `weights` is each token's weight (art-mega uses 1 / the number of
assistant tokens of its trajectory, so each trajectory counts once). An old (or inference)
logprob that is NaN on a trained token is unknown (a plain assistant message trained with
`allow_training_without_logprobs`, see `trainer.tokenize.UNKNOWN_LOGPROB`): the current policy's
logprob, detached, stands in for it, as in ART (`art/loss.py`), so that token's ratio is 1.

GRPO (Shao et al. 2024, "DeepSeekMath", eq. 3) with PPO's clipped surrogate (Schulman et al.
2017, eq. 7), asymmetric clip bounds as in DAPO (Yu et al. 2025, "clip-higher"), the k3 KL
estimator (Schulman 2020, "Approximating KL divergence"; GRPO eq. 4), sequence-level importance
ratios as in GSPO (Zheng et al. 2025, eq. 7-10), and truncated importance sampling against the
inference engine's logprobs (Yao et al. 2025, "Your efficient RL framework secretly brings you
off-policy RL training").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch


@dataclass(frozen=True)
class GRPOLossConfig:
    """Hyper-parameters of `grpo_loss`.

    Attributes:
        importance_sampling_level: "token" (PPO/GRPO ratio per token) or "sequence" (GSPO: one
            length-normalised ratio per sequence, shared by its tokens).
        epsilon_low: clip the ratio below at 1 - epsilon_low.
        epsilon_high: clip the ratio above at 1 + epsilon_high (None: epsilon_low).
        kl_beta: weight of the k3 KL penalty against `ref_logprobs` (0 disables it).
        tis_cap: cap C of truncated importance sampling min(pi_old / pi_inference, C); None disables it.
    """

    importance_sampling_level: Literal["token", "sequence"] = "token"
    epsilon_low: float = 0.2
    epsilon_high: float | None = None
    kl_beta: float = 0.0
    tis_cap: float | None = None

    def __post_init__(self) -> None:
        if self.importance_sampling_level not in ("token", "sequence"):
            raise ValueError(
                f"importance_sampling_level={self.importance_sampling_level!r} must be 'token' or 'sequence'"
            )
        if self.epsilon_low < 0 or (self.epsilon_high is not None and self.epsilon_high < 0):
            raise ValueError("epsilon_low and epsilon_high must be >= 0")


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
        ref_logprobs: [B, S] reference-policy logprobs, needed when `config.kl_beta > 0`.
        inference_logprobs: [B, S] the inference engine's logprobs, needed when `config.tis_cap`;
            NaN on a trained token: unknown, the old logprob is used (TIS weight 1 there).
        entropy: [B, S] per-token policy entropy, reported only.

    Per token t of sequence i, with A the advantage and r the ratio:
        token level:     r_t = exp(new_t - old_t)
        sequence level:  r_t = sg[s_i] * exp(new_t - sg[new_t]),
                         s_i = exp(mean_{t in y_i}(new_t - old_t))            (GSPO eq. 7, 10)
        surrogate_t = min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A)     (PPO eq. 7)
        kl_t = exp(ref_t - new_t) - (ref_t - new_t) - 1                      (k3; GRPO eq. 4)
        tis_t = min(exp(old_t - inference_t), C), no gradient                 (TIS)
        loss = sum_t w_t m_t (tis_t * -surrogate_t + beta kl_t) / sum_t w_t m_t
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
    if config.tis_cap is not None and inference_logprobs is None:
        raise ValueError("tis_cap needs inference_logprobs")
    mask = mask.to(new_logprobs.dtype)
    weights = mask if weights is None else weights.to(new_logprobs.dtype) * mask
    adv = advantages if advantages.dim() == 2 else advantages[:, None].expand_as(new_logprobs)
    old = known_logprobs(old_logprobs, new_logprobs, mask)
    log_ratio = new_logprobs - old
    if config.importance_sampling_level == "sequence":
        lengths = mask.sum(dim=1).clamp_min(1.0)
        seq_log_ratio = (log_ratio * mask).sum(dim=1) / lengths
        ratio = torch.exp(seq_log_ratio.detach())[:, None] * torch.exp(new_logprobs - new_logprobs.detach())
    else:
        ratio = torch.exp(log_ratio)
    eps_high = config.epsilon_low if config.epsilon_high is None else config.epsilon_high
    clipped = torch.clamp(ratio, 1.0 - config.epsilon_low, 1.0 + eps_high)
    surrogate = torch.minimum(ratio * adv, clipped * adv)
    per_token = -surrogate
    if config.tis_cap is not None:
        assert inference_logprobs is not None
        inference = known_logprobs(inference_logprobs, old, mask)
        tis = torch.clamp(torch.exp(old - inference), max=config.tis_cap)
        per_token = per_token * tis
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
        outside = ((ratio.detach() < 1.0 - config.epsilon_low) | (ratio.detach() > 1.0 + eps_high)).to(
            mask.dtype
        )
        return LossOutput(
            loss=loss,
            ratio_mean=float(selected.mean()),
            ratio_p95=float(torch.quantile(selected.float(), 0.95)),
            ratio_p99=float(torch.quantile(selected.float(), 0.99)),
            clipped_fraction=float(_masked_mean(outside, mask)),
            kl=float(_masked_mean(kl.detach(), mask)),
            entropy=None if entropy is None else float(_masked_mean(entropy.detach(), mask)),
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

"""ART's `src/art/test/test_kl_advantage.py` (KL-penalised advantages, `kl_penalty_coef`) ported
to art-mega's names: `art.loss.loss_fn(inputs, new, ref, entropies, config)` is
`trainer.rank.loss.grpo_loss(new, old, advantages, mask, config=GRPOLossConfig(...), ref_logprobs=ref)`.

ART's inputs are unshifted (its loss shifts them by one token); art-mega's are already aligned,
so ART's `assistant_mask[:, 0] = False` over 8 tokens is the aligned mask [1]*7 + [0] here.
Two differences are ported as art-mega behaves: with `kl_penalty_coef > 0` and no reference
art-mega refuses (ART ignores the option; art-mega's engine always computes the reference when
the option is on), and ART's later `kl_penalty_source` option is not in openpipe-art 0.5.18's
`dev.TrainConfig` (art-mega refuses unknown options), so its test is not ported.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the trainer's losses need torch (the cpu extra)")

from art_mega.trainer.protocol import GRPOLossConfig  # noqa: E402
from art_mega.trainer.rank.loss import grpo_loss  # noqa: E402


def _mask(seq_len: int = 8) -> torch.Tensor:
    mask = torch.ones(1, seq_len)
    mask[0, -1] = 0.0  # ART's first (unshifted) token is not the assistant's
    return mask


def _loss(new: torch.Tensor, ref: torch.Tensor | None, coef: float, advantages: torch.Tensor | None = None):
    seq_len = new.shape[1]
    old = torch.zeros(1, seq_len)  # ART's inputs["logprobs"]
    adv = torch.ones(1, seq_len) if advantages is None else advantages
    # ART's default objective (CISPO, epsilon 1.0 / 4.0) as backend.train sends it
    config = GRPOLossConfig(loss_fn="cispo", epsilon_low=1.0, epsilon_high=4.0, kl_penalty_coef=coef)
    return grpo_loss(new, old, adv, _mask(seq_len), config=config, ref_logprobs=ref)


def test_kl_advantage_no_effect_when_disabled() -> None:
    new = torch.zeros(1, 8)
    ref = torch.full((1, 8), -1.0)  # different from new
    no_kl = _loss(new, ref, 0.0)
    without_ref = _loss(new, None, 0.0)
    assert no_kl.kl_policy_ref is None and without_ref.kl_policy_ref is None
    assert no_kl.loss.item() == without_ref.loss.item()


def test_kl_advantage_enabled() -> None:
    out = _loss(torch.zeros(1, 8), torch.full((1, 8), -0.5), 0.1)
    assert out.kl_policy_ref is not None
    assert out.kl_policy_ref == pytest.approx(0.5 * 7 / (7 + 1e-6))  # positive when logprobs differ


def test_kl_advantage_zero_mean_penalty() -> None:
    """The penalty is zero-mean over assistant tokens: with every ratio 1 and PPO's loss
    -mean(A_t), the penalised loss equals the plain one."""
    torch.manual_seed(0)
    new = torch.randn(1, 16) * 0.5
    ref = torch.randn(1, 16) * 0.5
    mask = _mask(16)
    old = new.clone()  # ratio 1 everywhere
    adv = torch.ones(1, 16)
    plain = grpo_loss(new, old, adv, mask, config=GRPOLossConfig(loss_fn="ppo"))
    shaped = grpo_loss(
        new, old, adv, mask, config=GRPOLossConfig(loss_fn="ppo", kl_penalty_coef=0.1), ref_logprobs=ref
    )
    assert abs(shaped.loss.item() - plain.loss.item()) < 1e-5


def test_kl_advantage_direction() -> None:
    """Tokens with higher KL (more drift from the reference) get reduced advantages."""
    seq_len = 8
    advantages = torch.tensor([[0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0]])
    new = torch.zeros(1, seq_len)
    ref = torch.zeros(1, seq_len)
    new[0, 2], ref[0, 2] = 0.0, -2.0  # large gap: high KL
    new[0, 5], ref[0, 5] = -0.1, -0.1  # no gap
    new.requires_grad_(True)
    out = _loss(new, ref, 1.0, advantages)
    assert out.kl_policy_ref is not None
    out.loss.backward()
    # CISPO: d loss / d new_t = -r_t A_t / n; mean kl = 2/7, so A_2 = 1 + 2/7 - 2 and A_5 = 1 + 2/7
    a2, a5 = 1 + 2 / 7 - 2, 1 + 2 / 7
    assert new.grad[0, 2].item() == pytest.approx(-1.0 * a2 / 7, rel=1e-5)
    assert new.grad[0, 5].item() == pytest.approx(-torch.exp(torch.tensor(-0.1)).item() * a5 / 7, rel=1e-5)
    assert abs(new.grad[0, 2].item()) < abs(new.grad[0, 5].item())


def test_kl_advantage_needs_the_reference() -> None:
    """ART ignores kl_penalty_coef without ref_logprobs; art-mega refuses that call (its engine
    computes the reference whenever the option is on, `GRPOLossConfig.needs_reference`)."""
    with pytest.raises(ValueError, match="kl_penalty_coef > 0 needs ref_logprobs"):
        _loss(torch.zeros(1, 8), None, 0.5)
    assert GRPOLossConfig(kl_penalty_coef=0.5).needs_reference


def test_loss_masks_nonfinite_ignored_logprobs_before_arithmetic() -> None:
    mask = torch.tensor([[0.0, 1.0, 0.0, 0.0]])  # ART's [F, F, T, F] shifted by one
    advantages = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    new = torch.tensor([[float("nan"), -0.5, float("nan"), float("nan")]], requires_grad=True)
    ref = torch.tensor([[float("nan"), -0.25, float("nan"), float("nan")]])
    entropies = torch.tensor([[float("nan"), 0.125, float("nan"), float("nan")]])
    config = GRPOLossConfig(loss_fn="cispo", epsilon_low=1.0, epsilon_high=4.0, kl_penalty_coef=0.1)
    out = grpo_loss(
        new, torch.zeros(1, 4), advantages, mask, config=config, ref_logprobs=ref, entropy=entropies
    )
    assert torch.isfinite(out.loss)
    assert out.kl_policy_ref is not None and out.kl_policy_ref == pytest.approx(-0.25 / (1 + 1e-6))
    assert out.entropy == pytest.approx(0.125)
    out.loss.backward()
    assert torch.isfinite(new.grad).all()
    assert new.grad[0, 0] == 0.0 and new.grad[0, 1] != 0.0 and new.grad[0, 2] == 0.0 and new.grad[0, 3] == 0.0

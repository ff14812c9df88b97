"""The GRPO and SFT losses pinned to values computed by hand (see each comment)."""

import math

import pytest

torch = pytest.importorskip("torch", reason="the trainer's losses need torch (the cpu extra)")

from art_mega.trainer.prepare.advantages import group_advantages, token_weight  # noqa: E402
from art_mega.trainer.protocol import GRPOLossConfig  # noqa: E402
from art_mega.trainer.rank.loss import grpo_loss, sft_loss  # noqa: E402

L = math.log


def t(*rows):
    return torch.tensor(rows, dtype=torch.float32)


MASK = t([0.0, 1.0, 1.0])
OLD = t([0.0, L(0.5), L(0.5)])


def new(p1, p2):
    return t([0.0, L(p1), L(p2)]).requires_grad_(True)


def test_token_level_clipping_both_sides():
    # ratios 1.2 and 0.6; eps 0.2: A=+1 -> min(1.2,1.2)=1.2 and min(0.6,0.8)=0.6 -> loss -(1.8)/2
    out = grpo_loss(new(0.6, 0.3), OLD, torch.tensor([1.0]), MASK)
    assert out.loss.item() == pytest.approx(-0.9, abs=1e-6)
    assert out.clipped_fraction == pytest.approx(0.5)  # 0.6 < 0.8 is outside, 1.2 is on the bound
    assert out.ratio_mean == pytest.approx(0.9, abs=1e-6)
    # A=-1 -> min(-1.2,-1.2)=-1.2 and min(-0.6,-0.8)=-0.8 -> loss 2.0/2
    out = grpo_loss(new(0.6, 0.3), OLD, torch.tensor([-1.0]), MASK)
    assert out.loss.item() == pytest.approx(1.0, abs=1e-6)


def test_clipped_tokens_get_no_gradient_and_others_do():
    logprobs = new(0.75, 0.5)  # ratios 1.5 (clipped for A>0) and 1.0
    grpo_loss(logprobs, OLD, torch.tensor([1.0]), MASK).loss.backward()
    # d(-ratio*A/2)/d new = -ratio*A/2: 0 where clipped, -0.5 for ratio 1
    assert logprobs.grad.tolist()[0] == pytest.approx([0.0, 0.0, -0.5], abs=1e-6)
    logprobs = new(0.75, 0.5)
    grpo_loss(logprobs, OLD, torch.tensor([-1.0]), MASK).loss.backward()
    # A<0: min(-1.5,-1.2) = -1.5 is unclipped: gradient -ratio*A/2 = 0.75
    assert logprobs.grad.tolist()[0] == pytest.approx([0.0, 0.75, 0.5], abs=1e-6)


def test_asymmetric_clip_high():
    out = grpo_loss(
        new(0.75, 0.5),
        OLD,
        torch.tensor([1.0]),
        MASK,
        config=GRPOLossConfig(epsilon_low=0.2, epsilon_high=0.28),
    )
    # ratio 1.5 clipped at 1.28, ratio 1.0 kept: -(1.28 + 1.0)/2
    assert out.loss.item() == pytest.approx(-1.14, abs=1e-6)


def test_sequence_level_gspo_ratio():
    # s = exp(mean(ln 1.2, ln 0.6)) = sqrt(0.72) = 0.848528, inside [0.8, 1.2]: loss = -s
    out = grpo_loss(
        new(0.6, 0.3),
        OLD,
        torch.tensor([1.0]),
        MASK,
        config=GRPOLossConfig(importance_sampling_level="sequence"),
    )
    assert out.loss.item() == pytest.approx(-math.sqrt(0.72), abs=1e-6)
    assert out.ratio_mean == pytest.approx(math.sqrt(0.72), abs=1e-6)


def test_k3_kl_penalty():
    ref = t([0.0, L(0.5), L(0.5)])
    # kl_t = exp(ref-new) - (ref-new) - 1: 0.015655 and 0.155841, mean 0.085748
    out = grpo_loss(
        new(0.6, 0.3), OLD, torch.tensor([1.0]), MASK, config=GRPOLossConfig(kl_beta=0.1), ref_logprobs=ref
    )
    assert out.kl == pytest.approx(0.0857483, abs=1e-6)
    assert out.loss.item() == pytest.approx(-0.9 + 0.1 * 0.0857483, abs=1e-6)
    with pytest.raises(ValueError, match="kl_beta > 0 needs ref_logprobs"):
        grpo_loss(new(0.6, 0.3), OLD, torch.tensor([1.0]), MASK, config=GRPOLossConfig(kl_beta=0.1))


def test_truncated_importance_sampling():
    inference = t([0.0, L(0.25), L(0.5)])  # pi_old/pi_inf = 2 (capped at 1.5) and 1
    out = grpo_loss(
        new(0.6, 0.3),
        OLD,
        torch.tensor([1.0]),
        MASK,
        config=GRPOLossConfig(tis_cap=1.5),
        inference_logprobs=inference,
    )
    assert out.loss.item() == pytest.approx(-(1.5 * 1.2 + 0.6) / 2, abs=1e-6)


def test_weights_make_each_trajectory_count_once():
    # sequence a: 1 assistant token, A=+1; sequence b: 3 tokens, A=-1; all ratios 1
    logprobs = torch.zeros(2, 3)
    mask = t([1.0, 0.0, 0.0], [1.0, 1.0, 1.0])
    advantages = torch.tensor([1.0, -1.0])
    weights = t([token_weight(1)] * 3, [token_weight(3)] * 3)
    assert grpo_loss(logprobs, logprobs, advantages, mask, weights).loss.item() == pytest.approx(
        0.0, abs=1e-6
    )
    assert grpo_loss(logprobs, logprobs, advantages, mask).loss.item() == pytest.approx(0.5, abs=1e-6)


def test_shape_mismatch_is_named():
    with pytest.raises(ValueError, match="same \\[B, S\\] shape"):
        grpo_loss(torch.zeros(1, 3), torch.zeros(1, 2), torch.zeros(1), torch.ones(1, 3))
    with pytest.raises(ValueError, match="importance_sampling_level='word'"):
        GRPOLossConfig(importance_sampling_level="word")


def test_sft_loss_only_counts_masked_tokens():
    logprobs = t([L(0.5), L(0.25), L(0.125)])
    mask = t([0.0, 1.0, 1.0])
    assert sft_loss(logprobs, mask).item() == pytest.approx(-(L(0.25) + L(0.125)) / 2, abs=1e-6)


def test_group_advantages_by_hand():
    a = group_advantages([1.0, 0.0, 0.0, 1.0])
    x = 0.5 / (0.5 + 1e-6)
    assert a.advantages == pytest.approx((x, -x, -x, x))
    assert not a.skipped
    assert group_advantages([1.0, 1.0, 1.0]).skipped
    assert group_advantages([2.0, 0.0], scale_rewards=False).advantages == (1.0, -1.0)
    b = group_advantages([1.0, 0.5, 0.0])
    std = math.sqrt(0.5 / 3)
    assert b.advantages == pytest.approx((0.5 / (std + 1e-6), 0.0, -0.5 / (std + 1e-6)))
    assert b.kept() == [0, 2]
    assert token_weight(4) == 0.25 and token_weight(0) == 0.0


def test_sequence_level_clipping_both_sides_and_its_gradient():
    # One ratio per sequence s = exp(mean log-ratio) (GSPO); eps 0.2, old p = 0.5 everywhere.
    #   a: new p 0.8, 0.8    -> s = 1.6, A=+1: min(1.6, 1.2) = 1.2 clipped high -> per token -1.2
    #   b: new p 0.25, 0.25  -> s = 0.5, A=-1: min(-0.5, -0.8) = -0.8 clipped low -> per token 0.8
    #   c: new p 0.605, 0.5  -> s = sqrt(1.21 * 1.0) = 1.1, A=-1: inside -> per token 1.1
    # loss = (2 * -1.2 + 2 * 0.8 + 2 * 1.1) / 6 = 1.4 / 6
    logprobs = t([L(0.8), L(0.8)], [L(0.25), L(0.25)], [L(0.605), L(0.5)]).requires_grad_(True)
    old = torch.full((3, 2), L(0.5))
    config = GRPOLossConfig(importance_sampling_level="sequence")
    out = grpo_loss(logprobs, old, torch.tensor([1.0, -1.0, -1.0]), torch.ones(3, 2), config=config)
    assert out.loss.item() == pytest.approx(1.4 / 6, abs=1e-6)
    assert out.clipped_fraction == pytest.approx(4 / 6)
    assert out.ratio_mean == pytest.approx((2 * 1.6 + 2 * 0.5 + 2 * 1.1) / 6, abs=1e-6)
    out.loss.backward()
    # clipped sequences get none; c's tokens each get d(s * exp(new - sg new) * -A / 6) = s / 6
    assert logprobs.grad.tolist() == [
        pytest.approx([0.0, 0.0], abs=1e-6),
        pytest.approx([0.0, 0.0], abs=1e-6),
        pytest.approx([1.1 / 6, 1.1 / 6], abs=1e-6),
    ]


def test_token_level_would_clip_what_sequence_level_keeps():
    # sequence c above at token level: ratios 1.21 and 1.0, A=-1 -> min(-1.21, -1.2) = -1.21 and -1
    out = grpo_loss(t([L(0.605), L(0.5)]), torch.full((1, 2), L(0.5)), torch.tensor([-1.0]), torch.ones(1, 2))
    assert out.loss.item() == pytest.approx((1.21 + 1.0) / 2, abs=1e-6)
    assert out.clipped_fraction == pytest.approx(0.5)  # 1.21 > 1.2 is outside, though unclipped for A<0


def test_kl_gradient_alone():
    # A = 0: only beta * k3 remains; d k3 / d new = 1 - exp(ref - new), over 2 tokens
    logprobs = new(0.6, 0.3)
    ref = t([0.0, L(0.5), L(0.5)])
    out = grpo_loss(
        logprobs, OLD, torch.tensor([0.0]), MASK, config=GRPOLossConfig(kl_beta=0.1), ref_logprobs=ref
    )
    out.loss.backward()
    assert logprobs.grad.tolist()[0] == pytest.approx(
        [0.0, 0.1 * (1 - 0.5 / 0.6) / 2, 0.1 * (1 - 0.5 / 0.3) / 2], abs=1e-6
    )


def test_tis_weights_below_and_above_the_cap_and_their_gradient():
    # ratio 1 on both tokens; pi_old / pi_inference = 0.5 / 0.25 = 2 -> capped at 1.5, and 0.5 / 1 = 0.5 kept
    logprobs = new(0.5, 0.5)
    inference = t([0.0, L(0.25), 0.0])
    out = grpo_loss(
        logprobs,
        OLD,
        torch.tensor([1.0]),
        MASK,
        config=GRPOLossConfig(tis_cap=1.5),
        inference_logprobs=inference,
    )
    assert out.loss.item() == pytest.approx(-(1.5 + 0.5) / 2, abs=1e-6)
    out.loss.backward()
    assert logprobs.grad.tolist()[0] == pytest.approx([0.0, -1.5 / 2, -0.5 / 2], abs=1e-6)


def test_per_token_advantages_and_uneven_weights():
    # ratio 1: per token -A; sum w A / sum w = (1*1 + 2*-1 + 1*2) / 4; the unmasked token's weight 9 is ignored
    logprobs = torch.zeros(1, 4)
    advantages = t([1.0, -1.0, 2.0, 5.0])
    out = grpo_loss(logprobs, logprobs, advantages, t([1.0, 1.0, 1.0, 0.0]), t([1.0, 2.0, 1.0, 9.0]))
    assert out.loss.item() == pytest.approx(-0.25, abs=1e-6)


def test_ratio_quantiles_interpolate_over_trained_tokens():
    # trained ratios 1.2 and 0.6 (the masked position's ratio 1 is left out): linear interpolation
    out = grpo_loss(new(0.6, 0.3), OLD, torch.tensor([1.0]), MASK)
    assert out.ratio_p95 == pytest.approx(0.6 + 0.95 * 0.6, abs=1e-6)
    assert out.ratio_p99 == pytest.approx(0.6 + 0.99 * 0.6, abs=1e-6)


def test_sft_loss_with_weights():
    logprobs = t([L(0.5), L(0.25), L(0.9)])
    out = sft_loss(logprobs, t([1.0, 1.0, 0.0]), t([3.0, 1.0, 7.0]))
    assert out.item() == pytest.approx(-(3 * L(0.5) + L(0.25)) / 4, abs=1e-6)

"""ART's training options on a real engine step (megatron-core on gloo, the tiny llama): the
CISPO default, `kl_penalty_coef` (against the base model, the LoRA disabled) and
`precalculate_logprobs` with `truncated_importance_sampling`, each step's `loss/policy` equal to
the loss computed by hand (numpy, float64) from the engine's own logprobs before the step."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from tests.trainer.common import require_trainer_deps
from tests.trainer.engine_scenarios import LORA, OPTIMIZER
from tests.trainer.test_plain_assistant_engine import plain_turn_batch

require_trainer_deps()

CISPO = dict(loss_fn="cispo", epsilon_low=1.0, epsilon_high=4.0)


def by_hand(
    batch, new: np.ndarray, ref: np.ndarray | None = None, coef: float = 0.0, tis: float | None = None
):  # noqa: ANN001
    """CISPO over the batch: -sum w m clip(r, 0, 5) A' new / sum w m, with A' the KL-penalised
    advantage (the mean KL of each packed row) and, with `tis`, the weight min(exp(old - sampled), tis) where old is `new`."""
    mask = (batch.loss_mask > 0).astype(np.float64)
    new = new.astype(np.float64)
    sampled = batch.old_logprobs.astype(np.float64)
    old = new if tis is not None else np.where(np.isnan(sampled), new, sampled)
    ratio = np.clip(np.exp(new - old), 0.0, 5.0)
    adv = batch.advantages.astype(np.float64)
    mean_kl = None
    if coef:
        kl = (new - ref) * mask
        mean_kl = kl.sum() / (mask.sum() + 1e-6)
        per_row = kl.sum(axis=1, keepdims=True) / (
            mask.sum(axis=1, keepdims=True) + 1e-6
        )  # ART: per packed sequence
        adv = adv + coef * (per_row - kl) * mask
    per_token = -ratio * adv * new
    if tis is not None:
        per_token *= np.minimum(np.exp(old - np.where(np.isnan(sampled), old, sampled)), tis)
    weights = batch.weights.astype(np.float64) * mask
    return float((per_token * weights).sum() / weights.sum()), mean_kl


def test_art_options_train_as_computed_by_hand(megatron_world, tiny_llama_dir: Path) -> None:
    from transformers import AutoTokenizer

    from art_mega.trainer.engine import TrainerEngine
    from art_mega.trainer.loss import GRPOLossConfig

    batch = plain_turn_batch(AutoTokenizer.from_pretrained(tiny_llama_dir))
    engine = TrainerEngine(tiny_llama_dir, megatron_world, lora=LORA, optimizer=OPTIMIZER)

    loss, _ = by_hand(batch, engine.logprobs(batch))
    metrics = engine.train_step(batch, "grpo", GRPOLossConfig(**CISPO))
    assert metrics["loss/policy"] == pytest.approx(loss, abs=1e-5)
    assert "loss/kl_policy_ref" not in metrics

    # after one step the policy differs from the base model: the KL shapes the advantages
    new, ref = engine.logprobs(batch), engine.logprobs(batch, reference=True)
    assert not np.allclose(new[batch.loss_mask > 0], ref[batch.loss_mask > 0])
    assert batch.shape[0] == 2  # two packed rows: each has its own mean KL
    loss, mean_kl = by_hand(batch, new, ref, coef=0.5)
    metrics = engine.train_step(batch, "grpo", GRPOLossConfig(**CISPO, kl_penalty_coef=0.5))
    assert metrics["loss/policy"] == pytest.approx(loss, abs=1e-5)
    assert metrics["loss/kl_policy_ref"] == pytest.approx(mean_kl, abs=1e-5)

    # precalculate_logprobs: old = the trainer's own (ratio 1), the sampled ones weigh by TIS
    loss, _ = by_hand(batch, engine.logprobs(batch), tis=1.5)
    config = GRPOLossConfig(**CISPO, precalculate_logprobs=True, truncated_importance_sampling=1.5)
    metrics = engine.train_step(batch, "grpo", config)
    assert metrics["loss/policy"] == pytest.approx(loss, abs=1e-5)
    assert metrics["loss/ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert all(math.isfinite(v) for v in metrics.values()) and engine.steps == 3

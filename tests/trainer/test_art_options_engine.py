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

    from art_mega.trainer.protocol import GRPOLossConfig
    from art_mega.trainer.rank.engine import TrainerEngine

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


def test_a_step_takes_its_own_weight_decay_and_clip(megatron_world, tiny_llama_dir: Path) -> None:
    """ART decays and clips RL steps (0.1, 0.1) unlike SFT steps (0, 1.0): the job's values hold
    for that step only. At the first step B = 0, so A has no gradient and Adam leaves it: A moves
    by decoupled weight decay alone, A <- A (1 - lr wd); a clip far below the gradient's norm
    makes B's first Adam update ~ lr g / (|g| + eps) with |g| << eps, so B barely moves."""
    import torch
    from transformers import AutoTokenizer

    from art_mega.trainer.protocol import GRPOLossConfig
    from art_mega.trainer.rank.engine import TrainerEngine, _sub_optimizers
    from art_mega.trainer.rank.lora import lora_parameters

    batch = plain_turn_batch(AutoTokenizer.from_pretrained(tiny_llama_dir))
    engine = TrainerEngine(tiny_llama_dir, megatron_world, lora=LORA, optimizer=OPTIMIZER)
    before = {n: p.detach().clone() for n, p in lora_parameters(engine.ddp.module).items()}
    assert all(not bool(p.any()) for n, p in before.items() if n.endswith("lora_B"))
    engine.train_step(batch, "grpo", GRPOLossConfig(**CISPO), weight_decay=0.5, clip_grad=1e-12)
    after = {n: p.detach().clone() for n, p in lora_parameters(engine.ddp.module).items()}
    shrink = 1 - OPTIMIZER.lr * 0.5
    for name in before:
        if name.endswith("lora_A"):
            torch.testing.assert_close(after[name], before[name] * shrink, rtol=1e-6, atol=1e-9)
        else:
            assert float(after[name].abs().max()) < 1e-3 * OPTIMIZER.lr
    # the next step without them is back at the engine's settings: B moves by ~lr
    engine.train_step(batch, "grpo", GRPOLossConfig(**CISPO))
    assert all(g["weight_decay"] == OPTIMIZER.weight_decay for g in engine.optimizer.param_groups)
    assert all(sub.config.clip_grad == OPTIMIZER.clip_grad for sub in _sub_optimizers(engine.optimizer))
    moved = max(
        float(p.detach().abs().max())
        for n, p in lora_parameters(engine.ddp.module).items()
        if n.endswith("lora_B")
    )
    assert moved > 0.5 * OPTIMIZER.lr


def test_kl_against_a_reference_adapter(megatron_world, tiny_llama_dir: Path, tmp_path: Path) -> None:
    """kl_ref_adapter_path: the reference is the base model with that adapter (the policy of an
    earlier step here), and the trained LoRA is itself again after the reference pass."""
    from transformers import AutoTokenizer

    from art_mega.trainer.protocol import GRPOLossConfig
    from art_mega.trainer.rank.engine import TrainerEngine

    batch = plain_turn_batch(AutoTokenizer.from_pretrained(tiny_llama_dir))
    engine = TrainerEngine(tiny_llama_dir, megatron_world, lora=LORA, optimizer=OPTIMIZER)
    engine.train_step(batch, "grpo", GRPOLossConfig(**CISPO))
    engine.export_adapter(tmp_path / "step1")
    ref = engine.logprobs(batch)  # step 1's policy: what the adapter holds
    engine.train_step(batch, "grpo", GRPOLossConfig(**CISPO))
    new = engine.logprobs(batch)
    assert not np.allclose(new[batch.loss_mask > 0], ref[batch.loss_mask > 0])
    loss, mean_kl = by_hand(batch, new, ref, coef=0.5)
    config = GRPOLossConfig(**CISPO, kl_penalty_coef=0.5, kl_ref_adapter_path=str(tmp_path / "step1"))
    metrics = engine.train_step(batch, "grpo", config)
    assert metrics["loss/policy"] == pytest.approx(loss, abs=1e-5)
    assert metrics["loss/kl_policy_ref"] == pytest.approx(mean_kl, abs=1e-5)
    # the update went to the trained LoRA (step 2's), not to the reference's
    assert not np.allclose(engine.logprobs(batch)[batch.loss_mask > 0], ref[batch.loss_mask > 0])
    assert not np.allclose(engine.logprobs(batch)[batch.loss_mask > 0], new[batch.loss_mask > 0])

"""A real engine step (megatron-core on gloo, the tiny llama) on a GRPO batch whose plain
assistant turn trains with unknown old logprobs (`allow_training_without_logprobs`, issue 17
item 4): the step's loss is the one computed by hand with ratio 1 on those tokens, every metric is
finite, TIS keeps them at weight 1, an empty batch trains nothing, and a NaN old logprob where no
token is trained still aborts the step."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from tests.trainer.common import require_trainer_deps
from tests.trainer.engine_scenarios import LORA, OPTIMIZER

require_trainer_deps()

SEQ_LEN = 64


def plain_turn_batch(tokenizer):  # noqa: ANN001, ANN201
    from openai.types.chat.chat_completion import Choice

    import art_mega as art
    from art_mega.trainer.batch import pack
    from art_mega.trainer.prepare.tokenize import grpo_documents

    def conversation(ids: list[int], logprobs: list[float]) -> list:
        sampled = Choice.model_validate(
            {
                "index": 0,
                "finish_reason": "stop",
                "message": {"role": "assistant", "content": "x"},
                "token_ids": ids,
                "logprobs": {
                    "content": [
                        {"token": "t", "logprob": lp, "bytes": None, "top_logprobs": []} for lp in logprobs
                    ]
                },
            }
        )
        return [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi there"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "again"},
            sampled,
        ]

    group = art.TrajectoryGroup(
        [
            art.Trajectory(messages_and_choices=conversation([7, 8, 2], [-6.1, -6.2, -6.3]), reward=0.0),
            art.Trajectory(messages_and_choices=conversation([9, 2], [-6.4, -6.5]), reward=1.0),
        ]
    )
    documents, stats = grpo_documents(tokenizer, [group], allow_training_without_logprobs=True)
    assert stats.trained_tokens == 11
    (batch,) = pack(documents, SEQ_LEN)
    return batch


def expected_policy_loss(new: np.ndarray, batch) -> tuple[float, float]:  # noqa: ANN001
    """GRPO's token-level loss and mean ratio over the batch by hand (float64): eps 0.2, and
    ratio 1 where the old logprob is unknown (NaN)."""
    mask = batch.loss_mask > 0
    old = np.where(np.isnan(batch.old_logprobs), new, batch.old_logprobs).astype(np.float64)
    ratio = np.exp(new.astype(np.float64) - old)
    adv = batch.advantages.astype(np.float64)
    surrogate = np.minimum(ratio * adv, np.clip(ratio, 0.8, 1.2) * adv)
    weights = batch.weights.astype(np.float64) * mask
    return float((-surrogate * weights).sum() / weights.sum()), float(ratio[mask].mean())


def test_a_plain_turn_under_the_flag_trains_finite_with_ratio_one(
    megatron_world, tiny_llama_dir: Path
) -> None:
    import torch
    from transformers import AutoTokenizer

    from art_mega.errors import NonFiniteStepError
    from art_mega.trainer.batch import TrainBatch, pack
    from art_mega.trainer.protocol import GRPOLossConfig
    from art_mega.trainer.rank.engine import TrainerEngine
    from art_mega.trainer.rank.lora import lora_parameters

    batch = plain_turn_batch(AutoTokenizer.from_pretrained(tiny_llama_dir))
    unknown = np.isnan(batch.old_logprobs)
    assert unknown.sum() == 6 and (batch.loss_mask[unknown] == 1.0).all()
    engine = TrainerEngine(tiny_llama_dir, megatron_world, lora=LORA, optimizer=OPTIMIZER)
    before = {name: p.detach().clone() for name, p in lora_parameters(engine.ddp.module).items()}
    loss, ratio_mean = expected_policy_loss(engine.logprobs(batch), batch)

    metrics = engine.train_step(batch, "grpo", GRPOLossConfig())
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert metrics["loss/tokens"] == 11 and metrics["loss/nothing_trainable"] == 0.0
    assert metrics["loss/policy"] == pytest.approx(loss, abs=1e-5)
    assert metrics["loss/ratio_mean"] == pytest.approx(ratio_mean, abs=1e-5)
    assert metrics["loss/grad_norm"] > 0.0
    assert any(not torch.equal(before[n], p) for n, p in lora_parameters(engine.ddp.module).items())

    # TIS: the batch's logprobs are the inference engine's; unknown ones get weight 1
    tis = engine.train_step(batch, "grpo", GRPOLossConfig(tis_cap=2.0))
    assert all(math.isfinite(v) for v in tis.values()), tis
    assert engine.steps == 2

    # a GRPO step whose plain-only trajectories trained nothing: an all-padding batch
    (empty,) = pack([], SEQ_LEN)
    assert engine.train_step(empty)["loss/nothing_trainable"] == 1.0 and engine.steps == 2

    # a NaN where no token is trained is a real NaN: the step is refused, nothing changes
    poisoned = TrainBatch(**{name: value.copy() for name, value in vars(batch).items()})
    poisoned.old_logprobs[0, 0] = np.nan
    assert poisoned.loss_mask[0, 0] == 0.0
    kept = {name: p.detach().clone() for name, p in lora_parameters(engine.ddp.module).items()}
    with pytest.raises(NonFiniteStepError) as info:
        engine.train_step(poisoned)
    assert info.value.quantity == "loss/policy"
    assert engine.steps == 2
    assert all(torch.equal(kept[n], p) for n, p in lora_parameters(engine.ddp.module).items())

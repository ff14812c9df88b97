"""ART's several optimizer steps per train call on a real trainer rank (TP=1, this process, gloo):
an rl job with `step_rows` takes one optimizer step per that many rows of its batch (by
default one row per DP rank and step, ART's), and its weights are those of the same steps
taken one by one; a recomputing loss (precalculate_logprobs)
reads the old policy of all its steps from before the first one."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from tests.trainer.common import require_trainer_deps

require_trainer_deps()

from art_mega.trainer.batch import DTYPES, Document, TrainBatch, pack_steps  # noqa: E402
from art_mega.trainer.protocol import GRPOLossConfig, RLJob  # noqa: E402
from tests.trainer.engine_scenarios import LORA, OPTIMIZER  # noqa: E402

SEQ_LEN = 16


def documents(vocab_size: int) -> list[Document]:
    """Three documents of 10, 9 and 8 tokens: no two share a 16-token row, so they pack into 3 rows."""
    rng = np.random.default_rng(7)
    docs = []
    for length, advantage in ((10, 1.0), (9, -0.5), (8, 0.75)):
        docs.append(
            Document(
                input_ids=rng.integers(3, vocab_size, length).tolist(),
                loss_mask=[0.0] * 3 + [1.0] * (length - 3),
                old_logprobs=[0.0] * 3 + [-6.5] * (length - 3),
                advantage=advantage,
                weight=1.0 / (length - 3),
            )
        )
    return docs


def rows(batch: TrainBatch, first: int, last: int) -> TrainBatch:
    return TrainBatch(**{name: getattr(batch, name)[first:last] for name in DTYPES})


def lora(engine: Any) -> dict[str, Any]:
    from art_mega.trainer.rank.lora import lora_parameters

    return {name: p.detach().clone() for name, p in lora_parameters(engine.ddp.module).items()}


@pytest.fixture
def fresh(megatron_world, tiny_dirs: dict[str, Path]) -> Any:
    """Builds n identical fresh engines of the tiny llama (one thread: tiny matrices)."""
    import torch

    from art_mega.trainer.rank.engine import TrainerEngine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield lambda n: [
            TrainerEngine(tiny_dirs["llama"], megatron_world, lora=LORA, optimizer=OPTIMIZER)
            for _ in range(n)
        ]
    finally:
        torch.set_num_threads(threads)


def run_job(engine: Any, world: Any, batch: TrainBatch, tmp_path: Path, **job: Any) -> dict[str, float]:
    from art_mega.trainer.rank.jobs import run_train_job

    (tmp_path / "batch").mkdir()
    batch.save(tmp_path / "batch" / "dp0.safetensors")
    rl = RLJob(step=1, batch_dir=str(tmp_path / "batch"), checkpoint_dir=str(tmp_path / "0001"), **job)
    shared_root = SimpleNamespace(host_local_root=False)  # the RankConfig field the save reads
    metrics, adapter = run_train_job(rl, world, engine, shared_root, last_step=0)
    assert adapter is not None and adapter.step == 1
    return metrics


def test_n_sequences_with_k_per_step_take_ceil_n_over_k_steps_equal_to_sequential_updates(
    megatron_world, fresh: Any, tmp_path: Path
) -> None:
    job, by_hand, one_step = fresh(3)
    docs = documents(job.vocab_size)
    # 3 rows, grad_accumulation_sequences=2 on one DP rank: steps of rows {0, 1} and {2, padding}
    (batch,) = pack_steps(docs, SEQ_LEN, 1, 2)
    assert batch.shape == (4, SEQ_LEN) and batch.segment_ids[3].max() == 0
    metrics = run_job(job, megatron_world, batch, tmp_path, learning_rate=1e-2, step_rows=2)
    assert job.steps == 2  # ceil(3 / 2)

    first = by_hand.train_step(rows(batch, 0, 2), learning_rate=1e-2)
    second = by_hand.train_step(rows(batch, 2, 4), learning_rate=1e-2)
    assert by_hand.steps == 2
    for name, value in lora(by_hand).items():
        assert np.array_equal(value.numpy(), lora(job)[name].numpy()), name
    # the job's metrics are the two steps' means (ART's average_metric_samples)
    for key in ("loss/policy", "loss/grad_norm", "loss/tokens", "loss/learning_rate"):
        assert metrics[key] == pytest.approx((first[key] + second[key]) / 2, rel=1e-12), key
    assert metrics["loss/tokens"] == (7 + 6 + 5) / 2  # step 0: the 10- and 9-token rows

    # one step over all three rows is another update: the split is what the weights show
    one_step.train_step(batch, learning_rate=1e-2)
    assert one_step.steps == 1
    assert any(not np.allclose(v.numpy(), lora(job)[n].numpy()) for n, v in lora(one_step).items())


def test_arts_default_is_one_step_per_packed_row_equal_to_the_rows_applied_one_by_one(
    megatron_world, fresh: Any, tmp_path: Path
) -> None:
    from art_mega.backend import rl_step_batches

    job, by_hand = fresh(2)
    docs = documents(job.vocab_size)
    # grad_accumulation_sequences=None on one DP rank: the backend sends 3 rows, 1 per step
    (batch,), step_rows = rl_step_batches(docs, SEQ_LEN, 1, None)
    assert batch.shape == (3, SEQ_LEN) and step_rows == 1
    metrics = run_job(job, megatron_world, batch, tmp_path, learning_rate=1e-2, step_rows=step_rows)
    assert job.steps == 3
    samples = [by_hand.train_step(rows(batch, k, k + 1), learning_rate=1e-2) for k in range(3)]
    for name, value in lora(by_hand).items():
        assert np.array_equal(value.numpy(), lora(job)[name].numpy()), name
    assert metrics["loss/tokens"] == (7 + 6 + 5) / 3 == np.mean([s["loss/tokens"] for s in samples])
    # on 2 DP ranks ART's default is 2 rows per step, one on each rank: 2 steps, the last padded
    ranks, step_rows = rl_step_batches(docs, SEQ_LEN, 2, None)
    assert step_rows == 1 and [b.shape for b in ranks] == [(2, SEQ_LEN), (2, SEQ_LEN)]
    assert ranks[1].segment_ids[1].max() == 0


def test_several_steps_take_the_old_policy_from_before_the_first(
    megatron_world, fresh: Any, tmp_path: Path
) -> None:
    job, by_hand, per_step = fresh(3)
    loss = GRPOLossConfig(precalculate_logprobs=True, truncated_importance_sampling=2.0)
    (batch,) = pack_steps(documents(job.vocab_size), SEQ_LEN, 1, 2)
    run_job(job, megatron_world, batch, tmp_path, learning_rate=1e-2, step_rows=2, loss=loss)

    before = by_hand.logprobs(batch)  # ART precalculates them once, before the first step
    for k in range(2):
        by_hand.train_step(
            rows(batch, 2 * k, 2 * k + 2),
            loss_config=loss,
            learning_rate=1e-2,
            old_policy_logprobs=before[2 * k : 2 * k + 2],
        )
    for name, value in lora(by_hand).items():
        assert np.array_equal(value.numpy(), lora(job)[name].numpy()), name

    # recomputed before each step instead, the second step's old policy is the updated one
    for k in range(2):
        per_step.train_step(rows(batch, 2 * k, 2 * k + 2), loss_config=loss, learning_rate=1e-2)
    assert any(not np.allclose(v.numpy(), lora(job)[n].numpy()) for n, v in lora(per_step).items())


def test_a_batch_that_does_not_split_into_step_rows_is_refused(
    megatron_world, fresh: Any, tmp_path: Path
) -> None:
    (engine,) = fresh(1)
    (batch,) = pack_steps(documents(engine.vocab_size), SEQ_LEN, 1, 2)
    with pytest.raises(ValueError, match="has 4 rows, not a multiple of the job's step_rows=3"):
        run_job(engine, megatron_world, batch, tmp_path, learning_rate=1e-2, step_rows=3)
    assert engine.steps == 0

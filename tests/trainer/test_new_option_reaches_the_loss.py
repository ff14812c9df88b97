"""A new GRPO option is one field: a throwaway `loss_scale_for_test` (a `GRPOOptions` field with
its range, and the same field on `GRPOLossConfig`) given to `model.train` travels through
`backend.train` (checked, `GRPOOptions.loss_fields`) into the `RLJob` the backend sends, over the
process boundary (JSON), to the rank's job runner (`jobs._rl_steps` -> `engine.train_step` ->
`step_loss` -> `grpo_loss`), where it multiplies the loss: the step's `loss/policy` is 3x the same
step's at the default 1.0, which equals the CISPO loss computed by hand. A value out of its range
is refused at `backend.train` in one sentence.

A test cannot add a field to the classes themselves, so it subclasses them and swaps the names
where they are looked up: `backend.step.GRPOOptions`, `protocol.GRPOLossConfig` (read by
`loss_fields`), `backend.step.GRPOLossConfig` and `backend.step.RLJob` (an `RLJob` serializes its
`loss` by the declared class, so a subclass's field would not cross the boundary; a field added to
`GRPOLossConfig` itself does); the rank's use of the option is a wrapper around `grpo_loss`.
The backend runs its real step up to the job (packing, the batch file); only sending the batch
to the ranks and running the job there are replaced by this process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated, Any

import numpy as np
import pytest
from pydantic import Field

from tests.trainer.common import require_trainer_deps

require_trainer_deps()

import art_mega as art  # noqa: E402
from art_mega.backend import MegatronBackend  # noqa: E402
from art_mega.errors import HyperParameterError  # noqa: E402
from art_mega.hyperparams import positive_problem  # noqa: E402
from art_mega.train_options import Check, GRPOOptions  # noqa: E402
from art_mega.trainer import protocol  # noqa: E402
from art_mega.trainer.protocol import Finite, GRPOLossConfig, RLJob  # noqa: E402
from tests.trainer.engine_scenarios import LORA, OPTIMIZER  # noqa: E402
from tests.trainer.test_art_options_engine import by_hand  # noqa: E402


class ScaledOptions(GRPOOptions):
    loss_scale_for_test: Annotated[float, Check(positive_problem, "3.0", float)] = 1.0


class ScaledLoss(GRPOLossConfig):
    loss_scale_for_test: Finite = Field(default=1.0, gt=0)
    """Multiplies the GRPO loss (this test's throwaway option)."""


class ScaledJob(RLJob):
    loss: ScaledLoss = ScaledLoss()


class _Sent(Exception):
    """The job the backend would run on the ranks (raised instead of running it)."""

    def __init__(self, job: RLJob) -> None:
        super().__init__("sent")
        self.job = job


def trajectory(reply: str, reward: float) -> art.Trajectory:
    return art.Trajectory(
        messages_and_choices=[
            {"role": "user", "content": "say something"},
            {"role": "assistant", "content": reply},
        ],
        reward=reward,
    )


@pytest.fixture
def scaled(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The option added (the four lookups swapped) and used on the rank: `grpo_loss` times the
    config's `loss_scale_for_test`. Returns the scales the rank's loss saw, one per call."""
    from art_mega.backend import step
    from art_mega.trainer.rank import step_loss

    monkeypatch.setattr(step, "GRPOOptions", ScaledOptions)
    monkeypatch.setattr(protocol, "GRPOLossConfig", ScaledLoss)
    monkeypatch.setattr(step, "GRPOLossConfig", ScaledLoss)
    monkeypatch.setattr(step, "RLJob", ScaledJob)
    real = step_loss.grpo_loss
    seen: list[float] = []

    def grpo_loss(*args: Any, config: ScaledLoss, **kwargs: Any) -> Any:
        seen.append(config.loss_scale_for_test)
        out = real(*args, config=config, **kwargs)
        return dataclasses.replace(out, loss=out.loss * config.loss_scale_for_test)

    monkeypatch.setattr(step_loss, "grpo_loss", grpo_loss)
    return seen


def sent_job(model: art.TrainableModel, **options: Any) -> str:
    """The JSON of the job `model.train(groups, **options)` sends to the ranks."""
    groups = [
        art.TrajectoryGroup(
            [trajectory("yes, fine", 1.0), trajectory("no", 0.0), trajectory("maybe so", 0.5)]
        )
    ]
    with pytest.raises(_Sent) as sent:
        asyncio.run(model.train(groups, allow_training_without_logprobs=True, **options))
    return sent.value.job.model_dump_json()


def test_a_new_option_reaches_the_loss(scaled, megatron_world, tiny_llama_dir: Path, tmp_path: Path) -> None:  # noqa: ANN001
    from art_mega.trainer.batch import TrainBatch
    from art_mega.trainer.rank.engine import TrainerEngine
    from art_mega.trainer.rank.jobs import _rl_steps

    backend = MegatronBackend(seq_len=64)
    model = art.TrainableModel(name="m", project="p", base_model="tiny")
    backend._model, backend._model_dir, model._backend = model, tiny_llama_dir, backend
    backend._run_dir = tmp_path
    backend._runtime = SimpleNamespace(topology=SimpleNamespace(trainer_ranks=[SimpleNamespace(dp_rank=0)]))

    async def send_batches(batch_dir: Path) -> None:  # the batch stays where the rank reads it
        assert (batch_dir / "dp0.safetensors").is_file()

    async def run_and_commit(job: RLJob, metrics: dict[str, float]) -> Any:
        raise _Sent(job)

    backend._send_batches = send_batches  # type: ignore[method-assign]
    backend._run_and_commit = run_and_commit  # type: ignore[method-assign]

    # the edge: out of range is one sentence, before anything is packed
    for bad in (-1.0, math.nan):
        with pytest.raises(HyperParameterError) as info:
            asyncio.run(model.train([], loss_scale_for_test=bad))
        assert str(info.value) == (
            f"backend.train(loss_scale_for_test={bad!r}) must be a finite number greater than 0 "
            f"({'not above 0' if bad < 0 else 'not finite'}); pass e.g. loss_scale_for_test=3.0"
        )
        assert info.value.name == "loss_scale_for_test"

    # the boundary: the job as JSON, read back as the rank reads it
    wires = {scale: sent_job(model, loss_scale_for_test=scale) for scale in (1.0, 3.0)}
    wires[None] = sent_job(model)  # not given: the default
    jobs = {scale: ScaledJob.model_validate_json(wire) for scale, wire in wires.items()}
    assert [jobs[s].loss.loss_scale_for_test for s in (None, 1.0, 3.0)] == [1.0, 1.0, 3.0]
    assert jobs[3.0].loss.loss_fn == "cispo" and jobs[3.0].loss.epsilon_high == 4.0  # ART's defaults too
    with pytest.raises(ValueError, match="loss_scale_for_test"):  # a rank without the field refuses it
        RLJob.model_validate_json(wires[3.0])

    # the rank: each job on a fresh engine (the same start), through the job runner
    batch = TrainBatch.load(Path(jobs[3.0].batch_dir) / "dp0.safetensors")
    assert float(np.abs(batch.advantages * batch.loss_mask).sum()) > 0  # a step with a loss
    losses = {}
    for scale in (1.0, 3.0):
        engine = TrainerEngine(tiny_llama_dir, megatron_world, lora=LORA, optimizer=OPTIMIZER)
        expected, _ = by_hand(batch, engine.logprobs(batch))
        losses[scale] = _rl_steps(jobs[scale], megatron_world, engine, jobs[scale].step)["loss/policy"]
        assert losses[scale] == pytest.approx(scale * expected, rel=1e-5, abs=1e-6)
    assert abs(losses[1.0]) > 1e-3 and losses[3.0] == pytest.approx(3.0 * losses[1.0], rel=1e-5)
    assert set(scaled) == {1.0, 3.0}  # the rank's loss read the option

"""A trainer step's objective is dispatched on by its type (`trainer.rank.step_loss`), and rank 0's
save hands its main loop a typed `CommittedAdapter` (`trainer.rank.jobs`)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

pytest.importorskip("torch", reason="the cpu extra (torch) is not installed")

from art_mega.trainer.protocol import GRPOLossConfig  # noqa: E402
from art_mega.trainer.rank.jobs import CommittedAdapter  # noqa: E402
from art_mega.trainer.rank.step_loss import SFT_LOSS, SFTLoss, loss_metric, objective_of  # noqa: E402


def test_a_job_objective_is_taken_as_it_is_and_names_stand_for_one():
    cispo = GRPOLossConfig(loss_fn="cispo", logprob_calculation_chunk_size=64)
    assert objective_of(cispo, GRPOLossConfig()) is cispo  # an RLJob's loss: the given loss_config is unused
    assert objective_of(SFT_LOSS, cispo) is SFT_LOSS
    assert objective_of("grpo", cispo) is cispo
    assert objective_of("sft", cispo) is SFT_LOSS
    assert SFT_LOSS.logprob_calculation_chunk_size is None  # SFT's logprobs run over whole rows
    with pytest.raises(ValueError, match="loss='ppo' must be 'grpo' or 'sft'"):
        objective_of("ppo", cispo)


def test_the_loss_metric_follows_the_objective_type():
    assert loss_metric(GRPOLossConfig()) == "loss/policy"
    assert loss_metric(SFTLoss()) == "loss/sft"


def test_a_committed_adapter_is_typed():
    adapter = CommittedAdapter(path="/r/checkpoints/0003", step=3, sha256="ab" * 32)
    assert (adapter.path, adapter.step, adapter.sha256) == ("/r/checkpoints/0003", 3, "ab" * 32)
    with pytest.raises(ValidationError):
        CommittedAdapter(path="/r/checkpoints/0003", step="3", sha256="ab")  # a step is a strict int
    with pytest.raises(ValidationError):
        CommittedAdapter(path="/x", step=1, sha256="ab", event="adapter_ready")  # no untyped extras

"""CP=2 across two gloo processes (the CPU core attention of `cp_attention.py`) against one process:
Megatron's split, logits, packed-row logprobs, and three GRPO steps with LoRA."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.trainer.common import RankProcesses, input_ids, megatron_logits, require_trainer_deps

require_trainer_deps()

from tests.trainer.cp_worker import CP_MODELS, packed_forward  # noqa: E402
from tests.trainer.engine_scenarios import STEP_LOSSES, assert_steps_match, training  # noqa: E402
from tests.trainer.test_cpu_compat import only_patch as only_patch_fixture  # noqa: E402
from tests.trainer.test_cpu_compat import unpatched_fails  # noqa: E402
from tests.trainer.test_lora_engine import ADAM_DRIFT_TOLERANCE, COMPARED_METRICS  # noqa: E402

only_patch = only_patch_fixture
"""test_cpu_compat's fixture: remove every CPU patch, apply one, restore them afterwards."""

CP_TOLERANCE = 1e-5
"""Logits, logprobs, loss and grad norm: CP=2 against one process (issue 5)."""
WORLD = 2


@pytest.fixture(scope="session")
def cp_world(tiny_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[RankProcesses]:
    """The 2-rank `tests.trainer.cp_worker` world, started (not awaited): the one-process reference
    runs while it works."""
    models = {name: tiny_dirs[name] for name in CP_MODELS}
    world = RankProcesses("tests.trainer.cp_worker", tmp_path_factory.mktemp("cp-worker"), models, WORLD)
    yield world
    world.kill()


@pytest.fixture(scope="session")
def cp1_reference(megatron_world, tiny_dirs: dict[str, Path], cp_world, tmp_path_factory) -> dict:
    """What the worker computes, in this process's one-rank world (CP=1)."""
    import torch

    from art_mega.trainer.model_builder import build_megatron_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        results: dict[str, object] = {}
        for name in CP_MODELS:
            built = build_megatron_model(tiny_dirs[name])
            results[f"logits/{name}"] = megatron_logits(built, input_ids(built.vocab_size))
            results[f"packed/{name}"] = packed_forward(built)
        out = tmp_path_factory.mktemp("cp1-reference")
        results["training/llama"] = training(megatron_world, str(tiny_dirs["llama"]), out, dp_split=False)
        return results
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def cp2_results(cp_world: RankProcesses, cp1_reference: dict) -> list[dict]:
    return cp_world.results()


def test_cpu_rope_cp_slice(megatron_world, only_patch) -> None:
    # The CP=2 worker checks the slice itself (`megatron_split`); one rank holds every angle.
    import torch
    from megatron.core import parallel_state as mpu
    from megatron.core.models.common.embeddings.rope_utils import get_pos_emb_on_this_cp_rank

    from art_mega.trainer.rank import cpu_compat

    angles = torch.arange(16.0).reshape(8, 1, 1, 2)
    group = mpu.get_context_parallel_group()
    unpatched_fails(lambda: get_pos_emb_on_this_cp_rank(angles, 0, group))
    only_patch("cpu_rope_cp_slice")
    assert torch.equal(get_pos_emb_on_this_cp_rank(angles, 0, group), angles)
    assert cpu_compat.applied_patches() == ("cpu_rope_cp_slice",)


def test_ranks_split_rows_like_megatron(cp2_results: list[dict]) -> None:
    for rank, results in enumerate(cp2_results):
        assert results["state"] == (1, 2, 1, rank)
        assert results["megatron_split"] == {"tokens": True, "attention_mask": True, "rope": True}


@pytest.mark.parametrize("name", CP_MODELS)
def test_cp2_logits_and_logprobs_match_one_process(
    name: str, cp2_results: list[dict], cp1_reference: dict
) -> None:
    reference = cp1_reference[f"packed/{name}"]
    assert reference["logprobs"].abs().sum() > 0 and (reference["logprobs"] == 0).any()
    for rank, results in enumerate(cp2_results):
        diffs = {
            "plain logits": (results[f"logits/{name}"] - cp1_reference[f"logits/{name}"]).abs().max().item()
        }
        for key, expected in reference.items():
            got = results[f"packed/{name}"][key]
            assert got.shape == expected.shape
            diffs[f"packed {key}"] = (got - expected).abs().max().item()
        print(f"{name} rank {rank}: " + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items()))
        assert max(diffs.values()) <= CP_TOLERANCE, diffs


def test_cp2_grpo_steps_match_one_process(cp2_results: list[dict], cp1_reference: dict) -> None:
    reference = cp1_reference["training/llama"]
    for rank, results in enumerate(cp2_results):
        run = results["training/llama"]
        assert len(run["metrics"]) == len(STEP_LOSSES)
        assert_steps_match(f"cp2 rank {rank}", run["metrics"], reference["metrics"], CP_TOLERANCE)
        logits = (run["logits"] - reference["logits"]).abs().max().item()
        print(f"cp2 rank {rank}: max |logits - one process| after {len(STEP_LOSSES)} steps = {logits:.1e}")
        assert logits <= ADAM_DRIFT_TOLERANCE
        for key in COMPARED_METRICS:
            assert run["resumed_metrics"][key] == pytest.approx(run["metrics"][2][key], abs=1e-7), key
        assert (run["resumed_logits"] - run["logits"]).abs().max().item() <= 1e-6
        assert (run["imported_logits"] - run["logits"]).abs().max().item() <= 1e-6, (
            "export + import round trip"
        )

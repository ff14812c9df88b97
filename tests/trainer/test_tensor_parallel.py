"""TP=2 and DP=2 across two gloo processes give the TP=1 logits; TP=2 refuses a 3-head model."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.trainer.common import EQUIVALENCE_MODELS, RankProcesses, require_trainer_deps

require_trainer_deps()

TP_TOLERANCE = 1e-5
WORLD = 2


@pytest.fixture(scope="session")
def two_rank_results(tiny_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Each rank's results from `tests.trainer.tp_worker` (TP=2 phase, then TP=1/DP=2 phase)."""
    world = RankProcesses("tests.trainer.tp_worker", tmp_path_factory.mktemp("tp-worker"), tiny_dirs, WORLD)
    try:
        return world.results()
    finally:
        world.kill()


@pytest.mark.parametrize("name", EQUIVALENCE_MODELS)
def test_tp2_matches_tp1(name: str, two_rank_results: list[dict], tp1_logits: dict) -> None:
    for rank, results in enumerate(two_rank_results):
        assert results["tp2_state"] == (2, 1, rank, 0)
        diff = (results[f"tp2/{name}"] - tp1_logits[name]).abs().max().item()
        print(f"{name} rank {rank}: max |tp2 - tp1| = {diff:.2e}")
        assert diff <= TP_TOLERANCE


def test_dp2_ranks_match_tp1(two_rank_results: list[dict], tp1_logits: dict) -> None:
    for rank, results in enumerate(two_rank_results):
        assert results["dp2_state"] == (1, 2, 0, rank)
        assert (results["dp2/llama"] - tp1_logits["llama"]).abs().max().item() <= TP_TOLERANCE


def test_tp2_refuses_three_heads_before_allocating(two_rank_results: list[dict]) -> None:
    for results in two_rank_results:
        assert results["tp2_error"] == (
            "tp=2 cannot split this llama model (3 attention heads, 3 KV heads, FFN size 192); use tp in {1, 3}."
        )

"""A checkpoint resumes on another parallel layout: trained at TP=2 (2 steps, then a checkpoint
as `jobs.write_checkpoint` stages it), resumed at TP=1 x DP=2 (the distributed optimizer) and at
PP=2, the next two steps equal the unbroken TP=2 run's. The LoRA comes from the checkpoint's PEFT
adapter; Adam's moments are re-sharded from every old rank's layout-free record
(`TrainerEngine.load_portable`), which the second resumed step needs: with restarted moments
its update, and so its loss, would differ."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.trainer.common import RankProcesses, require_trainer_deps
from tests.trainer.engine_scenarios import assert_steps_match
from tests.trainer.test_lora_engine import LAYOUT_TOLERANCE

require_trainer_deps()
pytestmark = pytest.mark.timeout(900)  # gloo worlds of tiny models, started in the first test

RESUMED = ("tp1dp2", "pp2")


@pytest.fixture(scope="module")
def resume_results(tiny_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    world = RankProcesses(
        "tests.trainer.resume_layout_worker",
        tmp_path_factory.mktemp("resume-layout"),
        {"llama": tiny_dirs["llama"]},
    )
    try:
        return world.results(timeout=1200)
    finally:
        world.kill()


@pytest.mark.parametrize("layout", RESUMED)
def test_resumed_steps_equal_the_unbroken_run(layout: str, resume_results: list[dict]) -> None:
    from safetensors.torch import load_file

    for rank, results in enumerate(resume_results):
        unbroken, resumed = results["tp2"], results[layout]
        assert resumed["steps"] == 4
        assert resumed["adam_steps"] == [2.0], "Adam's moments and step came from the checkpoint"
        assert_steps_match(f"{layout} rank {rank}", resumed["metrics"], unbroken["metrics"], LAYOUT_TOLERANCE)
        ours = load_file(Path(resumed["adapter"]) / "adapter_model.safetensors")
        theirs = load_file(Path(unbroken["adapter"]) / "adapter_model.safetensors")
        diff = max((ours[key] - theirs[key]).abs().max().item() for key in theirs)
        print(f"{layout} rank {rank}: max |adapter after step 4 - unbroken| = {diff:.1e}")
        assert set(ours) == set(theirs) and diff <= LAYOUT_TOLERANCE

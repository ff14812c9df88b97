"""benchmarks/_memory_plan_rank.py's tensor accounting: a recording counts only what it allocates,
not the live tensors of an earlier one (the build's weights were once counted again in the step)."""

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

BENCH = Path(__file__).resolve().parents[3] / "benchmarks"
sys.path.insert(0, str(BENCH))

import _memory_plan_rank  # noqa: E402


def test_a_recording_does_not_count_an_earlier_recordings_live_tensors():
    kept, built_live, built_peak = _memory_plan_rank.tensor_bytes(lambda: torch.empty(10_000_000))
    assert (built_live, built_peak) == (40_000_000, 40_000_000)

    def step() -> None:
        scratch = torch.empty(1_000_000)
        del scratch
        torch.empty(250_000)  # freed at once too

    _, step_live, step_peak = _memory_plan_rank.tensor_bytes(step)
    assert (step_live, step_peak) == (0, 4_000_000)
    assert kept.numel() == 10_000_000  # still live through the second recording

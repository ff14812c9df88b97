"""benchmarks/pipeline.py's pure parts: the core split per process kind and the figures from
both modes' step events (steps per minute without the first step, the ratio, staleness)."""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import pipeline  # noqa: E402


def test_cores_split_this_process_affinity_in_two() -> None:
    replica, trainer = pipeline.cores()
    mine = os.sched_getaffinity(0)
    assert replica and trainer and replica | trainer == mine
    assert (replica & trainer) == (mine if len(mine) == 1 else set())


def test_figures_from_step_events() -> None:
    def steps(*seconds, **extra):
        return [{"event": "step", "step": i, "step_s": s, **extra} for i, s in enumerate(seconds)]

    sync = steps(50, 30, 30)  # its steps after the first trained 1 group each, the pipeline's 4
    for event, groups in zip(sync, (4.0, 1.0, 1.0)):
        event["groups"] = groups
    runs = {
        "sync": [[*sync, {"event": "done", "val_reward": 0.5}]],
        "pipeline": [
            [
                *steps(50, 20, 20, stale_fraction=0.5, staleness=0.5, groups=4.0),
                {"event": "done", "val_reward": 0.75},
            ]
        ],
    }
    figures = pipeline.summarize(runs)
    assert figures["sync_steps_per_min"] == pytest.approx(2.0)  # the 50 s first step is left out
    assert figures["pipeline_steps_per_min"] == pytest.approx(3.0)
    assert figures["ratio"] == pytest.approx(1.5)
    assert (figures["sync_val_reward"], figures["pipeline_val_reward"]) == (0.5, 0.75)
    assert figures["pipeline_stale_fraction"] == figures["pipeline_mean_staleness"] == 0.5
    # equal work: 2 groups in 60 s against 8 in 40 s
    assert figures["sync_trained_groups_per_min"] == pytest.approx(2.0)
    assert figures["pipeline_trained_groups_per_min"] == pytest.approx(12.0)
    assert figures["trained_groups_ratio"] == pytest.approx(6.0)

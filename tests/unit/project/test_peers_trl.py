"""benchmarks/peers_trl.py's parts that run without either trainer: the quickstart task read for
TRL's environment (no art_mega import) and the figures from both sides' step events."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))

import peers_trl  # noqa: E402


def test_the_quickstart_task_is_read_without_importing_art_mega():
    task = peers_trl._quickstart_task()
    assert task["reward_for"]("Yes.") == 1.0 and task["reward_for"]("No, it is not") == 0.5 + 0.5 / 4
    assert task["reward_for"]("maybe") == 0.5 and task["reward_for"]("") == 0.0
    assert len(task["TRAIN_QUESTIONS"]) == 12 and task["ANSWER_RULE"].startswith("Answer with one word")


def run(start: float, steps: list[float], trained: list[float] | None = None, rewards=None):
    events = []
    for i, s in enumerate(steps):
        event = {"event": "step", "step": i, "step_s": s, "rollout_s": s / 2, "train_s": s / 2}
        if trained is not None:
            event["trained"] = trained[i]
            event["metrics"] = {"inference/prefix_cache_hit_rate": 0.6}
        event["reward"] = (rewards or [0.5] * len(steps))[i]
        events.append(event)
    return start, events


def test_figures_are_medians_of_run_medians_after_the_first_step():
    art = [
        run(30.0, [99.0, 20.0, 30.0, 40.0], [32, 32, 24, 32]),
        run(40.0, [99.0, 10.0, 10.0, 10.0], [32] * 4),
    ]
    trl = [run(6.0, [50.0, 20.0, 20.0, 20.0]), run(8.0, [50.0, 40.0, 40.0, 40.0])]
    figures = {name: value for name, value, _ in peers_trl.summarize(art, trl)}
    assert figures["TRL peer: art-mega GRPO step (median)"] == 20.0  # medians 30 and 10
    assert figures["TRL peer: TRL GRPOTrainer step (median)"] == 30.0
    assert figures["TRL peer: step time art-mega / TRL"] == pytest.approx(2 / 3)
    assert figures["TRL peer: art-mega step on equal work (32 trajectories trained)"] == 20.0  # 30 and 10
    assert figures["TRL peer: start-up art-mega / TRL"] == pytest.approx(35.0 / 7.0)
    assert figures["TRL peer: art-mega replica prefix-cache hit rate (median step)"] == pytest.approx(60.0)
    assert figures["TRL peer: TRL training reward at step 3"] == 0.5

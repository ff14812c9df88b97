"""benchmarks/pipeline.py's pure parts: the core split per process kind, the figures from both
modes' step events (steps per minute without the first step, the ratio, staleness, rollout and
train seconds), the agent task's game (reward, checker answers, row names) and its CLI refusals."""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))

import pipeline  # noqa: E402


def test_cores_split_this_process_affinity_in_two() -> None:
    replica, trainer = pipeline.cores()
    mine = os.sched_getaffinity(0)
    assert replica and trainer and replica | trainer == mine
    assert (replica & trainer) == (mine if len(mine) == 1 else set())


def test_a_program_pinned_to_the_replica_cores_reads_the_runners_split(monkeypatch) -> None:
    """The runner starts the program under `taskset` on the replica's cores, so the program's
    own affinity is one half; it takes the split the runner put in its environment."""
    monkeypatch.setenv(pipeline.ENV_CORES, "0|1")
    assert pipeline.cores() == ({0}, {1})
    monkeypatch.setenv(pipeline.ENV_CORES, "0,1|2,3")
    assert pipeline.cores() == ({0, 1}, {2, 3})


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


def test_agent_task_figures_per_mode_from_step_events() -> None:
    """The agent task's figures: every group trains in both loops (equal work), the pipeline
    overlaps its rollouts with training, and the per-step seconds come from the step events."""

    def steps(rows, **extra):
        return [
            {"event": "step", "step": i, "step_s": s, "rollout_s": r, "train_s": t, "groups": 4.0, **extra}
            for i, (s, r, t) in enumerate(rows)
        ]

    sync = steps([(110, 60, 50), (100, 50, 50), (104, 50, 54)])
    pipeline_steps = steps([(110, 60, 50), (56, 52, 55), (52, 48, 49)], stale_fraction=0.0)
    for event, (idle, staleness) in zip(pipeline_steps, ((60, 0.0), (1, 1.0), (3, 0.5))):
        event.update(idle_s=idle, staleness=staleness)
    runs = {
        "sync": [[*sync, {"event": "done", "val_reward": 0.6}]],
        "pipeline": [[*pipeline_steps, {"event": "done", "val_reward": 0.62}]],
    }
    figures = {**pipeline.summarize(runs), **pipeline.phase_figures(runs)}
    # steps after the first: 102 s against 54 s a step, 4 trained groups each
    assert figures["ratio"] == pytest.approx(102 / 54)
    assert figures["trained_groups_ratio"] == pytest.approx(figures["ratio"])
    assert figures["pipeline_trained_groups_per_min"] == pytest.approx(60 * 8 / 108)
    assert figures["pipeline_mean_staleness"] == pytest.approx(0.5)  # every step, the first too
    assert figures["sync_rollout_s"] == 50.0 and figures["sync_train_s"] == 52.0
    assert figures["pipeline_rollout_s"] == 50.0 and figures["pipeline_train_s"] == 52.0
    assert figures["pipeline_trainer_idle_s"] == 2.0
    # three runs whose later steps train 52, 62 and 52 s on average: the median, not the mean
    slower = [dict(e, train_s=e["train_s"] + 10) if "train_s" in e else e for e in runs["pipeline"][0]]
    runs["pipeline"] += [slower, runs["pipeline"][0]]
    assert pipeline.phase_figures(runs)["pipeline_train_s"] == 52.0


def test_guessing_game_reward_checker_and_names() -> None:
    assert pipeline.read_guess("My guess is 42, or 7") == 42 and pipeline.read_guess("no idea") is None
    assert [pipeline.format_score(r) for r in (" 50.", "I guess 75", "hello")] == [1.0, 0.5, 0.0]
    # format (1 + 0.5 + 1) / 3, the last guess 62 is 2 away from 60
    assert pipeline.guess_reward(["50", "I guess 75", "62"], 60) == pytest.approx(
        0.25 * 2.5 / 3 + 0.75 * 0.98
    )
    # the last guess made counts when the last reply has none; a game without a guess scores 0
    assert pipeline.guess_reward(["50", "hello"], 60) == pytest.approx(0.25 * 0.5 + 0.75 * 0.9)
    assert pipeline.guess_reward(["hi", "hello"], 60) == 0.0
    assert pipeline.guess_reward(["500"], 60) == 0.25  # too far for any closeness
    assert (
        pipeline.checker_answer(50, 60, 2)
        == "checker: higher than 50. Pick again; answer with only the number."
    )
    assert (
        pipeline.checker_answer(75, 60, 1)
        == "checker: lower than 75. Last pick; answer with only the number."
    )
    assert (
        pipeline.checker_answer(None, 60, 1)
        == "checker: no number in your reply. Last pick; answer with only the number."
    )
    assert pipeline.figure_name("quickstart", "ratio", "SmolLM2-135M-Instruct", 0.0) == (
        "pipeline ratio (SmolLM2-135M-Instruct, taskset replica|trainer)"
    )
    assert pipeline.figure_name("agent", "ratio", "SmolLM2-135M-Instruct", 20.0) == (
        "pipeline agent ratio (SmolLM2-135M-Instruct, 3-turn guessing game, tool latency 20 s, "
        "taskset replica|trainer)"
    )


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--tool-latency-s", "5"], "--tool-latency-s 5 is the agent task's tool latency; leave it out"),
        (["--task", "agent", "--tool-latency-s", "-1"], "--tool-latency-s -1 must be a finite number"),
        (["--task", "agent", "--tool-latency-s", "nan"], "--tool-latency-s nan must be a finite number"),
        (["--task", "chat"], "argument --task: invalid choice: 'chat'"),
    ],
)
def test_cli_refuses_a_tool_latency_it_would_not_use_or_cannot_wait(argv, words, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        pipeline.main(argv)
    assert exited.value.code == 2
    assert words in capsys.readouterr().err

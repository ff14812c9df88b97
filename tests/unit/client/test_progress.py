"""Output a person reads (issue 34): plain lines when the output is not a terminal, a bar only on
one, no remaining-time estimate for iterate_dataset, one summary line per training step."""

import asyncio
import io

import art_mega as art
from art_mega import progress
from art_mega.model import step_line


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


async def _rollout(reward: float) -> art.Trajectory:
    await asyncio.sleep(0)
    return art.Trajectory(messages_and_choices=[{"role": "user", "content": "q"}], reward=reward, metrics={"ok": 1.0})


async def test_a_gather_piped_to_a_file_prints_one_line_and_no_bar(capsys, monkeypatch):
    monkeypatch.delenv("ART_MEGA_PROGRESS", raising=False)
    await art.gather_trajectory_groups([art.TrajectoryGroup(_rollout(r) for r in (0.0, 1.0))], pbar_desc="step 4")
    out, err = capsys.readouterr()
    assert err == ""
    lines = out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("step 4: 2/2 rollouts in ")
    assert lines[0].endswith(" s, reward=0.5, ok=1")


async def test_on_a_terminal_the_gather_draws_a_tqdm_bar(monkeypatch, capsys):
    terminal = Terminal()
    monkeypatch.setattr(progress, "stream", lambda: terminal)
    await art.gather_trajectory_groups([art.TrajectoryGroup(_rollout(r) for r in (0.0, 1.0))], pbar_desc="step 4")
    drawn = terminal.getvalue()
    assert "step 4" in drawn and "2/2" in drawn and "reward=0.5" in drawn
    assert capsys.readouterr().out == ""  # no plain line besides the bar


def test_iterate_dataset_shows_no_remaining_time_and_plans_its_steps(monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr(progress, "stream", lambda: terminal)
    batches = art.iterate_dataset(list(range(12)), groups_per_step=4, num_epochs=100)
    first = next(batches)
    assert progress.PLANNED_STEPS["last"] == 300 and first.step == 0
    batches.close()
    assert progress.PLANNED_STEPS["last"] == 0
    drawn = terminal.getvalue()
    assert "Iterating dataset" in drawn and "/300 step" in drawn and "<" not in drawn  # no ETA


def test_the_environment_chooses_bars_or_lines(monkeypatch):
    monkeypatch.setattr(progress, "stream", lambda: Terminal())
    monkeypatch.setenv("ART_MEGA_PROGRESS", "lines")
    assert progress.bars_shown() is False and progress.bar(3, "x", "step") is None
    monkeypatch.setenv("ART_MEGA_PROGRESS", "bars")
    monkeypatch.setattr(progress, "stream", lambda: io.StringIO())
    assert progress.bars_shown() is True


def test_a_step_line_from_a_history_row():
    row = {
        "step": 2,
        "train/reward": 0.76825,
        "loss/train": -0.51412,
        "data/step_trainer_tokens": 172.0,
        "time/step_actor_s": 66.19,
        "time/step_wall_s": 80.888,
    }
    assert step_line(row, 6) == (
        "art-mega: step 2/6, reward 0.768, loss -0.5141, trained tokens 172, rollouts 66.2 s, step 80.9 s"
    )
    assert step_line({"step": 0, "loss/train": 1.0}) == "art-mega: step 0, loss 1"

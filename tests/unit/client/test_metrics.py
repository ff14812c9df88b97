import json
import math

import pytest

from art_mega import TrainableModel, Trajectory, TrajectoryGroup
from art_mega.metrics import history_row, read_history


def groups():
    return [
        TrajectoryGroup(
            [Trajectory(reward=1.0, metrics={"correct": 1}), Trajectory(reward=0.0, metrics={"correct": 0})],
            metrics={"len": 4},
        ),
        TrajectoryGroup(
            [Trajectory(reward=0.5), Trajectory(reward=0.5)], metrics={"len": 2}, exceptions=[ValueError("x")]
        ),
    ]


def test_history_row_values_by_hand():
    row = history_row(groups(), split="val", step=3, metrics={"time/step_s": 2.0, "loss": 0.25})
    assert row["step"] == 3
    assert row["val/reward"] == pytest.approx(0.5)
    assert row["val/reward_std_dev"] == pytest.approx((0.5 + 0.0) / 2)  # pstd per group, averaged
    assert row["val/exception_rate"] == pytest.approx(1 / 5)
    assert row["val/correct"] == pytest.approx(0.5)  # only trajectories that report it
    assert row["val/group_len"] == pytest.approx(3.0)
    assert row["time/step_s"] == 2.0 and row["val/loss"] == 0.25
    assert all(not (isinstance(v, float) and math.isnan(v)) for v in row.values())


async def test_model_log_appends_history(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    model = TrainableModel(name="agent", project="proj", base_model="tiny")
    await model.log(groups(), step=0, split="train")
    await model.log(groups()[:1], step=1, split="val")
    path = tmp_path / ".art" / "proj" / "models" / "agent" / "history.jsonl"
    rows = read_history(path)
    assert [r["step"] for r in rows] == [0, 1]
    assert "train/reward" in rows[0] and "val/reward" in rows[1]
    assert json.loads(path.read_text().splitlines()[1])["val/reward"] == 0.5


def test_unregistered_model_says_so():
    model = TrainableModel(name="agent", project="proj", base_model="tiny")
    with pytest.raises(RuntimeError, match="not registered"):
        model.get_inference_name()


@pytest.mark.parametrize("name", ["", " a", "a/b", "a@1"])
def test_bad_model_names(name):
    with pytest.raises(ValueError, match="name"):
        TrainableModel(name=name, project="p", base_model="tiny")


@pytest.mark.parametrize(
    "content,message",
    [
        ("garbage\n", "line 1 is not valid JSON"),
        ("[1, 2]\n", "line 1 is not a JSON object"),
        ('{"step": "x"}\n', "integer 'step'"),
    ],
)
def test_bad_history_lines_are_named(tmp_path, content, message):
    from art_mega.errors import UserError

    path = tmp_path / "history.jsonl"
    path.write_text('{"step": 0}\n' + content if "line 1" not in message else content)
    with pytest.raises(UserError, match=message):
        read_history(path)
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(UserError, match="cannot be read as a text file"):
        read_history(path)

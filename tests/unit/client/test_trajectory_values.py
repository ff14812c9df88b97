"""Trajectory metadata and metrics values JSON or the metrics cannot take are refused where they
are built (`Trajectory(...)`, `TrajectoryGroup(...)`, a gather's groups) and where they are used
(`model.log`, `backend.train`), each with the rollout wire's one sentence naming the key path;
before, `Trajectory(...)` took a set and `model.log` failed with json's raw
"TypeError: Object of type set is not JSON serializable", naming no key."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

import art_mega as art
from art_mega.errors import TrainInputError
from art_mega.metrics_files import read_trajectory_groups, trajectory_file
from art_mega.rollouts import wire
from art_mega.trajectories import check_train_groups


class Thing:
    pass


SET = "is a set, which JSON cannot carry (it would arrive as a list); return a list, e.g. sorted(...)"
BYTES = "is bytes, which JSON cannot carry; decode it to str (or base64 text) first"
OBJECT = (
    f"is a {__name__}.Thing, which JSON cannot carry; use None, bool, int, float, str, lists, dicts "
    "with str keys or a pydantic model (with the field's type declared)"
)
CASES = [
    ({"tags": {"a"}}, f"metadata['tags'] {SET}"),
    ({"raw": b"\x00"}, f"metadata['raw'] {BYTES}"),
    ({"thing": Thing()}, f"metadata['thing'] {OBJECT}"),
    ({"scores": {"by_judge": [0.5, {3}]}}, f"metadata['scores']['by_judge'][1] {SET}"),
]
IDS = ["set", "bytes", "object", "nested"]
USER = {"role": "user", "content": "q"}


def built(metadata):
    """A trajectory whose metadata got `metadata` after it was built (no validator runs then)."""
    trajectory = art.Trajectory(messages_and_choices=[USER], reward=1.0)
    trajectory.metadata.update(metadata)
    return trajectory


def value_error(caught: pytest.ExceptionInfo[ValidationError]) -> str:
    (error,) = caught.value.errors()
    assert error["type"] == "value_error"
    return str(error["ctx"]["error"])


@pytest.mark.parametrize("metadata,sentence", CASES, ids=IDS)
def test_trajectory_refuses_the_value_naming_its_key(metadata, sentence) -> None:
    with pytest.raises(ValidationError) as caught:
        art.Trajectory(messages_and_choices=[USER], metadata=metadata)
    assert value_error(caught) == sentence
    # the rollout wire's own sentence for the same value (the one check, reused)
    with pytest.raises(wire.WireError) as sent:
        wire.encode(built(metadata))
    assert str(sent.value) == f"trajectory.{sentence}"


@pytest.mark.parametrize("metadata,sentence", CASES, ids=IDS)
def test_an_assignment_is_checked_as_the_constructor_checks(metadata, sentence) -> None:
    trajectory = art.Trajectory(messages_and_choices=[USER], metadata={"kept": 1})
    with pytest.raises(ValidationError) as caught:
        trajectory.metadata = metadata  # ART 0.5.23's Trajectory validates assignments too
    assert value_error(caught) == sentence
    assert trajectory.metadata == {"kept": 1}


@pytest.mark.parametrize("metadata,sentence", CASES, ids=IDS)
def test_a_group_refuses_a_value_set_after_its_trajectory_was_built(metadata, sentence) -> None:
    with pytest.raises(ValidationError) as caught:
        art.TrajectoryGroup([built({}), built(metadata)])
    assert value_error(caught) == f"trajectories[1].{sentence}"
    with pytest.raises(ValidationError) as own:
        art.TrajectoryGroup([built({})], metadata=metadata)
    assert value_error(own) == sentence


@pytest.mark.parametrize("metadata,sentence", CASES, ids=IDS)
async def test_model_log_refuses_the_value_naming_group_trajectory_and_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, metadata, sentence
) -> None:
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    model = art.Model(name="m", project="p", base_path=str(tmp_path))
    good = art.TrajectoryGroup([built({}), built({})])
    bad = art.TrajectoryGroup([built({}), built({})])
    bad.trajectories[1].metadata.update(metadata)  # after the group was built
    with pytest.raises(TrainInputError) as caught:
        await model.log([good, bad], split="val", step=1)
    assert str(caught.value) == f"model.log(trajectories): group 1: trajectories[1].{sentence}"
    assert (caught.value.group, caught.value.trajectory) == (1, 1)
    assert not trajectory_file(model.output_dir, "val", 1).exists()  # nothing written
    assert not (Path(model.output_dir) / "history.jsonl").exists()


def test_backend_train_refuses_the_value_before_anything_runs() -> None:
    group = art.TrajectoryGroup([built({}), built({})])
    group.trajectories[0].metadata["tags"] = {"a"}
    group.trajectories[1].metrics["score"] = "high"  # a metric that is not a number, also after
    with pytest.raises(TrainInputError) as caught:
        check_train_groups([group])
    assert (
        str(caught.value)
        == f"backend.train(trajectory_groups): group 0: trajectories[0].metadata['tags'] {SET}"
    )
    group.trajectories[0].metadata["tags"] = ["a"]
    with pytest.raises(TrainInputError) as caught:
        check_train_groups([group])
    assert str(caught.value) == (
        "backend.train(trajectory_groups): group 0: trajectories[1]: metric 'score' is 'high' (a str); "
        "metrics are numbers (float, int or bool), e.g. {'correct': 1.0}: keep other values in metadata"
    )


async def test_gather_refuses_a_rollout_that_sets_the_value_after_building_its_trajectory() -> None:
    async def rollout(tags):
        trajectory = art.Trajectory(messages_and_choices=[USER], reward=1.0)
        trajectory.metadata["tags"] = tags
        return trajectory

    with pytest.raises(ValidationError) as caught:
        await art.gather_trajectory_groups([art.TrajectoryGroup([rollout(["a"]), rollout({"a"})])])
    assert value_error(caught) == f"trajectories[1].metadata['tags'] {SET}"


async def test_what_json_carries_is_kept_and_logged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # NaN/inf in metadata and metrics (ART keeps them) and numpy scalars (json's raw TypeError before)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    model = art.Model(name="m", project="p", base_path=str(tmp_path))
    trajectory = art.Trajectory(
        messages_and_choices=[USER],
        reward=1.0,
        metrics={"ratio": math.inf, "n": np.int64(3), "f": np.float32(0.5)},
        metadata={"nan": math.nan, "i": np.int64(7), "nested": {"a": [1, "b", None, True]}},
    )
    await model.log(
        [art.TrajectoryGroup([trajectory, trajectory.model_copy(update={"reward": 0.0})])], step=2
    )
    (group,) = read_trajectory_groups(trajectory_file(model.output_dir, "val", 2))
    back = group.trajectories[0]
    assert back.metrics == {"ratio": math.inf, "n": 3, "f": 0.5}
    assert math.isnan(back.metadata["nan"])
    assert (back.metadata["i"], back.metadata["nested"]) == (7, {"a": [1, "b", None, True]})

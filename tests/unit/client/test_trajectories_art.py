"""Trajectory / TrajectoryGroup fields and methods as ART 0.5.18 has them: exception records,
logs, History, finish() and track_duration(), policy versions; each through rollouts/wire.py."""

from __future__ import annotations

import asyncio
import copy
import json
import time
from datetime import datetime, timedelta

import pytest
from openai.types.chat.chat_completion import Choice
from pydantic import ValidationError

from art_mega import Trajectory, TrajectoryGroup
from art_mega.errors import RemoteRolloutError, TrainInputError
from art_mega.rollouts import wire
from art_mega.rollouts.protocol import RemoteFailure
from art_mega.trajectories import (
    History,
    PydanticException,
    check_train_groups,
    exception_record,
    off_policy,
)


def over_the_wire(value):
    """`value` as another host receives it: encoded, through JSON text, decoded."""
    return wire.decode(json.loads(json.dumps(wire.encode(value))))


def raise_in_judge() -> None:
    raise KeyError("judge")


def caught() -> BaseException:
    try:
        raise_in_judge()
    except KeyError as exc:
        return exc
    raise AssertionError("unreachable")


SAMPLED = {
    "index": 0,
    "finish_reason": "stop",
    "message": {"role": "assistant", "content": "4"},
    "logprobs": {"content": [{"token": "4", "logprob": -0.25, "bytes": [52], "top_logprobs": []}]},
}


def test_exceptions_are_records_with_type_message_and_traceback_that_cross_hosts():
    group = TrajectoryGroup(
        [Trajectory(reward=1.0), caught(), Trajectory(reward=0.0)], exceptions=[ValueError("late")]
    )
    assert [t.reward for t in group] == [1.0, 0.0]
    assert [(e.type, e.message) for e in group.exceptions] == [
        ("<class 'KeyError'>", "'judge'"),  # ART's str(type(exc)) and str(exc)
        ("<class 'ValueError'>", "late"),
    ]
    assert "in raise_in_judge" in group.exceptions[0].traceback
    assert group.exceptions[0].traceback.endswith("KeyError: 'judge'\n")
    back = over_the_wire(group)
    assert isinstance(back.exceptions[0], PydanticException) and back.exceptions == group.exceptions
    assert back == group


def test_a_remote_rollout_keeps_the_workers_traceback():
    failure = RemoteFailure(
        kind="error",
        message="ZeroDivisionError: x",
        exc_type="ZeroDivisionError",
        traceback='Traceback ...\n  File "env.py", line 3, in score\nZeroDivisionError: x\n',
    )
    record = exception_record(RemoteRolloutError("h1", "w0", failure))
    assert record.traceback == failure.traceback
    assert record.type == "<class 'art_mega.errors.RemoteRolloutError'>"
    assert record.message == "rollout on host h1 worker w0 failed: ZeroDivisionError: x"


def test_an_exception_given_as_a_string_is_refused():
    with pytest.raises(
        ValidationError, match=r"exceptions\[0\] is the string 'ValueError: x'; pass the exception"
    ):
        TrajectoryGroup([Trajectory()], exceptions=["ValueError: x"])  # type: ignore[list-item]


def test_group_and_trajectory_logs_cross_hosts():
    trajectory = Trajectory(reward=1.0)
    trajectory.log("turn 1")
    group = TrajectoryGroup([trajectory], metadata={"scenario": "s1"}, logs=["built"])
    group.log("scored")
    back = over_the_wire(group)
    assert back.logs == ["built", "scored"] and back.trajectories[0].logs == ["turn 1"]
    assert back.metadata == {"scenario": "s1"}


def test_additional_histories_are_history_models_and_cross_hosts():
    trajectory = Trajectory(
        messages_and_choices=[{"role": "user", "content": "q"}, Choice.model_validate(SAMPLED)],
        additional_histories=[
            {"messages_and_choices": [{"role": "user", "content": "q2"}, SAMPLED]},  # a dict: validated
            History(messages_and_choices=[{"role": "user", "content": "q3"}], tools=[{"type": "function"}]),
        ],
    )
    first, second = trajectory.additional_histories
    assert isinstance(first, History) and isinstance(first.messages_and_choices[1], Choice)
    assert first.messages() == [{"role": "user", "content": "q2"}, {"role": "assistant", "content": "4"}]
    back = over_the_wire(trajectory)
    assert back.additional_histories == [first, second]
    assert back.additional_histories[0].messages_and_choices[1].logprobs.content[0].logprob == -0.25
    with pytest.raises(
        ValidationError, match=r"additional_histories\[0\] has the keys \['messages_and_choices', 'x'\]"
    ):
        Trajectory(additional_histories=[{"messages_and_choices": [], "x": 1}])


def test_a_dict_appended_to_additional_histories_is_refused_by_train():
    trajectory = Trajectory(messages_and_choices=[{"role": "user", "content": "q"}])
    trajectory.additional_histories.append({"messages_and_choices": []})  # type: ignore[arg-type]
    with pytest.raises(
        TrainInputError, match=r"additional_histories\[0\] is a dict, not an art.History; append art.History"
    ):
        check_train_groups([TrajectoryGroup([trajectory])])


def test_finish_records_the_duration_since_construction_within_the_measured_wall_time():
    before = time.monotonic()
    trajectory = Trajectory()
    time.sleep(0.01)
    assert trajectory.finish() is trajectory
    elapsed = time.monotonic() - before
    assert 0.0 < trajectory.metrics["duration"] <= elapsed
    before = time.monotonic()
    given = Trajectory(start_time=datetime.now() - timedelta(seconds=30))  # given: wall clock
    given.finish()
    assert 30.0 <= given.metrics["duration"] <= 30.0 + (time.monotonic() - before)
    # start_time is not sent: a received trajectory starts anew, and is equal to the one sent
    assert "start_time" not in trajectory.model_dump()
    back = over_the_wire(trajectory)
    assert back == trajectory and back.start_time >= trajectory.start_time


async def test_track_duration_sums_each_use_within_the_measured_wall_time():
    trajectory = Trajectory()
    before = time.monotonic()
    async with trajectory.track_duration("judge"):
        await asyncio.sleep(0.01)
    with pytest.raises(RuntimeError):
        async with trajectory.track_duration("judge"):
            raise RuntimeError("recorded anyway")
    elapsed = time.monotonic() - before
    assert 0.01 <= trajectory.metrics["judge_duration"] <= elapsed


def test_policy_versions_cross_hosts_and_count_as_stale_when_they_differ():
    current = Trajectory(initial_policy_version=3, final_policy_version=3)
    late = Trajectory(initial_policy_version=2, final_policy_version=3)
    assert over_the_wire(late).initial_policy_version == 2
    assert off_policy([TrajectoryGroup([current, late, Trajectory()])], expected_step=3) == [(0, 1, [2, 3])]
    for bad in (True, -1, "3", 2.0):
        with pytest.raises(ValidationError, match="is not a training step; use a step number"):
            Trajectory(initial_policy_version=bad)


def test_messages_and_for_logging_as_art_builds_them():
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    tool_choice = Choice.model_validate(
        {
            "index": 0,
            "finish_reason": "tool_calls",
            "message": {"role": "assistant", "content": None, "tool_calls": [call]},
        }
    )
    trajectory = Trajectory(
        messages_and_choices=[{"role": "user", "content": None}, tool_choice],
        reward=0.5,
        final_policy_version=1,
    )
    assert trajectory.messages() == [
        {"role": "user", "content": ""},
        {"role": "assistant", "content": "", "tool_calls": [call]},
    ]
    logged = trajectory.for_logging()
    assert [m["trainable"] for m in logged["messages"]] == [False, True]
    assert logged["final_policy_version"] == 1 and logged["reward"] == 0.5
    assert str(trajectory) == "Trajectory(reward=0.5, metrics={}, metadata={})"


def test_a_copied_group_has_its_own_lists_as_in_art():
    group = TrajectoryGroup([Trajectory(reward=1.0)], exceptions=[ValueError("x")], logs=["a"])
    copied = copy.copy(group)
    copied.trajectories.append(Trajectory())
    copied.exceptions.clear()
    copied.log("b")
    copied.metadata["k"] = 1
    assert (len(group), len(group.exceptions), group.logs, group.metadata) == (1, 1, ["a"], {})
    assert copied.trajectories[0] is group.trajectories[0]  # shallow: the same trajectories
    deep = copy.deepcopy(group)
    assert deep == group and deep.trajectories[0] is not group.trajectories[0]


def test_backend_train_refuses_a_trajectory_whose_policy_version_is_not_the_current_step():
    from art_mega.backend import MegatronBackend
    from art_mega.errors import UserError

    backend = MegatronBackend()
    backend._step = 4
    groups = [TrajectoryGroup([Trajectory(initial_policy_version=4), Trajectory(initial_policy_version=3)])]
    with pytest.raises(
        UserError, match=r"^trajectory 1 of group 0 was sampled by policy step 3, but backend.train"
    ):
        backend._check_policy_steps(groups, allow_stale=False)
    assert backend._check_policy_steps(groups, allow_stale=True) == 1


def test_the_documentations_legacy_history_name_is_history():
    from art_mega.trajectories import LegacyHistory

    trajectory = Trajectory(
        messages_and_choices=[{"role": "user", "content": "What is 2+2?"}],
        additional_histories=[LegacyHistory(messages_and_choices=[{"role": "assistant", "content": "4"}])],
    )
    assert trajectory.additional_histories == [
        History(messages_and_choices=[{"role": "assistant", "content": "4"}])
    ]

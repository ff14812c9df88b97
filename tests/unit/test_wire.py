import pytest
from openai.types.chat.chat_completion import Choice
from pydantic import BaseModel

from art_mega import Trajectory, TrajectoryGroup
from art_mega.runtime import wire


def _choice() -> Choice:
    return Choice.model_validate(
        {
            "index": 0,
            "finish_reason": "stop",
            "message": {"role": "assistant", "content": "maybe"},
            "logprobs": {
                "content": [{"token": "maybe", "logprob": -0.25, "bytes": [109], "top_logprobs": []}]
            },
        }
    )


def test_trajectory_with_choice_round_trips_exactly():
    trajectory = Trajectory(
        messages_and_choices=[{"role": "user", "content": "yes or no?"}, _choice()],
        reward=0.75,
        metrics={"correct": 1.0, "turns": 2},
        metadata={"pid": 12},
        logs=["a"],
    )
    back = wire.decode(wire.encode(trajectory))
    assert back == trajectory
    assert isinstance(back.messages_and_choices[1], Choice)
    assert isinstance(back.messages_and_choices[0], dict)
    assert back.messages()[-1] == {"role": "assistant", "content": "maybe"}


def test_group_and_nested_containers_round_trip():
    group = TrajectoryGroup([Trajectory(reward=1.0), Trajectory(reward=0.0)], metrics={"n": 2})
    value = {"groups": [group], "k": (1, 2), "none": None}
    back = wire.decode(wire.encode(value))
    assert back["groups"][0] == group
    assert back["k"] == [1, 2]
    assert back["none"] is None


def test_unencodable_values_are_named():
    with pytest.raises(wire.WireError, match="set cannot travel"):
        wire.encode({1, 2})
    with pytest.raises(wire.WireError, match="keys must be str"):
        wire.encode({1: "a"})


def test_local_model_classes_are_refused():
    class Local(BaseModel):
        x: int

    with pytest.raises(wire.WireError, match="local to a function"):
        wire.encode(Local(x=1))


def test_tag_naming_a_non_model_is_refused():
    with pytest.raises(wire.WireError, match="not a pydantic model"):
        wire.decode({"__model__": "os:getcwd", "data": {}})

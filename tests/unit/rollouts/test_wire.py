import datetime
import enum
import json
import math

import numpy as np
import pytest
from openai.types.chat.chat_completion import Choice
from pydantic import BaseModel

from art_mega import Trajectory, TrajectoryGroup
from art_mega.rollouts import wire


class Color(enum.Enum):
    RED = "red"


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


class Typed(BaseModel):
    """A model whose fields pydantic restores by their declared types."""

    when: datetime.datetime
    tags: set[int]
    color: Color
    pair: tuple[int, float]
    untyped: dict = {}


def _through_json(value):
    """`value` encoded, sent as strict JSON (no NaN tokens: the agent re-encodes with pydantic,
    which writes NaN as null) and decoded."""
    return wire.decode(json.loads(json.dumps(wire.encode(value), allow_nan=False)))


def changed(metadata, group=None):
    """A trajectory (or `group`, its first trajectory) whose metadata got `metadata` after it was
    built: `Trajectory(metadata=...)` refuses these values itself, so only a dict changed since
    reaches the wire."""
    trajectory = Trajectory() if group is None else group.trajectories[0]
    trajectory.metadata.update(metadata)
    return trajectory if group is None else group


@pytest.mark.parametrize(
    "value,message",
    [
        (
            changed({"scores": [0.5, 1, {3}]}),
            "trajectory.metadata['scores'][2] is a set, which JSON cannot carry (it would arrive as a list)",
        ),
        (changed({"raw": b"\x00"}), "trajectory.metadata['raw'] is bytes"),
        (changed({"o": object()}), "trajectory.metadata['o'] is a builtins.object"),
        (
            changed({"a": np.arange(3)}),
            "trajectory.metadata['a'] is a numpy array (shape (3,), dtype int64), which JSON cannot "
            "carry; return array.tolist()",
        ),
        (changed({"z": 1j}), "trajectory.metadata['z'] is the complex number 1j"),
        (changed({"z": np.complex64(1j)}), "trajectory.metadata['z'] is the complex number"),
        (
            changed(
                {"m": Typed(when=datetime.datetime(2026, 1, 1), tags=set(), color=Color.RED, pair=(1, 2))}
            ),
            "trajectory.metadata['m'] is a Typed model in a field that does not declare that class",
        ),
        (
            changed({"e": Color.RED}),
            f"trajectory.metadata['e'] is a {__name__}.Color, which JSON",
        ),
        ({1: "a"}, "result has the key 1 (int), but JSON object keys are strings"),
        ({"k": {1, 2}}, "result['k'] is a set"),
        ([Trajectory(), changed({"b": bytearray(b"x")})], "result[1].metadata['b'] is bytes"),
        (
            changed({"s": frozenset()}, TrajectoryGroup([Trajectory()])),
            "trajectory_group.trajectories[0].metadata['s'] is a frozenset",
        ),
    ],
)
def test_values_json_cannot_carry_are_refused_naming_the_key_path(value, message):
    """Each of these failed with a pydantic serializer traceback, or changed in silence (a set
    became a list, bytes a str, 1j the string '1j') before."""
    with pytest.raises(wire.WireError) as caught:
        wire.encode(value)
    assert str(caught.value).startswith(message), str(caught.value)


def test_non_finite_floats_and_numpy_scalars_arrive_by_the_documented_rules():
    """NaN in metadata became None and an inf reward a validation traceback before; numpy scalars
    in metadata were a serializer traceback."""
    trajectory = Trajectory(
        reward=-math.inf,
        metrics={"ratio": math.nan},
        metadata={
            "nan": math.nan,
            "inf": np.float64("inf"),
            "f": np.float32(1.5),
            "i": np.int64(3),
            "b": np.bool_(True),
        },
    )
    back = _through_json(trajectory)
    assert back.reward == -math.inf and math.isnan(back.metrics["ratio"])
    assert math.isnan(back.metadata["nan"]) and back.metadata["inf"] == math.inf
    assert [(back.metadata[k], type(back.metadata[k])) for k in ("f", "i", "b")] == [
        (1.5, float),
        (3, int),
        (True, bool),
    ]
    assert _through_json({"x": [math.nan, 1.0]})["x"][1] == 1.0 and math.isnan(_through_json(math.nan))


def test_typed_fields_round_trip_through_pydantic_and_tuples_become_lists_only_untyped():
    value = Typed(
        when=datetime.datetime(2026, 1, 2, 3),
        tags={3, 1},
        color=Color.RED,
        pair=(1, math.inf),
        untyped={"t": (1, 2)},
    )
    back = _through_json(value)
    assert (back.when, back.tags, back.color, back.pair) == (value.when, {1, 3}, Color.RED, (1, math.inf))
    assert back.untyped == {"t": [1, 2]}  # the documented rule: JSON has no tuple


def test_local_model_classes_are_refused():
    class Local(BaseModel):
        x: int

    with pytest.raises(wire.WireError, match="local to a function; define it at top level"):
        wire.encode(Local(x=1))


def test_received_values_that_cannot_be_rebuilt_are_named():
    with pytest.raises(wire.WireError, match="result names os:getcwd, which is not a pydantic model class"):
        wire.decode({"__model__": "os:getcwd", "data": {}})
    with pytest.raises(
        wire.WireError, match=r"result\[0\] is a no_such_module:X model, which cannot be imported here"
    ):
        wire.decode([{"__model__": "no_such_module:X", "data": {}}])
    with pytest.raises(
        wire.WireError, match="result does not validate as Trajectory: Trajectory.reward: reward None is"
    ):
        wire.decode({"__model__": "art_mega.trajectories:Trajectory", "data": {"reward": None}})


class Inner(BaseModel):
    x: float
    tags: set[int]


class Outer(BaseModel):
    inner: Inner
    items: list[Inner] = []


class Node(BaseModel):
    value: float
    children: list["Node"] = []


def test_fully_typed_models_are_dumped_by_pydantic_and_a_bad_assignment_is_named():
    outer = Outer(inner=Inner(x=math.nan, tags={2, 1}), items=[Inner(x=-math.inf, tags=set())])
    back = _through_json(outer)
    assert math.isnan(back.inner.x) and back.inner.tags == {1, 2} and back.items[0].x == -math.inf
    outer.inner.tags = {b"x"}  # pydantic does not validate assignments by default
    with pytest.raises(
        wire.WireError, match=r"^outer\.inner\.tags does not serialize as its declared type [^\n]*$"
    ):
        wire.encode(outer)
    tree = Node(value=1.0, children=[Node(value=math.inf)])
    assert _through_json(tree).children[0].value == math.inf  # a model that contains itself

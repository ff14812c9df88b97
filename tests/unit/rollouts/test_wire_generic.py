"""Parametrized generic models on the wire: `TrainableModel[Policy]` (ART's typed config) and
user generics travel as their generic class and type arguments and are parametrized again on
arrival; what cannot be named or rebuilt is refused in one sentence naming the key path."""

import json
import math
from typing import Generic, TypeVar

import pytest
from pydantic import BaseModel

from art_mega import TrainableModel
from art_mega.rollouts import wire

T = TypeVar("T")
U = TypeVar("U")
HERE = __name__


class Policy(BaseModel):
    bonus_word: str = "yes"
    temperature: float = 1.0


class Box(BaseModel, Generic[T]):
    item: T


class Pair(BaseModel, Generic[T, U]):
    first: T
    second: U


def _through_json(value):
    return wire.decode(json.loads(json.dumps(wire.encode(value), allow_nan=False)))


def test_a_typed_trainable_model_travels_as_its_generic_class_and_config_class():
    model = TrainableModel[Policy](
        name="m", project="p", base_model="tiny-llama", config=Policy(bonus_word="no", temperature=math.inf)
    )
    encoded = wire.encode(model)
    assert (encoded["__model__"], encoded["args"]) == ("art_mega.model:TrainableModel", [f"{HERE}:Policy"])
    back = _through_json(model)
    assert type(back) is TrainableModel[Policy]
    assert isinstance(back.config, Policy) and back.config == Policy(bonus_word="no", temperature=math.inf)
    assert back.base_model == "tiny-llama"


def test_nested_and_none_type_arguments_are_parametrized_again():
    value = Pair[Box[Policy], None](first=Box[Policy](item=Policy(bonus_word="b")), second=None)
    encoded = wire.encode(value)
    assert encoded["__model__"] == f"{HERE}:Pair"
    assert encoded["args"] == [{"__model__": f"{HERE}:Box", "args": [f"{HERE}:Policy"]}, None]
    back = _through_json([value, Box[int](item=3)])
    assert type(back[0]) is Pair[Box[Policy], None] and back[0].first.item == Policy(bonus_word="b")
    assert type(back[1]) is Box[int] and back[1].item == 3


def test_type_arguments_the_wire_cannot_name_are_refused_when_sent():
    with pytest.raises(wire.WireError) as caught:
        wire.encode({"page": Box[list[int]](item=[1])}, "kwargs")
    assert str(caught.value) == (
        "kwargs['page'] is a Box[list[int]], whose type argument list[int] is not a class the wire can "
        "name; parametrize the model with classes (e.g. pydantic models)"
    )

    class Local(BaseModel):
        x: int = 0

    with pytest.raises(
        wire.WireError, match=r"^result is a Box\[.*Local\], whose type argument .*Local is local"
    ):
        wire.encode(Box[Local](item=Local()), "result")
    with pytest.raises(wire.WireError, match="the form the wire uses for tagged values"):
        wire.encode({"__model__": "x:Y", "args": [], "data": {}})


@pytest.mark.parametrize(
    "tag,message",
    [
        (
            {"__model__": "art_mega.model:TrainableModel", "args": ["no_such_module:Cfg"]},
            "result is a art_mega.model:TrainableModel[no_such_module:Cfg] model, whose type argument "
            "no_such_module:Cfg cannot be imported here (No module named 'no_such_module'); make its module "
            "importable on every host",
        ),
        (
            {"__model__": f"{HERE}:Policy", "args": ["builtins:int"]},
            f"result is a {HERE}:Policy[builtins:int] model, but {HERE}:Policy is not a generic pydantic model",
        ),
        (
            {"__model__": f"{HERE}:Box", "args": ["builtins:int", "builtins:str"]},
            f"result is a {HERE}:Box[builtins:int, builtins:str] model, which cannot be parametrized here",
        ),
        (
            {"__model__": f"{HERE}:Box", "args": "builtins:int"},
            f"result is a {HERE}:Box model whose type arguments 'builtins:int' are not a list of classes",
        ),
        (
            {"__model__": f"{HERE}:Box", "args": [7]},
            "result names the class 7, which is not a 'module:qualname'",
        ),
        (
            {"__model__": f"{HERE}:Box", "args": [f"{HERE}:HERE"]},
            f"result names {HERE}:HERE, which is not a class",
        ),
    ],
)
def test_received_type_arguments_that_cannot_be_rebuilt_are_one_sentence(tag, message):
    with pytest.raises(wire.WireError) as caught:
        wire.decode({**tag, "data": {"item": 1}})
    assert str(caught.value).startswith(message), str(caught.value)
    assert "\n" not in str(caught.value)

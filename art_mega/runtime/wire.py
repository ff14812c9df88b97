"""JSON encoding of rollout arguments and results, with pydantic models kept typed.

A pydantic model travels as {"__model__": "module:qualname", "data": ...}; the receiver
re-imports the class and accepts it only if it is a `pydantic.BaseModel` subclass. Nothing is
pickled. Tuples arrive as lists (JSON has no tuple).
"""

from __future__ import annotations

import importlib
from typing import Any

from pydantic import BaseModel

MODEL_TAG = "__model__"


class WireError(TypeError):
    """A value that cannot travel as JSON, or a tagged value whose class is not a model."""


def encode(value: Any) -> Any:
    """Return a JSON-compatible form of `value` (None, bool, int, float, str, list, dict, models).

    Raises:
        WireError: for any other type (the message names the type).
    """
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, BaseModel):
        cls = type(value)
        if "<locals>" in cls.__qualname__:
            raise WireError(f"model class {cls.__qualname__} is local to a function; define it at top level")
        return {MODEL_TAG: f"{cls.__module__}:{cls.__qualname__}", "data": value.model_dump(mode="json")}
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in value]
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise WireError(f"dict keys must be str to travel as JSON, got {type(key).__name__}")
            out[key] = encode(item)
        return out
    raise WireError(
        f"{type(value).__name__} cannot travel between controller and workers; "
        "use JSON types or a pydantic model"
    )


def _load_model(ref: str) -> type[BaseModel]:
    module_name, _, qualname = ref.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not (isinstance(obj, type) and issubclass(obj, BaseModel)):
        raise WireError(f"{ref} is not a pydantic model class")
    return obj


def decode(value: Any) -> Any:
    """Inverse of `encode`: rebuild tagged pydantic models, recursively."""
    if isinstance(value, list):
        return [decode(v) for v in value]
    if isinstance(value, dict):
        if MODEL_TAG in value and set(value) == {MODEL_TAG, "data"}:
            return _load_model(value[MODEL_TAG]).model_validate(value["data"])
        return {k: decode(v) for k, v in value.items()}
    return value

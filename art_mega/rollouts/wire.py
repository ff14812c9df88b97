"""JSON encoding of rollout arguments and results, exact or refused.

What travels, and the only conversions made (everything else is refused with a `WireError`
naming the key path, e.g. `trajectory.metadata['scores'][2]`, never changed in silence):

- None, bool, int, str, finite floats, lists, and dicts with str keys, as they are.
- Tuples arrive as lists (JSON has no tuple); a field typed `tuple[...]` is a tuple again.
- NaN and +-inf travel as {"__float__": "nan" | "inf" | "-inf"} and arrive as the same float.
- numpy scalars (np.bool_, integers, floats, np.str_) arrive as Python bool / int / float / str
  (an np.longdouble only where float64 holds its value exactly).
- A pydantic model travels as {"__model__": "module:qualname", "data": ...}; the receiver
  re-imports the class, accepts it only if it is a `pydantic.BaseModel` subclass, and validates
  the data. Its fields are encoded by their declared types: typed values pydantic restores
  (datetime, set[int], Enum, ...) go through pydantic's JSON mode, values of untyped (`Any`)
  fields follow the rules above, and a model inside an untyped field is refused (it would
  arrive as a plain dict).

Refused: bytes, sets, complex numbers, numpy arrays and any other object where no declared
type restores it, and a dict shaped like a tag ({"__float__": ...} or {"__model__": ..., "data":
...} alone), which would arrive as the tagged value. Nothing is pickled.
"""

from __future__ import annotations

import functools
import importlib
import math
import re
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Union

from pydantic import BaseModel, TypeAdapter, ValidationError

MODEL_TAG = "__model__"
FLOAT_TAG = "__float__"
_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
_UNTYPED: Any = Any
"""The declared type of a position nothing declares (a top-level value, an `Any` field)."""


class WireError(TypeError):
    """A value that cannot travel as JSON, or a received value that cannot be rebuilt.

    `path` is the key path of the value (e.g. "trajectory.metadata['scores'][2]"); the message
    starts with it and says what to do.
    """

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path} {problem}")
        self.path = path


def root_name(value: Any, default: str = "result") -> str:
    """The key path's root for `value`: a model's class name in snake case ("trajectory",
    "trajectory_group"), else `default`."""
    if isinstance(value, BaseModel):
        return re.sub(r"(?<!^)(?=[A-Z])", "_", type(value).__name__).lower()
    return default


def encode(value: Any, path: str | None = None) -> Any:
    """A JSON-compatible form of `value` (see the module docstring for what travels).

    `path` names the value in errors (default: `root_name(value)`).

    Raises:
        WireError: a value that cannot travel, naming its key path, its type and the fix.
    """
    return _encode(value, _UNTYPED, root_name(value) if path is None else path, in_model=False)


def _encode(value: Any, declared: Any, path: str, in_model: bool) -> Any:
    """`value` at a position of declared type `declared` (`_UNTYPED` where nothing declares
    one); `in_model`: inside a model's data, where nested models are plain dicts that the
    declared type validates back, not tagged."""
    if value is None or type(value) in (bool, int, str):  # exactly: an Enum member is not its value
        return value
    if type(value) is float:
        return _tag_floats(value)
    numpy = sys.modules.get("numpy")  # only a process that imported numpy can hold its values
    if numpy is not None and isinstance(value, (numpy.bool_, numpy.integer, numpy.floating, numpy.str_)):
        item = value.item()
        if type(item).__module__ == "numpy":  # np.longdouble's item() is itself
            item = float(value)
            if item != value and not math.isnan(item):
                raise WireError(
                    path,
                    f"is the {type(value).__name__} {value!r}, which a JSON float (float64) cannot hold; "
                    "return float(value) if that precision is enough",
                )
        return _encode(item, declared, path, in_model)
    if isinstance(value, BaseModel):
        cls = type(value)
        if not in_model:
            if "<locals>" in cls.__qualname__:
                raise WireError(
                    path,
                    f"is a {cls.__qualname__}, a model class local to a function; define it at top level",
                )
            return {MODEL_TAG: f"{cls.__module__}:{cls.__qualname__}", "data": _model_data(value, path)}
        if cls in _models_in(declared):
            return _model_data(value, path)
        raise WireError(
            path,
            f"is a {cls.__name__} model in a field that does not declare that class, so it would arrive "
            f"as a plain dict; store its .model_dump() or declare the field as {cls.__name__}",
        )
    if isinstance(value, dict):
        if _looks_tagged(value):
            raise WireError(
                path,
                f"is a dict with only the keys {sorted(value)}, the form the wire uses for tagged "
                "values, so it would arrive as something else; rename the keys",
            )
        item_type = _item_type(declared)
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise WireError(
                    path,
                    f"has the key {key!r} ({type(key).__name__}), but JSON object keys are strings; use str keys",
                )
            out[key] = _encode(item, item_type, f"{path}[{key!r}]", in_model)
        return out
    if isinstance(value, (list, tuple)):
        item_types = _sequence_types(declared, len(value))
        return [
            _encode(item, t, f"{path}[{i}]", in_model) for i, (item, t) in enumerate(zip(value, item_types))
        ]
    if in_model and _is_typed(declared):
        return _encode(_dump_typed(declared, value, path), _UNTYPED, path, in_model)
    raise WireError(path, _refusal(value, numpy))


def _looks_tagged(value: dict[Any, Any]) -> bool:
    """True for a dict `decode` would read as a tagged float or model (see `decode`)."""
    keys = set(value)
    return keys == {FLOAT_TAG} or keys == {MODEL_TAG, "data"}


def _refusal(value: Any, numpy: Any) -> str:
    """What is wrong with `value` (not JSON, no declared type restores it) and the fix."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "is bytes, which JSON cannot carry; decode it to str (or base64 text) first"
    if isinstance(value, (set, frozenset)):
        return (
            f"is a {type(value).__name__}, which JSON cannot carry (it would arrive as a list); "
            "return a list, e.g. sorted(...)"
        )
    if isinstance(value, complex) or (numpy is not None and isinstance(value, numpy.complexfloating)):
        return f"is the complex number {value!r}, which JSON cannot carry; return its real and imaginary parts as floats"
    if numpy is not None and isinstance(value, numpy.ndarray):
        return (
            f"is a numpy array (shape {tuple(value.shape)}, dtype {value.dtype}), which JSON cannot carry; "
            "return array.tolist()"
        )
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    return (
        f"is a {kind}, which JSON cannot carry; use None, bool, int, float, str, lists, dicts with "
        "str keys or a pydantic model (with the field's type declared)"
    )


def _model_data(model: BaseModel, path: str) -> dict[str, Any]:
    """A model's fields (and extra fields) encoded by their declared types, keyed by field name.

    A model whose every field is typed (`_fully_typed`) and that holds no extra fields is dumped
    by pydantic in one call (only its non-finite floats are then tagged): a sampled `Choice`
    has one such model per token. A value pydantic would not serialize as its declared type (an
    unvalidated assignment) falls back to the field-by-field walk, which names its key path.
    """
    cls = type(model)
    if not model.model_extra and _fully_typed(cls):
        try:
            return _tag_floats(model.model_dump(mode="json", warnings="error"))
        except Exception:  # pydantic's serialization errors have no common base class
            pass
    data = {}
    for name, info in cls.model_fields.items():
        if info.exclude:
            continue
        data[name] = _encode(getattr(model, name), info.annotation, f"{path}.{name}", in_model=True)
    for name, value in (model.model_extra or {}).items():
        data[name] = _encode(value, _UNTYPED, f"{path}.{name}", in_model=True)
    return data


def _tag_floats(value: Any) -> Any:
    """JSON-mode data with its non-finite floats tagged (the inverse of `_floats`)."""
    if isinstance(value, float) and not math.isfinite(value):
        return {FLOAT_TAG: "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    if isinstance(value, list):
        return [_tag_floats(v) for v in value]
    if isinstance(value, dict):
        return {k: _tag_floats(v) for k, v in value.items()}
    return value


@functools.lru_cache(maxsize=512)
def _fully_typed(cls: type[BaseModel]) -> bool:
    """True when pydantic's JSON mode dumps every field of `cls` losslessly by its declared type:
    no untyped (`Any`) part, every nested model fully typed too, no computed fields."""
    if cls.model_computed_fields or cls in _CHECKING:
        return False  # a model that contains itself is walked (no recursion without end)
    _CHECKING.add(cls)
    try:
        return all(info.exclude or _typed(info.annotation, models=True) for info in cls.model_fields.values())
    finally:
        _CHECKING.discard(cls)


_CHECKING: set[type] = set()
"""The model classes `_fully_typed` is looking into right now."""


def _members(declared: Any) -> tuple[Any, ...]:
    """The alternatives of a declared type: Union / Optional / `X | Y` members, Annotated unwrapped."""
    origin = typing.get_origin(declared)
    if origin is Annotated:
        return _members(typing.get_args(declared)[0])
    if origin is Union or origin is types.UnionType:
        return tuple(m for arg in typing.get_args(declared) for m in _members(arg))
    return (declared,)


def _models_in(declared: Any) -> tuple[type, ...]:
    """The pydantic model classes a declared type names directly (as itself or a union member)."""
    return tuple(m for m in _members(declared) if isinstance(m, type) and issubclass(m, BaseModel))


def _item_type(declared: Any) -> Any:
    """The declared value type of a dict in `declared`, or untyped."""
    for member in _members(declared):
        origin = typing.get_origin(member) or member
        if isinstance(origin, type) and issubclass(origin, Mapping):
            args = typing.get_args(member)
            return args[1] if len(args) == 2 else _UNTYPED
    return _UNTYPED


def _sequence_types(declared: Any, length: int) -> list[Any]:
    """The declared item types of a list or tuple of `length` items in `declared`, or untyped."""
    for member in _members(declared):
        origin = typing.get_origin(member) or member
        if not (isinstance(origin, type) and issubclass(origin, Sequence)) or origin in (str, bytes):
            continue
        args = typing.get_args(member)
        if origin is tuple and args and args[-1] is not Ellipsis:
            return list(args)[:length] + [_UNTYPED] * max(0, length - len(args))
        return [args[0] if args else _UNTYPED] * length
    return [_UNTYPED] * length


def _is_typed(declared: Any) -> bool:
    """`_typed(declared)`, cached where the declared type is hashable."""
    try:
        return _typed_cached(declared)
    except TypeError:  # unhashable metadata in an Annotated type
        return _typed(declared)


@functools.lru_cache(maxsize=256)
def _typed_cached(declared: Any) -> bool:
    return _typed(declared)


def _typed(declared: Any, models: bool = False) -> bool:
    """True when `declared` names a type pydantic serializes and validates back: no `Any`, no
    `object`, no bare container; a model class counts only with `models` and when it is
    `_fully_typed` (otherwise models are walked field by field)."""
    if declared is Any or declared is object:
        return False
    if isinstance(declared, type) and issubclass(declared, BaseModel):
        return models and _fully_typed(declared)
    origin = typing.get_origin(declared)
    args = typing.get_args(declared)
    if origin is Annotated:
        return _typed(args[0], models)
    if origin is typing.Literal:
        return True
    if origin is not None and not args:
        return False
    if origin is None and declared in (list, dict, tuple, set, frozenset):
        return False  # a bare container holds untyped items
    return all(_typed(arg, models) for arg in args if arg is not Ellipsis)


def _adapter(declared: Any) -> TypeAdapter[Any]:
    """pydantic's adapter for `declared`, cached where the declared type is hashable."""
    try:
        return _adapter_cached(declared)
    except TypeError:
        return TypeAdapter(declared)


@functools.lru_cache(maxsize=256)
def _adapter_cached(declared: Any) -> TypeAdapter[Any]:
    return TypeAdapter(declared)


def _dump_typed(declared: Any, value: Any, path: str) -> Any:
    """`value` in pydantic's JSON mode for its declared type (validated back on arrival)."""
    try:
        return _adapter(declared).dump_python(value, mode="json", warnings="error")
    except Exception as exc:  # pydantic's serialization errors have no common base class
        raise WireError(
            path,
            f"does not serialize as its declared type {declared!r} ({' '.join(str(exc).split())}); "
            "give it a value of that type",
        ) from None


def _load_model(ref: str, path: str) -> type[BaseModel]:
    module_name, _, qualname = ref.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise WireError(
            path,
            f"is a {ref} model, which cannot be imported here ({exc}); make its module importable on every host",
        ) from None
    if not (isinstance(obj, type) and issubclass(obj, BaseModel)):
        raise WireError(path, f"names {ref}, which is not a pydantic model class")
    return obj


def decode(value: Any, path: str = "result") -> Any:
    """Inverse of `encode`: rebuild non-finite floats and tagged pydantic models, recursively.

    Raises:
        WireError: a tagged class that cannot be imported here or is not a model, or data its
            model does not validate (names the key path).
    """
    if isinstance(value, list):
        return [decode(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if set(value) == {FLOAT_TAG} and value[FLOAT_TAG] in _NON_FINITE:
            return _NON_FINITE[value[FLOAT_TAG]]
        if MODEL_TAG in value and set(value) == {MODEL_TAG, "data"}:
            cls = _load_model(value[MODEL_TAG], path)
            try:
                return cls.model_validate(_floats(value["data"]))
            except ValidationError as exc:
                from art_mega.errors import format_validation_error

                raise WireError(
                    path, f"does not validate as {cls.__name__}: {format_validation_error(exc, cls.__name__)}"
                ) from None
        return {k: decode(v, f"{path}[{k!r}]") for k, v in value.items()}
    return value


def _floats(value: Any) -> Any:
    """`value` with its non-finite float tags rebuilt (inside a model's data: no model tags)."""
    if isinstance(value, list):
        return [_floats(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {FLOAT_TAG} and value[FLOAT_TAG] in _NON_FINITE:
            return _NON_FINITE[value[FLOAT_TAG]]
        return {k: _floats(v) for k, v in value.items()}
    return value

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
  the data. A parametrized generic model (`TrainableModel[MyConfig]`, whose class pydantic
  creates where it is first written) travels as its generic class and its type arguments,
  {"__model__": "art_mega.model:TrainableModel", "args": ["my_module:MyConfig"], "data": ...}
  (an argument that is itself parametrized as {"__model__": ..., "args": [...]}), and is
  parametrized again on arrival; a type argument that is not a class (`list[int]`, a TypeVar)
  is refused. Its fields are encoded by their declared types: typed values pydantic restores
  (datetime, set[int], Enum, ...) go through pydantic's JSON mode, values of untyped (`Any`)
  fields follow the rules above, and a model inside an untyped field is refused (it would
  arrive as a plain dict).

Refused: bytes, sets, complex numbers, numpy arrays and any other object where no declared
type restores it, and a dict shaped like a tag ({"__float__": ...} or {"__model__": ..., "data":
...} alone, or with "args"), which would arrive as the tagged value. Nothing is pickled.
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
ARGS_KEY = "args"
"""The key of a parametrized generic model's type arguments, beside MODEL_TAG."""
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


def check_field(value: Any, path: str) -> None:
    """Refuse `value`, the value of an untyped (`Any`) field of a model (a trajectory's
    `metadata`, a group's), where it could not travel as that field: the check `encode` makes
    when the model travels, so `Trajectory(...)`, `model.log` and a rollout's result refuse the
    same values with the same sentence.

    Raises:
        WireError: a value that cannot travel (bytes, a set, an arbitrary object, a pydantic
            model, a dict with a non-str key), naming its key path under `path`.
    """
    _encode(value, _UNTYPED, path, in_model=True)


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
            return {**_class_tag(cls, cls, path), "data": _model_data(value, path)}
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
    return keys == {FLOAT_TAG} or keys in ({MODEL_TAG, "data"}, {MODEL_TAG, ARGS_KEY, "data"})


def _class_tag(cls: type, model: type, path: str) -> dict[str, Any]:
    """{MODEL_TAG: "module:qualname"} naming `cls` (a class in the type of the model class
    `model`), with ARGS_KEY for a parametrized generic pydantic model (its generic class)."""
    meta = getattr(cls, "__pydantic_generic_metadata__", None)
    if meta is not None and meta["origin"] is not None:
        args = [_type_arg(arg, model, path) for arg in meta["args"]]
        return {**_class_tag(meta["origin"], model, path), ARGS_KEY: args}
    if "<locals>" in cls.__qualname__:
        what = "a model class" if cls is model else f"whose type argument {cls.__qualname__} is"
        raise WireError(
            path,
            f"is a {model.__qualname__}, {what} local to a function; define it at top level",
        )
    return {MODEL_TAG: f"{cls.__module__}:{cls.__qualname__}"}


def _type_arg(arg: Any, model: type, path: str) -> str | dict[str, Any] | None:
    """A type argument of a parametrized model: "module:qualname", a parametrized model's tag,
    or None for None."""
    if arg is None or arg is type(None):
        return None
    if not isinstance(arg, type) or ("[" in arg.__qualname__ and not _parametrized(arg)):
        raise WireError(
            path,
            f"is a {model.__qualname__}, whose type argument {arg!r} is not a class the wire can name; "
            "parametrize the model with classes (e.g. pydantic models)",
        )
    tag = _class_tag(arg, model, path)
    return tag if ARGS_KEY in tag else tag[MODEL_TAG]


def _parametrized(cls: type) -> bool:
    meta = getattr(cls, "__pydantic_generic_metadata__", None)
    return meta is not None and meta["origin"] is not None


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


def _import_class(ref: Any, shown: str, role: str, path: str) -> type:
    """The class "module:qualname" `ref` names; `shown` is the received model as messages name
    it, `role` what `ref` is to it ("model" or "type argument")."""
    module_name, colon, qualname = ref.partition(":") if isinstance(ref, str) else ("", "", "")
    # an empty or relative module name is refused here: import_module raises ValueError/TypeError
    # for it, not ImportError
    if not (colon and module_name and qualname) or module_name.startswith("."):
        raise WireError(path, f"names the class {ref!r}, which is not a 'module:qualname' reference")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        what = "which" if role == "model" else f"whose type argument {ref}"
        raise WireError(
            path,
            f"is a {shown} model, {what} cannot be imported here ({exc}); make its module importable "
            "on every host",
        ) from None
    if not isinstance(obj, type):
        raise WireError(
            path, f"names {ref}, which is not a {'pydantic model class' if role == 'model' else 'class'}"
        )
    return obj


def _shown(tag: Any) -> str:
    """A type tag as messages name it: "module:Qualname[module:Arg, ...]"."""
    if isinstance(tag, dict):
        args = tag.get(ARGS_KEY)
        inner = f"[{', '.join(_shown(a) for a in args)}]" if isinstance(args, list) else ""
        return f"{tag.get(MODEL_TAG)}{inner}"
    return "None" if tag is None else str(tag)


def _load_class(tag: Any, shown: str, role: str, path: str) -> Any:
    """The class a type tag names: "module:qualname", or {MODEL_TAG: generic class, ARGS_KEY:
    [type tags]} parametrized again here; None for a None type argument (spelled as the sender
    most likely wrote it: pydantic keeps `Box[None]` and `Box[NoneType]` as two classes)."""
    if tag is None and role == "type argument":
        return None
    if not isinstance(tag, dict):
        return _import_class(tag, shown, role, path)
    origin = _import_class(tag.get(MODEL_TAG), shown, role, path)
    if ARGS_KEY not in tag:
        return origin
    args = tag[ARGS_KEY]
    meta = getattr(origin, "__pydantic_generic_metadata__", None)
    if not (meta and meta["parameters"]):
        raise WireError(path, f"is a {shown} model, but {tag[MODEL_TAG]} is not a generic pydantic model")
    if not isinstance(args, list) or not args:
        raise WireError(path, f"is a {shown} model whose type arguments {args!r} are not a list of classes")
    loaded = tuple(_load_class(arg, shown, "type argument", path) for arg in args)
    try:
        return origin[loaded]
    except TypeError as exc:
        raise WireError(path, f"is a {shown} model, which cannot be parametrized here ({exc})") from None


def _load_model(tag: dict[str, Any], path: str) -> type[BaseModel]:
    """The model class of a received model tag (its "data" aside)."""
    type_tag = {k: v for k, v in tag.items() if k != "data"}
    shown = _shown(type_tag)
    cls = _load_class(type_tag, shown, "model", path)
    if not issubclass(cls, BaseModel):
        raise WireError(path, f"names {shown}, which is not a pydantic model class")
    return cls


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
        if _looks_tagged(value) and MODEL_TAG in value:
            cls = _load_model(value, path)
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

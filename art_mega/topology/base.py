"""The frozen pydantic base model and the field types shared by every topology spec.

Specs forbid unknown fields and never change once built; ids and ports are checked here once.
Their integer, bool and float fields use `Integer`, `Flag` and `Number`, which take only their
own type (pydantic's lax mode read `True` as 1, `"2"` as 2 and `"no"` as False).
"""

from __future__ import annotations

import numbers
import re
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    ValidationInfo,
)

_IDENTIFIER = re.compile(r"^[A-Za-z0-9._-]+$")
_GPU_UUID = re.compile(r"^(GPU|MIG)-[A-Za-z0-9/_-]+$")


class SpecModel(BaseModel):
    """Base of every topology model: frozen (hashable, immutable) and strict about extra fields."""

    model_config = ConfigDict(frozen=True, extra="forbid")


def check_identifier(value: str, what: str) -> str:
    """Return `value` if it is a non-empty run of `[A-Za-z0-9._-]`, else raise `ValueError`.

    `what` names the field in the message, e.g. "host_id".
    """
    if not isinstance(value, str) or not _IDENTIFIER.fullmatch(value):
        raise ValueError(
            f"{what} {value!r} must be a non-empty name made of letters, digits, '.', '_' or '-'"
        )
    return value


def _validate_gpu_id(value: object) -> int | str:
    if isinstance(value, bool):
        raise ValueError(f"GPU id {value!r} must be an index >= 0 or a 'GPU-'/'MIG-' UUID")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"GPU id {value} must be an index >= 0 or a 'GPU-'/'MIG-' UUID")
        return value
    if isinstance(value, str):
        if value.isascii() and value.isdigit():
            return int(value)
        if _GPU_UUID.fullmatch(value):
            return value
    raise ValueError(f"GPU id {value!r} must be an index >= 0 or a 'GPU-'/'MIG-' UUID")


GpuId = Annotated[int | str, PlainValidator(_validate_gpu_id), PlainSerializer(lambda v: v)]
"""A GPU as CUDA names it: an index >= 0 (digit strings become ints) or a `GPU-`/`MIG-` UUID."""


def _integer(value: Any, info: ValidationInfo) -> Any:
    # pydantic's lax int takes True, "2" and 2.0; a count or port is an integer or refused
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)  # numpy integers too
    raise ValueError(
        f"{info.field_name} {value!r} must be an integer, not {_kind(value)}; "
        "write it as a whole number without quotes"
    )


def _flag(value: Any, info: ValidationInfo) -> Any:
    # pydantic's lax bool takes "no", "off", 0 and 1; a flag is True or False or refused
    if isinstance(value, bool):
        return value
    if type(value).__module__ == "numpy" and type(value).__name__ in {"bool", "bool_"}:
        return bool(value)
    raise ValueError(f"{info.field_name} {value!r} must be True or False, not {_kind(value)}")


def _number(value: Any, info: ValidationInfo) -> Any:
    # pydantic's lax float takes True and "2"; ints and numpy numbers stay accepted
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return value
    raise ValueError(
        f"{info.field_name} {value!r} must be a number, not {_kind(value)}; write it without quotes"
    )


def _kind(value: Any) -> str:
    if value is None:
        return "None"
    if isinstance(value, str):
        return "a string"
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


Integer = Annotated[int, BeforeValidator(_integer)]
"""An `int` field that refuses bools, strings and floats (numpy integers are accepted)."""

Flag = Annotated[bool, BeforeValidator(_flag)]
"""A `bool` field that refuses strings and numbers (numpy bools are accepted)."""

Number = Annotated[float, BeforeValidator(_number)]
"""A `float` field that refuses bools and strings (ints and numpy numbers are accepted)."""

Port = Annotated[Integer, Field(ge=0, le=65535)]
"""A TCP port number, 0..65535."""

ListenPort = Annotated[Integer, Field(ge=1, le=65535)]
"""A TCP port a process listens on, 1..65535."""


def unique_gpu_ids(values: tuple[int | str, ...], what: str) -> tuple[int | str, ...]:
    """Return `values` unchanged if no GPU id repeats, else raise `ValueError` naming `what`."""
    seen: set[int | str] = set()
    for value in values:
        if value in seen:
            raise ValueError(f"{what} lists GPU {value!r} twice; list each GPU once")
        seen.add(value)
    return values


def unique_names(values: tuple[str, ...], what: str) -> tuple[str, ...]:
    """Return `values` if each is an identifier listed once, else raise `ValueError`."""
    seen: set[str] = set()
    for value in values:
        check_identifier(value, what)
        if value in seen:
            raise ValueError(f"{what} lists {value!r} twice; list each one once")
        seen.add(value)
    return values

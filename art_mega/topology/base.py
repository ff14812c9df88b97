"""The frozen pydantic base model and the field types shared by every topology spec.

Specs forbid unknown fields and never change once built; ids and ports are checked here once.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, PlainSerializer, PlainValidator

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

Port = Annotated[int, Field(ge=0, le=65535)]
"""A TCP port number, 0..65535."""

ListenPort = Annotated[int, Field(ge=1, le=65535)]
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

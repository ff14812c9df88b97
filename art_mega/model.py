"""Model and TrainableModel: the names a program trains and serves (ART's client API).

They are plain serializable descriptions until registered with a backend: nothing is loaded.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator


def _check_name(value: str, field: str) -> str:
    if not value or not value.strip() or value != value.strip():
        raise ValueError(f"{field} {value!r} must be a non-empty name without surrounding spaces")
    if any(c in value for c in "/\\@\0\n\r"):
        raise ValueError(f"{field} {value!r} must not contain '/', '\\\\', '@', NUL or line breaks")
    return value


class Model(BaseModel):
    """A model served for inference: `name` within `project`, an optional run name."""

    model_config = ConfigDict(extra="forbid")

    name: str
    project: str
    run_name: str | None = None
    config: dict[str, Any] = Field(default_factory=dict)

    @field_validator("name", "project")
    @classmethod
    def _names(cls, value: str, info: Any) -> str:
        return _check_name(value, info.field_name)


class TrainableModel(Model):
    """A model that art-mega trains: `base_model` is an HF directory, a cached name, or an adapter.

    Serializable without loading anything; the backend resolves `base_model` on `register`.
    """

    base_model: str
    trainable: bool = True

    @field_validator("base_model")
    @classmethod
    def _base(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("base_model must name an HF directory, a cached model or a PEFT adapter")
        return value

"""Bodies of the trainer service: controller <-> agent (the /trainer/* routes), agent <-> rank.

Pydantic models, JSON on the wire; every body is validated against them on receipt.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TrainerRankLaunch(_Body):
    """One trainer rank to start on this host: its global rank, environment and log file."""

    rank: int = Field(ge=0)
    env: dict[str, str]
    log_path: str


class TrainerStartRequest(_Body):
    """Start this host's trainer ranks with `config` (JSON the rank main understands)."""

    ranks: tuple[TrainerRankLaunch, ...]
    config: dict[str, Any]
    python: str | None = None
    sys_path: tuple[str, ...] = ()


class TrainerStartResponse(_Body):
    pids: tuple[int, ...] = ()
    error: str = ""


class TrainerJobRequest(_Body):
    """A job for every trainer rank of this host (kind, step, hyper-parameters, batch location)."""

    job: dict[str, Any]


class TrainerJobResponse(_Body):
    sent: int


class TrainerEventsRequest(_Body):
    """Long-poll the ranks' events from index `after`, waiting up to `timeout_s` seconds."""

    after: int = Field(ge=0)
    timeout_s: float = Field(default=10.0, ge=0, le=120)


class TrainerEventsResponse(_Body):
    events: tuple[dict[str, Any], ...] = ()
    next: int = 0

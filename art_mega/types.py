"""ART's type names: `Messages`, `MessagesAndChoices`, `Tools` (the OpenAI chat types a
`Trajectory` holds), `Verbosity`, `Backend` (what a `TrainableModel` needs of its backend), and,
as ART's `art.types` has them, `TrainResult` and `LocalTrainResult` (what `backend.train` returns,
defined here) and `TrainConfig`, `TrainSFTConfig`: the very classes `art_mega` exports (from
`art_mega.model`, `art_mega.sft`), loaded on first use so this module stays light.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

from openai.types.chat.chat_completion import Choice
from openai.types.chat.chat_completion_message_param import ChatCompletionMessageParam
from openai.types.chat.chat_completion_tool_param import ChatCompletionToolParam

Message = ChatCompletionMessageParam
MessageOrChoice = Message | Choice
Messages = list[Message]
"""Chat messages (OpenAI's message dicts), e.g. a trajectory's prompt."""
MessagesAndChoices = list[MessageOrChoice]
"""A conversation: message dicts and the sampled `Choice`s training learns from."""
Tools = list[ChatCompletionToolParam]
"""OpenAI tool definitions (`{"type": "function", "function": {...}}`)."""
Verbosity = Literal[0, 1, 2]
"""ART's verbosity levels (0 quiet, 1 progress, 2 debug), for annotating a program's own option."""


@dataclass(frozen=True)
class TrainResult:
    """What one `backend.train` did: the new policy step and its metrics (loss/, data/, time/)."""

    step: int
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class LocalTrainResult(TrainResult):
    """ART's LocalTrainResult: a `TrainResult` with the new step's checkpoint directory, and ART
    0.5.23's `checkpoint_ready` (an awaitable for a checkpoint still being written; always None
    here: art-mega's step returns once its checkpoint is committed)."""

    checkpoint_path: str | None = None
    checkpoint_ready: Any = field(default=None, repr=False, compare=False)


_CLASSES = {
    "TrainConfig": "art_mega.model",
    "TrainSFTConfig": "art_mega.sft",
}
"""ART's `art.types` classes, by the module that defines them (imported on first access)."""


def __getattr__(name: str) -> Any:
    module = _CLASSES.get(name)
    if module is None:
        from art_mega.unsupported import missing

        raise missing("art_mega.types", name)
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


@runtime_checkable
class Backend(Protocol):
    """What `TrainableModel` calls on its backend (`MegatronBackend` and `LocalBackend` are ones).

    Unlike ART's protocol (private `_get_step`, `_delete_checkpoint_files`, ...), these are
    art-mega's public backend methods; `isinstance(backend, art.Backend)` checks for them.
    """

    async def register(self, model: Any) -> Path: ...

    def policy_router(self, model: Any) -> Any: ...

    def inference_name(self, model: Any) -> str: ...

    async def get_step(self, model: Any) -> int: ...

    async def train(self, model: Any, trajectory_groups: Any, **kwargs: Any) -> Any: ...

    async def train_sft(self, model: Any, trajectories: Any, config: Any = None, **kwargs: Any) -> Any: ...

    async def delete_checkpoints(
        self, model: Any, best_checkpoint_metric: str = "val/reward"
    ) -> list[int]: ...

    async def close(self) -> None: ...

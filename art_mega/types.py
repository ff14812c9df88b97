"""ART's type names: `Messages`, `MessagesAndChoices`, `Tools` (the OpenAI chat types a
`Trajectory` holds) and `Backend` (what a `TrainableModel` needs of its backend)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

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

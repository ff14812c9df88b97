"""Trajectory and TrajectoryGroup: one scored rollout and a group of rollouts of one prompt.

`messages_and_choices` holds chat messages (dicts) and the `openai` `Choice` objects the model
returned; both survive a JSON round trip exactly (a Choice comes back as a Choice).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Any, Union

from openai.types.chat.chat_completion import Choice
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

MetricValue = Union[float, int, bool]


def _message_kind(value: Any) -> str:
    if isinstance(value, Choice):
        return "choice"
    if isinstance(value, dict) and "message" in value and "finish_reason" in value and "index" in value:
        return "choice"
    return "message"


MessageOrChoice = Annotated[
    Union[Annotated[Choice, Tag("choice")], Annotated[dict[str, Any], Tag("message")]],
    Discriminator(_message_kind),
]
"""A chat message dict ({"role": ..., "content": ...}) or an `openai` chat `Choice`."""


class Trajectory(BaseModel):
    """One rollout: the conversation (messages and sampled choices), its reward and metrics.

    Attributes:
        messages_and_choices: the conversation in order; `Choice` entries are what the policy
            sampled (they carry token ids and logprobs when the server returned them).
        tools: the tool schemas offered to the model, if any.
        reward: the scalar reward (any scale; advantages are normalised per group).
        metrics: named numbers averaged in logs (e.g. {"correct": 1.0}).
        metadata: free-form scalars kept with the trajectory.
        logs: free-form log lines.
    """

    model_config = ConfigDict(arbitrary_types_allowed=False, extra="forbid")

    messages_and_choices: list[MessageOrChoice] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    additional_histories: list[dict[str, Any]] = Field(default_factory=list)
    reward: float = 0.0
    metrics: dict[str, MetricValue] = Field(default_factory=dict)
    metadata: dict[str, Any] = Field(default_factory=dict)
    logs: list[str] = Field(default_factory=list)

    def messages(self) -> list[dict[str, Any]]:
        """The conversation as plain chat messages (choices turned into assistant messages)."""
        out: list[dict[str, Any]] = []
        for item in self.messages_and_choices:
            if isinstance(item, Choice):
                out.append(item.message.model_dump(exclude_none=True))
            else:
                out.append(dict(item))
        return out

    def finish(self) -> Trajectory:
        """Mark the rollout complete and return it (kept for ART compatibility)."""
        return self

    def log(self, message: str) -> None:
        """Append one line to `logs`."""
        self.logs.append(message)


class TrajectoryGroup(BaseModel):
    """Trajectories sampled for the same prompt; GRPO normalises rewards within a group.

    Attributes:
        trajectories: the group's trajectories.
        metrics: group-level metrics.
        exceptions: descriptions of rollouts of this group that raised (type and message).
    """

    model_config = ConfigDict(extra="forbid")

    trajectories: list[Trajectory] = Field(default_factory=list)
    metrics: dict[str, MetricValue] = Field(default_factory=dict)
    exceptions: list[str] = Field(default_factory=list)

    def __init__(self, trajectories: Iterable[Trajectory] | None = None, **data: Any) -> None:
        if trajectories is not None:
            data["trajectories"] = list(trajectories)
        super().__init__(**data)

    def __iter__(self):  # type: ignore[override]
        return iter(self.trajectories)

    def __len__(self) -> int:
        return len(self.trajectories)

"""Trajectory and TrajectoryGroup: one scored rollout and a group of rollouts of one prompt.

`messages_and_choices` holds chat messages (dicts) and the `openai` `Choice` objects the model
returned; both survive a JSON round trip exactly (a Choice comes back as a Choice).
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import math
import numbers
from collections.abc import Iterable
from typing import Annotated, Any, Protocol, Union

from openai.types.chat.chat_completion import Choice
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

MetricValue = Union[float, int, bool]

POLICY_STEP_FIELD = "policy_step"
"""The attribute `model.openai_client()` sets on each choice: the training step whose adapter
served it (None: the base model). Kept through JSON round trips (choices allow extra fields)."""


def _message_kind(value: Any) -> str:
    if isinstance(value, Choice):
        return "choice"
    if isinstance(value, dict) and "message" in value and "finish_reason" in value and "index" in value:
        return "choice"
    return "message"


HISTORY_KEYS = {"messages_and_choices", "tools"}
"""The keys of one `Trajectory.additional_histories` entry (ART's History model)."""


def _check_metrics(value: Any) -> Any:
    """A `metrics` dict as given, when every value is a number (a bool counts as 0 or 1; numpy
    scalars too); NaN and inf are kept (see `metrics.history_row`). ValueError otherwise: one
    sentence naming the key (pydantic names the field)."""
    if isinstance(value, dict):
        for key, metric in value.items():
            if not isinstance(metric, (bool, numbers.Real)) and not _numpy_bool(metric):
                raise ValueError(
                    f"metric {key!r} is {metric!r} (a {type(metric).__name__}); metrics are numbers "
                    "(float, int or bool), e.g. {'correct': 1.0}: keep other values in metadata"
                )
            try:
                float(metric)
            except OverflowError:
                raise ValueError(f"metric {key!r} is {_magnitude(metric)}, too large for a float") from None
    return value


def _magnitude(value: int) -> str:
    """An int beyond float range, shown by its size (its repr may have thousands of digits)."""
    return f"{'-' if value < 0 else ''}~10**{int(math.log10(abs(value)))}"


def _numpy_bool(value: Any) -> bool:
    return type(value).__module__ == "numpy" and type(value).__name__ == "bool"


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

    @field_validator("messages_and_choices", mode="before")
    @classmethod
    def _items(cls, value: Any) -> Any:
        # a ChatCompletionMessage (choice.message) is a pydantic object, not a message dict: its
        # union error listed every member; appending choice.message also drops the sampled tokens
        if isinstance(value, list):
            for m, item in enumerate(value):
                if isinstance(item, BaseModel) and not isinstance(item, Choice):
                    raise ValueError(
                        f"messages_and_choices[{m}] is a {type(item).__name__} object, not a chat "
                        "message dict or an openai Choice; append the Choice itself (its sampled "
                        "tokens train as sampled) or item.model_dump(exclude_none=True)"
                    )
        return value

    @field_validator("reward", mode="before")
    @classmethod
    def _reward(cls, value: Any) -> Any:
        # pydantic turns "1.0" into 1.0 in silence; a reward is a number (a bool, e.g. reward=
        # correct, is 0.0 or 1.0 as in ART and as in metrics; NaN and inf are kept here:
        # backend.train refuses them, or drops them with drop_nonfinite_rewards=True)
        if _numpy_bool(value):
            return float(value)
        if not isinstance(value, numbers.Real):
            raise ValueError(
                f"reward {value!r} is a {type(value).__name__}, not a number; score the rollout "
                "with a float, e.g. reward=1.0"
            )
        try:
            return float(value)
        except OverflowError:  # an int beyond float range (10**400)
            raise ValueError(
                f"reward {_magnitude(value)} is too large for a float; rescale the reward"
            ) from None

    @field_validator("additional_histories", mode="before")
    @classmethod
    def _histories(cls, value: Any) -> Any:
        # ART's History model: messages_and_choices (required) and tools; a history without
        # them (e.g. {"messages": [...]}) trained nothing here, in silence
        if isinstance(value, list):
            for h, history in enumerate(value):
                keys = set(history) if isinstance(history, dict) else None
                if keys is None or "messages_and_choices" not in keys or keys - HISTORY_KEYS:
                    shown = (
                        f"has the keys {sorted(keys, key=str)}"
                        if keys is not None
                        else f"is a {type(history).__name__}"
                    )
                    raise ValueError(
                        f"additional_histories[{h}] {shown}; a history is "
                        "{'messages_and_choices': [...], 'tools': [...] (optional)}"
                    )
        return value

    @field_validator("metrics", mode="before")
    @classmethod
    def _metrics(cls, value: Any) -> Any:
        return _check_metrics(value)

    def messages(self) -> list[dict[str, Any]]:
        """The conversation as plain chat messages (choices turned into assistant messages)."""
        out: list[dict[str, Any]] = []
        for item in self.messages_and_choices:
            if isinstance(item, Choice):
                out.append(item.message.model_dump(exclude_none=True))
            else:
                out.append(dict(item))
        return out

    def policy_steps(self) -> list[int | None]:
        """The policy steps of this trajectory's tagged choices, distinct, in order of first
        appearance (None: served by the base model). Untagged choices (not sampled through
        `model.openai_client()`) and plain messages add nothing."""
        steps: list[int | None] = []
        for item in self.messages_and_choices:
            if isinstance(item, Choice) and POLICY_STEP_FIELD in (item.model_extra or {}):
                step = item.model_extra[POLICY_STEP_FIELD]  # type: ignore[index]
                if step not in steps:
                    steps.append(step)
        return steps

    def finish(self) -> Trajectory:
        """Mark the rollout complete and return it (kept for ART compatibility)."""
        return self

    def log(self, message: str) -> None:
        """Append one line to `logs`."""
        self.logs.append(message)


class TrajectoryGroup(BaseModel):
    """Trajectories sampled for the same prompt; GRPO normalises rewards within a group.

    `TrajectoryGroup(items)` with plain trajectories builds the group. Given awaitables (one
    rollout coroutine per trajectory), it returns an awaitable instead, as in ART: awaiting it
    runs the rollouts concurrently and builds the group; a rollout that raises is recorded in
    `exceptions` ("Type: message") and left out of `trajectories`.

    Attributes:
        trajectories: the group's trajectories.
        metrics: group-level metrics (averaged over groups in logs).
        metadata: free-form scalars kept with the group.
        exceptions: descriptions of rollouts of this group that raised.
    """

    model_config = ConfigDict(extra="forbid")

    trajectories: list[Trajectory] = Field(default_factory=list)
    metrics: dict[str, MetricValue] = Field(default_factory=dict)
    metadata: dict[str, Any] = Field(default_factory=dict)
    exceptions: list[str] = Field(default_factory=list)

    @field_validator("metrics", mode="before")
    @classmethod
    def _metrics(cls, value: Any) -> Any:
        return _check_metrics(value)

    def __new__(cls, trajectories: Iterable[Any] | None = None, *args: Any, **kwargs: Any) -> Any:
        items = None if trajectories is None else list(trajectories)
        if items and any(inspect.isawaitable(t) for t in items):
            return PendingTrajectoryGroup(cls, items, kwargs)
        instance = super().__new__(cls)
        if items is not None:
            instance.__dict__["_art_items"] = items  # a generator can only be read once
        return instance

    def __init__(self, trajectories: Iterable[Trajectory] | None = None, **data: Any) -> None:
        items = self.__dict__.pop("_art_items", None)
        if items is not None:
            data["trajectories"] = items
        elif trajectories is not None:
            data["trajectories"] = list(trajectories)
        super().__init__(**data)

    def __iter__(self):  # type: ignore[override]
        return iter(self.trajectories)

    def __len__(self) -> int:
        return len(self.trajectories)


class PendingTrajectoryGroup:
    """What `TrajectoryGroup(awaitables)` returns: awaiting it runs the rollouts (once)."""

    def __init__(self, cls: type[TrajectoryGroup], items: list[Any], kwargs: dict[str, Any]) -> None:
        self._cls = cls
        self._items = items
        self._kwargs = kwargs

    @property
    def num_trajectories(self) -> int:
        """How many rollouts this group will run."""
        return len(self._items)

    def __await__(self):  # type: ignore[no-untyped-def]
        return _gather_group(self._cls, self._items, self._kwargs).__await__()


def off_policy(
    groups: Iterable[TrajectoryGroup], expected_step: int
) -> list[tuple[int, int, list[int | None]]]:
    """The trajectories holding a choice served by a step other than `expected_step`, as
    (group index, trajectory index, its `policy_steps()`), in order. Untagged ones pass."""
    found = []
    for g, group in enumerate(groups):
        for t, trajectory in enumerate(group.trajectories):
            steps = trajectory.policy_steps()
            if any(step != expected_step for step in steps):
                found.append((g, t, steps))
    return found


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function", "ipython")
"""The message roles training accepts: OpenAI's chat roles ("function" is its legacy tool role)
and "ipython", the tool-result role of Llama 3.1 chat templates."""


def check_train_groups(value: Any, where: str = "backend.train") -> list[TrajectoryGroup]:
    """`value` (the `trajectory_groups` argument of `where`) as a list of groups, checked whole
    before anything is tokenized or trained.

    Every element must be a built `TrajectoryGroup` holding at least one trajectory (a group
    whose every rollout raised, as `gather_trajectory_groups` may return under
    `max_exceptions`, is kept: training skips it), and each trajectory a conversation training
    can take (see `check_conversation`). Rewards are checked by `nonfinite_rewards`.

    Raises:
        TrainInputError: a string, a single group, something not iterable, an empty list, an
            element that is not a built TrajectoryGroup (a list, an un-awaited group), an empty
            group without recorded exceptions, or a bad message (names group, trajectory, message).
        NonFiniteValueError: a sampled Choice with a NaN or inf logprob (names the token).
    """
    from art_mega.errors import TrainInputError

    argument = f"{where}(trajectory_groups)"
    if isinstance(value, TrajectoryGroup):
        raise TrainInputError(
            f"{argument} got one TrajectoryGroup; pass a list of groups, e.g. [group]", "trajectory_groups"
        )
    if isinstance(value, (str, bytes, dict)) or not isinstance(value, Iterable):
        raise TrainInputError(
            f"{argument} got a {type(value).__name__}; pass a list of art.TrajectoryGroup "
            "(what art.gather_trajectory_groups returns)",
            "trajectory_groups",
        )
    groups = list(value)
    if not groups:
        raise TrainInputError(
            f"{argument} got an empty list; pass at least one TrajectoryGroup", "trajectory_groups"
        )
    for g, group in enumerate(groups):
        if isinstance(group, PendingTrajectoryGroup) or inspect.isawaitable(group):
            raise TrainInputError(
                f"{argument}: group {g} was never awaited; await it or build the groups with "
                "art.gather_trajectory_groups",
                "trajectory_groups",
                g,
            )
        if isinstance(group, Trajectory):
            raise TrainInputError(
                f"{argument}: group {g} is a Trajectory, not an art.TrajectoryGroup; group the "
                "trajectories of one prompt: [art.TrajectoryGroup([t1, t2, ...]), ...]",
                "trajectory_groups",
                g,
            )
        if not isinstance(group, TrajectoryGroup) and type(group).__name__ == "TrajectoryGroup":
            raise TrainInputError(
                f"{argument}: group {g} is a {type(group).__module__}.TrajectoryGroup, not "
                "art_mega's; build the groups with art_mega (import art_mega as art) rather than "
                "another package's classes",
                "trajectory_groups",
                g,
            )
        if not isinstance(group, TrajectoryGroup):
            raise TrainInputError(
                f"{argument}: group {g} is a {type(group).__name__}, not an art.TrajectoryGroup; "
                "wrap its trajectories: art.TrajectoryGroup([...])",
                "trajectory_groups",
                g,
            )
        if not group.trajectories and not group.exceptions:
            raise TrainInputError(
                f"{argument}: group {g} has no trajectories; leave it out or fill it",
                "trajectory_groups",
                g,
            )
        for t, trajectory in enumerate(group.trajectories):
            check_conversation(
                trajectory, f"{argument}: trajectory {t} of group {g}", "trajectory_groups", g, t
            )
    return groups


def check_sft_trajectories(value: Any, where: str = "train_sft") -> list[Trajectory]:
    """`value` (the `trajectories` argument of `where`) as a non-empty list of trajectories whose
    conversations training can take (see `check_conversation`).

    Raises:
        TrainInputError: a string, something not iterable, an empty list, an element that is
            not a Trajectory, or a bad message (names the trajectory and message).
        NonFiniteValueError: a sampled Choice with a NaN or inf logprob.
    """
    from art_mega.errors import TrainInputError

    argument = f"{where}(trajectories)"
    if isinstance(value, (str, bytes, dict, Trajectory)) or not isinstance(value, Iterable):
        raise TrainInputError(
            f"{argument} got a {type(value).__name__}; pass a list of art.Trajectory", "trajectories"
        )
    trajectories = list(value)
    if not trajectories:
        raise TrainInputError(f"{argument} got an empty list; pass at least one Trajectory", "trajectories")
    for t, trajectory in enumerate(trajectories):
        if not isinstance(trajectory, Trajectory):
            raise TrainInputError(
                f"{argument}: trajectory {t} is a {type(trajectory).__name__}, not an art.Trajectory",
                "trajectories",
                None,
                t,
            )
        check_conversation(trajectory, f"{argument}: trajectory {t}", "trajectories", None, t)
    return trajectories


def check_conversation(
    trajectory: Trajectory, where: str, argument: str, group: int | None, index: int
) -> None:
    """Refuse a conversation (main history or `additional_histories`) training cannot take: a
    message whose role is not one of `CHAT_ROLES`, whose `content` is neither a string, a list of
    content parts (objects) nor None/absent, or a sampled Choice with a NaN, inf (also in
    float32) or positive logprob.

    Raises:
        TrainInputError: names `where` (argument, group, trajectory), the history and the message.
        NonFiniteValueError: names `where`, the message and the token index.
    """
    histories = [("messages_and_choices", trajectory.messages_and_choices)]
    for h, history in enumerate(trajectory.additional_histories):
        histories.append(
            (f"additional_histories[{h}].messages_and_choices", history.get("messages_and_choices", []))
        )
    for name, items in histories:
        for m, item in enumerate(items):
            _check_item(item, f"{where}: {name}[{m}]", argument, group, index)


def _check_item(item: Any, where: str, argument: str, group: int | None, index: int) -> None:
    from art_mega.errors import NonFiniteValueError, TrainInputError
    from art_mega.hyperparams import FLOAT32_MAX

    def refuse(reason: str) -> TrainInputError:
        return TrainInputError(f"{where} {reason}", argument, group, index)

    if isinstance(item, Choice):
        message: Any = item.message.model_dump(exclude_none=True)
        entries = [e.logprob for e in (item.logprobs.content or [])] if item.logprobs else []
    elif isinstance(item, dict) and _message_kind(item) == "choice":
        message = item["message"]
        logprobs = item.get("logprobs") or {}
        entries = [e.get("logprob") for e in logprobs.get("content") or [] if isinstance(e, dict)]
    elif isinstance(item, dict):
        message, entries = item, []
    else:
        raise refuse(f"is a {type(item).__name__}; use a chat message dict or an openai Choice")
    if not isinstance(message, dict):
        raise refuse(f"holds a message of type {type(message).__name__}; use a chat message dict")
    role = message.get("role")
    if role not in CHAT_ROLES:
        shown = "no role" if "role" not in message else f"the unknown role {role!r}"
        raise refuse(f"has {shown}; use one of {', '.join(repr(r) for r in CHAT_ROLES)}")
    content = message.get("content")
    if content is not None and not isinstance(content, str):
        if not isinstance(content, list):
            raise refuse(
                f"has a content of type {type(content).__name__}; content must be a string, "
                "a list of content parts or None"
            )
        for k, part in enumerate(content):
            if not isinstance(part, dict):
                raise refuse(
                    f"has a content part {k} of type {type(part).__name__}; a part is an object "
                    "such as {'type': 'text', 'text': '...'}"
                )
    texts = [content] if isinstance(content, str) else [p.get("text") for p in content or []]
    for text in texts:
        surrogate = _lone_surrogate(text)
        if surrogate is not None:
            raise refuse(
                f"has a lone UTF-16 surrogate {text[surrogate]!r} at character {surrogate} of its "
                "content, which no tokenizer encodes; decode the text with errors='replace'"
            )
    for k, logprob in enumerate(entries):
        if (
            isinstance(logprob, bool)
            or not isinstance(logprob, (int, float))
            or not math.isfinite(logprob)
            or abs(logprob) > FLOAT32_MAX  # -inf in the batch's float32
        ):
            raise NonFiniteValueError(
                f"{where} has the sampling logprob {logprob!r} at token {k}; training needs finite "
                "logprobs (float32: beyond -3.4e38 is -inf): drop this trajectory or sample it again",
                "logprob",
                logprob,
                group,
                index,
            )
        if logprob > 0:  # log_softmax is <= 0 exactly in floating point: no server returns this
            raise refuse(
                f"has the sampling logprob {logprob!r} at token {k}, above 0, which no "
                "log-probability is; train choices as the server returned them"
            )


def _lone_surrogate(text: Any) -> int | None:
    """The index of the first lone surrogate in `text` (e.g. from bytes decoded with
    errors='surrogateescape'), None when `text` is valid Unicode or not a string."""
    if not isinstance(text, str):
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def nonfinite_rewards(groups: Iterable[TrajectoryGroup]) -> list[tuple[int, int, float]]:
    """(group index, trajectory index, reward) of every NaN or +-inf reward, in order."""
    return [
        (g, t, trajectory.reward)
        for g, group in enumerate(groups)
        for t, trajectory in enumerate(group.trajectories)
        if not math.isfinite(trajectory.reward)
    ]


def without_trajectories(
    groups: list[TrajectoryGroup], drop: Iterable[tuple[int, int]]
) -> list[TrajectoryGroup]:
    """Copies of `groups` without the (group index, trajectory index) pairs in `drop`."""
    dropped = set(drop)
    return [
        group.model_copy(
            update={"trajectories": [x for t, x in enumerate(group.trajectories) if (g, t) not in dropped]}
        )
        for g, group in enumerate(groups)
    ]


def describe_exception(exc: BaseException) -> str:
    """`Type: message`, the form exceptions take in `TrajectoryGroup.exceptions`."""
    return f"{type(exc).__name__}: {exc}"


class GroupProgress(Protocol):
    """What counts the rollouts of a gather in progress (`gather.GatherProgress`): each finished
    trajectory and each rollout that raised."""

    def on_trajectory(self, trajectory: Trajectory) -> None: ...

    def on_exception(self, exc: BaseException) -> None: ...


GROUP_PROGRESS: contextvars.ContextVar[GroupProgress | None] = contextvars.ContextVar(
    "art_mega_gather", default=None
)
"""The progress of the enclosing `gather.gather_trajectory_groups`, if any: a group being
awaited reports each of its rollouts to it."""


async def _gather_group(
    cls: type[TrajectoryGroup], items: list[Any], kwargs: dict[str, Any]
) -> TrajectoryGroup:
    progress = GROUP_PROGRESS.get()

    async def one(item: Any) -> Any:
        try:
            result = await item if inspect.isawaitable(item) else item
        except Exception as exc:  # a failed rollout is recorded, not raised (see gather)
            if progress is not None:
                progress.on_exception(exc)
            return exc
        if progress is not None and isinstance(result, Trajectory):
            progress.on_trajectory(result)
        return result

    results = await asyncio.gather(*(one(i) for i in items))
    exceptions = [describe_exception(r) for r in results if isinstance(r, BaseException)]
    trajectories = [r for r in results if not isinstance(r, BaseException)]
    for value in trajectories:
        if not isinstance(value, Trajectory):
            raise TypeError(f"a rollout returned {type(value).__name__}, expected Trajectory")
    group = cls(trajectories, **kwargs)
    group.exceptions.extend(exceptions)
    return group

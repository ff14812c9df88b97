"""Trajectory and TrajectoryGroup: one scored rollout and a group of rollouts of one prompt.

`messages_and_choices` holds chat messages (dicts) and the `openai` `Choice` objects the model
returned; both survive a JSON round trip exactly (a Choice comes back as a Choice). The fields
and methods are ART 0.5.18's (`art.trajectories`); where art-mega refuses more, the docstrings
say so.
"""

from __future__ import annotations

import asyncio
import contextvars
import copy
import inspect
import math
import numbers
import time
import traceback
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from datetime import datetime
from typing import Annotated, Any, Protocol, Union

from openai.types.chat.chat_completion import Choice
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    PrivateAttr,
    Tag,
    field_validator,
    model_validator,
)

MetricValue = Union[float, int, bool]

POLICY_STEP_FIELD = "policy_step"
"""The field every replica sets on each choice it serves (and `model.openai_client()` from the
reply's model name where a server did not): the training step whose adapter served it (None: the
base model). Kept through JSON round trips (choices allow extra fields)."""

SAMPLING_FIELD = "art_mega_sampling"
"""The field every replica sets on each choice it serves: `SamplingRecord`, the settings vLLM
drew its tokens with (art_mega/inference/vllm_plugin/art_mega_vllm_serve.py writes it; its
`SAMPLING_FIELD` must equal this one)."""


class SamplingRecord(BaseModel):
    """The effective sampling settings of one served choice (`SAMPLING_FIELD`): the request's
    values, else the server's defaults (the model's generation config unless the replica runs
    with `--generation-config vllm`), else OpenAI's, as vLLM's `to_sampling_params` merges them;
    temperature 0 is greedy (top_p 1, top_k 0, min_p 0).

    `top_k` 0 or -1 means no top-k cut (vLLM's convention). `constrained`: a mask on the logits
    (structured outputs: JSON schema or object, regex, choice, grammar, structural tag; or
    `tool_choice` "required" or a named function). `processed`: any other change to the
    distribution (repetition, presence or frequency penalties, logit_bias, bad_words,
    allowed_token_ids, min_tokens > 0, a thinking token budget, logits processors' arguments).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(ge=0, allow_inf_nan=False)
    top_p: float = Field(gt=0, le=1, allow_inf_nan=False)
    top_k: int
    min_p: float = Field(ge=0, le=1, allow_inf_nan=False)
    constrained: bool
    processed: bool

    @classmethod
    def of(cls, choice: Any) -> SamplingRecord | None:
        """The record a replica set on `choice` (an openai Choice, or its dict); None when it
        has none (a server other than art-mega's replicas answered)."""
        fields = choice if isinstance(choice, dict) else getattr(choice, "model_extra", None) or {}
        extra = fields.get(SAMPLING_FIELD)
        return None if extra is None else cls.model_validate(extra)


def _message_kind(value: Any) -> str:
    if isinstance(value, Choice):
        return "choice"
    if isinstance(value, dict) and "message" in value and "finish_reason" in value and "index" in value:
        return "choice"
    return "message"


HISTORY_KEYS = {"messages_and_choices", "tools"}
"""The keys of one `Trajectory.additional_histories` entry given as a dict (ART's History)."""


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


def _check_metadata(value: Any, path: str = "metadata") -> Any:
    """A `metadata` dict as given, when JSON can carry every value in it (None, bool, int,
    float, str, lists, dicts with str keys; NaN and inf too, as ART's JSON writer writes them):
    the rollout wire's check of an untyped field (`rollouts.wire.check_field`), so a value is
    refused here, in `model.log` and on its way back from a rollout worker with one sentence.
    ValueError otherwise, naming the key path under `path` (e.g. "metadata['tags'] is a set, ...")."""
    from art_mega.rollouts import wire

    try:
        wire.check_field(value, path)
    except wire.WireError as exc:
        raise ValueError(str(exc)) from None
    return value


def value_problem(group: TrajectoryGroup) -> tuple[int | None, str] | None:
    """The first value of `group` that metrics or JSON cannot take, checked again where groups
    are used (their dicts may have changed since they were validated): the group's own metadata
    and metrics, then each trajectory's. Returns (the trajectory's index, or None for the group
    itself; the sentence naming the key path, e.g. "trajectories[2].metadata['tags'] is a set,
    ..."), or None when every value is fine."""
    parts: list[tuple[int | None, str, Any]] = [(None, "", group)]
    parts += [(t, f"trajectories[{t}].", trajectory) for t, trajectory in enumerate(group.trajectories)]
    for index, prefix, holder in parts:
        try:
            _check_metadata(holder.metadata, f"{prefix}metadata")
            _check_metrics(holder.metrics)
        except ValueError as exc:
            text = str(exc)
            return index, text if text.startswith(prefix) else f"{prefix.rstrip('.')}: {text}"
    return None


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


def _check_items(value: Any) -> Any:
    """`messages_and_choices` as given, unless an item is a pydantic object other than a Choice.

    A ChatCompletionMessage (choice.message) is not a message dict: pydantic's union error listed
    every member, and appending choice.message also drops the sampled tokens."""
    if isinstance(value, list):
        for m, item in enumerate(value):
            if isinstance(item, BaseModel) and not isinstance(item, Choice):
                raise ValueError(
                    f"messages_and_choices[{m}] is a {type(item).__name__} object, not a chat "
                    "message dict or an openai Choice; append the Choice itself (its sampled "
                    "tokens train as sampled) or item.model_dump(exclude_none=True)"
                )
    return value


def get_messages(messages_and_choices: Iterable[Any]) -> list[dict[str, Any]]:
    """The conversation as plain chat messages, as ART's `get_messages` builds them: a Choice
    becomes {"role": "assistant", "content": its content or "", "tool_calls": [...] (when it
    called tools)}; a message dict is copied, a None or absent content made ""."""
    out: list[dict[str, Any]] = []
    for item in messages_and_choices:
        if isinstance(item, Choice):
            message: dict[str, Any] = {"role": "assistant", "content": item.message.content or ""}
            if item.message.tool_calls:
                message["tool_calls"] = [call.model_dump(mode="json") for call in item.message.tool_calls]
        else:
            message = dict(item)
            if message.get("content") is None:  # chat templates expect a string
                message["content"] = ""
        out.append(message)
    return out


class History(BaseModel):
    """One more conversation of a trajectory (`Trajectory.additional_histories`), trained as
    its own sequences with the trajectory's reward (ART's `History`).

    Attributes:
        messages_and_choices: chat message dicts and sampled `Choice`s, in order.
        tools: the tool schemas offered in this conversation, if any.
    """

    model_config = ConfigDict(extra="forbid")

    messages_and_choices: list[MessageOrChoice]
    tools: list[dict[str, Any]] | None = None

    @field_validator("messages_and_choices", mode="before")
    @classmethod
    def _items(cls, value: Any) -> Any:
        return _check_items(value)

    def messages(self) -> list[dict[str, Any]]:
        """This conversation as plain chat messages (see `get_messages`)."""
        return get_messages(self.messages_and_choices)


LegacyHistory = History
"""The name ART's documentation (Additional Histories) gives `History`:
`from art.trajectories import LegacyHistory` runs unchanged."""


class PydanticException(BaseModel):
    """A rollout exception as a `TrajectoryGroup` keeps it (ART's record): plain text, so that
    it travels between hosts and into logs.

    Attributes:
        type: `str(type(exc))`, e.g. "<class 'ValueError'>" (ART's form).
        message: `str(exc)`.
        traceback: the formatted traceback; for a rollout that raised on a remote worker
            (`errors.RemoteRolloutError`) the worker's own traceback.
    """

    model_config = ConfigDict(extra="forbid")

    type: str
    message: str
    traceback: str


def exception_record(exc: BaseException) -> PydanticException:
    """`exc` as a `PydanticException` record (see its attributes)."""
    from art_mega.errors import RemoteRolloutError

    if isinstance(exc, RemoteRolloutError):  # the local re-raise's traceback shows nothing of the rollout
        text = exc.traceback
    else:
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return PydanticException(type=str(type(exc)), message=str(exc), traceback=text)


def _check_policy_version(value: Any) -> Any:
    # pydantic turns True into 1 and "3" into 3 in silence; a policy version is a step number
    if value is None:
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(
            f"policy version {value!r} is not a training step; use a step number (int >= 0), "
            "e.g. await model.get_step(), or None"
        )
    return int(value)


class ChatCompletionsExchange(BaseModel):
    """One chat completion a capture recorded (ART 0.5.23's exchange): the JSON body sent and
    the server's reply as an OpenAI `ChatCompletion` (its choices carry the token ids and
    logprobs the replica returned)."""

    model_config = ConfigDict(extra="forbid")

    request: dict[str, Any]
    response: Any


class TrajectoryExchanges(BaseModel):
    """ART 0.5.23's `Trajectory.exchanges`: the requests a capture (`art.trajectory`,
    `capture_auto_trajectory`) saw, in order. art-mega records chat completions (ART also
    records completions, responses and Anthropic messages)."""

    model_config = ConfigDict(extra="forbid")

    chat_completions: list[ChatCompletionsExchange] = Field(default_factory=list)


class Trajectory(BaseModel):
    """One rollout: the conversation (messages and sampled choices), its reward and metrics.

    Attributes:
        messages_and_choices: the conversation in order; `Choice` entries are what the policy
            sampled (they carry token ids and logprobs when the server returned them).
        tools: the tool schemas offered to the model, if any.
        additional_histories: more conversations of this rollout (`History`; a dict with the
            keys `messages_and_choices` and optional `tools` is validated into one), trained
            with this trajectory's reward.
        reward: the scalar reward (any scale; advantages are normalised per group).
        initial_policy_version, final_policy_version: the training steps whose policy served
            the rollout when it started and when it ended (None: not recorded). `backend.train`
            counts a trajectory whose version differs from the current step as stale.
        metrics: named numbers averaged in logs (e.g. {"correct": 1.0}); `finish()` adds
            "duration" and `track_duration(name)` adds f"{name}_duration", in seconds.
        metadata: free-form values kept with the trajectory: what JSON carries (a set, bytes or
            another object is refused, naming its key).
        logs: free-form log lines (`log()`).
        start_time: when this object was built (local time; not serialized: a received
            trajectory starts anew), the start of `finish()`'s duration.
        exchanges: the chat completions a capture recorded (ART 0.5.23; not serialized: the
            conversation they built is `messages_and_choices` / `additional_histories`).
    """

    # assignments are validated as in ART 0.5.23 (`trajectory.metadata = {...}` is checked as
    # the constructor checks it; changing a dict in place is checked where groups are used)
    model_config = ConfigDict(arbitrary_types_allowed=False, extra="forbid", validate_assignment=True)

    messages_and_choices: list[MessageOrChoice] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    additional_histories: list[History] = Field(default_factory=list)
    reward: float = 0.0
    initial_policy_version: int | None = None
    final_policy_version: int | None = None
    metrics: dict[str, MetricValue] = Field(default_factory=dict)
    metadata: dict[str, Any] = Field(default_factory=dict)
    logs: list[str] = Field(default_factory=list)
    start_time: datetime = Field(default_factory=datetime.now, exclude=True)
    exchanges: TrajectoryExchanges = Field(default_factory=TrajectoryExchanges, exclude=True)
    _started: float | None = PrivateAttr(default=None)
    """time.monotonic() at construction when start_time was not given: finish() then measures
    with a clock that a wall-clock step (NTP) cannot make negative."""

    def model_post_init(self, context: Any) -> None:
        if "start_time" not in self.model_fields_set:
            self._started = time.monotonic()

    @field_validator("messages_and_choices", mode="before")
    @classmethod
    def _items(cls, value: Any) -> Any:
        return _check_items(value)

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

    @field_validator("initial_policy_version", "final_policy_version", mode="before")
    @classmethod
    def _policy_version(cls, value: Any) -> Any:
        return _check_policy_version(value)

    @field_validator("additional_histories", mode="before")
    @classmethod
    def _histories(cls, value: Any) -> Any:
        # ART's History model: messages_and_choices (required) and tools; a history without
        # them (e.g. {"messages": [...]}) trained nothing here, in silence
        if isinstance(value, list):
            for h, history in enumerate(value):
                if isinstance(history, History):
                    continue
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

    @field_validator("metadata", mode="after")
    @classmethod
    def _metadata(cls, value: Any) -> Any:
        return _check_metadata(value)

    def messages(self) -> list[dict[str, Any]]:
        """The conversation as plain chat messages (see `get_messages`)."""
        return get_messages(self.messages_and_choices)

    def history(
        self, *, model: str | None = None, reconcile_text_equivalent_tokenizations: bool = False
    ) -> History:
        """ART 0.5.23's main history view: this trajectory's conversation as a `History`
        (`messages_and_choices`, `tools`). `model`: only ART's exchanges of that model count;
        art-mega's trajectory holds one policy's conversations, so a model name is checked
        against the captured requests (see `histories`)."""
        return self.histories(
            model=model, reconcile_text_equivalent_tokenizations=reconcile_text_equivalent_tokenizations
        )[0]

    def histories(
        self, *, model: str | None = None, reconcile_text_equivalent_tokenizations: bool = False
    ) -> list[History]:
        """ART 0.5.23's history views: the main conversation then each of `additional_histories`.

        Raises:
            HyperParameterError: `model` names no captured request's model (ART raises too), or
                `reconcile_text_equivalent_tokenizations=True` (art-mega trains the sampled token
                ids as they are; there is nothing to reconcile).
        """
        from art_mega.errors import HyperParameterError

        if reconcile_text_equivalent_tokenizations is not False:
            raise HyperParameterError(
                f"trajectory.history(reconcile_text_equivalent_tokenizations={reconcile_text_equivalent_tokenizations!r}): "
                "art-mega keeps the sampled token ids as they are; leave it out",
                "reconcile_text_equivalent_tokenizations",
                reconcile_text_equivalent_tokenizations,
            )
        if model is not None:
            seen = {e.request.get("model") for e in self.exchanges.chat_completions}
            if model not in seen:
                raise HyperParameterError(
                    f"trajectory.history(model={model!r}) names no captured request's model (captured: "
                    f"{sorted(str(m) for m in seen) or 'none'}); leave it out",
                    "model",
                    model,
                )
        main = History(messages_and_choices=list(self.messages_and_choices), tools=self.tools)
        return [main, *self.additional_histories]

    def chat_completions_history(
        self, *, model: str | None = None, reconcile_text_equivalent_tokenizations: bool = False
    ) -> History:
        """ART 0.5.23's chat-completions history: the same as `history` (art-mega captures
        chat completions only)."""
        return self.history(
            model=model, reconcile_text_equivalent_tokenizations=reconcile_text_equivalent_tokenizations
        )

    def chat_completions_histories(
        self, *, model: str | None = None, reconcile_text_equivalent_tokenizations: bool = False
    ) -> list[History]:
        """ART 0.5.23's chat-completions histories: the same as `histories`."""
        return self.histories(
            model=model, reconcile_text_equivalent_tokenizations=reconcile_text_equivalent_tokenizations
        )

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
        """Record `metrics["duration"]`: seconds since `start_time` (ART's name); returns self."""
        if self._started is not None:
            self.metrics["duration"] = time.monotonic() - self._started
        else:
            self.metrics["duration"] = (datetime.now() - self.start_time).total_seconds()
        return self

    @asynccontextmanager
    async def track_duration(self, metric_name: str) -> AsyncIterator[None]:
        """Add the seconds the `async with` body takes to `metrics[f"{metric_name}_duration"]`
        (summed over uses; recorded when the body raises too), as ART does."""
        started = time.monotonic()
        try:
            yield
        finally:
            key = f"{metric_name}_duration"
            self.metrics[key] = self.metrics.get(key, 0.0) + time.monotonic() - started

    def log(self, message: str) -> None:
        """Append one line to `logs`."""
        self.logs.append(message)

    def for_logging(self) -> dict[str, Any]:
        """ART's console/log form: reward, policy versions, metrics, metadata, tools, logs and
        the messages, each marked `trainable` (True for a sampled Choice)."""
        messages = []
        for item in self.messages_and_choices:
            if isinstance(item, Choice):
                messages.append({**item.message.to_dict(), "trainable": True})
            else:
                messages.append({**item, "trainable": False})
        return {
            "reward": self.reward,
            "initial_policy_version": self.initial_policy_version,
            "final_policy_version": self.final_policy_version,
            "metrics": self.metrics,
            "metadata": self.metadata,
            "messages": messages,
            "tools": self.tools,
            "logs": self.logs,
        }

    def __eq__(self, other: object) -> bool:
        # start_time says when this object was built, not what the rollout was: a trajectory
        # received from another host (or copied) equals the one sent
        if not isinstance(other, Trajectory) or type(other) is not type(self):
            return NotImplemented
        mine = {k: v for k, v in self.__dict__.items() if k != "start_time"}
        theirs = {k: v for k, v in other.__dict__.items() if k != "start_time"}
        return mine == theirs and self.__pydantic_extra__ == other.__pydantic_extra__

    def __str__(self) -> str:
        return f"Trajectory(reward={self.reward}, metrics={self.metrics}, metadata={self.metadata})"


class TrajectoryGroup(BaseModel):
    """Trajectories sampled for the same prompt; GRPO normalises rewards within a group.

    `TrajectoryGroup(items, *, exceptions=[], metadata=None, metrics=None, logs=None)`, as in
    ART: `items` may mix trajectories and exceptions (each exception becomes a record in
    `exceptions`, as do those of `exceptions=`). Given awaitables (one rollout coroutine per
    trajectory), it returns a `PendingTrajectoryGroup` instead: awaiting it runs the rollouts
    concurrently and builds the group; a rollout that raises is recorded in `exceptions` and
    left out of `trajectories` while the enclosing gather's `max_exceptions` allows it, and
    raised at once past it (outside a gather the limit is 0, as in ART).

    Attributes:
        trajectories: the group's trajectories.
        exceptions: `PydanticException` records of this group's rollouts that raised.
        metadata: free-form values kept with the group: what JSON carries (as a trajectory's).
        metrics: group-level metrics (averaged over groups in logs).
        logs: free-form log lines (`log()`).

    Raises:
        pydantic.ValidationError: an exception given as a string (pass the exception, or a
            `PydanticException`), or a field that does not validate.
    """

    model_config = ConfigDict(extra="forbid")

    # (call number, seconds) of the gather_trajectory_groups call that returned this group:
    # model.log records the rollout time of a step from it (`metrics.gather_seconds`)
    _gathered: tuple[int, float] | None = PrivateAttr(default=None)

    trajectories: list[Trajectory] = Field(default_factory=list)
    exceptions: list[PydanticException] = Field(default_factory=list)
    metadata: dict[str, Any] = Field(default_factory=dict)
    metrics: dict[str, MetricValue] = Field(default_factory=dict)
    logs: list[str] = Field(default_factory=list)

    @field_validator("metrics", mode="before")
    @classmethod
    def _metrics(cls, value: Any) -> Any:
        return _check_metrics(value)

    @model_validator(mode="after")
    def _values(self) -> TrajectoryGroup:
        # the trajectories' dicts may have changed since each was built (a rollout sets
        # trajectory.metadata["x"] = ... after construction): checked again as the group forms
        problem = value_problem(self)
        if problem is not None:
            raise ValueError(problem[1])
        return self

    @field_validator("exceptions", mode="before")
    @classmethod
    def _exceptions(cls, value: Any) -> Any:
        # "ValueError: x" was art-mega's old form; ART records the exception's type, message and
        # traceback, which a string cannot give
        if isinstance(value, list):
            for e, item in enumerate(value):
                if isinstance(item, str):
                    raise ValueError(
                        f"exceptions[{e}] is the string {item!r}; pass the exception itself "
                        "(exceptions=[exc]) or a PydanticException(type=..., message=..., traceback=...)"
                    )
        return value

    def __new__(cls, trajectories: Iterable[Any] | None = None, *args: Any, **kwargs: Any) -> Any:
        items = None if trajectories is None else list(trajectories)
        if items and any(inspect.isawaitable(t) for t in items):
            return PendingTrajectoryGroup(cls, items, kwargs)
        instance = super().__new__(cls)
        if items is not None:
            instance.__dict__["_art_items"] = items  # a generator can only be read once
        return instance

    def __init__(
        self,
        trajectories: Iterable[Any] | None = (),
        *,
        exceptions: Iterable[BaseException | PydanticException] = (),
        metadata: dict[str, Any] | None = None,
        metrics: dict[str, MetricValue] | None = None,
        logs: list[str] | None = None,
    ) -> None:
        items = self.__dict__.pop("_art_items", None)
        if items is None:
            items = [] if trajectories is None else list(trajectories)
        raised = [i for i in items if isinstance(i, BaseException)] + list(exceptions)
        super().__init__(
            trajectories=[i for i in items if not isinstance(i, BaseException)],
            exceptions=[exception_record(e) if isinstance(e, BaseException) else e for e in raised],
            metadata={} if metadata is None else metadata,
            metrics={} if metrics is None else metrics,
            logs=[] if logs is None else logs,
        )

    def log(self, message: str) -> None:
        """Append one line to `logs`."""
        self.logs.append(message)

    def __copy__(self) -> TrajectoryGroup:
        # ART's copy.copy gives the copy its own lists and dicts (pydantic's shares them):
        # appending to one group's trajectories, exceptions or logs leaves the other as it was
        copied = super().__copy__()
        for name in ("trajectories", "exceptions", "logs", "metadata", "metrics"):
            copied.__dict__[name] = copy.copy(self.__dict__[name])
        return copied

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

    def close(self) -> None:
        """Close the rollout coroutines of a group that will never be awaited (no 'never
        awaited' warning)."""
        for item in self._items:
            if inspect.iscoroutine(item):
                item.close()


def off_policy(
    groups: Iterable[TrajectoryGroup], expected_step: int, base_is_expected: bool = False
) -> list[tuple[int, int, list[int | None]]]:
    """The trajectories sampled by a step other than `expected_step`, as (group index,
    trajectory index, steps), in order. `steps` are the trajectory's `policy_steps()` followed
    by its `initial_policy_version` / `final_policy_version` when set and not already named;
    a trajectory with no tagged choice and no policy version passes. With `base_is_expected`
    (the expected step's adapter is the base model: step 0 of a fresh LoRA, whose B is zero)
    choices of the base model (step None) pass too."""
    found = []
    for g, group in enumerate(groups):
        for t, trajectory in enumerate(group.trajectories):
            steps = trajectory.policy_steps()
            for version in (trajectory.initial_policy_version, trajectory.final_policy_version):
                if version is not None and version not in steps:
                    steps.append(version)
            if any(step != expected_step and not (step is None and base_is_expected) for step in steps):
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
            group without recorded exceptions, a bad message (names group, trajectory, message),
            or metadata / metrics changed since the group was built to hold a value JSON or the
            metrics cannot take (`value_problem`: names group, trajectory and key).
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
        problem = value_problem(group)
        if problem is not None:
            raise TrainInputError(f"{argument}: group {g}: {problem[1]}", "trajectory_groups", g, problem[0])
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
    from art_mega.errors import TrainInputError

    histories = [("messages_and_choices", trajectory.messages_and_choices)]
    for h, history in enumerate(trajectory.additional_histories):
        if not isinstance(history, History):  # appended after validation: ART reads its attributes
            raise TrainInputError(
                f"{where}: additional_histories[{h}] is a {type(history).__name__}, not an "
                "art.History; append art.History(messages_and_choices=[...], tools=...)",
                argument,
                group,
                index,
            )
        histories.append((f"additional_histories[{h}].messages_and_choices", history.messages_and_choices))
    for name, items in histories:
        for m, item in enumerate(items):
            _check_item(item, f"{where}: {name}[{m}]", argument, group, index)


def _check_item(item: Any, where: str, argument: str, group: int | None, index: int) -> None:
    from art_mega.errors import NonFiniteValueError, TrainInputError
    from art_mega.hyperparams import FLOAT32_MAX

    def refuse(reason: str) -> TrainInputError:
        return TrainInputError(f"{where} {reason}", argument, group, index)

    if isinstance(item, Choice):
        if not isinstance(item.message, BaseModel):  # a reply the SDK built without validating
            raise refuse(
                f"is a Choice without its message (message={item.message!r}); append the choice "
                "of a reply whose choices hold their messages"
            )
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


class GroupProgress(Protocol):
    """What counts the rollouts of a gather in progress (`gather.GatherProgress`)."""

    def on_trajectory(self, trajectory: Trajectory) -> None:
        """One rollout returned `trajectory`."""

    def on_exception(self, exc: BaseException) -> bool:
        """One rollout raised `exc`; True when that passes the gather's `max_exceptions`."""


GROUP_PROGRESS: contextvars.ContextVar[GroupProgress | None] = contextvars.ContextVar(
    "art_mega_gather", default=None
)
"""The progress of the enclosing `gather.gather_trajectory_groups`, if any: a group being
awaited reports each of its rollouts to it."""


def record_completion_tokens(trajectory: Trajectory) -> None:
    """Set `metrics["completion_tokens"]` as ART's gather does: the mean number of sampled
    tokens (logprob entries) per Choice that carries logprobs; nothing without such a Choice."""
    counts = [
        len(item.logprobs.content or item.logprobs.refusal or [])
        for item in trajectory.messages_and_choices
        if isinstance(item, Choice) and item.logprobs
    ]
    if counts:
        trajectory.metrics["completion_tokens"] = sum(counts) / len(counts)


async def _gather_group(
    cls: type[TrajectoryGroup], items: list[Any], kwargs: dict[str, Any]
) -> TrajectoryGroup:
    progress = GROUP_PROGRESS.get()

    async def one(item: Any) -> Any:
        try:
            result = await item if inspect.isawaitable(item) else item
        except Exception as exc:  # recorded while the gather's max_exceptions allows (ART)
            if progress is None or progress.on_exception(exc):
                raise
            return exc
        if isinstance(result, Trajectory):
            record_completion_tokens(result)
            if progress is not None:
                progress.on_trajectory(result)
        return result

    tasks = [asyncio.ensure_future(one(i)) for i in items]
    try:
        results = await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:  # the rest of the group stops with the rollout that raised
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    for value in results:
        if not isinstance(value, (Trajectory, BaseException)):
            raise TypeError(f"a rollout returned {type(value).__name__}, expected Trajectory")
    options = {k: v for k, v in kwargs.items() if k != "exceptions"}
    raised = [*kwargs.get("exceptions", ()), *(r for r in results if isinstance(r, BaseException))]
    return cls([r for r in results if isinstance(r, Trajectory)], exceptions=raised, **options)


def __getattr__(name: str) -> Any:
    from art_mega.unsupported import missing  # ART 0.5.23's capture functions live in art_mega

    raise missing("art_mega.trajectories", name)

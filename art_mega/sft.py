"""Supervised fine-tuning helpers with ART's names: JSONL validation, LR schedules, dataset iterators.

A JSONL row is {"messages": [...], "tools": [...] (optional)} in OpenAI chat format; the last
message must be the assistant's. Every row is validated before any training starts; a bad row is
reported with its line number and the reason.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, field_validator

from art_mega.errors import UserError
from art_mega.hyperparams import check, nonnegative_problem, pydantic_check, whole_problem
from art_mega.trajectories import Trajectory

ROLES = {"system", "user", "assistant", "tool", "developer"}
ScheduleType = Literal["constant", "linear", "cosine"]
T = TypeVar("T")


class SFTConfig(BaseModel):
    """One SFT step's hyper-parameters (ART's SFTConfig).

    `learning_rate` may be 0: a schedule decaying to `min_lr=0` (`create_lr_schedule`, as ART's)
    ends on a step at 0.

    Raises:
        pydantic.ValidationError: `learning_rate` is not a finite number >= 0 (a string, NaN,
            inf or a negative value), or `batch_size` is not a whole number >= 1 (a float or a
            bool is not).
    """

    model_config = ConfigDict(extra="forbid")

    learning_rate: float = 1e-4
    batch_size: int = 1
    assistant_turns: Literal["all", "last"] = "all"

    @field_validator("learning_rate", mode="before")
    @classmethod
    def _learning_rate(cls, value: Any) -> Any:
        return pydantic_check(value, nonnegative_problem, "1e-4")

    @field_validator("batch_size", mode="before")
    @classmethod
    def _batch_size(cls, value: Any) -> Any:
        return pydantic_check(value, whole_problem(1), "8")


def _check_tool_calls(calls: Any, where: str) -> None:
    if not isinstance(calls, list):
        raise UserError(f"{where}: tool_calls must be a list")
    for k, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
            or not function["name"]
        ):
            raise UserError(f"{where}: tool_calls[{k}] has no function name")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                json.loads(arguments)
            except ValueError:
                raise UserError(f"{where}: tool_calls[{k}].function.arguments is not valid JSON") from None
        elif not isinstance(arguments, dict):
            raise UserError(f"{where}: tool_calls[{k}].function.arguments must be a JSON string or object")


def parse_sft_row(line: str, where: str) -> Trajectory:
    """Validate one JSONL row and return it as a Trajectory (reward 0).

    Raises:
        UserError: `where` (file:line) and the reason: not JSON, no messages, an unknown role,
            a bad tool call, or a last message that is not the assistant's.
    """
    try:
        row = json.loads(line)
    except ValueError as exc:
        raise UserError(f"{where}: not valid JSON ({exc.msg})") from None
    if not isinstance(row, dict):
        raise UserError(f"{where}: a row must be a JSON object with 'messages'")
    messages = row.get("messages")
    if not isinstance(messages, list) or not messages:
        raise UserError(f"{where}: no 'messages' list")
    for k, message in enumerate(messages):
        if not isinstance(message, dict):
            raise UserError(f"{where}: messages[{k}] is not an object")
        role = message.get("role")
        if role not in ROLES:
            raise UserError(f"{where}: messages[{k}] has unknown role {role!r}; use one of {sorted(ROLES)}")
        if "tool_calls" in message:
            _check_tool_calls(message["tool_calls"], f"{where}: messages[{k}]")
    if messages[-1].get("role") != "assistant":
        raise UserError(
            f"{where}: the last message must be the assistant's, got {messages[-1].get('role')!r}"
        )
    tools = row.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise UserError(f"{where}: 'tools' must be a list")
    return Trajectory(messages_and_choices=messages, tools=tools, reward=0.0)


def read_sft_jsonl(path: str | Path) -> list[Trajectory]:
    """Read and validate every row of `path` (blank lines skipped) before anything trains.

    Raises:
        UserError: a missing file, an empty file, or the first bad row (file:line and reason).
    """
    file = Path(path)
    if not file.is_file():
        raise UserError(f"SFT file {file} does not exist")
    trajectories = []
    with open(file) as handle:
        for number, line in enumerate(handle, start=1):
            if line.strip():
                trajectories.append(parse_sft_row(line, f"{file}:{number}"))
    if not trajectories:
        raise UserError(f"SFT file {file} has no rows")
    return trajectories


def iterate_file(
    path: str | Path, epochs: int = 1, shuffle: bool = True, seed: int = 0
) -> Iterator[Trajectory]:
    """Every validated row of `path`, `epochs` times, shuffled per epoch with `seed`."""
    rows = read_sft_jsonl(path)
    rng = random.Random(seed)
    for _ in range(epochs):
        order = list(rows)
        if shuffle:
            rng.shuffle(order)
        yield from order


def create_lr_schedule(
    total_steps: int,
    peak_lr: float,
    method: ScheduleType = "linear",
    warmup_steps: int = 0,
    min_lr: float = 0.0,
) -> list[float]:
    """Learning rate for each of `total_steps` steps: linear warmup to `peak_lr`, then decay.

    constant: peak after warmup. linear: peak -> min_lr linearly. cosine: min_lr + (peak -
    min_lr) * (1 + cos(pi * progress)) / 2 (Loshchilov & Hutter 2017, SGDR, without restarts).
    """
    if method not in ("constant", "linear", "cosine"):
        raise UserError(f"schedule_type={method!r} must be 'constant', 'linear' or 'cosine'")
    rates = []
    decay_steps = max(total_steps - warmup_steps, 1)
    for step in range(total_steps):
        if step < warmup_steps:
            rates.append(peak_lr * (step + 1) / warmup_steps)
            continue
        progress = (step - warmup_steps) / max(decay_steps - 1, 1)
        if method == "constant":
            rates.append(peak_lr)
        elif method == "linear":
            rates.append(peak_lr + (min_lr - peak_lr) * progress)
        else:
            rates.append(min_lr + (peak_lr - min_lr) * (1 + math.cos(math.pi * progress)) / 2)
    return rates


@dataclass(frozen=True)
class SFTDatasetChunk:
    """One SFT step: its trajectories, config (learning rate), and position."""

    trajectories: list[Trajectory]
    config: SFTConfig
    step: int
    epoch: int
    epoch_step: int


def create_sft_dataset_iterator(
    trajectories: Sequence[Trajectory],
    epochs: int = 1,
    batch_size: int = 1,
    peak_lr: float = 1e-4,
    schedule_type: ScheduleType = "linear",
    warmup_ratio: float = 0.0,
    initial_step: int = 0,
    shuffle: bool = True,
    seed: int = 0,
    assistant_turns: Literal["all", "last"] = "all",
) -> Iterator[SFTDatasetChunk]:
    """Batches of `batch_size` trajectories over `epochs`, each with its scheduled learning rate.

    Starts at `initial_step` (resume); the schedule spans every step of every epoch.
    """
    if batch_size < 1 or epochs < 1:
        raise UserError(f"batch_size={batch_size} and epochs={epochs} must be >= 1")
    per_epoch = math.ceil(len(trajectories) / batch_size)
    total = per_epoch * epochs
    rates = create_lr_schedule(total, peak_lr, schedule_type, warmup_steps=int(total * warmup_ratio))
    rng = random.Random(seed)
    step = 0
    for epoch in range(epochs):
        order = list(trajectories)
        if shuffle:
            rng.shuffle(order)
        for epoch_step in range(per_epoch):
            if step >= initial_step:
                batch = order[epoch_step * batch_size : (epoch_step + 1) * batch_size]
                config = SFTConfig(
                    learning_rate=rates[step], batch_size=batch_size, assistant_turns=assistant_turns
                )
                yield SFTDatasetChunk(batch, config, step, epoch, epoch_step)
            step += 1


@dataclass(frozen=True)
class DatasetBatch(Generic[T]):
    """One RL step's items (ART's DatasetBatch)."""

    items: list[T]
    step: int
    epoch: int
    epoch_step: int


def iterate_dataset(
    dataset: Sequence[T],
    groups_per_step: int = 1,
    num_epochs: int = 1,
    initial_step: int = 0,
    shuffle: bool = True,
    seed: int = 0,
) -> Iterator[DatasetBatch[T]]:
    """Batches of `groups_per_step` items per step over `num_epochs`, resuming at `initial_step`.

    Raises:
        HyperParameterError: `groups_per_step` or `num_epochs` is not a whole number >= 1, or
            `initial_step` not one >= 0 (a float such as 1.5 or a bool is not).
    """
    where = "iterate_dataset"
    check(where, "groups_per_step", groups_per_step, whole_problem(1), "4")
    check(where, "num_epochs", num_epochs, whole_problem(1), "1")
    check(where, "initial_step", initial_step, whole_problem(0), "await model.get_step()")
    per_epoch = math.ceil(len(dataset) / groups_per_step)
    rng = random.Random(seed)
    step = 0
    for epoch in range(num_epochs):
        order = list(dataset)
        if shuffle:
            rng.shuffle(order)
        for epoch_step in range(per_epoch):
            if step >= initial_step:
                yield DatasetBatch(
                    order[epoch_step * groups_per_step : (epoch_step + 1) * groups_per_step],
                    step,
                    epoch,
                    epoch_step,
                )
            step += 1


async def train_sft_from_file(
    model: Any,
    file_path: str | Path,
    epochs: int = 1,
    batch_size: int = 1,
    peak_lr: float = 1e-4,
    schedule_type: ScheduleType = "linear",
    warmup_ratio: float = 0.0,
    assistant_turns: Literal["all", "last"] = "all",
    verbose: bool = False,
) -> list[Any]:
    """Validate `file_path`, then run one `model.train_sft` call per batch; returns their results."""
    trajectories = read_sft_jsonl(file_path)
    results = []
    for chunk in create_sft_dataset_iterator(
        trajectories,
        epochs,
        batch_size,
        peak_lr,
        schedule_type,
        warmup_ratio,
        assistant_turns=assistant_turns,
    ):
        result = await model.train_sft(chunk.trajectories, chunk.config)
        if verbose:
            print(f"sft step {chunk.step} epoch {chunk.epoch} lr {chunk.config.learning_rate:.3g}: {result}")
        results.append(result)
    return results

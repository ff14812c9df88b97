"""Supervised fine-tuning helpers with ART's names: JSONL validation, LR schedules, dataset iterators.

A JSONL row is {"messages": [...], "tools": [...] (optional)} in OpenAI chat format; the last
message must be the assistant's. Every row is validated before any training starts; a bad row is
reported with its line number and the reason.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, field_validator

from art_mega.errors import HyperParameterError, SFTFileError, UserError
from art_mega.hyperparams import (
    check,
    fraction_problem,
    nonnegative_problem,
    positive_problem,
    pydantic_check,
    whole_problem,
)
from art_mega.trajectories import CHAT_ROLES, Trajectory

ROLES = set(CHAT_ROLES)
"""The roles an SFT message may have: those RL training takes (a chat template that cannot
render one is refused at tokenization, naming the row)."""
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
    """Refuse tool calls the chat template could not render as the OpenAI format means them."""
    from art_mega.trainer.tokenize import parse_tool_arguments

    if not isinstance(calls, list):
        raise ValueError(f"{where}.tool_calls is a {type(calls).__name__}; tool_calls must be a list")
    for k, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
            or not function["name"]
        ):
            raise ValueError(f"{where}.tool_calls[{k}] has no function name")
        parse_tool_arguments(function.get("arguments"), f"{where}.tool_calls[{k}].function.arguments")


def _check_message(message: Any, k: int) -> None:
    """Refuse messages[k] unless the chat template can render it (ValueError: the reason)."""
    where = f"messages[{k}]"
    if not isinstance(message, dict):
        raise ValueError(f"{where} is a {type(message).__name__}, not an object")
    role = message.get("role")
    if role not in ROLES:
        raise ValueError(f"{where} has unknown role {role!r}; use one of {sorted(ROLES)}")
    weight = message.get("weight", 1)
    if isinstance(weight, bool) or weight != 1:  # OpenAI's fine-tuning format: 0 = do not train
        raise ValueError(
            f"{where} has weight={weight!r}; every assistant message of a row is trained (OpenAI's "
            "weight 0 is not supported): remove the weight, drop the message, or use "
            "assistant_turns='last'"
        )
    calls = message.get("tool_calls")
    if calls is not None:
        if role != "assistant":
            raise ValueError(
                f"{where} is a {role!r} message with tool_calls; only assistant messages carry them"
            )
        _check_tool_calls(calls, where)
    content = message.get("content")
    if isinstance(content, str) or (content is None and role == "assistant" and calls):
        return
    if content is None:
        raise ValueError(
            f"{where} has no content; give it a string (only an assistant message with tool_calls may have none)"
        )
    hint = "; join its text parts into one string" if isinstance(content, list) else ""
    shown = json.dumps(content)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    raise ValueError(
        f"{where}.content is the {type(content).__name__} {shown}, not a string; SFT message content "
        f"must be a string{hint}"
    )


def parse_sft_row(line: str, path: str, number: int) -> Trajectory:
    """Validate one JSONL row (line `number` of `path`) and return it as a Trajectory (reward 0).

    A row is an object with a non-empty "messages" list and optionally a "tools" list (other
    keys are not read, as in ART). Each message has a known role and a string content (None
    or absent only on an assistant message with tool_calls); tool-call arguments are a JSON
    object or a string holding one; the last message is the assistant's.

    Raises:
        SFTFileError: "file:line: reason": not JSON, not an object, no messages, an unknown
            role, a content that is not a string, a bad tool call, a last message that is not
            the assistant's, or tools that are not a list of function tools.
    """
    from art_mega.trainer.tokenize import template_tools

    where = f"{path}:{number}"

    def refuse(reason: str) -> SFTFileError:
        return SFTFileError(f"{where}: {reason}", path, number)

    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise refuse(
            f"not valid JSON ({exc.msg} at column {exc.colno}); each line is one JSON object"
        ) from None
    except ValueError as exc:  # an integer literal past Python's 4300-digit limit
        raise refuse(f"not a JSON row this loader reads ({exc}); each line is one JSON object") from None
    except RecursionError:
        raise refuse(
            "nests JSON arrays or objects too deeply to load; each line is one JSON object"
        ) from None
    if not isinstance(row, dict):
        raise refuse(f"a row must be a JSON object with 'messages', got a {type(row).__name__}")
    messages = row.get("messages")
    if not isinstance(messages, list) or not messages:
        raise refuse('no \'messages\' list; a row is {"messages": [{"role": ..., "content": ...}, ...]}')
    for k, message in enumerate(messages):
        try:
            _check_message(message, k)
        except ValueError as exc:
            raise refuse(str(exc)) from None
    if messages[-1].get("role") != "assistant":
        raise refuse(f"the last message must be the assistant's, got {messages[-1].get('role')!r}")
    if "functions" in row:  # OpenAI's legacy format: without this the model trained with no tools
        raise refuse(
            "'functions' (OpenAI's legacy format) is not read; give them as "
            '"tools": [{"type": "function", "function": {...}}, ...]'
        )
    tools = row.get("tools")
    try:
        template_tools(tools, "'tools'")
    except UserError as exc:
        raise refuse(str(exc).removeprefix("'tools': ")) from None
    return Trajectory(messages_and_choices=messages, tools=tools, reward=0.0)


def read_sft_jsonl(path: str | Path) -> list[Trajectory]:
    """Read and validate every row of `path` (UTF-8, a leading byte-order mark allowed; blank
    lines skipped) before anything trains.

    Raises:
        SFTFileError: a missing, unreadable or empty file, a line that is not UTF-8, or the
            first bad row (file:line and reason, see `parse_sft_row`).
    """
    file = Path(path)
    if not file.is_file():
        raise SFTFileError(f"SFT file {file} does not exist", str(file))
    trajectories = []
    try:
        with open(file, "rb") as handle:
            for number, raw in enumerate(handle, start=1):
                try:
                    # Editors on Windows save UTF-8 with a byte-order mark: json.loads refuses it.
                    line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
                except UnicodeDecodeError as exc:
                    raise SFTFileError(
                        f"{file}:{number}: byte {exc.start + 1} of the line is not UTF-8; save the file as UTF-8",
                        str(file),
                        number,
                    ) from None
                if line.strip():
                    trajectories.append(parse_sft_row(line, str(file), number))
    except OSError as exc:
        raise SFTFileError(f"SFT file {file} cannot be read ({exc.strerror})", str(file)) from None
    if not trajectories:
        raise SFTFileError(f"SFT file {file} has no rows", str(file))
    return trajectories


def iterate_file(
    path: str | Path, epochs: int = 1, shuffle: bool = True, seed: int = 0
) -> Iterator[Trajectory]:
    """Every validated row of `path`, `epochs` times, shuffled per epoch with `seed`.

    Raises:
        SFTFileError: see `read_sft_jsonl` (when called: every row is read first).
        HyperParameterError: `epochs` is not a whole number >= 1.
    """
    check("iterate_file", "epochs", epochs, whole_problem(1), "1")
    return _file_rows(read_sft_jsonl(path), epochs, shuffle, seed)


def _file_rows(rows: list[Trajectory], epochs: int, shuffle: bool, seed: int) -> Iterator[Trajectory]:
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

    Raises:
        HyperParameterError: `epochs` or `batch_size` is not a whole number >= 1, `initial_step`
            not one >= 0, `peak_lr` not a finite number > 0, `warmup_ratio` outside [0, 1], or
            `assistant_turns` not "all" or "last" (when called, before the first batch).
        UserError: `schedule_type` is not "constant", "linear" or "cosine".
    """
    where = "create_sft_dataset_iterator"
    check(where, "epochs", epochs, whole_problem(1), "1")
    check(where, "batch_size", batch_size, whole_problem(1), "8")
    check(where, "initial_step", initial_step, whole_problem(0), "0")
    check(where, "peak_lr", peak_lr, positive_problem, "1e-4")
    check(where, "warmup_ratio", warmup_ratio, fraction_problem, "0.1")
    if assistant_turns not in ("all", "last"):
        raise HyperParameterError(
            f"{where}(assistant_turns={assistant_turns!r}) must be 'all' or 'last'",
            "assistant_turns",
            assistant_turns,
        )
    per_epoch = math.ceil(len(trajectories) / batch_size)
    total = per_epoch * epochs
    rates = create_lr_schedule(total, peak_lr, schedule_type, warmup_steps=int(total * warmup_ratio))
    # checked here, when called, not at the first next() of a generator
    return _sft_chunks(trajectories, epochs, batch_size, rates, initial_step, shuffle, seed, assistant_turns)


def _sft_chunks(
    trajectories: Sequence[Trajectory],
    epochs: int,
    batch_size: int,
    rates: list[float],
    initial_step: int,
    shuffle: bool,
    seed: int,
    assistant_turns: Literal["all", "last"],
) -> Iterator[SFTDatasetChunk]:
    per_epoch = math.ceil(len(trajectories) / batch_size)
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
        HyperParameterError: `groups_per_step` or `num_epochs` is not a whole number >= 1,
            `initial_step` not one >= 0 (a float such as 1.5 or a bool is not), or `dataset`
            is a string, a dict or not iterable (a generator is read once into a list).
    """
    where = "iterate_dataset"
    check(where, "groups_per_step", groups_per_step, whole_problem(1), "4")
    check(where, "num_epochs", num_epochs, whole_problem(1), "1")
    check(where, "initial_step", initial_step, whole_problem(0), "await model.get_step()")
    if isinstance(dataset, (str, bytes, dict)) or not isinstance(dataset, Iterable):
        raise HyperParameterError(
            f"{where}(dataset) got a {type(dataset).__name__}; pass a list of items (prompts, scenarios)",
            "dataset",
            None,
        )
    # a generator has no len(): read it once; checked here, not at the first next()
    items = dataset if isinstance(dataset, Sequence) else list(dataset)
    return _dataset_batches(items, groups_per_step, num_epochs, initial_step, shuffle, seed)


def _dataset_batches(
    dataset: Sequence[T], groups_per_step: int, num_epochs: int, initial_step: int, shuffle: bool, seed: int
) -> Iterator[DatasetBatch[T]]:
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

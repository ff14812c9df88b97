"""Supervised fine-tuning with ART's names and semantics (`art.types.TrainSFTConfig`,
`art.utils.sft`, `art.utils.iterate_dataset`): JSONL validation, LR schedules, dataset iterators.

A JSONL row is {"messages": [...], "tools": [...] (optional)} in OpenAI chat format; the last
message must be the assistant's. Every row is validated before any training starts; a bad row is
reported with its line number and the reason.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Literal, NamedTuple, TypeVar

from pydantic import BaseModel, ConfigDict, field_validator

from art_mega.errors import HyperParameterError, SFTFileError, UserError
from art_mega.hyperparams import (
    bool_problem,
    check,
    fraction_problem,
    nonnegative_problem,
    optional,
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


DEFAULT_SFT_BATCH_SIZE = 2
"""The batch size `batch_size="auto"` means (ART's `LocalBackend._default_sft_batch_size`)."""


class TrainSFTConfig(BaseModel):
    """ART's `TrainSFTConfig`: the learning rate and batch size of one `train_sft` call.

    `learning_rate` is one rate for every batch or a list of one rate per batch (what
    `create_sft_dataset_iterator` and `train_sft_from_file` pass: a schedule sliced to the call);
    a rate may be 0 (a schedule decaying to `min_lr=0` ends on a batch at 0). `batch_size` is the
    trajectories per optimizer step, "auto" = `DEFAULT_SFT_BATCH_SIZE`. `assistant_turns`
    (art-mega's, the documentation's `train_sft_from_file(assistant_turns=...)`): "all" trains
    every assistant message of a trajectory, "last" only its last one.

    Raises:
        pydantic.ValidationError: `learning_rate` is not a finite number >= 0 nor a non-empty
            list of them (a string, NaN, inf, a negative value, an empty list; an element is
            named by its index), `batch_size` is not "auto" nor a whole number >= 1 (a float or a
            bool is not), or an unknown field.
    """

    model_config = ConfigDict(extra="forbid")

    learning_rate: float | list[float] = 5e-5
    batch_size: int | Literal["auto"] = "auto"
    assistant_turns: Literal["all", "last"] = "all"

    @field_validator("learning_rate", mode="before")
    @classmethod
    def _learning_rate(cls, value: Any) -> Any:
        if isinstance(value, (list, tuple)):
            if not value:
                raise ValueError("[] is an empty list; give one learning rate per batch, e.g. [2e-4, 1e-4]")
            for k, rate in enumerate(value):
                why = nonnegative_problem(rate)
                if why is not None:
                    raise ValueError(f"element {k} ({rate!r}) {why}; use e.g. 1e-4")
            return [float(rate) for rate in value]
        return pydantic_check(value, nonnegative_problem, "5e-5")

    @field_validator("batch_size", mode="before")
    @classmethod
    def _batch_size(cls, value: Any) -> Any:
        if value == "auto" and isinstance(value, str):
            return value
        return pydantic_check(value, whole_problem(1), "2 or 'auto'")

    def batch_count(self, trajectories: int) -> int:
        """The optimizer steps `trajectories` trajectories take: ceil(trajectories / batch size)."""
        return math.ceil(trajectories / self.resolved_batch_size())

    def resolved_batch_size(self) -> int:
        """`batch_size`, with "auto" as `DEFAULT_SFT_BATCH_SIZE`."""
        return DEFAULT_SFT_BATCH_SIZE if self.batch_size == "auto" else int(self.batch_size)

    def learning_rates(self, batches: int) -> list[float]:
        """The learning rate of each of `batches` optimizer steps.

        Raises:
            HyperParameterError: `learning_rate` is a list whose length is not `batches` (ART
                would stop at the end of a short list and leave a long one's tail unused).
        """
        if not isinstance(self.learning_rate, list):
            return [float(self.learning_rate)] * batches
        if len(self.learning_rate) != batches:
            raise HyperParameterError(
                f"train_sft(config=TrainSFTConfig(learning_rate=[...])) has {len(self.learning_rate)} "
                f"learning rates for {batches} batches of batch_size={self.batch_size}; give one rate "
                "per batch (create_sft_dataset_iterator's chunk.config does)",
                "learning_rate",
                self.learning_rate,
            )
        return list(self.learning_rate)


def _check_tool_calls(calls: Any, where: str) -> None:
    """Refuse tool calls the chat template could not render as the OpenAI format means them."""
    from art_mega.trainer.prepare.tokenize import parse_tool_arguments

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
    from art_mega.trainer.prepare.tokenize import template_tools

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


def get_file_row_count(file_path: str | Path) -> int:
    """ART's `get_file_row_count`: the non-blank lines of `file_path` (what `train_sft_from_file`
    trains per epoch), without validating them.

    Raises:
        SFTFileError: the file is missing or unreadable (ART: OSError).
    """
    file = Path(file_path)
    try:
        with open(file, "rb") as handle:
            return sum(1 for line in handle if line.strip())
    except OSError as exc:
        raise SFTFileError(f"SFT file {file} cannot be read ({exc.strerror})", str(file)) from None


def iterate_file(
    file_path: str | Path,
    epochs: int = 1,
    shuffle_buffer_size: int = 10000,
    seed: int = 42,
    initial_skip: int = 0,
) -> Iterator[Trajectory]:
    """ART's `iterate_file`: the rows of `file_path` as trajectories, `epochs` times, in ART's
    order, skipping the first `initial_skip` (resume).

    ART's buffer shuffle, per epoch with `random.Random(seed + epoch)`: rows fill a buffer of
    `shuffle_buffer_size`; once full, each new row makes it yield one buffered row at a random
    index; at the end of the file the rest is shuffled and yielded (1 = file order). Unlike ART,
    every row is read and validated first (`read_sft_jsonl`), so a bad row is refused before
    anything trains.

    Raises:
        SFTFileError: see `read_sft_jsonl` (when called).
        HyperParameterError: `epochs` or `shuffle_buffer_size` is not a whole number >= 1, or
            `initial_skip` not one >= 0.
    """
    where = "iterate_file"
    check(where, "epochs", epochs, whole_problem(1), "1")
    check(where, "shuffle_buffer_size", shuffle_buffer_size, whole_problem(1), "10000")
    check(where, "seed", seed, whole_problem(0), "42")
    check(where, "initial_skip", initial_skip, whole_problem(0), "0")
    rows = read_sft_jsonl(file_path)
    return itertools.islice(_buffer_shuffled(rows, epochs, shuffle_buffer_size, seed), initial_skip, None)


def _buffer_shuffled(
    rows: list[Trajectory], epochs: int, buffer_size: int, seed: int
) -> Iterator[Trajectory]:
    for epoch in range(epochs):
        rng = random.Random(seed + epoch)
        buffer: list[Trajectory] = []
        for row in rows:
            buffer.append(row)
            if len(buffer) >= buffer_size:
                yield buffer.pop(rng.randint(0, len(buffer) - 1))
        rng.shuffle(buffer)
        yield from buffer


def create_lr_schedule(
    total_steps: int,
    peak_lr: float,
    method: ScheduleType = "linear",
    warmup_steps: int = 0,
    min_lr: float = 0.0,
) -> list[float]:
    """ART's schedule: the learning rate of each of `total_steps` steps (none for 0).

    Warmup: linear from `min_lr` to `peak_lr` over `warmup_steps` (step k at (k + 1) /
    warmup_steps of the way, so the first is above `min_lr`). Then with progress p from 0 to 1
    over the remaining steps: constant `peak_lr`; linear `peak_lr - (peak_lr - min_lr) p`; cosine
    `min_lr + (peak_lr - min_lr) (1 + cos(pi p)) / 2` (Loshchilov & Hutter 2017, SGDR, without
    restarts). A single decay step is at `peak_lr`.

    Raises:
        UserError: `method` is not "constant", "linear" or "cosine".
    """
    if method not in ("constant", "linear", "cosine"):
        raise UserError(f"schedule_type={method!r} must be 'constant', 'linear' or 'cosine'")
    rates = []
    decay_steps = total_steps - warmup_steps
    for step in range(max(total_steps, 0)):
        if step < warmup_steps:
            rates.append(min_lr + (peak_lr - min_lr) * (step + 1) / warmup_steps)
            continue
        progress = (step - warmup_steps) / (decay_steps - 1) if decay_steps > 1 else 0.0
        if method == "constant":
            rates.append(peak_lr)
        elif method == "linear":
            rates.append(peak_lr - (peak_lr - min_lr) * progress)
        else:
            rates.append(min_lr + (peak_lr - min_lr) * 0.5 * (1 + math.cos(math.pi * progress)))
    return rates


class SFTChunk(NamedTuple):
    """ART's `SFTChunk`: the trajectories of one `train_sft` call, its config (one learning rate
    per batch), the global batch step of its first batch, its epoch and batch step in the epoch."""

    trajectories: list[Trajectory]
    config: TrainSFTConfig
    step: int
    epoch: int
    epoch_step: int


def create_sft_dataset_iterator(
    trajectories: Sequence[Trajectory],
    chunk_size: int = 10,
    epochs: int = 1,
    batch_size: int = 2,
    peak_lr: float = 2e-4,
    schedule_type: ScheduleType = "linear",
    warmup_ratio: float = 0.1,
    shuffle: bool = True,
    seed: int = 42,
    initial_step: int = 0,
    show_progress: bool = True,
    *,
    assistant_turns: Literal["all", "last"] = "all",
) -> Iterator[SFTChunk]:
    """ART's `create_sft_dataset_iterator`: chunks of `chunk_size` batches of `batch_size`
    trajectories, one `model.train_sft(chunk.trajectories, chunk.config)` call each.

    Each epoch is shuffled with `random.Random(seed + epoch)` (as ART) and cut into chunks of
    `batch_size * chunk_size` trajectories (the last of an epoch may be shorter). The schedule
    (`create_lr_schedule`, warmup `int(total batches * warmup_ratio)` steps) spans every batch of
    every epoch; a chunk's config carries its batches' slice of it. `initial_step` is the global
    batch step to resume from: the first chunk starts exactly there (ART restarts at the chunk
    holding it, `initial_step // chunk_size`, which retrains that chunk's earlier batches).
    `show_progress` shows a tqdm bar of batches. `assistant_turns` (art-mega's) goes into each
    chunk's config.

    Raises:
        HyperParameterError: `chunk_size`, `epochs` or `batch_size` is not a whole number >= 1,
            `initial_step` or `seed` not one >= 0, `peak_lr` not a finite number > 0,
            `warmup_ratio` outside [0, 1], `shuffle` / `show_progress` not a bool,
            `assistant_turns` not "all" or "last", or `trajectories` is empty (when called,
            before the first chunk).
        UserError: `schedule_type` is not "constant", "linear" or "cosine".
    """
    where = "create_sft_dataset_iterator"
    check(where, "chunk_size", chunk_size, whole_problem(1), "10")
    check(where, "epochs", epochs, whole_problem(1), "1")
    check(where, "batch_size", batch_size, whole_problem(1), "2")
    check(where, "initial_step", initial_step, whole_problem(0), "0")
    check(where, "seed", seed, whole_problem(0), "42")
    check(where, "peak_lr", peak_lr, positive_problem, "2e-4")
    check(where, "warmup_ratio", warmup_ratio, fraction_problem, "0.1")
    check(where, "shuffle", shuffle, bool_problem, "True")
    check(where, "show_progress", show_progress, bool_problem, "False")
    if assistant_turns not in ("all", "last"):
        raise HyperParameterError(
            f"{where}(assistant_turns={assistant_turns!r}) must be 'all' or 'last'",
            "assistant_turns",
            assistant_turns,
        )
    if isinstance(trajectories, (str, bytes, dict)) or not isinstance(trajectories, Iterable):
        raise HyperParameterError(
            f"{where}(trajectories) got a {type(trajectories).__name__}; pass a list of art.Trajectory",
            "trajectories",
            None,
        )
    items = list(trajectories)
    if not items:
        raise HyperParameterError(
            f"{where}(trajectories) got an empty list; pass at least one art.Trajectory", "trajectories", None
        )
    per_epoch = math.ceil(len(items) / batch_size)
    total = per_epoch * epochs
    rates = create_lr_schedule(total, peak_lr, schedule_type, warmup_steps=int(total * warmup_ratio))
    # checked here, when called, not at the first next() of a generator
    return _sft_chunks(
        items,
        chunk_size,
        epochs,
        batch_size,
        rates,
        initial_step,
        shuffle,
        seed,
        show_progress,
        assistant_turns,
    )


def _sft_chunks(
    trajectories: list[Trajectory],
    chunk_size: int,
    epochs: int,
    batch_size: int,
    rates: list[float],
    initial_step: int,
    shuffle: bool,
    seed: int,
    show_progress: bool,
    assistant_turns: Literal["all", "last"],
) -> Iterator[SFTChunk]:
    per_epoch = math.ceil(len(trajectories) / batch_size)
    bar = _progress(show_progress, initial_step, len(rates), "SFT Training", "step")
    try:
        for epoch in range(epochs):
            order = list(trajectories)
            if shuffle:
                random.Random(seed + epoch).shuffle(order)
            for first in range(0, per_epoch, chunk_size):
                epoch_step = max(first, initial_step - epoch * per_epoch)
                end = min(first + chunk_size, per_epoch)
                if epoch_step >= end:
                    continue
                step = epoch * per_epoch + epoch_step
                batches = end - epoch_step
                config = TrainSFTConfig(
                    learning_rate=rates[step : step + batches],
                    batch_size=batch_size,
                    assistant_turns=assistant_turns,
                )
                chunk = order[epoch_step * batch_size : end * batch_size]
                yield SFTChunk(chunk, config, step, epoch, epoch_step)
                if bar is not None:
                    bar.update(batches)
    finally:
        if bar is not None:
            bar.close()


def _progress(show: bool, initial: int, total: int, desc: str, unit: str, eta: bool = True) -> Any:
    """A tqdm bar (`art_mega.progress.bar`: on a terminal only), or None when not shown."""
    if not show:
        return None
    from art_mega.progress import bar

    return bar(total, desc, unit, initial=initial, eta=eta)


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
    use_tqdm: bool = True,
    *,
    shuffle: bool = True,
    seed: int = 0,
) -> Iterator[DatasetBatch[T]]:
    """ART's `iterate_dataset`: batches of `groups_per_step` items per step over `num_epochs`,
    resuming at global step `initial_step`, with a tqdm bar of steps when `use_tqdm`.

    Epoch e is shuffled with `random.Random(seed + e)`: with `seed=0`, ART's order (ART seeds
    the global `random` with e; art-mega leaves it alone). art-mega's `shuffle=False` keeps
    the dataset's order.

    Raises:
        HyperParameterError: `groups_per_step` or `num_epochs` is not a whole number >= 1,
            `initial_step` or `seed` not one >= 0 (a float such as 1.5 or a bool is not),
            `use_tqdm` / `shuffle` not a bool, or `dataset` is a string, a dict or not iterable
            (a generator is read once into a list).
    """
    where = "iterate_dataset"
    check(where, "groups_per_step", groups_per_step, whole_problem(1), "4")
    check(where, "num_epochs", num_epochs, whole_problem(1), "1")
    check(where, "initial_step", initial_step, whole_problem(0), "await model.get_step()")
    check(where, "use_tqdm", use_tqdm, bool_problem, "False")
    check(where, "shuffle", shuffle, bool_problem, "True")
    check(where, "seed", seed, whole_problem(0), "0")
    if isinstance(dataset, (str, bytes, dict)) or not isinstance(dataset, Iterable):
        raise HyperParameterError(
            f"{where}(dataset) got a {type(dataset).__name__}; pass a list of items (prompts, scenarios)",
            "dataset",
            None,
        )
    # a generator has no len(): read it once; checked here, not at the first next()
    items = dataset if isinstance(dataset, Sequence) else list(dataset)
    return _dataset_batches(items, groups_per_step, num_epochs, initial_step, use_tqdm, shuffle, seed)


def _dataset_batches(
    dataset: Sequence[T],
    groups_per_step: int,
    num_epochs: int,
    initial_step: int,
    use_tqdm: bool,
    shuffle: bool,
    seed: int,
) -> Iterator[DatasetBatch[T]]:
    from art_mega.progress import PLANNED_STEPS

    per_epoch = math.ceil(len(dataset) / groups_per_step)
    # no remaining-time estimate: a program often stops before the last epoch (issue 34)
    bar = _progress(
        use_tqdm and per_epoch > 0, initial_step, per_epoch * num_epochs, "Iterating dataset", "step", eta=False
    )
    PLANNED_STEPS["last"] = per_epoch * num_epochs
    try:
        step = 0
        for epoch in range(num_epochs):
            order = list(dataset)
            if shuffle:
                random.Random(seed + epoch).shuffle(order)
            for epoch_step in range(per_epoch):
                if step >= initial_step:
                    yield DatasetBatch(
                        order[epoch_step * groups_per_step : (epoch_step + 1) * groups_per_step],
                        step,
                        epoch,
                        epoch_step,
                    )
                    if bar is not None:
                        bar.update(1)
                step += 1
    finally:
        PLANNED_STEPS["last"] = 0
        if bar is not None:
            bar.close()


async def train_sft_from_file(
    model: Any,
    file_path: str | Path,
    epochs: int = 1,
    batch_size: int = 2,
    peak_lr: float = 2e-4,
    schedule_type: ScheduleType = "linear",
    warmup_ratio: float = 0.1,
    initial_step: int = 0,
    final_step: int | None = None,
    _config: Any = None,
    verbose: bool = False,
    shuffle_buffer_size: int = 10000,
    log_metrics: bool = True,
    assistant_turns: Literal["all", "last"] = "all",
) -> Any:
    """ART's `train_sft_from_file`: one `model.train_sft` call over the file's batches.

    The file's N rows, `epochs` times in `iterate_file`'s order (`shuffle_buffer_size`, seed
    42), make ceil(N * epochs / batch_size) batches (a batch may span two epochs, as in ART);
    the schedule (`create_lr_schedule`, warmup int(batches * warmup_ratio)) covers them all and
    this call trains batches `initial_step` up to `final_step` (exclusive; None or past the end:
    to the end), one optimizer step each at its rate, in one `train_sft` call: the model's step
    moves by 1 (ART's too). `assistant_turns` (ART 0.5.23's): "last" trains only each row's
    last assistant message. `log_metrics` (ART 0.5.23's): False writes no history row for the
    call. Every row is validated before anything trains.

    Returns:
        `model.train_sft`'s result (a TrainResult), or None when `initial_step` is at or past
        the last batch (nothing left to train; printed when `verbose`).

    Raises:
        SFTFileError: the file is missing, unreadable, empty, or has a bad row (file:line).
        HyperParameterError: `epochs` or `batch_size` not a whole number >= 1, `initial_step`
            not one >= 0, `final_step` not None or a whole number > `initial_step`, `peak_lr`
            not a finite number > 0, `warmup_ratio` outside [0, 1], `shuffle_buffer_size` not a
            whole number >= 1, `verbose` not a bool, `assistant_turns` not "all" or "last"; and
            what `model.train_sft` raises.
        UserError: `schedule_type` is not "constant", "linear" or "cosine".
    """
    where = "train_sft_from_file"
    check(where, "epochs", epochs, whole_problem(1), "1")
    check(where, "batch_size", batch_size, whole_problem(1), "2")
    check(where, "peak_lr", peak_lr, positive_problem, "2e-4")
    check(where, "warmup_ratio", warmup_ratio, fraction_problem, "0.1")
    check(where, "initial_step", initial_step, whole_problem(0), "0")
    check(where, "final_step", final_step, optional(whole_problem(initial_step + 1)), f"{initial_step + 1}")
    check(where, "shuffle_buffer_size", shuffle_buffer_size, whole_problem(1), "10000")
    check(where, "verbose", verbose, bool_problem, "True")
    check(where, "log_metrics", log_metrics, bool_problem, "False")
    if assistant_turns not in ("all", "last"):
        raise HyperParameterError(
            f"{where}(assistant_turns={assistant_turns!r}) must be 'all' or 'last'",
            "assistant_turns",
            assistant_turns,
        )
    if schedule_type not in ("constant", "linear", "cosine"):
        raise UserError(f"schedule_type={schedule_type!r} must be 'constant', 'linear' or 'cosine'")
    rows = read_sft_jsonl(file_path)
    if verbose:
        print(f"File has {len(rows)} rows")
    total = math.ceil(len(rows) * epochs / batch_size)
    if initial_step >= total:
        if verbose:
            print(f"initial_step {initial_step} skips all {total} batches")
        return None
    schedule = create_lr_schedule(total, peak_lr, schedule_type, warmup_steps=int(total * warmup_ratio))
    rates = schedule[initial_step:final_step]
    trajectories = list(
        itertools.islice(
            _buffer_shuffled(rows, epochs, shuffle_buffer_size, 42),
            initial_step * batch_size,
            (initial_step + len(rates)) * batch_size,
        )
    )
    if verbose:
        print(f"Training {len(trajectories)} trajectories")
        print(f"Batches: {len(rates)}, batch_size: {batch_size}")
        print(f"Schedule: {schedule_type}, peak_lr: {peak_lr}")
    config = TrainSFTConfig(learning_rate=rates, batch_size=batch_size, assistant_turns=assistant_turns)
    return await model.train_sft(
        trajectories, config, _config=_config, verbose=verbose, log_metrics=log_metrics
    )

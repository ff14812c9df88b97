"""The packed training batch one DP rank consumes, and its file form (safetensors).

Shapes: B packed rows of S tokens. Several documents share a row; `segment_ids` tells them
apart so no token attends across documents. A document is one token sequence of a trajectory
(see `trainer.prepare.tokenize`: one per history, more where a turn is trained in its own context); all
documents of one trajectory carry its advantage and weight. Token t of a row is
predicted from tokens < t of its own document; the per-token fields below describe token t.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from art_mega.trainer.behaviour import NOT_SAMPLED, SFT_SAMPLING, TokenSampling

INT_FIELDS = ("input_ids", "segment_ids", "position_ids")
FLOAT_FIELDS = ("loss_mask", "old_logprobs", "advantages", "weights")
SAMPLING_FIELDS: dict[str, tuple[type[np.generic], float]] = {
    "temperature": (np.float32, 1.0),
    "top_k": (np.int32, 0),
    "top_p": (np.float32, 1.0),
    "min_p": (np.float32, 0.0),
    "sampling": (np.int8, NOT_SAMPLED),
}
"""The behaviour-policy fields of a `TrainBatch` (see `trainer.behaviour`): dtype and the value of
a token that was not sampled (T=1, no truncation)."""
DTYPES: dict[str, type[np.generic]] = {
    "input_ids": np.int64,
    "segment_ids": np.int32,
    "position_ids": np.int64,
    **dict.fromkeys(FLOAT_FIELDS, np.float32),
    **{name: dtype for name, (dtype, _) in SAMPLING_FIELDS.items()},
}
"""The dtype of each `TrainBatch` field in its file, in field order (`TrainBatch.load` checks them)."""


@dataclass
class TrainBatch:
    """One DP rank's packed batch (numpy arrays, [B, S] each).

    Attributes:
        input_ids: int64 token ids; 0-padded past the last document of a row.
        segment_ids: int32 document index within its row, from 1; 0 marks padding.
        position_ids: int64 position of each token within its own document (restarts at 0).
        loss_mask: float32 1.0 where token t is trained (a sampled/assistant token), else 0.0.
        old_logprobs: float32 logprob of token t under the sampling policy (0 where not trained);
            NaN on a trained token whose sampling logprob is unknown (a plain assistant message
            trained with `allow_training_without_logprobs`, `tokenize.UNKNOWN_LOGPROB`): the loss
            uses the current policy's there (`loss.known_logprobs`). NaN nowhere else.
        advantages: float32 the advantage of token t's trajectory (0 for SFT).
        weights: float32 token weight: 1 / assistant tokens of its trajectory.
        temperature, top_k, top_p, min_p: what token t was sampled with (float32, int32 with 0 =
            off, float32, float32): the trainer computes its logprobs at that temperature and
            truncation (`logprobs.SamplingRows`). None: T=1 without truncation everywhere.
        sampling: int8 `trainer.behaviour` code of token t (EXACT, UNTAGGED, CONSTRAINED,
            PROCESSED; NOT_SAMPLED on untrained and plain assistant tokens). None: NOT_SAMPLED.
    """

    input_ids: np.ndarray
    segment_ids: np.ndarray
    position_ids: np.ndarray
    loss_mask: np.ndarray
    old_logprobs: np.ndarray
    advantages: np.ndarray
    weights: np.ndarray
    temperature: np.ndarray | None = None
    top_k: np.ndarray | None = None
    top_p: np.ndarray | None = None
    min_p: np.ndarray | None = None
    sampling: np.ndarray | None = None

    def __post_init__(self) -> None:
        shape = self.input_ids.shape
        for name, (dtype, default) in SAMPLING_FIELDS.items():
            if getattr(self, name) is None:
                setattr(self, name, np.full(shape, default, dtype=dtype))
        for f in fields(self):
            value = getattr(self, f.name)
            if value.shape != shape or value.ndim != 2:
                raise ValueError(f"TrainBatch.{f.name} has shape {value.shape}, expected [B, S] = {shape}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.input_ids.shape)  # type: ignore[return-value]

    @property
    def trained_tokens(self) -> int:
        return int((self.loss_mask > 0).sum())

    def save(self, path: str | Path) -> None:
        """Write to `path` (safetensors) via a temp file and rename: never half-written."""
        from safetensors.numpy import save_file

        target = Path(path)
        tmp = target.with_name(target.name + ".tmp")
        save_file({f.name: np.ascontiguousarray(getattr(self, f.name)) for f in fields(self)}, str(tmp))
        tmp.replace(target)

    @classmethod
    def load(cls, path: str | Path) -> TrainBatch:
        """Read the batch that `save` wrote to `path` (the controller writes it, a rank reads it).

        Raises:
            ValueError: the file lacks a field, holds a tensor that is none, or a field has
                another dtype than `DTYPES` names or another shape (named, with the file).
        """
        from safetensors.numpy import load_file

        data = load_file(str(path))
        missing = [name for name in DTYPES if name not in data]
        unknown = sorted(set(data) - set(DTYPES))
        if missing or unknown:
            raise ValueError(
                f"batch file {path} is not a TrainBatch: it lacks {missing} and holds unknown "
                f"tensors {unknown}; write it with TrainBatch.save"
            )
        for name, dtype in DTYPES.items():
            if data[name].dtype != dtype:
                raise ValueError(
                    f"batch file {path}: {name} is {data[name].dtype}, a TrainBatch's is {np.dtype(dtype)}; "
                    "write it with TrainBatch.save"
                )
        return cls(**{name: data[name] for name in DTYPES})

    def to_torch(self, device: Any = "cpu") -> dict[str, Any]:
        """The fields as torch tensors on `device` (int64/int32/float32 kept)."""
        import torch

        return {f.name: torch.from_numpy(getattr(self, f.name)).to(device) for f in fields(self)}


@dataclass(frozen=True)
class Document:
    """One sequence to pack: its tokens and, per token, the training fields (length L each).

    `old_logprobs[t]` is the sampling logprob of `input_ids[t]`: 0.0 where `loss_mask[t]` is 0
    or the token is trained for SFT without being sampled, NaN (unknown, see
    `TrainBatch.old_logprobs`) where a GRPO token is trained without being sampled;
    `advantage` and `weight` are its trajectory's. `sampling[t]` is what token t was sampled
    with (`trainer.behaviour.TokenSampling`); None: nothing was sampled (SFT).
    """

    input_ids: list[int]
    loss_mask: list[float]
    old_logprobs: list[float]
    advantage: float
    weight: float
    sampling: Sequence[TokenSampling] | None = None

    def __len__(self) -> int:
        return len(self.input_ids)


def pack(documents: list[Document], seq_len: int, dp_size: int = 1) -> list[TrainBatch]:
    """Pack documents into rows of `seq_len` tokens, split across `dp_size` ranks by tokens.

    First-fit decreasing by length into rows; rows are dealt to DP ranks greedily (least tokens
    first) so ranks get balanced token counts; every rank gets the same number of rows (empty
    rows are all padding, loss_mask 0). A document longer than `seq_len` raises ValueError.

    Returns:
        one TrainBatch per DP rank.
    """
    rows = _rows(documents, seq_len)
    per_rank: list[list[list[Document]]] = [[] for _ in range(dp_size)]
    tokens = [0] * dp_size
    for row in sorted(rows, key=lambda r: -sum(len(d) for d in r)):
        rank = min(range(dp_size), key=lambda r: (tokens[r], len(per_rank[r])))
        per_rank[rank].append(row)
        tokens[rank] += sum(len(d) for d in row)
    height = max(1, max(len(r) for r in per_rank))
    return [_fill(rank_rows, height, seq_len) for rank_rows in per_rank]


def pack_steps(documents: list[Document], seq_len: int, dp_size: int, rows_per_step: int) -> list[TrainBatch]:
    """Pack documents for several optimizer steps of `rows_per_step` rows each (over all DP
    ranks; ART's grad_accumulation_sequences packed sequences per step).

    The rows are `pack`'s (first-fit decreasing into rows of `seq_len` tokens), in the order
    they were opened (by their longest document); step s takes rows
    [s * rows_per_step, (s + 1) * rows_per_step), the last step's missing rows all padding (at
    least one step, all padding when there is no document). Each step's rows are dealt to the
    `dp_size` ranks, rows_per_step / dp_size to each, the next row to the rank with the fewest
    tokens so far in that step.

    Returns:
        one TrainBatch per DP rank of steps * rows_per_step / dp_size rows: step s is its rows
        [s * h, (s + 1) * h), h = rows_per_step / dp_size.

    Raises:
        ValueError: a document longer than `seq_len`, or `rows_per_step` not a positive
            multiple of `dp_size`.
    """
    if rows_per_step < 1 or rows_per_step % dp_size:
        raise ValueError(f"rows_per_step={rows_per_step} is not a positive multiple of dp_size={dp_size}")
    rows = _rows(documents, seq_len)
    height = rows_per_step // dp_size
    per_rank: list[list[list[Document]]] = [[] for _ in range(dp_size)]
    for first in range(0, max(len(rows), 1), rows_per_step):
        dealt: list[list[list[Document]]] = [[] for _ in range(dp_size)]
        tokens = [0] * dp_size
        for row in rows[first : first + rows_per_step]:
            rank = min((r for r in range(dp_size) if len(dealt[r]) < height), key=lambda r: tokens[r])
            dealt[rank].append(row)
            tokens[rank] += sum(len(d) for d in row)
        for rank, step_rows in enumerate(dealt):
            per_rank[rank] += step_rows + [[]] * (height - len(step_rows))
    return [_fill(rank_rows, len(rank_rows), seq_len) for rank_rows in per_rank]


def _rows(documents: list[Document], seq_len: int) -> list[list[Document]]:
    """Documents first-fit decreasing by length into rows of at most `seq_len` tokens.

    Raises:
        ValueError: a document longer than `seq_len`.
    """
    for doc in documents:
        if len(doc) > seq_len:
            raise ValueError(f"a sequence of {len(doc)} tokens does not fit seq_len={seq_len}; raise seq_len")
    rows: list[list[Document]] = []
    room: list[int] = []
    for doc in sorted(documents, key=len, reverse=True):
        for i, free in enumerate(room):
            if len(doc) <= free:
                rows[i].append(doc)
                room[i] -= len(doc)
                break
        else:
            rows.append([doc])
            room.append(seq_len - len(doc))
    return rows


def _fill(rows: list[list[Document]], height: int, seq_len: int) -> TrainBatch:
    shape = (height, seq_len)
    out = {name: np.zeros(shape, dtype=np.int64) for name in ("input_ids", "position_ids")}
    out["segment_ids"] = np.zeros(shape, dtype=np.int32)
    for name in FLOAT_FIELDS:
        out[name] = np.zeros(shape, dtype=np.float32)
    for name, (dtype, default) in SAMPLING_FIELDS.items():
        out[name] = np.full(shape, default, dtype=dtype)
    for r, row in enumerate(rows):
        start = 0
        for segment, doc in enumerate(row, start=1):
            end = start + len(doc)
            out["input_ids"][r, start:end] = doc.input_ids
            out["segment_ids"][r, start:end] = segment
            out["position_ids"][r, start:end] = np.arange(len(doc))
            out["loss_mask"][r, start:end] = doc.loss_mask
            out["old_logprobs"][r, start:end] = doc.old_logprobs
            out["advantages"][r, start:end] = np.where(np.asarray(doc.loss_mask) > 0, doc.advantage, 0.0)
            out["weights"][r, start:end] = np.where(np.asarray(doc.loss_mask) > 0, doc.weight, 0.0)
            if doc.sampling is not None:
                _fill_sampling(out, r, start, doc.sampling)
            start = end
    return TrainBatch(**out)


def _fill_sampling(out: dict[str, np.ndarray], row: int, start: int, sampling: Sequence[TokenSampling]) -> None:
    """Write a document's per-token `TokenSampling`s into the batch arrays from column `start`
    (one `TokenSampling` object per choice, so runs of equal ones are written at once)."""
    end = start + len(sampling)
    first = start
    while first < end:
        current = sampling[first - start] or SFT_SAMPLING
        last = first + 1
        while last < end and sampling[last - start] is current:
            last += 1
        out["temperature"][row, first:last] = current.temperature
        out["top_k"][row, first:last] = current.top_k
        out["top_p"][row, first:last] = current.top_p
        out["min_p"][row, first:last] = current.min_p
        out["sampling"][row, first:last] = current.code
        first = last

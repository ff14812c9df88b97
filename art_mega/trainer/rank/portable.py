"""Layout-free Adam moments: a checkpoint's per-rank records, rebuilt and cut for another layout.

A rank file of format 2 (`TrainerEngine.save_state`) holds, per LoRA parameter the rank
updates, its Adam moments in that rank's layout (`TrainerEngine._named_adam`): the parameter's
TP shard (`split`, `tp_rank`; `shape` the shard's shape) and, under the distributed optimizer,
the flat slice [start, end) of that shard the rank owns (`range`, None for all of it).

A TP shard is a slice in Megatron's fused row order, not the HF module's: a linear_fc1 B shard
is [gate rows; up rows] of its rank, a linear_qkv B shard its rank's query groups, a Qwen3.5
in_proj_qkv shard its rank's (q, k, v) pieces. Concatenating the shards therefore is not the
whole tensor, and cutting that concatenation for another TP size hands a parameter the moments
of other rows. The moments take the LoRA weights' way instead: the old shards become PEFT
tensors as `peft_io.export_adapter` makes them (`LoraNames.to_peft`), and this rank's shards are
cut from those as `peft_io.import_adapter` cuts the weights (`LoraNames.from_peft`). Every
moment therefore lands on the element whose weight it belongs to, on any TP / PP / EP / DP
layout the adapter loads on.

Where the moments cannot be rebuilt the optimizer restarts from zero moments, said in one
logged line (`log_resume`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from art_mega.trainer.families.spec import LoraNames
    from art_mega.trainer.rank.lora import LoraLinear

MOMENTS = ("exp_avg", "exp_avg_sq")
"""torch Adam's per-parameter moment tensors (first and second), float32."""

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Slot:
    """What re-sharding needs of one LoRA layer on this rank (`of(layer)` reads a `LoraLinear`).

    `name`: the adapter name (`lora.apply_lora`); `kind`: "column" or "row"; `tp_size`,
    `tp_rank`: the layer's TP group (the expert-TP one for an expert); `column_parts`:
    `peft_io.column_parts`; `a_shape`, `b_shape`: this rank's lora_A / lora_B shapes."""

    name: str
    kind: str
    tp_size: int
    tp_rank: int
    column_parts: tuple[int, ...] | None
    a_shape: tuple[int, ...]
    b_shape: tuple[int, ...]

    @classmethod
    def of(cls, layer: LoraLinear) -> Slot:
        from art_mega.trainer.peft_io import column_parts

        return cls(
            layer.name,
            layer.kind,
            layer.tp_size,
            layer.tp_rank,
            column_parts(layer),
            tuple(layer.lora_A.shape),
            tuple(layer.lora_B.shape),
        )


def missing_state(payloads: list[dict[str, Any]]) -> str | None:
    """Why a checkpoint's rank files (`save_state` payloads) give no moments to re-shard, or None.

    Format-1 files hold no layout-free records; a file whose record is None was written before
    the first optimizer step or by a bf16 optimizer without the distributed layout (no fp32 copy
    per parameter)."""
    if not payloads:
        return "the checkpoint holds no rank files"
    if any("named_adam" not in payload for payload in payloads):
        return "its rank files hold no layout-free optimizer state (written before format 2)"
    if any(payload["named_adam"] is None for payload in payloads):
        return (
            "a rank file holds no per-parameter Adam state (saved before the first optimizer step, "
            "or by a bf16 optimizer without the distributed layout)"
        )
    return None


def tp_shards(records: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Every old TP shard of every LoRA parameter, rebuilt from all old ranks' records.

    The distributed optimizer's slices of one shard (several DP ranks) fill it together; DP
    replicas and the TP ranks of a replicated parameter write the same values. Returns {name:
    {"exp_avg", "exp_avg_sq": [shard of TP rank 0, 1, ...] (float32, each the record's `shape`),
    "step": float}}; a parameter with a shard no record covers is left out (its moments are
    unknown), as is one without any record.
    """
    import numpy as np
    import torch

    filled: dict[tuple[str, int], dict[str, Any]] = {}
    for record in records:
        for name, part in record.items():
            numel = int(np.prod(part["shape"]))
            entry = filled.setdefault(
                (name, part["tp_rank"]),
                {
                    **{m: torch.zeros(numel) for m in MOMENTS},
                    "covered": torch.zeros(numel, dtype=torch.bool),
                    "part": part,
                },
            )
            start, end = part["range"] if part["range"] is not None else (0, numel)
            for m in MOMENTS:
                entry[m][start:end] = part[m].reshape(-1).float()
            entry["covered"][start:end] = True
    out: dict[str, dict[str, Any]] = {}
    for (name, tp_rank), entry in filled.items():
        part = entry["part"]
        split = part["split"]
        count = 1 if split is None else part["full"][split] // part["shape"][split]
        shards = out.setdefault(name, {**{m: [None] * count for m in MOMENTS}, "step": part["step"]})
        if entry["covered"].all() and tp_rank < count:
            for m in MOMENTS:
                shards[m][tp_rank] = entry[m].reshape(part["shape"])
    return {
        name: shards for name, shards in out.items() if all(s is not None for m in MOMENTS for s in shards[m])
    }


def rank_moments(
    shards: dict[str, dict[str, Any]],
    slot: Slot,
    names: LoraNames,
    num_heads: int,
    num_query_groups: int,
) -> dict[str, dict[str, Any]] | str:
    """This rank's Adam state of `slot`'s lora_A and lora_B from the old TP shards (`tp_shards`),
    or why it cannot be rebuilt (one clause).

    The old shards of each moment are put together as `peft_io.export_adapter` puts the weights
    together (A's column shards of a row layer concatenated, B's row shards of a column layer in
    `peft_io.hf_order`), mapped to PEFT tensors (`names.to_peft`) and cut for this rank as
    `peft_io.import_adapter` cuts the weights (`names.from_peft`; `num_heads`,
    `num_query_groups` as there). Returns {"lora_A": {"exp_avg", "exp_avg_sq" (float32, this
    rank's parameter shape), "step"}, "lora_B": {...}}.
    """
    import torch

    from art_mega.trainer.peft_io import hf_order

    a_name, b_name = f"{slot.name}.lora_A", f"{slot.name}.lora_B"
    for name in (a_name, b_name):
        if name not in shards:
            return f"the records have no complete state for {name}"
    local: dict[str, dict[str, Any]] = {
        "lora_A": {"step": shards[a_name]["step"]},
        "lora_B": {"step": shards[b_name]["step"]},
    }
    for m in MOMENTS:
        a = torch.cat(shards[a_name][m], dim=1)
        b_shards = shards[b_name][m]
        if slot.kind == "column":
            b_shards = hf_order(b_shards, slot.column_parts)
        tensors = names.to_peft(slot.name, a, b_shards, num_heads, num_query_groups)
        a_local, b_local = names.from_peft(
            slot.name,
            tensors,
            num_heads,
            num_query_groups,
            slot.tp_size,
            slot.tp_rank,
            column_parts=slot.column_parts,
        )
        for matrix, value, shape in (("lora_A", a_local, slot.a_shape), ("lora_B", b_local, slot.b_shape)):
            if tuple(value.shape) != shape:
                return f"the records' {slot.name}.{matrix} is {tuple(value.shape)} here, not {shape}"
            local[matrix][m] = value.contiguous()
    return local


def log_resume(
    directory: Path | str, old: dict[str, int] | None, new: dict[str, int], problem: str | None
) -> None:
    """The one line a layout-portable resume logs (global rank 0 calls it): the optimizer state
    re-sharded, or restarted from zero moments and why (`problem`)."""
    if problem is None:
        log.info("resumed %s written on layout %s at %s, optimizer state re-sharded", directory, old, new)
    else:
        log.warning(
            "resumed %s (layout %s) at layout %s with its LoRA weights; the optimizer state "
            "restarts from zero because %s",
            directory,
            old,
            new,
            problem,
        )


def as_flat_slice(value: torch.Tensor, span: tuple[int, int] | None, like: torch.Tensor) -> torch.Tensor:
    """`value` (a parameter's moment) as the optimizer keeps it for the main parameter `like`:
    the flat slice `span` the distributed optimizer gives this rank (all of it for None), in
    `like`'s shape, dtype and device (a copy)."""
    flat = value.reshape(-1)
    if span is not None:
        flat = flat[span[0] : span[1]]
    return flat.reshape(like.shape).to(device=like.device, dtype=like.dtype).clone()

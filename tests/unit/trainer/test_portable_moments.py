"""Layout-portable Adam moments (`trainer.rank.portable`): the per-rank records a TP=2 (and
distributed-optimizer) run writes are re-cut for TP=1 and TP=2 element by element as the LoRA
weights are, with the llama and Qwen3.5 families' real LoRA <-> PEFT names; and a checkpoint
whose records cannot be re-sharded gives the one-line reason the resume logs when the optimizer
restarts from zero moments.

The records follow `TrainerEngine._named_adam` (rank file format 2). "Moments" here are random
tensors in the Megatron layout of TP=1; a TP rank's part is what `LoraNames.from_peft` cuts for
that rank, the cut `peft_io.import_adapter` makes of the weights."""

from __future__ import annotations

import logging

import pytest

torch = pytest.importorskip("torch")

from art_mega.trainer.families.llama import SPEC as LLAMA  # noqa: E402
from art_mega.trainer.families.qwen3_5 import SPEC as QWEN35  # noqa: E402
from art_mega.trainer.rank import portable  # noqa: E402
from art_mega.trainer.rank.portable import MOMENTS, Slot  # noqa: E402

HEADS, GROUPS, HEAD_DIM, HIDDEN, FFN, R = 4, 2, 2, 8, 6, 2
QKV_OUT = (HEADS + 2 * GROUPS) * HEAD_DIM
LAYERS = {
    # name -> (kind, in, out, column_parts)
    "decoder.layers.0.self_attention.linear_qkv": ("column", HIDDEN, QKV_OUT, (QKV_OUT,)),
    "decoder.layers.0.self_attention.linear_proj": ("row", HEADS * HEAD_DIM, HIDDEN, None),
    "decoder.layers.0.mlp.linear_fc1": ("column", HIDDEN, 2 * FFN, (2 * FFN,)),
    "decoder.layers.0.mlp.linear_fc2": ("row", FFN, HIDDEN, None),
}
"""One llama decoder layer's LoRA layers (4 heads in 2 query groups of width 2, hidden 8, ffn 6)."""

QWEN_PARTS = (4, 4, 8)
QWEN_LAYER = "decoder.layers.0.self_attention.in_proj_qkv"
"""Qwen3.5's delta-net in_proj_qkv: each TP shard holds a slice of its q, k and v rows."""


def _full(kind: str, fan_in: int, fan_out: int, seed: int) -> dict[str, dict[str, torch.Tensor]]:
    """Random positive 'moments' of one LoRA layer in the TP=1 layout: {matrix: {moment: tensor}}."""
    generator = torch.Generator().manual_seed(seed)
    shapes = {"lora_A": (R, fan_in), "lora_B": (fan_out, R)}
    return {m: {k: torch.rand(shape, generator=generator) for k in MOMENTS} for m, shape in shapes.items()}


def _rank_parts(names, name, kind, full, parts, tp, rank):
    """(A, B) of each moment on TP rank `rank` of `tp`: as `import_adapter` cuts the weights."""
    out = {}
    for moment in MOMENTS:
        tensors = names.to_peft(name, full["lora_A"][moment], [full["lora_B"][moment]], HEADS, GROUPS)
        out[moment] = names.from_peft(name, tensors, HEADS, GROUPS, tp, rank, column_parts=parts)
    return out


def _records(names, layers, tp: int, dp: int) -> list[dict]:
    """The `named_adam` records of a tp x dp run (dp > 1: the distributed optimizer, each DP rank
    a flat slice of its TP rank's shard), one per old rank, with Adam at step 2."""
    records = []
    for tp_rank in range(tp):
        for dp_rank in range(dp):
            record = {}
            for name, (kind, _, _, parts, full) in layers.items():
                cut = _rank_parts(names, name, kind, full, parts, tp, tp_rank)
                for index, matrix in enumerate(("lora_A", "lora_B")):
                    split = None if tp == 1 else {"column": {"lora_B": 0}, "row": {"lora_A": 1}}[kind].get(matrix)
                    shard = {m: cut[m][index] for m in MOMENTS}
                    shape = tuple(shard["exp_avg"].shape)
                    numel = shard["exp_avg"].numel()
                    start, end = numel * dp_rank // dp, numel * (dp_rank + 1) // dp
                    full_shape = list(shape)
                    if split is not None:
                        full_shape[split] *= tp
                    record[f"{name}.{matrix}"] = {
                        **{m: shard[m].reshape(-1)[start:end].clone() for m in MOMENTS},
                        "step": 2.0,
                        "shape": shape,
                        "full": tuple(full_shape),
                        "split": split,
                        "tp_rank": tp_rank if split is not None else 0,
                        "range": (start, end) if dp > 1 else None,
                    }
            records.append(record)
    return records


def _llama_layers() -> dict:
    return {
        name: (kind, fan_in, fan_out, parts, _full(kind, fan_in, fan_out, seed))
        for seed, (name, (kind, fan_in, fan_out, parts)) in enumerate(LAYERS.items())
    }


@pytest.mark.parametrize(("old", "new"), [((2, 2), 1), ((2, 1), 1), ((1, 2), 2), ((2, 1), 2)])
def test_moments_land_on_their_own_elements(old: tuple[int, int], new: int) -> None:
    """TP=2 (x DP=2 distributed) records re-cut for TP=1 and TP=2 equal the cut of the TP=1 moments."""
    names = LLAMA.lora
    layers = _llama_layers()
    shards = portable.tp_shards(_records(names, layers, *old))
    for name, (kind, _, _, parts, full) in layers.items():
        for rank in range(new):
            expected = _rank_parts(names, name, kind, full, parts, new, rank)
            slot = Slot(name, kind, new, rank, parts, *(tuple(t.shape) for t in expected["exp_avg"]))
            got = portable.rank_moments(shards, slot, names, HEADS, GROUPS)
            assert not isinstance(got, str), got
            for index, matrix in enumerate(("lora_A", "lora_B")):
                assert got[matrix]["step"] == 2.0
                for moment in MOMENTS:
                    assert torch.equal(got[matrix][moment], expected[moment][index]), (name, matrix, moment)


def test_concatenated_fc1_shards_are_not_the_whole_tensor() -> None:
    """What the re-cut guards against: linear_fc1's TP shards are [gate; up] each, so their
    concatenation puts up rows where gate rows belong (the moments of other elements)."""
    names = LLAMA.lora
    name = "decoder.layers.0.mlp.linear_fc1"
    full = _full("column", HIDDEN, 2 * FFN, 0)
    cut = _rank_parts(names, name, "column", full, (2 * FFN,), 2, 0), _rank_parts(
        names, name, "column", full, (2 * FFN,), 2, 1
    )
    joined = torch.cat([cut[0]["exp_avg"][1], cut[1]["exp_avg"][1]])
    assert not torch.equal(joined, full["lora_B"]["exp_avg"])


def test_qwen35_in_proj_qkv_parts_recut() -> None:
    """A column layer whose TP shards hold q, k, v pieces (`peft_io.hf_order`) re-cut TP=2 -> TP=1."""
    names = QWEN35.lora
    full = _full("column", HIDDEN, sum(QWEN_PARTS), 7)
    layers = {QWEN_LAYER: ("column", HIDDEN, sum(QWEN_PARTS), QWEN_PARTS, full)}
    shards = portable.tp_shards(_records(names, layers, 2, 1))
    slot = Slot(QWEN_LAYER, "column", 1, 0, QWEN_PARTS, (R, HIDDEN), (sum(QWEN_PARTS), R))
    got = portable.rank_moments(shards, slot, names, HEADS, GROUPS)
    assert not isinstance(got, str), got
    for matrix in ("lora_A", "lora_B"):
        for moment in MOMENTS:
            assert torch.equal(got[matrix][moment], full[matrix][moment])


def test_an_uncovered_slice_or_another_shape_is_a_reason() -> None:
    """A distributed slice no record holds, or records of another model, give a reason, not moments."""
    names = LLAMA.lora
    layers = _llama_layers()
    records = _records(names, layers, 2, 2)
    name = "decoder.layers.0.mlp.linear_fc2"
    del records[1][f"{name}.lora_A"]  # TP rank 0, DP rank 1: the second half of A's shard
    shards = portable.tp_shards(records)
    slot = Slot(name, "row", 1, 0, None, (R, FFN), (HIDDEN, R))
    assert portable.rank_moments(shards, slot, names, HEADS, GROUPS) == (
        f"the records have no complete state for {name}.lora_A"
    )
    qkv = "decoder.layers.0.self_attention.linear_qkv"
    wider = Slot(qkv, "column", 1, 0, (QKV_OUT,), (R, HIDDEN + 1), (QKV_OUT, R))
    assert portable.rank_moments(shards, wider, names, HEADS, GROUPS) == (
        f"the records' {qkv}.lora_A is {(R, HIDDEN)} here, not {(R, HIDDEN + 1)}"
    )


def test_flat_slice_is_the_distributed_optimizers() -> None:
    value = torch.arange(12.0).reshape(3, 4)
    main = torch.zeros(5, dtype=torch.float64)
    got = portable.as_flat_slice(value, (3, 8), main)
    assert got.dtype == torch.float64 and got.tolist() == [3.0, 4.0, 5.0, 6.0, 7.0]
    assert torch.equal(portable.as_flat_slice(value, None, torch.zeros(3, 4)), value)


@pytest.mark.parametrize(
    ("payloads", "reason"),
    [
        ([], "the checkpoint holds no rank files"),
        (
            [{"format": 1, "steps": 3}],
            "its rank files hold no layout-free optimizer state (written before format 2)",
        ),
        (
            [{"named_adam": {}}, {"named_adam": None}],
            "a rank file holds no per-parameter Adam state (saved before the first optimizer step, "
            "or by a bf16 optimizer without the distributed layout)",
        ),
        ([{"named_adam": {}}], None),
    ],
)
def test_checkpoints_without_records_restart_with_one_logged_line(
    payloads: list, reason: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    assert portable.missing_state(payloads) == reason
    old, new = {"tp": 2, "dp": 1, "pp": 1}, {"tp": 1, "dp": 2, "pp": 1}
    with caplog.at_level(logging.INFO, logger=portable.__name__):
        portable.log_resume("/run/checkpoints/0002", old, new, reason)
    [line] = caplog.records
    if reason is None:
        assert line.levelno == logging.INFO
        assert line.getMessage() == (
            f"resumed /run/checkpoints/0002 written on layout {old} at {new}, optimizer state re-sharded"
        )
    else:
        assert line.levelno == logging.WARNING and "\n" not in line.getMessage()
        assert line.getMessage() == (
            f"resumed /run/checkpoints/0002 (layout {old}) at layout {new} with its LoRA weights; "
            f"the optimizer state restarts from zero because {reason}"
        )

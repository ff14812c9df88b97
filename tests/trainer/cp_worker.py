"""One gloo rank of the context-parallel test (run as `python -m tests.trainer.cp_worker`).

CP=2 over 2 ranks (TP=1, DP=1): logits of plain and packed rows and the packed rows' logprobs
and entropies for the llama and qwen3 models, then the 3 GRPO steps of
`engine_scenarios.training` on llama. `packed_forward` is also what the test runs in its own
one-rank world (CP=1) for the reference. Results go to OUT/rankR.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from art_mega.topology.compiled import TrainerRank
from art_mega.topology.groups import rank_coordinates
from art_mega.topology.trainer import TrainerSpec
from art_mega.trainer.model_builder import build_megatron_model
from art_mega.trainer.rank.parallel import ParallelState, destroy_parallel, init_parallel
from tests.trainer.common import input_ids, megatron_logits
from tests.trainer.engine_scenarios import training

CP_MODELS = ("llama", "qwen3")
DOCUMENTS = ((9, 10), (13, 5))
"""Document lengths of the two packed rows (row 0: 9 + 10 tokens, row 1: 13 + 5)."""
PACKED_LEN = 22
"""Not a multiple of 2*cp = 4: the CP path pads the rows."""


def packed_rows(vocab_size: int) -> dict[str, torch.Tensor]:
    """Two packed rows [2, PACKED_LEN] of two documents each plus padding: input_ids,
    position_ids (restarting per document) and segment_ids (1, 2, then 0)."""
    generator = torch.Generator().manual_seed(7)
    ids = torch.zeros(len(DOCUMENTS), PACKED_LEN, dtype=torch.long)
    positions = torch.zeros_like(ids)
    segments = torch.zeros(len(DOCUMENTS), PACKED_LEN, dtype=torch.int32)
    for row, lengths in enumerate(DOCUMENTS):
        start = 0
        for segment, length in enumerate(lengths, start=1):
            ids[row, start : start + length] = torch.randint(3, vocab_size, (length,), generator=generator)
            positions[row, start : start + length] = torch.arange(length)
            segments[row, start : start + length] = segment
            start += length
    return {"input_ids": ids, "position_ids": positions, "segment_ids": segments}


def packed_forward(built: Any) -> dict[str, torch.Tensor]:
    """Full logits [2, PACKED_LEN, vocab], logprobs and entropies [2, PACKED_LEN] of `packed_rows`
    (gathered over TP and CP)."""
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    from art_mega.trainer.rank.cp_attention import gather_from_cp_ranks
    from art_mega.trainer.rank.logprobs import forward_logits, token_entropy, token_logprobs

    rows = packed_rows(built.vocab_size)
    with torch.no_grad():
        local = forward_logits(built.module, rows["input_ids"], rows["position_ids"], rows["segment_ids"])
        full = gather_from_tensor_model_parallel_region(local, mpu.get_tensor_model_parallel_group())
        full = gather_from_cp_ranks(full, mpu.get_context_parallel_group(), dim=1)[:, :PACKED_LEN]
        entropy = token_entropy(local, vocab_size=built.vocab_size, segment_ids=rows["segment_ids"])
        logprobs = token_logprobs(  # consumes its logits (Megatron's in-place kernel): a copy
            local.clone(), rows["input_ids"], vocab_size=built.vocab_size, segment_ids=rows["segment_ids"]
        )
        # ART's logprob_calculation_chunk_size: chunks of this CP rank's positions, same values
        chunked = token_logprobs(
            local,
            rows["input_ids"],
            vocab_size=built.vocab_size,
            segment_ids=rows["segment_ids"],
            chunk_size=3,
        )
    return {
        "logits": full[..., : built.vocab_size].float(),
        "logprobs": logprobs,
        "logprobs in chunks of 3": chunked,
        "entropy": entropy,
    }


def megatron_split(state: ParallelState) -> dict[str, bool]:
    """This rank's share under Megatron's own CP functions against `cp_attention`'s.

    `get_batch_on_this_cp_rank` slices tokens and the full packed mask's query rows
    (`utils.py:1994`); `get_pos_emb_on_this_cp_rank` slices RoPE angles (`rope_utils.py:48`,
    runnable on CPU through the `cpu_rope_cp_slice` patch).
    """
    from megatron.core import parallel_state as mpu
    from megatron.core.models.common.embeddings.rope_utils import get_pos_emb_on_this_cp_rank
    from megatron.core.utils import get_batch_on_this_cp_rank

    from art_mega.trainer.rank.cp_attention import cp_attention_mask, cp_token_indices
    from art_mega.trainer.rank.logprobs import packed_attention_mask

    length = 24
    segments = torch.nn.functional.pad(packed_rows(768)["segment_ids"], (0, length - PACKED_LEN))
    tokens = torch.arange(length).expand(2, length)
    split = get_batch_on_this_cp_rank(
        {"tokens": tokens.clone(), "attention_mask": packed_attention_mask(segments)}
    )
    held = cp_token_indices(length, state.cp, state.cp_rank)
    angles = torch.randn(length, 1, 1, 8, generator=torch.Generator().manual_seed(0))
    return {
        "tokens": torch.equal(split["tokens"], tokens[:, held]),
        "attention_mask": torch.equal(
            split["attention_mask"], cp_attention_mask(segments, state.cp, state.cp_rank)
        ),
        "rope": torch.equal(
            get_pos_emb_on_this_cp_rank(angles, 0, mpu.get_context_parallel_group()), angles[held]
        ),
    }


def join(rank: int, world: int, cp: int, port: int) -> ParallelState:
    row = TrainerRank(rank=rank, host_id="local", local_rank=rank, **rank_coordinates(rank, world, cp=cp))
    return init_parallel(
        row, TrainerSpec(cp=cp), world, master_addr="127.0.0.1", master_port=port, timeout_s=120
    )


def main(rank: int, world: int, out: Path, port: int, models: dict[str, str]) -> None:
    torch.set_num_threads(1)
    state = join(rank, world, cp=2, port=port)
    results: dict[str, object] = {"state": (state.tp, state.cp, state.dp, state.cp_rank)}
    results["megatron_split"] = megatron_split(state)
    for name in CP_MODELS:
        built = build_megatron_model(models[name])
        results[f"logits/{name}"] = megatron_logits(built, input_ids(built.vocab_size))
        results[f"packed/{name}"] = packed_forward(built)
    results["training/llama"] = training(state, models["llama"], out / "llama", dp_split=False)
    destroy_parallel()
    torch.save(results, out / f"rank{rank}.pt")


if __name__ == "__main__":
    rank_arg, world_arg, out_arg, port_arg, _, *pairs = sys.argv[1:]
    main(
        int(rank_arg),
        int(world_arg),
        Path(out_arg),
        int(port_arg),
        dict(pair.split("=", 1) for pair in pairs),
    )

"""One gloo rank of the Qwen3.5 TP=2 checks (run as `python -m tests.trainer.qwen3_5_worker`):
the tiny model's full logits on whole rows and on packed rows (two documents per row), and
`engine_scenarios.training` (3 GRPO steps, save/resume, adapter export and import round trip), to
OUT/rankR.pt."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from art_mega.trainer.model_builder import build_megatron_model
from art_mega.trainer.rank.parallel import destroy_parallel
from tests.trainer.common import input_ids, megatron_logits
from tests.trainer.engine_scenarios import training
from tests.trainer.tp_worker import join


def packed_logits(built, ids):
    """Full logits [b, s, vocab] of rows packed as two documents (tokens 0..9 and 10..s-1)."""
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    from art_mega.trainer.rank.logprobs import forward_logits

    length = ids.shape[1]
    segments = torch.cat([torch.ones(ids.shape[0], 10), 2 * torch.ones(ids.shape[0], length - 10)], 1).long()
    positions = torch.cat([torch.arange(10), torch.arange(length - 10)]).expand_as(ids)
    with torch.no_grad():
        shard = forward_logits(built.module, ids, positions, segments)
        full = gather_from_tensor_model_parallel_region(shard, mpu.get_tensor_model_parallel_group())
    return full[..., : built.vocab_size].float()


def main(rank: int, world: int, out: Path, port: int, models: dict[str, str]) -> None:
    torch.set_num_threads(1)
    state = join(rank, world, tp=2, port=port)
    results: dict[str, object] = {"state": (state.tp, state.dp, state.tp_rank, state.dp_rank)}
    for name, path in models.items():
        built = build_megatron_model(path)
        ids = input_ids(built.vocab_size)
        results[f"logits/{name}"] = megatron_logits(built, ids)
        results[f"packed/{name}"] = packed_logits(built, ids)
        results[f"training/{name}"] = training(state, path, out / name, dp_split=False)
    destroy_parallel()
    torch.save(results, out / f"rank{rank}.pt")


if __name__ == "__main__":
    rank_arg, world_arg, out_arg, port_a, _port_b, *pairs = sys.argv[1:]
    main(
        int(rank_arg), int(world_arg), Path(out_arg), int(port_a), dict(pair.split("=", 1) for pair in pairs)
    )

"""One gloo rank of a model family's TP=2 checks (run as `python -m tests.trainer.family_worker`).

TP=2 over 2 ranks, for every model given: its full logits, and `engine_scenarios.training` (3 GRPO
steps, save/resume, adapter export and import round trip). Results go to OUT/rankR.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from art_mega.trainer.model_builder import build_megatron_model
from art_mega.trainer.rank.parallel import destroy_parallel
from tests.trainer.common import input_ids, megatron_logits
from tests.trainer.engine_scenarios import training
from tests.trainer.tp_worker import join


def main(rank: int, world: int, out: Path, port: int, models: dict[str, str]) -> None:
    torch.set_num_threads(1)
    state = join(rank, world, tp=2, port=port)
    results: dict[str, object] = {"state": (state.tp, state.dp, state.tp_rank, state.dp_rank)}
    for name, path in models.items():
        built = build_megatron_model(path)
        results[f"logits/{name}"] = megatron_logits(built, input_ids(built.vocab_size))
        results[f"training/{name}"] = training(state, path, out / name, dp_split=False)
    destroy_parallel()
    torch.save(results, out / f"rank{rank}.pt")


if __name__ == "__main__":
    rank_arg, world_arg, out_arg, port_a, _port_b, *pairs = sys.argv[1:]
    main(
        int(rank_arg), int(world_arg), Path(out_arg), int(port_a), dict(pair.split("=", 1) for pair in pairs)
    )

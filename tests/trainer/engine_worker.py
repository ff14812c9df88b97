"""One gloo rank of the LoRA / engine tests (run as `python -m tests.trainer.engine_worker`).

Phase 1: TP=2 over 2 ranks: every scenario of `engine_scenarios.run_all`. Phase 2: TP=1, DP=2:
the training scenario with the batch's rows split over the DP ranks (distributed optimizer).
Results go to OUT/rankR.pt; adapters and states under OUT/tp2 and OUT/dp2.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from art_mega.trainer.rank.parallel import destroy_parallel
from tests.trainer.engine_scenarios import run_all, training
from tests.trainer.tp_worker import join


def main(rank: int, world: int, out: Path, ports: tuple[int, int], models: dict[str, str]) -> None:
    torch.set_num_threads(1)
    results: dict[str, object] = {}
    state = join(rank, world, tp=2, port=ports[0])
    results["tp2"] = run_all(state, models, out / "tp2")
    destroy_parallel()

    state = join(rank, world, tp=1, port=ports[1])
    results["dp2"] = {
        "state": (state.tp, state.dp, state.tp_rank, state.dp_rank),
        "training/llama": training(state, models["llama"], out / "dp2" / "llama", dp_split=True),
    }
    destroy_parallel()
    torch.save(results, out / f"rank{rank}.pt")


if __name__ == "__main__":
    rank_arg, world_arg, out_arg, port_a, port_b, *pairs = sys.argv[1:]
    main(
        int(rank_arg),
        int(world_arg),
        Path(out_arg),
        (int(port_a), int(port_b)),
        dict(pair.split("=", 1) for pair in pairs),
    )

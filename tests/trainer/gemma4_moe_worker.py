"""One gloo rank of the Gemma 4 MoE checks (run as `python -m tests.trainer.gemma4_moe_worker`).

One 2-rank world for both layouts: TP=2 (sequence parallel, the experts replicated over TP) on
port A, then EP=2 (2 experts per rank, the rows split over DP=2) on port B. Each: the full logits
and `engine_scenarios.training` (3 GRPO steps, save/resume, adapter export and import round trip).
Results go to OUT/rankR.pt: "state/<layout>", "logits/<layout>", "training/<layout>".
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from art_mega.trainer.model_builder import build_megatron_model
from art_mega.trainer.rank.parallel import destroy_parallel
from tests.trainer import moe_worker, tp_worker
from tests.trainer.common import input_ids, megatron_logits
from tests.trainer.engine_scenarios import training


def main(rank: int, world: int, out: Path, ports: tuple[int, int], model: str) -> None:
    torch.set_num_threads(1)
    results: dict[str, object] = {}
    for layout, port in zip(("tp2", "ep2"), ports, strict=True):
        if layout == "tp2":
            state = tp_worker.join(rank, world, tp=2, port=port)
        else:
            state = moe_worker.join(rank, world, port, ep=2)
        results[f"state/{layout}"] = {
            key: getattr(state, key) for key in ("tp", "ep", "dp", "tp_rank", "ep_rank")
        }
        built = build_megatron_model(model)
        results[f"logits/{layout}"] = megatron_logits(built, input_ids(built.vocab_size))
        del built
        results[f"training/{layout}"] = training(state, model, out / layout, dp_split=layout == "ep2")
        destroy_parallel()
    torch.save(results, out / f"rank{rank}.pt")


if __name__ == "__main__":
    rank_arg, world_arg, out_arg, port_a, port_b, pair = sys.argv[1:]
    main(int(rank_arg), int(world_arg), Path(out_arg), (int(port_a), int(port_b)), pair.split("=", 1)[1])

"""One gloo rank of the expert-tensor-parallel test (`python -m tests.trainer.etp_worker`).

The layout comes as the pair `layout=NAME` (`LAYOUTS`). On 2 or 4 ranks, the tiny Qwen3-MoE:
`pp_worker.pipeline_steps` (3 GRPO steps, each step's LoRA gradients, the PEFT export), then the
export imported into a fresh engine and exported again. Results go to OUT/rankR.pt.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

LAYOUTS = {
    "tp2etp2": {"tp": 2, "etp": 2},
    "tp2": {"tp": 2},
    "dp2etp2": {"etp": 2},
    "tp2ep2etp2": {"tp": 2, "ep": 2, "etp": 2},
}
"""Layout name -> trainer sizes: dense TP=2 with every expert's FFN split over the same 2 ranks;
its ETP=1 twin (experts whole on both ranks, expert DP=2); dense DP=2 (TP=1, the distributed
optimizer) with each expert split over the 2 ranks, which see different rows; and on 4 ranks
TP=2 x DP=2 dense, experts ETP=2 x EP=2 (2 experts per EP rank, each split in two)."""
WORLDS = {"tp2ep2etp2": 4}
"""The layouts on more than 2 ranks -> their world size."""


def main(rank: int, world: int, out: Path, port: int, models: dict[str, str]) -> None:
    import torch

    from art_mega.trainer.rank.engine import TrainerEngine
    from art_mega.trainer.rank.parallel import destroy_parallel
    from tests.trainer.common import input_ids, megatron_logits
    from tests.trainer.engine_scenarios import LORA
    from tests.trainer.pp_worker import PP_OPTIMIZER, join, pipeline_steps

    torch.set_num_threads(1)
    state = join(rank, world, port, **LAYOUTS[models["layout"]])
    results: dict[str, Any] = {
        "state": {
            key: getattr(state, key) for key in ("tp", "etp", "ep", "dp", "tp_rank", "etp_rank", "ep_rank")
        }
    }
    results["training"] = pipeline_steps(state, models["moe"], out / "run")
    fresh = TrainerEngine(models["moe"], state, lora=LORA, optimizer=PP_OPTIMIZER)
    fresh.load_adapter(results["training"]["adapter"])
    fresh.export_adapter(out / "roundtrip")
    results["roundtrip"] = str(out / "roundtrip")
    results["imported_logits"] = megatron_logits(fresh.model, input_ids(fresh.vocab_size))
    destroy_parallel()
    torch.save(results, out / f"rank{rank}.pt")


if __name__ == "__main__":
    import sys

    rank_arg, world_arg, out_arg, port_a, _port_b, *items = sys.argv[1:]
    main(int(rank_arg), int(world_arg), Path(out_arg), int(port_a), dict(p.split("=", 1) for p in items))

"""One gloo rank of the DeepSeek-V3 family's 2-rank checks (`python -m tests.trainer.deepseek_v3_worker`).

Layout per the model name given: "tp2" (TP=2, the MLA heads and latent projections split, sequence
parallel for the MoE) or "ep2" (EP=2 over DP=2, each rank 4 of the 8 routed experts, rows split
over DP). Each: the full logits and `engine_scenarios.training` (3 GRPO steps, resume, export and
import round trip) with `MLA_LORA`. Results go to OUT/rankR.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path

from art_mega.trainer.protocol import LoraConfig
from tests.trainer.engine_scenarios import LORA

MLA_LORA = LoraConfig(
    rank=LORA.rank,
    alpha=LORA.alpha,
    seed=LORA.seed,
    targets=("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj", "gate_proj", "up_proj", "down_proj"),
)
"""The tests' LoRA on every target ART adapts on an MLA model (kv_b_proj excepted, as ART and vLLM)."""

ATTENTION_LORA = MLA_LORA.model_copy(
    update={"targets": ("linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_proj")}
)
"""The MLA projections only (an adapter PEFT 0.21 loads whole)."""


def main(rank: int, world: int, out: Path, port: int, models: dict[str, str]) -> None:
    import torch

    from art_mega.trainer.model_builder import build_megatron_model
    from art_mega.trainer.rank.parallel import destroy_parallel
    from tests.trainer.common import input_ids, megatron_logits
    from tests.trainer.engine_scenarios import training
    from tests.trainer.moe_worker import join

    torch.set_num_threads(1)
    ((layout, path),) = models.items()
    sizes = {"tp2": {"tp": 2}, "ep2": {"ep": 2}}[layout]
    state = join(rank, world, port, **sizes)
    built = build_megatron_model(path)
    results: dict[str, object] = {"logits": megatron_logits(built, input_ids(built.vocab_size))}
    del built
    results["training"] = training(state, path, out / layout, dp_split=layout == "ep2", lora=MLA_LORA)
    destroy_parallel()
    torch.save(results, out / f"rank{rank}.pt")


if __name__ == "__main__":
    rank_arg, world_arg, out_arg, port_a, _port_b, *pairs = sys.argv[1:]
    main(int(rank_arg), int(world_arg), Path(out_arg), int(port_a), dict(p.split("=", 1) for p in pairs))

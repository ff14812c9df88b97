"""Tiny Qwen3-MoE test model, and one gloo rank of the MoE tests (`python -m tests.trainer.moe_worker`)."""

from __future__ import annotations

from pathlib import Path

from art_mega.basemodels.tiny_moe import MOE_SIZES, build_tiny_moe

__all__ = ["MOE_SIZES", "build_tiny_moe", "join"]


def join(rank: int, world: int, port: int, *, tp: int = 1, ep: int = 1, etp: int = 1):
    """Join a `world`-rank gloo trainer world with these parallel sizes (rank table from topology)."""
    from art_mega.topology.compiled import TrainerRank
    from art_mega.topology.groups import rank_coordinates
    from art_mega.topology.trainer import TrainerSpec
    from art_mega.trainer.rank.parallel import init_parallel

    coordinates = rank_coordinates(rank, world, tp=tp, ep=ep, etp=etp)
    row = TrainerRank(rank=rank, host_id="local", local_rank=rank, **coordinates)
    spec = TrainerSpec(tp=tp, ep=ep, etp=etp)
    return init_parallel(row, spec, world, master_addr="127.0.0.1", master_port=port, timeout_s=600)


def three_steps(state, model_dir: str, out: Path, *, dp_split: bool) -> dict:
    """The 3 GRPO steps of `engine_scenarios.training` (same batch, losses, LoRA and optimizer)
    and the export of the adapter, without its resume and import round trip."""
    from art_mega.trainer.rank.engine import TrainerEngine
    from tests.trainer.common import input_ids, megatron_logits
    from tests.trainer.engine_scenarios import LORA, OPTIMIZER, STEP_LOSSES, grpo_batch, rows

    engine = TrainerEngine(model_dir, state, lora=LORA, optimizer=OPTIMIZER)
    full = grpo_batch(engine)
    batch = rows(full, state.dp_rank, state.dp) if dp_split else full
    metrics = [engine.train_step(batch, "grpo", loss_config) for loss_config in STEP_LOSSES]
    engine.export_adapter(out / "adapter")
    return {
        "metrics": metrics,
        "logits": megatron_logits(engine.model, input_ids(engine.vocab_size)),
        "adapter": str(out / "adapter"),
    }


LAYOUTS = {2: {"tp": 1, "ep": 2}, 4: {"tp": 2, "ep": 2}}
"""World size -> the layout its worker runs: EP=2 (DP=2) on 2 ranks, TP=2 + EP=2 (DP=2) on 4."""


def main(rank: int, world: int, out: Path, port: int, models: dict[str, str]) -> None:
    """One rank: the MoE model's logits and 3 GRPO steps with the batch's rows split over DP:
    `engine_scenarios.training` (with resume and import) on 2 ranks, `three_steps` on 4.
    Results go to OUT/rankR.pt."""
    import torch

    from art_mega.trainer.model_builder import build_megatron_model
    from art_mega.trainer.rank.parallel import destroy_parallel
    from tests.trainer.common import input_ids, megatron_logits
    from tests.trainer.engine_scenarios import training

    torch.set_num_threads(1)
    layout = LAYOUTS[world]
    state = join(rank, world, port, **layout)
    results: dict[str, object] = {
        "state": {key: getattr(state, key) for key in ("tp", "ep", "dp", "tp_rank", "ep_rank", "dp_rank")}
    }
    built = build_megatron_model(models["moe"])
    results["logits"] = megatron_logits(built, input_ids(built.vocab_size))
    del built
    scenario = training if world == 2 else three_steps
    results["training"] = scenario(state, models["moe"], out / "moe", dp_split=True)
    destroy_parallel()
    torch.save(results, out / f"rank{rank}.pt")


if __name__ == "__main__":
    import sys

    rank_arg, world_arg, out_arg, port_a, _port_b, *pairs = sys.argv[1:]
    main(int(rank_arg), int(world_arg), Path(out_arg), int(port_a), dict(p.split("=", 1) for p in pairs))

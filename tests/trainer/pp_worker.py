"""One gloo rank of the pipeline-parallel tests (`python -m tests.trainer.pp_worker`).

The layout comes as the pair `layout=NAME` among the model pairs (`LAYOUTS`); every layout runs
`pipeline_steps` (3 GRPO steps of `engine_scenarios.STEP_LOSSES`, DP ranks on their share of
the rows, then the PEFT export), then `random_roundtrip` (a random adapter imported and exported
again). Results go to OUT/rankR.pt.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

LAYOUTS: dict[str, dict[str, Any]] = {
    "pp2": {"world": 2, "model": "llama", "sizes": {"pp": 2}},
    "pp2tp2": {"world": 4, "model": "llama", "sizes": {"pp": 2, "tp": 2}},
    "pp2dp2": {"world": 4, "model": "llama", "sizes": {"pp": 2}},
    "pp2ep2": {"world": 4, "model": "moe", "sizes": {"pp": 2, "ep": 2}},
    "tp2": {"world": 2, "model": "llama", "sizes": {"tp": 2}},
    "dp2": {"world": 2, "model": "llama", "sizes": {}},
    "ep2": {"world": 2, "model": "moe", "sizes": {"ep": 2}},
}
"""Layout name -> world size, test model and trainer sizes (dp = world / (tp * pp)). The last
three are `TWINS`' PP=1 worlds."""
TWINS = {"pp2tp2": "tp2", "pp2dp2": "dp2", "pp2ep2": "ep2"}
"""Each combined pipeline layout -> its PP=1 twin: the same TP, DP and EP without the pipeline.
Twin rank r % (twin world) has the coordinates of pipeline rank r but its stage
(megatron-core's tp-cp-ep-dp-pp order puts pp last)."""


def _optimizer():
    from art_mega.trainer.protocol import OptimizerConfig

    return OptimizerConfig(lr=2e-2, clip_grad=0.0, weight_decay=0.01)


PP_OPTIMIZER = _optimizer()
"""`engine_scenarios.OPTIMIZER` without gradient clipping (see `pipeline_steps`)."""


def join(rank: int, world: int, port: int, **sizes: int):
    """Join a `world`-rank gloo trainer world with these sizes (rank table from topology)."""
    from art_mega.topology.compiled import TrainerRank
    from art_mega.topology.groups import rank_coordinates
    from art_mega.topology.trainer import TrainerSpec
    from art_mega.trainer.rank.parallel import init_parallel

    row = TrainerRank(rank=rank, host_id="local", local_rank=rank, **rank_coordinates(rank, world, **sizes))
    return init_parallel(
        row, TrainerSpec(**sizes), world, master_addr="127.0.0.1", master_port=port, timeout_s=600
    )


def pipeline_steps(state, model_dir: str, out: Path, engine=None) -> dict[str, Any]:
    """3 GRPO steps (`STEP_LOSSES`: token level, GSPO with KL to the base model, TIS) on
    `grpo_batch` split over DP, this rank's LoRA gradients after each step (by global name;
    the DDP buffer's, after the DP reduction), its LoRA weights after each step, and the PEFT
    export.

    Without gradient clipping (`PP_OPTIMIZER`): the clip coefficient comes from the global norm,
    a sum whose order depends on the layout, and would make the weights differ in their last
    bits; without it, pipeline stages compute exactly what one process does. `engine`: a fresh
    `TrainerEngine` of `model_dir` (`LORA`, `PP_OPTIMIZER`) to train instead of a new one."""
    from art_mega.trainer.rank.engine import TrainerEngine
    from art_mega.trainer.rank.lora import lora_parameters
    from tests.trainer.engine_scenarios import LORA, STEP_LOSSES, grpo_batch, rows

    engine = engine or TrainerEngine(model_dir, state, lora=LORA, optimizer=PP_OPTIMIZER)
    full = grpo_batch(engine)
    batch = rows(full, state.dp_rank, state.dp)
    metrics, grads, weights = [], [], []
    for loss_config in STEP_LOSSES:
        metrics.append(engine.train_step(batch, "grpo", loss_config))
        params = lora_parameters(engine.ddp.module)
        grads.append({name: p.main_grad.detach().clone() for name, p in params.items()})
        weights.append({name: p.detach().clone() for name, p in params.items()})
    engine.export_adapter(out / "adapter")
    return {
        "old_logprobs": full.old_logprobs,
        "metrics": metrics,
        "grads": grads,
        "weights": weights,
        "adapter": str(out / "adapter"),
    }


def random_roundtrip(engine, adapter: Path, out: Path) -> dict[str, str]:
    """Global rank 0 writes `adapter` (a PEFT directory) with N(0, 1) values (seed 0; the same
    keys, order, dtype and metadata as the export writes; tensors equal in `adapter`, such as the
    lora_A of q/k/v that art-mega fuses, equal again) to OUT/random; every rank imports it into
    `engine` and exports it to OUT/random-roundtrip. Collective."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    weights, config = "adapter_model.safetensors", "adapter_config.json"
    if torch.distributed.get_rank() == 0:
        generator = torch.Generator().manual_seed(0)
        drawn: dict[tuple, torch.Tensor] = {}
        random = {}
        for key, value in sorted(load_file(adapter / weights).items()):
            same = (value.dtype, tuple(value.shape), value.numpy().tobytes())
            if same not in drawn:
                drawn[same] = torch.randn(value.shape, generator=generator).to(value.dtype)
            random[key] = drawn[same].clone()  # safetensors stores no shared memory
        (out / "random").mkdir(parents=True)
        save_file(random, out / "random" / weights, metadata={"format": "pt"})
        shutil.copy(adapter / config, out / "random" / config)
    torch.distributed.barrier()
    engine.load_adapter(out / "random")
    engine.export_adapter(out / "random-roundtrip")
    return {"random": str(out / "random"), "random_roundtrip": str(out / "random-roundtrip")}


def main(rank: int, world: int, out: Path, port: int, pairs: dict[str, str]) -> None:
    import torch

    from art_mega.trainer.rank.engine import TrainerEngine
    from art_mega.trainer.rank.parallel import destroy_parallel
    from tests.trainer.engine_scenarios import LORA

    torch.set_num_threads(1)
    layout = LAYOUTS[pairs["layout"]]
    assert layout["world"] == world
    state = join(rank, world, port, **layout["sizes"])
    results: dict[str, Any] = {
        "state": {
            key: getattr(state, key) for key in ("tp", "pp", "dp", "ep", "tp_rank", "pp_rank", "dp_rank")
        }
    }
    engine = TrainerEngine(pairs[layout["model"]], state, lora=LORA, optimizer=PP_OPTIMIZER)
    results["training"] = pipeline_steps(state, pairs[layout["model"]], out / "run", engine)
    results["roundtrip"] = random_roundtrip(engine, Path(results["training"]["adapter"]), out)
    destroy_parallel()
    torch.save(results, out / f"rank{rank}.pt")


if __name__ == "__main__":
    import sys

    rank_arg, world_arg, out_arg, port_a, _port_b, *items = sys.argv[1:]
    main(int(rank_arg), int(world_arg), Path(out_arg), int(port_a), dict(p.split("=", 1) for p in items))

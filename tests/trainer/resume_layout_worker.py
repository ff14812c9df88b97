"""One gloo rank of the layout-portable checkpoint test (`python -m tests.trainer.resume_layout_worker`).

Two processes, three worlds in turn: TP=2 trains 2 GRPO steps, writes a checkpoint (adapter and
rank files, as `jobs.write_checkpoint` stages them) and goes on unbroken for steps 3 and 4; then
TP=1 x DP=2 and PP=2 each resume that checkpoint and train steps 3 and 4 on the same batch
(DP ranks on their share of the rows). Each world's metrics and its adapter after step 4 go to
OUT/rankR.pt.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

STEPS_AFTER = 2
"""Steps trained after the checkpoint, unbroken and resumed."""


def _join(rank: int, world: int, port: int, **sizes: int):
    from tests.trainer.pp_worker import join

    return join(rank, world, port, **sizes)


def _next_port(state) -> int:
    """A free port chosen by rank 0, told to every rank (collective over the world)."""
    import torch.distributed as dist

    from art_mega.agent.ports import free_port

    box: list[Any] = [free_port() if state.rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return int(box[0])


def main(rank: int, world: int, out: Path, ports: tuple[int, int], model_dir: str) -> None:
    import torch

    from art_mega.trainer import checkpoint
    from art_mega.trainer.rank.engine import TrainerEngine, _sub_optimizers
    from art_mega.trainer.rank.parallel import destroy_parallel
    from tests.trainer.engine_scenarios import LORA, OPTIMIZER, grpo_batch, rows
    from tests.trainer.engine_scenarios import STEP_LOSSES as LOSSES

    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    saved = out / "checkpoint"

    state = _join(rank, world, ports[0], tp=2)
    engine = TrainerEngine(model_dir, state, lora=LORA, optimizer=OPTIMIZER)
    batch = grpo_batch(engine)
    for step in range(2):
        engine.train_step(batch, "grpo", LOSSES[step])
    engine.export_adapter(checkpoint.adapter_dir(saved))
    engine.save_state(saved)
    torch.distributed.barrier()
    metrics = [engine.train_step(batch, "grpo", LOSSES[(2 + k) % len(LOSSES)]) for k in range(STEPS_AFTER)]
    engine.export_adapter(out / "tp2-adapter")
    results["tp2"] = {"metrics": metrics, "adapter": str(out / "tp2-adapter")}
    del engine
    destroy_parallel()

    port = ports[1]
    for name, sizes in (("tp1dp2", {}), ("pp2", {"pp": 2})):
        state = _join(rank, world, port, **sizes)
        engine = TrainerEngine(model_dir, state, lora=LORA, optimizer=OPTIMIZER)
        engine.load_state(saved)
        adam_steps = sorted(
            {
                float(st["step"])
                for sub in _sub_optimizers(engine.optimizer)
                for st in sub.optimizer.state.values()
            }
        )
        share = rows(batch, state.dp_rank, state.dp)
        metrics = [
            engine.train_step(share, "grpo", LOSSES[(2 + k) % len(LOSSES)]) for k in range(STEPS_AFTER)
        ]
        engine.export_adapter(out / f"{name}-adapter")
        results[name] = {
            "metrics": metrics,
            "adapter": str(out / f"{name}-adapter"),
            "steps": engine.steps,
            "adam_steps": adam_steps,
        }
        port = _next_port(state)
        del engine
        destroy_parallel()
    torch.save(results, out / f"rank{rank}.pt")


if __name__ == "__main__":
    import sys

    rank_arg, world_arg, out_arg, port_a, port_b, *pairs = sys.argv[1:]
    models = dict(p.split("=", 1) for p in pairs)
    main(int(rank_arg), int(world_arg), Path(out_arg), (int(port_a), int(port_b)), models["llama"])

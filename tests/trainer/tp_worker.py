"""One gloo rank of the tensor/data-parallel equivalence test (run as `python -m tests.trainer.tp_worker`).

Phase 1: TP=2 over 2 ranks: full logits of every equivalence model, and the divisibility error
of a 3-head model. Phase 2: TP=1, DP=2: each rank's logits of the llama model. Results go to
OUT/rankR.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from art_mega.errors import UserError
from art_mega.topology.compiled import TrainerRank
from art_mega.topology.groups import rank_coordinates
from art_mega.topology.trainer import TrainerSpec
from art_mega.trainer.model_builder import build_megatron_model
from art_mega.trainer.rank.parallel import destroy_parallel, init_parallel
from tests.trainer.common import EQUIVALENCE_MODELS, input_ids, megatron_logits


def join(rank: int, world: int, tp: int, port: int):
    row = TrainerRank(rank=rank, host_id="local", local_rank=rank, **rank_coordinates(rank, world, tp=tp))
    return init_parallel(
        row, TrainerSpec(tp=tp), world, master_addr="127.0.0.1", master_port=port, timeout_s=120
    )


def main(rank: int, world: int, out: Path, ports: tuple[int, int], models: dict[str, str]) -> None:
    results: dict[str, object] = {}
    state = join(rank, world, tp=2, port=ports[0])
    results["tp2_state"] = (state.tp, state.dp, state.tp_rank, state.dp_rank)
    for name in EQUIVALENCE_MODELS:
        built = build_megatron_model(models[name])
        results[f"tp2/{name}"] = megatron_logits(built, input_ids(built.vocab_size))
    try:
        build_megatron_model(models["llama_3heads"])
    except UserError as exc:
        results["tp2_error"] = str(exc)
    destroy_parallel()

    state = join(rank, world, tp=1, port=ports[1])
    results["dp2_state"] = (state.tp, state.dp, state.tp_rank, state.dp_rank)
    built = build_megatron_model(models["llama"])
    results["dp2/llama"] = megatron_logits(built, input_ids(built.vocab_size))
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

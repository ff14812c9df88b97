"""Tiny Qwen3-MoE test model, and one gloo rank of the MoE tests (`python -m tests.trainer.moe_worker`)."""

from __future__ import annotations

import json
from pathlib import Path

MOE_SIZES = {
    "vocab_size": 768,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_experts": 4,
    "num_experts_per_tok": 2,
}
"""2 layers of 4 experts (top-2, expert FFN 32), hidden 64, 4 heads / 2 KV heads of 32."""


def build_tiny_moe(out_dir: Path, *, fused: bool = False, norm_topk_prob: bool = True, seed: int = 0) -> Path:
    """A tiny Qwen3-MoE HF directory (config.json, model.safetensors; no tokenizer) in `out_dir`.

    Weights are `art_mega.models.tiny`'s seeded fill. `fused` writes the expert weights as the
    3-D `mlp.experts.gate_up_proj` / `down_proj` tensors of transformers 5's module instead of
    the per-expert names `save_pretrained` writes. Idempotent per directory.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from art_mega.models.tiny import _fill_weights

    if (out_dir / "model.safetensors").exists():
        return out_dir
    config = Qwen3MoeConfig(
        **MOE_SIZES,
        norm_topk_prob=norm_topk_prob,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=2048,
        architectures=["Qwen3MoeForCausalLM"],
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _fill_weights(model, seed, config.hidden_size)
    model.save_pretrained(out_dir, safe_serialization=True)
    if fused:
        state = {name: p.detach().contiguous() for name, p in model.state_dict().items()}
        save_file(state, out_dir / "model.safetensors", metadata={"format": "pt"})
    (out_dir / "art_mega_tiny_moe.json").write_text(json.dumps({"fused": fused, "seed": seed}))
    return out_dir


def join(rank: int, world: int, port: int, *, tp: int = 1, ep: int = 1, etp: int = 1):
    """Join a `world`-rank gloo trainer world with these parallel sizes (rank table from topology)."""
    from art_mega.topology.compiled import TrainerRank
    from art_mega.topology.groups import rank_coordinates
    from art_mega.topology.trainer import TrainerSpec
    from art_mega.trainer.parallel import init_parallel

    coordinates = rank_coordinates(rank, world, tp=tp, ep=ep, etp=etp)
    row = TrainerRank(rank=rank, host_id="local", local_rank=rank, **coordinates)
    spec = TrainerSpec(tp=tp, ep=ep, etp=etp)
    return init_parallel(row, spec, world, master_addr="127.0.0.1", master_port=port, timeout_s=600)


def three_steps(state, model_dir: str, out: Path, *, dp_split: bool) -> dict:
    """The 3 GRPO steps of `engine_scenarios.training` (same batch, losses, LoRA and optimizer)
    and the export of the adapter, without its resume and import round trip."""
    from art_mega.trainer.engine import TrainerEngine
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
    from art_mega.trainer.parallel import destroy_parallel
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

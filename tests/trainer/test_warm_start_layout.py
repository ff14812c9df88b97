"""What the trainer exports is what `register` accepts as a warm start: `peft_io.adapter_layout`
(the torch-free shape rule `checkpoint.check_warm_start` applies) is the layout `export_adapter`
writes, for a dense and an MoE family, and the checked adapter loads back into the ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

from art_mega.trainer import checkpoint


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_an_exported_adapter_passes_the_warm_start_check(
    megatron_world, tiny_llama_dir: Path, tmp_path: Path, family: str
) -> None:
    from art_mega.trainer.rank.engine import TrainerEngine
    from tests.trainer.engine_scenarios import LORA, OPTIMIZER
    from tests.trainer.moe_worker import build_tiny_moe

    model_dir = tiny_llama_dir if family == "llama" else build_tiny_moe(tmp_path / "moe")
    engine = TrainerEngine(model_dir, megatron_world, lora=LORA, optimizer=OPTIMIZER)
    engine.export_adapter(tmp_path / "adapter")
    checkpoint.check_warm_start(tmp_path / "adapter", model_dir, str(tmp_path / "adapter"))
    engine.load_adapter(tmp_path / "adapter")

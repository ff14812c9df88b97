"""The Mistral family (HF MistralForCausalLM, `families/mistral.py`) on a tiny checkpoint: Megatron's
logits equal transformers' at TP=1 and TP=2, and the LoRA adapter trained for 3 GRPO steps exports
to a PEFT adapter that transformers + PEFT load with the Megatron logits (TP=1 and TP=2 exports),
imports back bit-exactly, and names every Llama-style module."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from art_mega.basemodels.tiny import build_tiny_model
from tests.trainer.common import RankProcesses, input_ids, megatron_logits, require_trainer_deps

require_trainer_deps()
pytest.importorskip("peft", reason="peft is not installed (the test extra)")

HF_TOLERANCE = 1e-4
TP_TOLERANCE = 1e-5
ADAM_DRIFT_TOLERANCE = 1e-3
"""As tests/trainer: HF vs Megatron logits, TP=2 vs TP=1 logits, TP=2 vs TP=1 trained adapters."""
WORLDS = ("tp1", "tp2")


@pytest.fixture(scope="session")
def mistral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Mistral (2 layers, hidden 64, 4 heads and 2 KV heads of head_dim 32, untied)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-mistral") / "mistral", "mistral")


@pytest.fixture(scope="session")
def mistral_world(mistral_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The 2-rank `tests.trainer.family_worker` world on the tiny Mistral, started (not awaited)."""
    world = RankProcesses(
        "tests.trainer.family_worker", tmp_path_factory.mktemp("mistral-tp2"), {"mistral": mistral_dir}
    )
    yield world
    world.kill()


@pytest.fixture(scope="session")
def mistral_tp1(mistral_world, megatron_world, mistral_dir: Path, tmp_path_factory) -> dict:
    """TP=1 in this process (while the TP=2 world works): the built model's logits and the training run."""
    import torch

    from art_mega.trainer.model_builder import build_megatron_model
    from tests.trainer.engine_scenarios import training

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        built = build_megatron_model(mistral_dir)
        logits = megatron_logits(built, input_ids(built.vocab_size))
        run = training(
            megatron_world, str(mistral_dir), tmp_path_factory.mktemp("mistral-tp1"), dp_split=False
        )
    finally:
        torch.set_num_threads(threads)
    return {"family": built.family.name, "logits": logits, "training": run}


@pytest.fixture(scope="session")
def mistral_tp2(mistral_world) -> list[dict]:
    return mistral_world.results()


def _runs(mistral_tp1: dict, mistral_tp2: list[dict]) -> dict[str, dict]:
    return {"tp1": mistral_tp1["training"], "tp2": mistral_tp2[0]["training/mistral"]}


@pytest.fixture(scope="session")
def hf_model(mistral_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(mistral_dir, dtype=torch.float32)
    assert type(model).__name__ == "MistralForCausalLM"
    return model


def test_megatron_matches_transformers(mistral_tp1: dict, hf_model) -> None:
    import torch

    assert mistral_tp1["family"] == "mistral"
    with torch.no_grad():
        expected = hf_model(input_ids(hf_model.config.vocab_size)).logits
    diff = (mistral_tp1["logits"] - expected).abs().max().item()
    print(f"mistral: max |megatron - hf| = {diff:.2e} (logit std {expected.std().item():.2f})")
    assert mistral_tp1["logits"].shape == expected.shape == (2, 24, 768)
    assert diff <= HF_TOLERANCE


def test_tp2_matches_tp1(mistral_tp1: dict, mistral_tp2: list[dict]) -> None:
    for rank, results in enumerate(mistral_tp2):
        assert results["state"] == (2, 1, rank, 0)
        diff = (results["logits/mistral"] - mistral_tp1["logits"]).abs().max().item()
        print(f"mistral rank {rank}: max |tp2 - tp1| = {diff:.2e}")
        assert diff <= TP_TOLERANCE


@pytest.mark.parametrize("world", WORLDS)
def test_peft_logits_match_megatron(world: str, mistral_tp1, mistral_tp2, mistral_dir: Path) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run = _runs(mistral_tp1, mistral_tp2)[world]
    base = AutoModelForCausalLM.from_pretrained(mistral_dir, dtype=torch.float32)
    ids = input_ids(base.config.vocab_size)
    with torch.no_grad():
        base_logits = base(ids).logits
        peft_logits = PeftModel.from_pretrained(base, run["adapter"])(ids).logits
    diff = (peft_logits - run["logits"]).abs().max().item()
    effect = (peft_logits - base_logits).abs().max().item()
    print(
        f"{world} mistral: max |peft - megatron| = {diff:.2e}; the adapter moves logits by up to {effect:.2f}"
    )
    assert diff <= HF_TOLERANCE
    assert effect > 0.05


@pytest.mark.parametrize("world", WORLDS)
def test_import_then_export_is_bit_exact(world: str, mistral_tp1, mistral_tp2) -> None:
    import torch

    run = _runs(mistral_tp1, mistral_tp2)[world]
    for file in ("adapter_model.safetensors", "adapter_config.json"):
        assert (Path(run["adapter"]) / file).read_bytes() == (Path(run["roundtrip"]) / file).read_bytes()
    assert torch.equal(run["imported_logits"], run["logits"])


def test_tp2_export_equals_tp1_export_and_names_every_module(mistral_tp1, mistral_tp2) -> None:
    from safetensors.torch import load_file

    runs = _runs(mistral_tp1, mistral_tp2)
    tp1, tp2 = (load_file(Path(runs[w]["adapter"]) / "adapter_model.safetensors") for w in WORLDS)
    assert tp1.keys() == tp2.keys()
    diff = max((tp1[key] - tp2[key]).abs().max().item() for key in tp1)
    print(f"mistral: max |tp2 adapter - tp1 adapter| = {diff:.1e}")
    assert diff <= ADAM_DRIFT_TOLERANCE
    modules = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
    modules += ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    assert set(tp1) == {
        f"base_model.model.model.layers.{i}.{module}.lora_{m}.weight"
        for i in range(2)
        for module in modules
        for m in "AB"
    }
    config = json.loads((Path(runs["tp1"]["adapter"]) / "adapter_config.json").read_text())
    assert config["target_modules"] == [
        "down_proj",
        "gate_proj",
        "k_proj",
        "o_proj",
        "q_proj",
        "up_proj",
        "v_proj",
    ]

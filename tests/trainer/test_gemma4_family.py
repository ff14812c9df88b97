"""The Gemma 4 text family (HF Gemma4ForCausalLM, `families/gemma4.py`) on a tiny checkpoint with its
distinctive features (`basemodels.tiny.GEMMA4_TINY`: a local layer with head 32, 2 KV heads and a
6-token window; a global layer with head 64 and one KV head whose values are its keys,
proportional RoPE on a quarter of the head; value norms, plain x * w norms around both sublayers,
attention scale 1, layer scalars 0.9 / 1.1, a final logit cap of 3, tied scaled embeddings), through
the family harness of `test_gemma3_family` (`family_worker` for TP=2, `engine_scenarios.training`
for 3 GRPO steps, export, import): Megatron's logits equal transformers' at TP=1 and TP=2 (TP=2
all-gathers the global layer's single KV head), the trained adapter loads in PEFT with the Megatron
logits (its global layer's v_proj adapter a copy of k_proj's,
for vLLM), and import -> export is bit-exact."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from art_mega.basemodels.tiny import build_tiny_model
from tests.trainer.common import RankProcesses, input_ids, megatron_logits, require_trainer_deps

require_trainer_deps()
pytest.importorskip("peft", reason="peft is not installed (the test extra)")

HF_TOLERANCE = 1e-4
TP_TOLERANCE = 1e-5
"""As tests/trainer: HF vs Megatron logits, TP=2 vs TP=1 logits."""
WORLDS = ("tp1", "tp2")


@pytest.fixture(scope="session")
def gemma4_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-gemma4") / "gemma4", "gemma4_text")


@pytest.fixture(scope="session")
def gemma4_world(gemma4_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    world = RankProcesses(
        "tests.trainer.family_worker", tmp_path_factory.mktemp("gemma4-tp2"), {"gemma4": gemma4_dir}
    )
    yield world
    world.kill()


@pytest.fixture(scope="session")
def gemma4_tp1(gemma4_world, megatron_world, gemma4_dir: Path, tmp_path_factory) -> dict:
    import torch

    from art_mega.trainer.model_builder import build_megatron_model
    from tests.trainer.engine_scenarios import training

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        built = build_megatron_model(gemma4_dir)
        logits = megatron_logits(built, input_ids(built.vocab_size))
        run = training(megatron_world, str(gemma4_dir), tmp_path_factory.mktemp("gemma4-tp1"), dp_split=False)
    finally:
        torch.set_num_threads(threads)
    return {"family": built.family.name, "args": built.args, "logits": logits, "training": run}


@pytest.fixture(scope="session")
def gemma4_tp2(gemma4_world) -> list[dict]:
    return gemma4_world.results(timeout=480)


def _runs(gemma4_tp1: dict, gemma4_tp2: list[dict]) -> dict[str, dict]:
    return {"tp1": gemma4_tp1["training"], "tp2": gemma4_tp2[0]["training/gemma4"]}


def test_megatron_matches_transformers(gemma4_tp1: dict, gemma4_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    args = gemma4_tp1["args"]
    assert gemma4_tp1["family"] == "gemma4"
    assert (args.window_layers, args.head_dim, args.global_head_dim) == ((True, False), 32, 64)
    assert (args.num_query_groups, args.global_query_groups, args.k_eq_v) == (2, 1, True)
    assert (args.global_rope_partial, args.final_logit_softcapping) == (0.25, 3.0)
    hf = AutoModelForCausalLM.from_pretrained(gemma4_dir, dtype=torch.float32)
    assert type(hf).__name__ == "Gemma4ForCausalLM" and hf.model.layers[1].self_attn.v_proj is None
    with torch.no_grad():
        expected = hf(input_ids(hf.config.vocab_size)).logits
        hf.model.layers[0].layer_scalar.fill_(1.0)  # the last layer's is cancelled by the final norm
        unscaled = hf(input_ids(hf.config.vocab_size)).logits
    diff = (gemma4_tp1["logits"] - expected).abs().max().item()
    print(f"gemma4: max |megatron - hf| = {diff:.2e} (logit std {expected.std().item():.2f})")
    assert gemma4_tp1["logits"].shape == expected.shape == (2, 24, 768)
    assert diff <= HF_TOLERANCE
    assert expected.abs().max().item() < 3.0, "the cap bounds the logits"
    assert (unscaled - expected).abs().max().item() > 0.05, "the layer scalar shows in the logits"


def test_tp2_matches_tp1(gemma4_tp1: dict, gemma4_tp2: list[dict]) -> None:
    for rank, results in enumerate(gemma4_tp2):
        assert results["state"] == (2, 1, rank, 0)
        diff = (results["logits/gemma4"] - gemma4_tp1["logits"]).abs().max().item()
        print(f"gemma4 rank {rank}: max |tp2 - tp1| = {diff:.2e}")
        assert diff <= TP_TOLERANCE


def test_grpo_steps_train(gemma4_tp1: dict) -> None:
    run = gemma4_tp1["training"]
    norms = [m["loss/grad_norm"] for m in run["metrics"]]
    print(f"gemma4 GRPO grad norms {norms}, policy losses {[m['loss/policy'] for m in run['metrics']]}")
    assert all(math.isfinite(norm) and norm > 0 for norm in norms)
    assert run["resumed_metrics"]["loss/policy"] == pytest.approx(run["metrics"][2]["loss/policy"], abs=1e-6)
    assert (run["logits"] - gemma4_tp1["logits"]).abs().max().item() > 0.05, "the adapter moved the logits"


@pytest.mark.parametrize("world", WORLDS)
def test_peft_logits_match_megatron(world: str, gemma4_tp1, gemma4_tp2, gemma4_dir: Path) -> None:
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run = _runs(gemma4_tp1, gemma4_tp2)[world]
    prefix = "base_model.model.model.layers"
    tensors = load_file(Path(run["adapter"]) / "adapter_model.safetensors")
    assert f"{prefix}.0.self_attn.v_proj.lora_B.weight" in tensors
    for m in "AB":  # k_eq_v: the v_proj adapter vLLM reads is k_proj's (PEFT has no v_proj there)
        key = f"{prefix}.1.self_attn.{{}}_proj.lora_{m}.weight".format
        assert torch.equal(tensors[key("v")], tensors[key("k")])
    assert tensors[f"{prefix}.1.self_attn.k_proj.lora_B.weight"].shape == (64, 4)
    base = AutoModelForCausalLM.from_pretrained(gemma4_dir, dtype=torch.float32)
    ids = input_ids(base.config.vocab_size)
    with torch.no_grad():
        base_logits = base(ids).logits
        peft_logits = PeftModel.from_pretrained(base, run["adapter"])(ids).logits
    diff = (peft_logits - run["logits"]).abs().max().item()
    effect = (peft_logits - base_logits).abs().max().item()
    print(
        f"{world} gemma4: max |peft - megatron| = {diff:.2e}; the adapter moves logits by up to {effect:.2f}"
    )
    assert diff <= HF_TOLERANCE
    assert effect > 0.05


@pytest.mark.parametrize("world", WORLDS)
def test_import_then_export_is_bit_exact(world: str, gemma4_tp1, gemma4_tp2) -> None:
    import torch

    run = _runs(gemma4_tp1, gemma4_tp2)[world]
    for file in ("adapter_model.safetensors", "adapter_config.json"):
        assert (Path(run["adapter"]) / file).read_bytes() == (Path(run["roundtrip"]) / file).read_bytes()
    assert torch.equal(run["imported_logits"], run["logits"])

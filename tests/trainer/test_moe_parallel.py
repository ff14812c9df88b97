"""Qwen3-MoE on Megatron: logits equal Hugging Face's, EP=2 and TP=2+EP=2 (with DP=2) agree with
one process over 3 GRPO steps with LoRA on attention and every expert, and the exported adapter
gives the Megatron logits in Hugging Face + PEFT."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.trainer.common import RankProcesses, input_ids, megatron_logits, require_trainer_deps
from tests.trainer.engine_scenarios import COMPARED_METRICS, LORA, assert_steps_match
from tests.trainer.moe_worker import MOE_SIZES, build_tiny_moe
from tests.trainer.test_lora_engine import LAYOUT_TOLERANCE

require_trainer_deps()
pytest.importorskip("peft", reason="peft is not installed (the test extra)")

HF_TOLERANCE = 1e-4
LOGITS_TOLERANCE = 1e-5
WORLDS = {"ep2": 2, "tp2ep2": 4}
"""Layout name -> world size (`moe_worker.LAYOUTS`)."""
COORDINATES = {
    "ep2": [(1, 2, 2, 0, 0, 0), (1, 2, 2, 0, 1, 1)],
    "tp2ep2": [(2, 2, 2, 0, 0, 0), (2, 2, 2, 1, 1, 0), (2, 2, 2, 0, 0, 1), (2, 2, 2, 1, 1, 1)],
}
"""Each rank's (tp, ep, dp, tp_rank, ep_rank, dp_rank): megatron-core's tp-cp-ep-dp-pp order."""
MODELS = ("moe", "moe_fused", "moe_no_renorm")


@pytest.fixture(scope="session")
def moe_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny Qwen3-MoE directories: per-expert weights (as save_pretrained writes), the same
    weights as fused 3-D expert tensors, and a router without top-k renormalisation."""
    root = tmp_path_factory.mktemp("tiny-moe")
    return {
        "moe": build_tiny_moe(root / "moe"),
        "moe_fused": build_tiny_moe(root / "moe_fused", fused=True),
        "moe_no_renorm": build_tiny_moe(root / "moe_no_renorm", norm_topk_prob=False),
    }


@pytest.fixture(scope="session")
def moe_worlds(moe_dirs, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, RankProcesses]]:
    """The EP=2 and TP=2+EP=2 worker worlds, started (not awaited): the one-process reference runs
    while they work."""
    worlds = {
        name: RankProcesses(
            "tests.trainer.moe_worker", tmp_path_factory.mktemp(name), {"moe": moe_dirs["moe"]}, size
        )
        for name, size in WORLDS.items()
    }
    yield worlds
    for world in worlds.values():
        world.kill()


@pytest.fixture(scope="session")
def moe_results(moe_worlds: dict[str, RankProcesses]) -> dict[str, list[dict]]:
    """Layout name -> each rank's `moe_worker.main` results."""
    return {name: world.results(timeout=1200) for name, world in moe_worlds.items()}


@pytest.fixture(scope="session")
def moe_reference(megatron_world, moe_dirs, moe_worlds, tmp_path_factory) -> dict:
    """In this process (TP=EP=DP=1): logits of every test model and `engine_scenarios.training`."""
    import torch

    from art_mega.trainer.model_builder import build_megatron_model
    from tests.trainer.engine_scenarios import training

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        logits = {}
        for name in MODELS:
            built = build_megatron_model(moe_dirs[name])
            logits[name] = megatron_logits(built, input_ids(built.vocab_size))
        run = training(
            megatron_world, str(moe_dirs["moe"]), tmp_path_factory.mktemp("moe-tp1"), dp_split=False
        )
        return {"logits": logits, "training": run}
    finally:
        torch.set_num_threads(threads)


def _hf_logits(model_dir: Path, adapter: str | None = None):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    with torch.no_grad():
        return model(input_ids(MOE_SIZES["vocab_size"])).logits


@pytest.mark.parametrize("name", MODELS)
def test_megatron_moe_matches_transformers(name: str, moe_reference: dict, moe_dirs) -> None:
    expected = _hf_logits(moe_dirs[name])
    got = moe_reference["logits"][name]
    diff = (got - expected).abs().max().item()
    print(f"{name}: max |megatron - hf| = {diff:.2e} (logit std {expected.std().item():.2f})")
    assert got.shape == expected.shape
    assert diff <= HF_TOLERANCE


@pytest.mark.parametrize("layout", WORLDS)
def test_expert_parallel_logits_match_one_process(layout: str, moe_results, moe_reference) -> None:
    ranks = moe_results[layout]
    coordinates = [
        tuple(r["state"][k] for k in ("tp", "ep", "dp", "tp_rank", "ep_rank", "dp_rank")) for r in ranks
    ]
    assert coordinates == COORDINATES[layout]
    for rank, results in enumerate(ranks):
        diff = (results["logits"] - moe_reference["logits"]["moe"]).abs().max().item()
        print(f"{layout} rank {rank}: max |logits - one process| = {diff:.1e}")
        assert diff <= LOGITS_TOLERANCE


@pytest.mark.parametrize("layout", WORLDS)
def test_grpo_steps_agree_with_one_process(layout: str, moe_results, moe_reference) -> None:
    reference = moe_reference["training"]["metrics"]
    for rank, results in enumerate(moe_results[layout]):
        assert_steps_match(
            f"{layout} rank {rank}", results["training"]["metrics"], reference, LAYOUT_TOLERANCE
        )
    assert reference[0]["loss/grad_norm"] > 0 and reference[1]["loss/kl"] > 0


def test_ep2_resume_and_adapter_round_trip(moe_results) -> None:
    import torch

    for results in moe_results["ep2"]:
        run = results["training"]
        for key in COMPARED_METRICS:
            assert run["resumed_metrics"][key] == pytest.approx(run["metrics"][2][key], abs=1e-7), key
        assert (run["resumed_logits"] - run["logits"]).abs().max().item() <= 1e-6
        assert torch.equal(run["imported_logits"], run["logits"])
        for file in ("adapter_model.safetensors", "adapter_config.json"):
            assert (Path(run["adapter"]) / file).read_bytes() == (Path(run["roundtrip"]) / file).read_bytes()


# PEFT converts the per-expert adapter onto transformers 5's fused experts and warns that the
# rank/alpha patterns it adds for gate_up_proj matched no module; the fused LoRA still gets rank 2r
# (gate and up stacked), as the logits below show.
@pytest.mark.filterwarnings("ignore:The following (rank|alpha)_pattern keys:RuntimeWarning")
@pytest.mark.parametrize("layout", ["tp1", *WORLDS])
def test_peft_export_gives_megatron_logits(layout: str, moe_results, moe_reference, moe_dirs) -> None:
    run = moe_reference["training"] if layout == "tp1" else moe_results[layout][0]["training"]
    base = _hf_logits(moe_dirs["moe"])
    peft_logits = _hf_logits(moe_dirs["moe"], run["adapter"])
    diff = (peft_logits - run["logits"]).abs().max().item()
    effect = (peft_logits - base).abs().max().item()
    print(f"{layout}: max |peft - megatron| = {diff:.2e}; the adapter moves logits by up to {effect:.2f}")
    assert diff <= HF_TOLERANCE
    assert effect > 0.05


def test_adapter_holds_every_expert(moe_reference) -> None:
    import json

    from safetensors.torch import load_file

    adapter = Path(moe_reference["training"]["adapter"])
    targets = json.loads((adapter / "adapter_config.json").read_text())["target_modules"]
    assert targets == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    shapes = {
        key: tuple(value.shape) for key, value in load_file(adapter / "adapter_model.safetensors").items()
    }
    r, hidden, expert_ffn = LORA.rank, MOE_SIZES["hidden_size"], MOE_SIZES["moe_intermediate_size"]
    expected_experts = {
        f"base_model.model.model.layers.{i}.mlp.experts.{e}.{module}.lora_{m}.weight": shape
        for i in range(2)
        for e in range(MOE_SIZES["num_experts"])
        for module, a, b in (
            ("gate_proj", (r, hidden), (expert_ffn, r)),
            ("up_proj", (r, hidden), (expert_ffn, r)),
            ("down_proj", (r, expert_ffn), (hidden, r)),
        )
        for m, shape in (("A", a), ("B", b))
    }
    assert {k: v for k, v in shapes.items() if ".experts." in k} == expected_experts
    assert len(shapes) == len(expected_experts) + 2 * 4 * 2, "plus q/k/v/o of both layers"


def test_fresh_moe_lora_wraps_every_expert(megatron_world, moe_dirs) -> None:
    import torch

    from art_mega.trainer.model_builder import build_megatron_model
    from art_mega.trainer.rank.lora import apply_lora, lora_parameters

    built = build_megatron_model(moe_dirs["moe"])
    layers = apply_lora(built.module, LORA)
    experts = [name for name in layers if ".mlp.experts." in name]
    assert experts == [
        f"decoder.layers.{i}.mlp.experts.{e}.{leaf}"
        for i in range(2)
        for e in range(4)
        for leaf in ("linear_fc1", "linear_fc2")
    ]
    assert all(layers[name].is_expert and not layers[name].lora_A.allreduce for name in experts)
    assert all(not hasattr(layers[name].lora_A, "allreduce") for name in layers if name not in experts)
    params = lora_parameters(built.module)
    assert [n for n, p in built.module.named_parameters() if p.requires_grad] != []
    assert all(not torch.any(p) for n, p in params.items() if n.endswith("lora_B"))

"""The Gemma 3 text family (HF Gemma3ForCausalLM, `families/gemma3.py`) on a tiny checkpoint with its
distinctive features (a local layer with a 6-token window and RoPE base 1e4, a global layer with
base 1e5 and linear factor 2, QK norms, Gemma's 1 + w norms around both sublayers, GeGLU, the
sqrt(hidden) embedding scale, tied embeddings, query scale 24^-0.5): Megatron's logits equal
transformers' at TP=1 and TP=2; the LoRA adapter trained for 3 GRPO steps exports to a PEFT
adapter that transformers + PEFT load with the Megatron logits (TP=1 and TP=2 exports), imports
back bit-exactly and names every q/k/v/o and gate/up/down projection. The published
gemma-3-27b text config, built on the meta device, maps every HF tensor at TP=8 with Megatron's
shapes and parameter count."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from art_mega.basemodels.tiny import build_tiny_model
from tests.trainer.common import RankProcesses, input_ids, megatron_logits, require_trainer_deps
from tests.trainer.gemma3_configs import GEMMA3_27B_TEXT

require_trainer_deps()
pytest.importorskip("peft", reason="peft is not installed (the test extra)")

HF_TOLERANCE = 1e-4
TP_TOLERANCE = 1e-5
ADAM_DRIFT_TOLERANCE = 1e-3
"""As tests/trainer: HF vs Megatron logits, TP=2 vs TP=1 logits, TP=2 vs TP=1 trained adapters."""
WORLDS = ("tp1", "tp2")


@pytest.fixture(scope="session")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Gemma 3 (2 layers: local then global; hidden 64, 4 heads and 2 KV heads of head_dim 32)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-gemma3") / "gemma3", "gemma3_text")


@pytest.fixture(scope="session")
def gemma_world(gemma_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The 2-rank `tests.trainer.family_worker` world on the tiny Gemma 3, started (not awaited)."""
    world = RankProcesses(
        "tests.trainer.family_worker", tmp_path_factory.mktemp("gemma3-tp2"), {"gemma3": gemma_dir}
    )
    yield world
    world.kill()


@pytest.fixture(scope="session")
def gemma_tp1(gemma_world, megatron_world, gemma_dir: Path, tmp_path_factory) -> dict:
    """TP=1 in this process (while the TP=2 world works): the built model's logits and the training run."""
    import torch

    from art_mega.trainer.model_builder import build_megatron_model
    from tests.trainer.engine_scenarios import training

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        built = build_megatron_model(gemma_dir)
        logits = megatron_logits(built, input_ids(built.vocab_size))
        run = training(megatron_world, str(gemma_dir), tmp_path_factory.mktemp("gemma3-tp1"), dp_split=False)
    finally:
        torch.set_num_threads(threads)
    return {"family": built.family.name, "args": built.args, "logits": logits, "training": run}


@pytest.fixture(scope="session")
def gemma_tp2(gemma_world) -> list[dict]:
    return gemma_world.results(timeout=480)


def _runs(gemma_tp1: dict, gemma_tp2: list[dict]) -> dict[str, dict]:
    return {"tp1": gemma_tp1["training"], "tp2": gemma_tp2[0]["training/gemma3"]}


@pytest.fixture(scope="session")
def hf_model(gemma_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32)
    assert type(model).__name__ == "Gemma3ForCausalLM"
    return model


def test_megatron_matches_transformers(gemma_tp1: dict, hf_model) -> None:
    import torch

    args = gemma_tp1["args"]
    assert gemma_tp1["family"] == "gemma3"
    assert hf_model.config.layer_types == ["sliding_attention", "full_attention"]
    assert (args.sliding_window, args.window_layers, args.query_pre_attn_scalar) == (6, (True, False), 24.0)
    assert (args.rope_theta, args.global_rope_factor, args.local_rope_theta) == (1e5, 2.0, 1e4)
    with torch.no_grad():
        expected = hf_model(input_ids(hf_model.config.vocab_size)).logits
    diff = (gemma_tp1["logits"] - expected).abs().max().item()
    print(f"gemma3: max |megatron - hf| = {diff:.2e} (logit std {expected.std().item():.2f})")
    assert gemma_tp1["logits"].shape == expected.shape == (2, 24, 768)
    assert diff <= HF_TOLERANCE


def test_tp2_matches_tp1(gemma_tp1: dict, gemma_tp2: list[dict]) -> None:
    for rank, results in enumerate(gemma_tp2):
        assert results["state"] == (2, 1, rank, 0)
        diff = (results["logits/gemma3"] - gemma_tp1["logits"]).abs().max().item()
        print(f"gemma3 rank {rank}: max |tp2 - tp1| = {diff:.2e}")
        assert diff <= TP_TOLERANCE


def test_grpo_steps_train(gemma_tp1: dict) -> None:
    import math

    run = gemma_tp1["training"]
    norms = [m["loss/grad_norm"] for m in run["metrics"]]
    print(f"gemma3 GRPO grad norms {norms}, policy losses {[m['loss/policy'] for m in run['metrics']]}")
    assert all(math.isfinite(norm) and norm > 0 for norm in norms)
    assert run["resumed_metrics"]["loss/policy"] == pytest.approx(run["metrics"][2]["loss/policy"], abs=1e-6)
    assert (run["logits"] - gemma_tp1["logits"]).abs().max().item() > 0.05, "the adapter moved the logits"


@pytest.mark.parametrize("world", WORLDS)
def test_peft_logits_match_megatron(world: str, gemma_tp1, gemma_tp2, gemma_dir: Path) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run = _runs(gemma_tp1, gemma_tp2)[world]
    base = AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32)
    ids = input_ids(base.config.vocab_size)
    with torch.no_grad():
        base_logits = base(ids).logits
        peft_logits = PeftModel.from_pretrained(base, run["adapter"])(ids).logits
    diff = (peft_logits - run["logits"]).abs().max().item()
    effect = (peft_logits - base_logits).abs().max().item()
    print(
        f"{world} gemma3: max |peft - megatron| = {diff:.2e}; the adapter moves logits by up to {effect:.2f}"
    )
    assert diff <= HF_TOLERANCE
    assert effect > 0.05


@pytest.mark.parametrize("world", WORLDS)
def test_import_then_export_is_bit_exact(world: str, gemma_tp1, gemma_tp2) -> None:
    import torch

    run = _runs(gemma_tp1, gemma_tp2)[world]
    for file in ("adapter_model.safetensors", "adapter_config.json"):
        assert (Path(run["adapter"]) / file).read_bytes() == (Path(run["roundtrip"]) / file).read_bytes()
    assert torch.equal(run["imported_logits"], run["logits"])


def test_tp2_export_equals_tp1_export_and_names_every_module(gemma_tp1, gemma_tp2) -> None:
    from safetensors.torch import load_file

    runs = _runs(gemma_tp1, gemma_tp2)
    tp1, tp2 = (load_file(Path(runs[w]["adapter"]) / "adapter_model.safetensors") for w in WORLDS)
    assert tp1.keys() == tp2.keys()
    diff = max((tp1[key] - tp2[key]).abs().max().item() for key in tp1)
    print(f"gemma3: max |tp2 adapter - tp1 adapter| = {diff:.1e}")
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


COLUMN_PARALLEL = ("linear_qkv.weight", "linear_fc1.weight", "word_embeddings.weight")
ROW_PARALLEL = ("linear_proj.weight", "linear_fc2.weight")


def test_gemma3_27b_maps_every_tensor_on_the_meta_device(megatron_world) -> None:
    """HF Gemma3ForCausalLM and Megatron's GPTModel of the published 27B text config, both on the
    meta device: every HF parameter is read, the TP=1 mapping has exactly Megatron's names and
    shapes, the 8 TP ranks' shards re-assemble them (column-parallel rows, row-parallel columns,
    norms replicated), both count the same parameters, and the LoRA targets name real modules."""
    import torch
    from megatron.core.models.gpt.gpt_model import GPTModel
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from art_mega.trainer.families import gemma3
    from art_mega.trainer.families.spec import ParallelLayout

    config = Gemma3TextConfig(**{k: v for k, v in GEMMA3_27B_TEXT.items() if k != "model_type"})
    assert config.rope_parameters["full_attention"] == {
        "rope_type": "linear",
        "factor": 8.0,
        "rope_theta": 1e6,
    }
    assert config.rope_parameters["sliding_attention"] == {"rope_type": "default", "rope_theta": 1e4}
    args = gemma3.model_args(GEMMA3_27B_TEXT)
    assert tuple(kind == "sliding_attention" for kind in config.layer_types) == args.window_layers
    with torch.device("meta"):
        hf = Gemma3ForCausalLM(config)
        megatron = GPTModel(
            gemma3.SPEC.transformer_config(args, ParallelLayout()),
            gemma3.SPEC.layer_spec(args, use_te=False),
            **gemma3.SPEC.gpt_model_kwargs(args, tp=1),
        )
    hf_params = dict(hf.named_parameters())
    read: set[str] = set()

    def reader(name: str):
        read.add(name)
        return hf_params[name]

    full = gemma3.SPEC.megatron_state_dict(args, reader, ParallelLayout())
    assert read == set(hf_params), "every HF tensor is mapped (lm_head is tied to embed_tokens)"
    expected = {
        name: tuple(t.shape) for name, t in megatron.state_dict().items() if not name.endswith("_extra_state")
    }
    assert {name: tuple(t.shape) for name, t in full.items()} == expected
    hf_count = sum(p.numel() for p in hf_params.values())
    megatron_count = sum(p.numel() for p in megatron.parameters())
    print(f"gemma-3-27b text: {hf_count} parameters in HF and Megatron")
    assert megatron_count == hf_count == 27_009_346_304
    shards = [
        gemma3.SPEC.megatron_state_dict(args, reader, ParallelLayout(tp=8, tp_rank=r)) for r in range(8)
    ]
    for name, shape in expected.items():
        pieces = [tuple(shard[name].shape) for shard in shards]
        assert len(set(pieces)) == 1, name
        dim = 0 if name.endswith(COLUMN_PARALLEL) else 1 if name.endswith(ROW_PARALLEL) else None
        if dim is None:
            assert pieces[0] == shape, f"{name} is replicated"
        else:
            assert pieces[0][dim] * 8 == shape[dim] and pieces[0][1 - dim] == shape[1 - dim], name
    hf_modules = dict(hf.named_modules())
    lora = gemma3.SPEC.lora
    for target, names in lora.modules.items():
        for i in range(args.num_layers):
            assert all(
                f"model.layers.{i}.{lora.parents[target]}.{hf_name}" in hf_modules for hf_name in names
            )
    leaves = {path.rsplit(".", 1)[-1] for path, _ in megatron.named_modules() if ".layers." in path}
    assert set(lora.targets) <= leaves

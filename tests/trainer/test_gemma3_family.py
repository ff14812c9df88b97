"""The Gemma 3 text family (HF Gemma3ForCausalLM, `families/gemma3.py`) on a tiny checkpoint with its
distinctive features (a local layer with a 6-token window and RoPE base 1e4, a global layer with
base 1e5 and linear factor 2, QK norms, Gemma's 1 + w norms around both sublayers, GeGLU, the
sqrt(hidden) embedding scale, tied embeddings, query scale 24^-0.5): Megatron's logits equal
transformers' at TP=1 and TP=2; the LoRA adapter trained for 3 GRPO steps exports to a PEFT
adapter that transformers + PEFT load with the Megatron logits (TP=1 and TP=2 exports), imports
back bit-exactly and names every q/k/v/o and gate/up/down projection. The same for the multimodal
wrapper (`Gemma3ForConditionalGeneration`, model_type "gemma3": that text decoder plus a tiny
vision tower; text-only input), whose adapter PEFT loads on the wrapper; its checkpoint in the
pre-4.52 naming gives the same logits. The published gemma-3-27b-it config.json (the wrapper),
built on the meta device, maps every text-decoder tensor at TP=8 with Megatron's shapes and
parameter count, and no vision tensor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from art_mega.basemodels.tiny import build_tiny_model
from tests.trainer.common import RankProcesses, input_ids, megatron_logits, require_trainer_deps
from tests.trainer.gemma3_configs import GEMMA3_27B_IT, GEMMA3_27B_TEXT, build_tiny_gemma3_wrapper

require_trainer_deps()
pytest.importorskip("peft", reason="peft is not installed (the test extra)")

HF_TOLERANCE = 1e-4
TP_TOLERANCE = 1e-5
ADAM_DRIFT_TOLERANCE = 1e-3
"""As tests/trainer: HF vs Megatron logits, TP=2 vs TP=1 logits, TP=2 vs TP=1 trained adapters."""
WORLDS = ("tp1", "tp2")
MODELS = ("gemma3", "gemma3mm")
"""The text model and the multimodal wrapper around it."""


@pytest.fixture(scope="session")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Gemma 3 (2 layers: local then global; hidden 64, 4 heads and 2 KV heads of head_dim 32)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-gemma3") / "gemma3", "gemma3_text")


@pytest.fixture(scope="session")
def wrapper_dir(gemma_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Gemma3ForConditionalGeneration around `gemma_dir`'s decoder (transformers >= 4.52 names)."""
    return build_tiny_gemma3_wrapper(gemma_dir, tmp_path_factory.mktemp("tiny-gemma3mm") / "gemma3mm")


@pytest.fixture(scope="session")
def model_dirs(gemma_dir: Path, wrapper_dir: Path) -> dict[str, Path]:
    return {"gemma3": gemma_dir, "gemma3mm": wrapper_dir}


@pytest.fixture(scope="session")
def gemma_world(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    """The 2-rank `tests.trainer.family_worker` world on both tiny models, started (not awaited)."""
    world = RankProcesses("tests.trainer.family_worker", tmp_path_factory.mktemp("gemma3-tp2"), model_dirs)
    yield world
    world.kill()


@pytest.fixture(scope="session")
def tp1_runs(gemma_world, megatron_world, model_dirs: dict[str, Path], tmp_path_factory) -> dict[str, dict]:
    """TP=1 in this process (while the TP=2 world works), per model: the built model's logits and
    the training run; for the wrapper also the logits of its pre-4.52-named copy."""
    import torch

    from art_mega.trainer.model_builder import build_megatron_model
    from tests.trainer.engine_scenarios import training

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    results = {}
    try:
        for name, path in model_dirs.items():
            built = build_megatron_model(path)
            logits = megatron_logits(built, input_ids(built.vocab_size))
            out = tmp_path_factory.mktemp(f"{name}-tp1")
            run = training(megatron_world, str(path), out, dp_split=False)
            results[name] = {
                "family": built.family.name,
                "args": built.args,
                "logits": logits,
                "training": run,
            }
        old = build_tiny_gemma3_wrapper(
            model_dirs["gemma3"], tmp_path_factory.mktemp("old") / "gemma3mm", old_names=True
        )
        results["gemma3mm"]["old_names_logits"] = megatron_logits(build_megatron_model(old), input_ids(768))
    finally:
        torch.set_num_threads(threads)
    return results


@pytest.fixture(scope="session")
def gemma_tp1(tp1_runs: dict[str, dict]) -> dict:
    return tp1_runs["gemma3"]


@pytest.fixture(scope="session")
def gemma_tp2(gemma_world) -> list[dict]:
    return gemma_world.results(timeout=480)


def _runs(tp1_runs: dict[str, dict], gemma_tp2: list[dict], model: str = "gemma3") -> dict[str, dict]:
    return {"tp1": tp1_runs[model]["training"], "tp2": gemma_tp2[0][f"training/{model}"]}


def _hf_class(model: str):
    from transformers import AutoModelForCausalLM, Gemma3ForConditionalGeneration

    return Gemma3ForConditionalGeneration if model == "gemma3mm" else AutoModelForCausalLM


@pytest.fixture(scope="session")
def hf_models(model_dirs: dict[str, Path]) -> dict:
    import torch

    models = {
        name: _hf_class(name).from_pretrained(path, dtype=torch.float32) for name, path in model_dirs.items()
    }
    assert type(models["gemma3"]).__name__ == "Gemma3ForCausalLM"
    assert type(models["gemma3mm"]).__name__ == "Gemma3ForConditionalGeneration"
    return models


@pytest.mark.parametrize("model", MODELS)
def test_megatron_matches_transformers(model: str, tp1_runs: dict, hf_models: dict) -> None:
    import torch

    run, hf_model = tp1_runs[model], hf_models[model]
    args = run["args"]
    assert (
        run["family"] == "gemma3"
        and args.model_type == {"gemma3": "gemma3_text", "gemma3mm": "gemma3"}[model]
    )
    assert hf_model.config.get_text_config().layer_types == ["sliding_attention", "full_attention"]
    assert (args.sliding_window, args.window_layers, args.query_pre_attn_scalar) == (6, (True, False), 24.0)
    assert (args.rope_theta, args.global_rope_factor, args.local_rope_theta) == (1e5, 2.0, 1e4)
    with torch.no_grad():
        expected = hf_model(input_ids=input_ids(768)).logits
    diff = (run["logits"] - expected).abs().max().item()
    print(f"{model}: max |megatron - hf| = {diff:.2e} (logit std {expected.std().item():.2f})")
    assert run["logits"].shape == expected.shape == (2, 24, 768)
    assert diff <= HF_TOLERANCE
    if model == "gemma3mm":
        assert torch.equal(run["old_names_logits"], run["logits"]), "language_model.model. names read alike"
        assert torch.equal(run["logits"], tp1_runs["gemma3"]["logits"]), "the same decoder as the text model"


@pytest.mark.parametrize("model", MODELS)
def test_tp2_matches_tp1(model: str, tp1_runs: dict, gemma_tp2: list[dict]) -> None:
    for rank, results in enumerate(gemma_tp2):
        assert results["state"] == (2, 1, rank, 0)
        diff = (results[f"logits/{model}"] - tp1_runs[model]["logits"]).abs().max().item()
        print(f"{model} rank {rank}: max |tp2 - tp1| = {diff:.2e}")
        assert diff <= TP_TOLERANCE


@pytest.mark.parametrize("model", MODELS)
def test_grpo_steps_train(model: str, tp1_runs: dict) -> None:
    import math

    run = tp1_runs[model]["training"]
    norms = [m["loss/grad_norm"] for m in run["metrics"]]
    print(f"{model} GRPO grad norms {norms}, policy losses {[m['loss/policy'] for m in run['metrics']]}")
    assert all(math.isfinite(norm) and norm > 0 for norm in norms)
    assert run["resumed_metrics"]["loss/policy"] == pytest.approx(run["metrics"][2]["loss/policy"], abs=1e-6)
    assert (run["logits"] - tp1_runs[model]["logits"]).abs().max().item() > 0.05, (
        "the adapter moved the logits"
    )


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("world", WORLDS)
def test_peft_logits_match_megatron(world: str, model: str, tp1_runs, gemma_tp2, model_dirs) -> None:
    import torch
    from peft import PeftModel

    run = _runs(tp1_runs, gemma_tp2, model)[world]
    base = _hf_class(model).from_pretrained(model_dirs[model], dtype=torch.float32)
    ids = input_ids(768)
    with torch.no_grad():
        base_logits = base(input_ids=ids).logits
        peft_logits = PeftModel.from_pretrained(base, run["adapter"])(input_ids=ids).logits
    diff = (peft_logits - run["logits"]).abs().max().item()
    effect = (peft_logits - base_logits).abs().max().item()
    print(
        f"{world} {model}: max |peft - megatron| = {diff:.2e}; the adapter moves logits by up to {effect:.2f}"
    )
    assert diff <= HF_TOLERANCE
    assert effect > 0.05


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("world", WORLDS)
def test_import_then_export_is_bit_exact(world: str, model: str, tp1_runs, gemma_tp2) -> None:
    import torch

    run = _runs(tp1_runs, gemma_tp2, model)[world]
    for file in ("adapter_model.safetensors", "adapter_config.json"):
        assert (Path(run["adapter"]) / file).read_bytes() == (Path(run["roundtrip"]) / file).read_bytes()
    assert torch.equal(run["imported_logits"], run["logits"])


@pytest.mark.parametrize("model", MODELS)
def test_tp2_export_equals_tp1_export_and_names_every_module(model: str, tp1_runs, gemma_tp2) -> None:
    from safetensors.torch import load_file

    runs = _runs(tp1_runs, gemma_tp2, model)
    tp1, tp2 = (load_file(Path(runs[w]["adapter"]) / "adapter_model.safetensors") for w in WORLDS)
    assert tp1.keys() == tp2.keys()
    diff = max((tp1[key] - tp2[key]).abs().max().item() for key in tp1)
    print(f"{model}: max |tp2 adapter - tp1 adapter| = {diff:.1e}")
    assert diff <= ADAM_DRIFT_TOLERANCE
    modules = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
    modules += ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    # the wrapper's decoder in PEFT's names on Gemma3ForConditionalGeneration (vLLM's gemma3_mm maps
    # model.language_model. to its language_model.model.)
    prefix = {"gemma3": "model", "gemma3mm": "model.language_model"}[model]
    assert set(tp1) == {
        f"base_model.model.{prefix}.layers.{i}.{module}.lora_{m}.weight"
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
    """HF Gemma3ForConditionalGeneration of google/gemma-3-27b-it's published config.json (the
    multimodal wrapper, sparse text_config) and Megatron's GPTModel of its decoder, both on the
    meta device: the wrapper's config reads as the text config with Gemma3TextConfig's defaults,
    every text-decoder parameter (model.language_model.*) is read and no vision one, the TP=1
    mapping has exactly Megatron's names and shapes, the 8 TP ranks' shards re-assemble them
    (column-parallel rows, row-parallel columns, norms replicated), both count the same
    parameters, and the LoRA targets name real modules under PEFT's wrapper prefix."""
    import dataclasses

    import torch
    from megatron.core.models.gpt.gpt_model import GPTModel
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from art_mega.trainer.families import gemma3
    from art_mega.trainer.families.spec import ParallelLayout

    config = Gemma3Config(**{k: v for k, v in GEMMA3_27B_IT.items() if k != "model_type"})
    assert config.text_config.rope_parameters["full_attention"] == {
        "rope_type": "linear",
        "factor": 8.0,
        "rope_theta": 1e6,
    }
    assert config.text_config.rope_parameters["sliding_attention"] == {
        "rope_type": "default",
        "rope_theta": 1e4,
    }
    args = gemma3.model_args(GEMMA3_27B_IT)
    assert args.model_type == "gemma3"
    assert dataclasses.replace(args, model_type="gemma3_text") == gemma3.model_args(GEMMA3_27B_TEXT)
    assert tuple(kind == "sliding_attention" for kind in config.text_config.layer_types) == args.window_layers
    with torch.device("meta"):
        hf = Gemma3ForConditionalGeneration(config)
        megatron = GPTModel(
            gemma3.SPEC.transformer_config(args, ParallelLayout()),
            gemma3.SPEC.layer_spec(args, use_te=False),
            **gemma3.SPEC.gpt_model_kwargs(args, tp=1),
        )
    hf_params = dict(hf.named_parameters())
    text_params = {name for name in hf_params if name.startswith("model.language_model.")}
    assert len(text_params) < len(hf_params), "the wrapper also holds the vision tower and projector"
    read: set[str] = set()

    def reader(name: str):
        if name not in hf_params:
            raise KeyError(name)
        read.add(name)
        return hf_params[name]

    full = gemma3.SPEC.megatron_state_dict(args, reader, ParallelLayout())
    assert read == text_params, "every text-decoder tensor is mapped (lm_head is tied), no vision tensor"
    expected = {
        name: tuple(t.shape) for name, t in megatron.state_dict().items() if not name.endswith("_extra_state")
    }
    assert {name: tuple(t.shape) for name, t in full.items()} == expected
    hf_count = sum(hf_params[name].numel() for name in text_params)
    megatron_count = sum(p.numel() for p in megatron.parameters())
    print(f"gemma-3-27b-it text decoder: {hf_count} parameters in HF and Megatron")
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
    hf_modules = {f"base_model.model.{name}" for name, _ in hf.named_modules()}
    lora = gemma3.SPEC.lora_names(args)
    for target, names in lora.modules.items():
        for i in range(args.num_layers):
            assert all(
                f"{lora.layer_prefix}.{i}.{lora.parents[target]}.{hf_name}" in hf_modules for hf_name in names
            )
    leaves = {path.rsplit(".", 1)[-1] for path, _ in megatron.named_modules() if ".layers." in path}
    assert set(lora.targets) <= leaves

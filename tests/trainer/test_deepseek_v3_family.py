"""The DeepSeek-V3 family (HF DeepseekV3ForCausalLM, `families/deepseek_v3.py`) on a tiny checkpoint
with its distinctive features (`basemodels/tiny_deepseek_v3.py`: multi-head latent attention with
both latent projections, YaRN with mscale != mscale_all_dim, a dense first layer, then 8 routed
experts chosen top 4 in 2 of 4 groups by a sigmoid router with a live correction bias, scaling 2.5,
and 2 shared experts): Megatron's logits equal transformers' (eager attention) at TP=1, and TP=2
and EP=2 equal TP=1; 3 GRPO steps train at each layout with LoRA on q_a_proj, q_b_proj,
kv_a_proj_with_mqa, o_proj, the dense and shared MLPs and every expert, resume exactly, and the
adapter imports back bit-exactly and, merged into transformers' weights, gives Megatron's logits,
and passes register's warm-start check (`checkpoint.check_warm_start`); PEFT loads an attention
adapter with Megatron's logits, and the whole adapter as `peft_io.write_for_peft` writes it (the
routed experts packed as PEFT's `target_parameters` tensors, the dense and shared MLPs as 2-D
`target_parameters`) with Megatron's logits: the adapter as exported (per-module names, what vLLM
reads) PEFT 0.21 loads without the dense and shared MLP LoRA, its MoE conversion taking every
gate/up/down_proj for the experts' (`test_peft_drops_the_dense_and_shared_mlp_lora`); the published DeepSeek-V3
config, built on the meta device, maps every HF tensor at TP=8 / EP=8 with Megatron's shapes and
its 671B parameters, and so does Kimi-K2's (model_type kimi_k2, DeepSeek-V3's architecture; its
first two layers, then all 61; 18 s and 16 s in the session's mapping worker); and the config refusals.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from art_mega.basemodels.tiny_deepseek_v3 import DEEPSEEK_V3_TINY, build_tiny_deepseek_v3
from tests.real_size_configs import (
    DEEPSEEK_V3,
    DEEPSEEK_V3_PARAMETERS,
    KIMI_K2,
    KIMI_K2_PARAMETERS,
    KIMI_K2_THINKING_QUANTIZATION,
)
from tests.trainer.common import MetaMapper, RankProcesses, input_ids, megatron_logits, require_trainer_deps

require_trainer_deps()

HF_TOLERANCE = 1e-4
PARALLEL_TOLERANCE = 1e-5
"""As tests/trainer: HF vs Megatron logits; TP=2 / EP=2 vs TP=1 logits."""

LAYOUTS = ("tp1", "tp2", "ep2")


@pytest.fixture(scope="session")
def deepseek_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_deepseek_v3(tmp_path_factory.mktemp("tiny-deepseek-v3") / "deepseek_v3")


@pytest.fixture(scope="session")
def deepseek_worlds(deepseek_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The 2-rank TP=2 and EP=2 (rows split over DP=2) worlds of `deepseek_v3_worker`, started."""
    worlds = {
        layout: RankProcesses(
            "tests.trainer.deepseek_v3_worker",
            tmp_path_factory.mktemp(f"deepseek-{layout}"),
            {layout: deepseek_dir},
        )
        for layout in ("tp2", "ep2")
    }
    yield worlds
    for world in worlds.values():
        world.kill()


@pytest.fixture(scope="session")
def deepseek_tp1(deepseek_worlds, megatron_world, deepseek_dir: Path, tmp_path_factory) -> dict:
    import torch

    from art_mega.trainer.model_builder import build_megatron_model
    from art_mega.trainer.rank.engine import TrainerEngine
    from tests.trainer.deepseek_v3_worker import ATTENTION_LORA, MLA_LORA
    from tests.trainer.engine_scenarios import OPTIMIZER, STEP_LOSSES, grpo_batch, training

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        built = build_megatron_model(deepseek_dir)
        logits = megatron_logits(built, input_ids(built.vocab_size))
        out = tmp_path_factory.mktemp("deepseek-tp1")
        run = training(megatron_world, str(deepseek_dir), out, dp_split=False, lora=MLA_LORA)
        engine = TrainerEngine(str(deepseek_dir), megatron_world, lora=ATTENTION_LORA, optimizer=OPTIMIZER)
        engine.train_step(grpo_batch(engine), "grpo", STEP_LOSSES[0])
        engine.export_adapter(out / "attention")
        attention = {
            "adapter": str(out / "attention"),
            "logits": megatron_logits(engine.model, input_ids(engine.vocab_size)),
        }
    finally:
        torch.set_num_threads(threads)
    return {
        "family": built.family.name,
        "args": built.args,
        "logits": logits,
        "training": run,
        "attention": attention,
    }


@pytest.fixture(scope="session")
def deepseek_parallel(deepseek_worlds) -> dict[str, list[dict]]:
    return {name: world.results(timeout=1500) for name, world in deepseek_worlds.items()}


def _runs(deepseek_tp1: dict, deepseek_parallel) -> dict[str, dict]:
    return {
        "tp1": deepseek_tp1["training"],
        "tp2": deepseek_parallel["tp2"][0]["training"],
        "ep2": deepseek_parallel["ep2"][0]["training"],
    }


def _hf_logits(model_dir: Path, change: str | None = None) -> object:
    """transformers' logits (fp32, eager attention) on `input_ids`, with one feature switched off
    where `change` names it: "bias" (zero correction bias), "groups" (every group allowed),
    "scaling" (routed_scaling_factor 1), "shared" (shared experts' output 0), "mscale" (the softmax
    scale without mscale_all_dim)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    with torch.no_grad():
        for layer in model.model.layers:
            mlp = layer.mlp
            if change == "mscale":
                layer.self_attn.scaling = layer.self_attn.qk_head_dim**-0.5
            if not hasattr(mlp, "gate"):
                continue
            if change == "bias":
                mlp.gate.e_score_correction_bias.zero_()
            elif change == "groups":
                mlp.gate.topk_group = mlp.gate.num_group
            elif change == "scaling":
                mlp.gate.routed_scaling_factor = 1.0
            elif change == "shared":
                mlp.shared_experts.down_proj.weight.zero_()
        return model(input_ids(model.config.vocab_size)).logits


def test_megatron_matches_transformers(deepseek_tp1: dict, deepseek_dir: Path) -> None:
    args = deepseek_tp1["args"]
    assert deepseek_tp1["family"] == "deepseek_v3"
    assert (args.first_k_dense, args.num_experts, args.top_k, args.n_group, args.topk_group) == (
        1,
        8,
        4,
        4,
        2,
    )
    assert (args.rope_scaling.rope_type, args.rope_scaling.factor, args.mscale_all_dim) == ("yarn", 4.0, 0.8)
    expected = _hf_logits(deepseek_dir)
    diff = (deepseek_tp1["logits"] - expected).abs().max().item()
    print(f"deepseek_v3: max |megatron - hf| = {diff:.2e} (logit std {expected.std().item():.2f})")
    assert deepseek_tp1["logits"].shape == expected.shape == (2, 24, 768)
    assert diff <= HF_TOLERANCE
    # the features are live: without each, transformers' logits move
    for change in ("bias", "groups", "scaling", "shared", "mscale"):
        moved = (_hf_logits(deepseek_dir, change) - expected).abs().max().item()
        print(f"deepseek_v3: without {change} transformers' logits move by up to {moved:.2f}")
        assert moved > 0.01, change


@pytest.mark.parametrize("layout", ["tp2", "ep2"])
def test_parallel_logits_match_tp1(layout: str, deepseek_tp1: dict, deepseek_parallel) -> None:
    for rank, results in enumerate(deepseek_parallel[layout]):
        diff = (results["logits"] - deepseek_tp1["logits"]).abs().max().item()
        print(f"deepseek_v3 {layout} rank {rank}: max |logits - tp1| = {diff:.2e}")
        assert diff <= PARALLEL_TOLERANCE


@pytest.mark.parametrize("layout", LAYOUTS)
def test_grpo_steps_train_and_the_adapter_round_trips(layout: str, deepseek_tp1, deepseek_parallel) -> None:
    import torch
    from safetensors.torch import load_file

    run = _runs(deepseek_tp1, deepseek_parallel)[layout]
    norms = [m["loss/grad_norm"] for m in run["metrics"]]
    print(
        f"deepseek_v3 {layout}: GRPO grad norms {norms}, policy losses {[m['loss/policy'] for m in run['metrics']]}"
    )
    assert all(math.isfinite(norm) and norm > 0 for norm in norms)
    assert run["resumed_metrics"]["loss/policy"] == pytest.approx(run["metrics"][2]["loss/policy"], abs=1e-6)
    assert (run["logits"] - deepseek_tp1["logits"]).abs().max().item() > 0.05, "the adapter moved the logits"
    for file in ("adapter_model.safetensors", "adapter_config.json"):
        assert (Path(run["adapter"]) / file).read_bytes() == (Path(run["roundtrip"]) / file).read_bytes()
    assert torch.equal(run["imported_logits"], run["logits"])
    tensors = load_file(Path(run["adapter"]) / "adapter_model.safetensors")
    attention = [f"self_attn.{m}" for m in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj")]
    mlp = ("gate_proj", "up_proj", "down_proj")
    modules = {0: attention + [f"mlp.{m}" for m in mlp]}
    modules[1] = attention + [f"mlp.shared_experts.{m}" for m in mlp]
    modules[1] += [f"mlp.experts.{e}.{m}" for e in range(8) for m in mlp]
    assert set(tensors) == {
        f"base_model.model.model.layers.{i}.{module}.lora_{m}.weight"
        for i, names in modules.items()
        for module in names
        for m in "AB"
    }
    config = json.loads((Path(run["adapter"]) / "adapter_config.json").read_text())
    assert config["target_modules"] == sorted(
        ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )


def test_parallel_exports_name_the_same_tensors(deepseek_tp1, deepseek_parallel) -> None:
    """TP=2 and EP=2 write the adapter's tensors under TP=1's names with TP=1's shapes (their values
    differ after the first step: TP=2 sums in another order and a routing choice near a tie flips,
    EP=2 trains on split rows)."""
    from safetensors.torch import load_file

    runs = _runs(deepseek_tp1, deepseek_parallel)
    tp1 = load_file(Path(runs["tp1"]["adapter"]) / "adapter_model.safetensors")
    for layout in ("tp2", "ep2"):
        other = load_file(Path(runs[layout]["adapter"]) / "adapter_model.safetensors")
        assert {k: v.shape for k, v in other.items()} == {k: v.shape for k, v in tp1.items()}


def _merged_logits(model_dir: Path, adapter: str, skip: tuple[str, ...] = ()) -> object:
    """transformers' logits with the PEFT adapter in `adapter` merged by hand, W += (alpha / r) B A
    per module (an expert's into its row of the fused `experts.gate_up_proj` [E, 2I, h] / `down_proj`),
    leaving out modules whose name contains one of `skip`."""
    import re

    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    config = json.loads((Path(adapter) / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    tensors = load_file(Path(adapter) / "adapter_model.safetensors")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    params = dict(model.named_parameters())
    width = model.config.moe_intermediate_size
    with torch.no_grad():
        for key in tensors:
            if not key.endswith("lora_A.weight"):
                continue
            module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            if any(part in module for part in skip):
                continue
            delta = scale * tensors[key.replace("lora_A", "lora_B")] @ tensors[key]
            expert = re.match(r"(.*)\.experts\.(\d+)\.(\w+)$", module)
            if expert is None:
                params[module + ".weight"] += delta
            elif expert.group(3) == "down_proj":
                params[expert.group(1) + ".experts.down_proj"][int(expert.group(2))] += delta
            else:
                rows = slice(0, width) if expert.group(3) == "gate_proj" else slice(width, 2 * width)
                params[expert.group(1) + ".experts.gate_up_proj"][int(expert.group(2)), rows] += delta
        return model(input_ids(model.config.vocab_size)).logits


@pytest.mark.parametrize("layout", LAYOUTS)
def test_adapter_merged_into_transformers_gives_megatron_logits(
    layout: str, deepseek_tp1, deepseek_parallel, deepseek_dir: Path
) -> None:
    run = _runs(deepseek_tp1, deepseek_parallel)[layout]
    diff = (_merged_logits(deepseek_dir, run["adapter"]) - run["logits"]).abs().max().item()
    print(f"deepseek_v3 {layout}: max |hf + merged adapter - megatron| = {diff:.2e}")
    assert diff <= HF_TOLERANCE


def test_peft_loads_the_attention_adapter_with_megatron_logits(deepseek_tp1, deepseek_dir: Path) -> None:
    """PEFT loads an adapter on q_a_proj, q_b_proj, kv_a_proj_with_mqa and o_proj (one GRPO step at
    TP=1) and gives Megatron's logits."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run = deepseek_tp1["attention"]
    base = AutoModelForCausalLM.from_pretrained(
        deepseek_dir, dtype=torch.float32, attn_implementation="eager"
    )
    ids = input_ids(base.config.vocab_size)
    with torch.no_grad():
        base_logits = base(ids).logits
        peft_logits = PeftModel.from_pretrained(base, run["adapter"])(ids).logits
    diff = (peft_logits - run["logits"]).abs().max().item()
    effect = (peft_logits - base_logits).abs().max().item()
    print(
        f"deepseek_v3 attention adapter: max |peft - megatron| = {diff:.2e}; it moves logits by {effect:.2f}"
    )
    assert diff <= HF_TOLERANCE
    assert effect > 0.01


def test_peft_loads_the_whole_adapter_written_for_peft(
    deepseek_tp1, deepseek_dir: Path, tmp_path: Path
) -> None:
    """`write_for_peft` on the 3-step TP=1 adapter (every target): the routed experts as PEFT's
    LoRA on `mlp.experts.gate_up_proj` / `down_proj`, the dense layer's and the shared experts'
    gate/up/down_proj as 2-D `target_parameters` (`LoraNames.mlp_parameters`), only the MLA
    projections in `target_modules`, so PEFT's MoE conversion leaves it as it is: PEFT's logits
    are Megatron's, and the dense and shared MLP LoRA is in them."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from art_mega.trainer.hf_checkpoint import read_hf_config
    from art_mega.trainer.peft_io import write_for_peft

    run = deepseek_tp1["training"]
    peft_dir = write_for_peft(run["adapter"], tmp_path / "peft", read_hf_config(deepseek_dir))
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    assert config["target_modules"] == sorted(["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"])
    assert config["target_parameters"] == [
        "mlp.experts.gate_up_proj",
        "mlp.experts.down_proj",
        *(
            f"{path}.{m}.weight"
            for path in ("mlp", "mlp.shared_experts")
            for m in ("gate_proj", "up_proj", "down_proj")
        ),
    ]
    base = AutoModelForCausalLM.from_pretrained(
        deepseek_dir, dtype=torch.float32, attn_implementation="eager"
    )
    with torch.no_grad():
        peft_logits = PeftModel.from_pretrained(base, peft_dir)(input_ids(base.config.vocab_size)).logits
    without = _merged_logits(deepseek_dir, run["adapter"], skip=("layers.0.mlp.", ".shared_experts."))
    diff = (peft_logits - run["logits"]).abs().max().item()
    mlp = (peft_logits - without).abs().max().item()
    print(
        f"deepseek_v3 adapter written for PEFT: max |peft - megatron| = {diff:.2e}; its dense and shared "
        f"MLP LoRA moves logits by up to {mlp:.2f}"
    )
    assert diff <= HF_TOLERANCE
    assert mlp > 0.05


def test_the_trained_adapters_pass_the_warm_start_check(deepseek_tp1, deepseek_dir: Path) -> None:
    """register's check of a warm-start adapter (`checkpoint.check_warm_start`, against
    `peft_io.adapter_layout`) accepts what the trainer exported: every target, and the MLA
    projections alone."""
    from art_mega.trainer import checkpoint

    for adapter in (deepseek_tp1["training"]["adapter"], deepseek_tp1["attention"]["adapter"]):
        checkpoint.check_warm_start(adapter, deepseek_dir, adapter)


def test_peft_drops_the_dense_and_shared_mlp_lora(deepseek_tp1, deepseek_dir: Path) -> None:
    """PEFT 0.21 on the adapter as exported (per-module names, what vLLM reads) loads its experts
    into transformers 5's fused DeepSeek-V3 experts (transformers maps deepseek_v3 to the qwen2_moe
    weight conversion), but its conversion rewrites target_modules gate_proj / up_proj / down_proj
    to the fused experts, so the dense layer's MLP and the shared experts get no LoRA, silently:
    PEFT's logits equal the hand-merged adapter without those modules. `write_for_peft` writes
    the form PEFT loads whole (test above). A PEFT that fixes this fails here; then
    `LoraNames.mlp_parameters` may go."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run = deepseek_tp1["training"]
    base = AutoModelForCausalLM.from_pretrained(
        deepseek_dir, dtype=torch.float32, attn_implementation="eager"
    )
    with torch.no_grad():
        peft_logits = PeftModel.from_pretrained(base, run["adapter"])(
            input_ids(base.config.vocab_size)
        ).logits
    without = _merged_logits(deepseek_dir, run["adapter"], skip=("layers.0.mlp.", ".shared_experts."))
    assert (peft_logits - without).abs().max().item() <= HF_TOLERANCE
    assert (peft_logits - run["logits"]).abs().max().item() > 0.01


@pytest.mark.timeout(900)
def test_published_config_maps_every_tensor_on_meta(meta_mapper: MetaMapper) -> None:
    """`tests.trainer.meta_mapping_worker` (see tests/trainer/test_real_size_mapping.py) at TP=8, EP=8
    on DeepSeek-V3's published config (its fp8 quantization_config is read by the family; on the
    meta device transformers builds the unquantized layout)."""
    got = meta_mapper.map(DEEPSEEK_V3, 8, 8)
    print(
        f"DeepSeek-V3: {got['hf_names']} HF tensors -> {got['megatron_keys']} Megatron tensors per rank, "
        f"{got['megatron_params']:,} parameters, {got['lora_layers']} LoRA layers on rank 0"
    )
    assert (got["family"], got["hf_class"]) == ("deepseek_v3", "DeepseekV3ForCausalLM")
    assert got["unread"] == [] and got["unknown_reads"] == []
    assert got["missing"] == [] and got["unexpected"] == [] and got["mismatched"] == []
    assert got["hf_params"] == got["megatron_params"] == DEEPSEEK_V3_PARAMETERS
    # rank 0, every target: 4 MLA linears + fc1/fc2 per layer (dense MLP or shared experts), and
    # the 58 MoE layers' 256/8 local experts' fc1/fc2
    assert got["lora_layers"] == 61 * 6 + 58 * 32 * 2
    assert got["lora_unmatched"] == []
    shapes = got["rank0_shapes"]
    sa = "decoder.layers.0.self_attention."
    assert shapes[sa + "linear_q_down_proj.weight"] == [1536 // 8, 7168]
    assert shapes[sa + "linear_q_up_proj.weight"] == [128 * 192 // 8, 1536]
    assert shapes[sa + "linear_kv_down_proj.weight"] == [576 // 8, 7168]
    assert shapes[sa + "linear_kv_up_proj.weight"] == [128 * 256 // 8, 512]
    assert shapes[sa + "linear_proj.weight"] == [7168, 128 * 128 // 8]
    assert shapes["decoder.layers.0.mlp.linear_fc1.weight"] == [2 * 18432 // 8, 7168]


KIMI_K2_MOE_LAYER = (384 + 1) * 3 * 7168 * 2048 + 384 * 7168 + 101_124_096 + 2 * 7168
"""One Kimi-K2 MoE layer's parameters: 384 routed + 1 shared SwiGLU experts of width 2048, the
router, MLA with 64 heads (q_a 7168x1536 + its norm, q_b 1536x(64x192), kv_a 7168x576 + its norm,
kv_b 512x(64x256), o 8192x7168) and the layer's two norms."""


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layers", [2, 61])
def test_kimi_k2_config_maps_every_tensor_on_meta(layers: int, meta_mapper: MetaMapper) -> None:
    """Kimi-K2's published config.json (`KIMI_K2`: model_type kimi_k2, architectures
    DeepseekV3ForCausalLM) goes through the deepseek_v3 family: at TP=8 / EP=8 every tensor of
    transformers' DeepseekV3ForCausalLM built from it maps with Megatron's shapes and parameter
    count. `layers` 2: its dense first layer and one MoE layer; 61: the model."""
    config = {**KIMI_K2, "num_hidden_layers": layers}
    got = meta_mapper.map(config, 8, 8)
    print(
        f"Kimi-K2 ({layers} layers): {got['hf_names']} HF tensors -> {got['megatron_keys']} Megatron "
        f"tensors per rank, {got['megatron_params']:,} parameters, {got['lora_layers']} LoRA layers on rank 0"
    )
    assert (got["family"], got["hf_class"]) == ("deepseek_v3", "DeepseekV3ForCausalLM")
    assert got["unread"] == [] and got["unknown_reads"] == []
    assert got["missing"] == [] and got["unexpected"] == [] and got["mismatched"] == []
    assert (
        got["hf_params"] == got["megatron_params"] == KIMI_K2_PARAMETERS - (61 - layers) * KIMI_K2_MOE_LAYER
    )
    # rank 0: 4 MLA linears + fc1/fc2 per layer (dense MLP or shared experts) and the MoE layers'
    # 384/8 local experts' fc1/fc2
    assert got["lora_layers"] == layers * 6 + (layers - 1) * 48 * 2
    assert got["lora_unmatched"] == []
    shapes = got["rank0_shapes"]
    sa = "decoder.layers.0.self_attention."
    assert shapes[sa + "linear_q_up_proj.weight"] == [64 * 192 // 8, 1536]
    assert shapes[sa + "linear_kv_up_proj.weight"] == [64 * 256 // 8, 512]
    assert shapes[sa + "linear_proj.weight"] == [7168, 64 * 128 // 8]


def test_kimi_k2_config_reads_as_deepseek_v3() -> None:
    """The fields Kimi-K2's config.json sets differently from DeepSeek-V3's reach the arguments."""
    from art_mega.trainer.families import family_for

    family = family_for(KIMI_K2)
    args = family.model_args(KIMI_K2)
    assert (family.name, args.model_type) == ("deepseek_v3", "kimi_k2")
    assert (args.num_experts, args.top_k, args.n_group, args.topk_group) == (384, 8, 1, 1)
    assert (args.first_k_dense, args.num_heads, args.num_shared_experts) == (1, 64, 1)
    assert (args.routed_scaling_factor, args.rope_theta, args.fp8_block) == (2.827, 50000.0, (128, 128))
    assert (args.rope_scaling.rope_type, args.rope_scaling.factor, args.rope_scaling.beta_fast) == (
        "yarn",
        32.0,
        1.0,
    )
    assert family.valid_tp_sizes(args) == [1, 2, 4, 8, 16, 32, 64]


def _tiny(**changes) -> dict:
    return {**DEEPSEEK_V3_TINY, "model_type": "deepseek_v3", **changes}


@pytest.mark.parametrize(
    ("changes", "sentence"),
    [
        (
            {"q_lora_rank": None},
            "q_lora_rank=null (a query without its low-rank projection) is not supported; "
            "use a DeepSeek-V3 checkpoint with q_lora_rank set.",
        ),
        (
            {"rope_interleave": False},
            "rope_interleave=false is not supported; Megatron's MLA rotates DeepSeek's interleaved pairs, "
            "so use the model's own config.json (true).",
        ),
        (
            {"num_experts_per_tok": 6},
            "num_experts_per_tok=6 with topk_group=2 is not supported: Megatron scores a group by its top "
            "num_experts_per_tok/topk_group experts and transformers by its top 2, so use "
            "num_experts_per_tok = 2 * topk_group.",
        ),
        (
            {"norm_topk_prob": False},
            "norm_topk_prob=false is not supported with num_experts_per_tok > 1: Megatron's sigmoid router "
            "always normalises the chosen weights; use norm_topk_prob true.",
        ),
        (
            {"quantization_config": {"quant_method": "bitsandbytes"}},
            "quantization_config (quant_method='bitsandbytes') is not "
            "supported for DeepSeek-V3; use DeepSeek's block-scaled e4m3 fp8 checkpoint or a bf16 one.",
        ),
        (
            # moonshotai/Kimi-K2-Thinking's int4 weights (its config.json's quantization_config, abridged)
            {"quantization_config": KIMI_K2_THINKING_QUANTIZATION},
            "quantization_config (quant_method='compressed-tensors') is not "
            "supported for DeepSeek-V3; use DeepSeek's block-scaled e4m3 fp8 checkpoint or a bf16 one.",
        ),
    ],
)
def test_refusals_are_one_sentence(changes: dict, sentence: str) -> None:
    from art_mega.errors import UserError
    from art_mega.trainer.families import family_for

    config = _tiny(**changes)
    with pytest.raises(UserError) as caught:
        family_for(config).model_args(config)
    assert str(caught.value) == sentence


def test_published_config_reads_and_tp_refusal() -> None:
    from art_mega.errors import UserError
    from art_mega.trainer.families import family_for
    from art_mega.trainer.families.spec import ParallelLayout

    config = {k: v for k, v in DEEPSEEK_V3.items()}
    family = family_for(config)
    args = family.model_args(config)
    assert args.fp8_block == (128, 128) and family.valid_tp_sizes(args) == [1, 2, 4, 8, 16, 32, 64]
    with pytest.raises(UserError) as caught:
        family.check_parallel(args, ParallelLayout(tp=3))
    assert str(caught.value) == (
        "tp=3 cannot split this deepseek_v3 model (128 heads, q_lora_rank 1536, kv_lora_rank + "
        "qk_rope_head_dim 576, FFN size 18432); use tp in {1, 2, 4, 8, 16, 32, 64}."
    )


def test_fp8_blocks_dequantize_as_deepseek_does() -> None:
    """`dequantize_fp8` on a weight whose size is not a multiple of the block (the last blocks are
    partial, as in DeepSeek-V3's 7168 x 576 kv_a_proj_with_mqa at block 128): each value is its
    fp8 code times its block's scale."""
    import torch

    from art_mega.trainer.families.deepseek_v3 import dequantize_fp8

    weight = torch.randn(5, 7, generator=torch.Generator().manual_seed(0)).to(torch.float8_e4m3fn)
    scale = torch.tensor([[2.0, 0.5], [4.0, 0.25], [8.0, 3.0]])
    got = dequantize_fp8(weight, scale, (2, 4))
    for r in range(5):
        for c in range(7):
            assert got[r, c].item() == weight[r, c].float().item() * scale[r // 2, c // 4].item()

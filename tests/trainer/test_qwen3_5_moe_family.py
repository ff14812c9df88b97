"""The Qwen3.5 / Qwen3.6 MoE family (`families/qwen3_5_moe.py`) on a tiny Qwen3_5MoeForCausalLM
with its distinctive features (`basemodels/tiny_qwen3_5_moe.py`: a gated delta-net layer then a
gated full-attention layer with partial RoPE, 1 + w norms, and on both a softmax top-2 router over
4 experts plus a shared expert of another width behind its sigmoid gate): Megatron's logits equal
transformers' at TP=1 (whole rows and rows packed with two documents), also from the Hub's
layout (multimodal wrapper config, `model.language_model.` names, fused 3-D experts); TP=2 (with
sequence parallelism, which Megatron's MoE layer needs under TP) and EP=2 equal TP=1. 3 GRPO steps
train at each layout, resume exactly, and export a PEFT adapter that imports back bit-exactly: at
TP=1 and TP=2 with LoRA on q/k/v/o, the delta-net's in_proj_qkv / in_proj_z / out_proj, every
routed expert and the shared expert; at EP=2 with the default targets (experts split over EP),
which are the same modules (ART 0.5.23's default for Qwen3.5).

PEFT: the adapter's attention, delta-net and shared-expert modules load in `peft` 0.21 as
exported; its per-expert tensors (`mlp.experts.{e}.gate_proj`, the names vLLM's
Qwen3_5MoeForCausalLM reads) do not, because transformers 5 keeps Qwen3.5 MoE's experts fused
(`mlp.experts.gate_up_proj`) and PEFT converts per-expert adapters onto fused experts only for the
model types its `_MOE_TARGET_MODULE_MAPPING` knows (qwen3_5_moe_text maps to qwen3_5_text, which it
lacks), dropping them otherwise. `peft_io.write_for_peft` writes the same factors with the
experts as PEFT's `target_parameters` tensors, which `PeftModel.from_pretrained` loads: the
logits equal Megatron's, and the experts' part moves them (measured against the export as it is).

Real size without memory: the published Qwen3.5-35B-A3B config (and Qwen3.6-35B-A3B's, the same
architecture) maps every HF tensor at TP=8 / EP=8 with Megatron's shapes, Megatron's parameter
count equals transformers' and the architecture's, and every LoRA target names a real module.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from art_mega.basemodels.tiny_qwen3_5_moe import build_tiny_qwen3_5_moe
from art_mega.errors import UserError
from tests.trainer.common import MetaMapper, RankProcesses, input_ids, megatron_logits, require_trainer_deps
from tests.trainer.qwen3_5_configs import QWEN3_5_35B_A3B, QWEN3_6_35B_A3B
from tests.trainer.test_qwen3_5_family import _hf_param_count

require_trainer_deps()
pytest.importorskip("peft", reason="peft is not installed (the test extra)")

HF_TOLERANCE = 1e-4
PARALLEL_TOLERANCE = 1e-5
"""As tests/trainer: HF vs Megatron logits; TP=2 / EP=2 vs TP=1 logits."""
LAYOUTS = ("tp1", "tp2", "ep2")


def _hub_layout(tiny: Path, out: Path) -> Path:
    """The tiny model as the Hub holds Qwen3.5 MoE: config.json the multimodal wrapper
    (model_type qwen3_5_moe, the text config in `text_config`), weights under
    `model.language_model.` with each layer's experts fused (`mlp.experts.gate_up_proj` [E, 2I, h],
    gate rows first; `mlp.experts.down_proj` [E, h, I]). Megatron only reads it."""
    import torch
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    text = json.loads((tiny / "config.json").read_text())
    wrapper = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "tie_word_embeddings": text.pop("tie_word_embeddings"),
        "text_config": {**text, "model_type": "qwen3_5_moe_text"},
    }
    (out / "config.json").write_text(json.dumps(wrapper))
    tensors = load_file(tiny / "model.safetensors")
    hub: dict[str, torch.Tensor] = {}
    experts = text["num_experts"]
    for layer in range(text["num_hidden_layers"]):
        prefix = f"model.layers.{layer}.mlp.experts."
        gate_up = [
            torch.cat(
                [tensors.pop(f"{prefix}{e}.gate_proj.weight"), tensors.pop(f"{prefix}{e}.up_proj.weight")]
            )
            for e in range(experts)
        ]
        down = [tensors.pop(f"{prefix}{e}.down_proj.weight") for e in range(experts)]
        hub[f"model.language_model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.stack(gate_up)
        hub[f"model.language_model.layers.{layer}.mlp.experts.down_proj"] = torch.stack(down)
    for name, tensor in tensors.items():
        hub[name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name] = (
            tensor
        )
    save_file(hub, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="session")
def moe35_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-qwen35-moe")
    tiny = build_tiny_qwen3_5_moe(root / "qwen3_5_moe")
    return {"tiny": tiny, "hub": _hub_layout(tiny, root / "hub")}


@pytest.fixture(scope="session")
def moe35_worlds(moe35_dirs, tmp_path_factory: pytest.TempPathFactory):
    """The 2-rank TP=2 (`qwen3_5_worker`: packed logits, its delta-net LoRA) and EP=2
    (`moe_worker`, rows split over DP=2, the default LoRA) worlds, started (not awaited)."""
    tiny = moe35_dirs["tiny"]
    worlds = {
        "tp2": RankProcesses(
            "tests.trainer.qwen3_5_worker", tmp_path_factory.mktemp("q35moe-tp2"), {"q": tiny}
        ),
        "ep2": RankProcesses(
            "tests.trainer.moe_worker", tmp_path_factory.mktemp("q35moe-ep2"), {"moe": tiny}
        ),
    }
    yield worlds
    for world in worlds.values():
        world.kill()


@pytest.fixture(scope="session")
def moe35_tp1(moe35_worlds, megatron_world, moe35_dirs, tmp_path_factory) -> dict:
    """TP=1 in this process (while the worlds work): logits (whole, packed, Hub layout), training."""
    import torch

    from art_mega.trainer.model_builder import build_megatron_model
    from tests.trainer.engine_scenarios import training
    from tests.trainer.qwen3_5_worker import QWEN3_5_LORA, packed_logits

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        built = build_megatron_model(moe35_dirs["tiny"])
        ids = input_ids(built.vocab_size)
        hub = build_megatron_model(moe35_dirs["hub"])
        return {
            "family": built.family.name,
            "args": built.args,
            "logits": megatron_logits(built, ids),
            "packed": packed_logits(built, ids),
            "hub_logits": megatron_logits(hub, ids),
            "training": training(
                megatron_world,
                str(moe35_dirs["tiny"]),
                tmp_path_factory.mktemp("q35moe-tp1"),
                dp_split=False,
                lora=QWEN3_5_LORA,
            ),
        }
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def moe35_parallel(moe35_worlds) -> dict[str, list[dict]]:
    return {name: world.results(timeout=1200) for name, world in moe35_worlds.items()}


def _hf_model(model_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert type(model).__name__ == "Qwen3_5MoeForCausalLM"
    return model


def test_megatron_matches_transformers(moe35_tp1: dict, moe35_dirs) -> None:
    import torch

    args = moe35_tp1["args"]
    assert moe35_tp1["family"] == "qwen3_5_moe"
    assert (args.linear_layers, args.num_experts, args.top_k) == ((True, False), 4, 2)
    assert (args.expert_ffn_hidden_size, args.shared_expert_ffn_hidden_size, args.ffn_hidden_size) == (
        32,
        48,
        48,
    )
    model = _hf_model(moe35_dirs["tiny"])
    ids = input_ids(model.config.vocab_size)
    with torch.no_grad():
        expected = model(ids).logits
        documents = torch.cat([model(ids[:, :10]).logits, model(ids[:, 10:]).logits], dim=1)
        for layer in model.model.layers:  # the shared expert's gate is live
            layer.mlp.shared_expert_gate.weight.zero_()
        ungated = model(ids).logits
    diff = (moe35_tp1["logits"] - expected).abs().max().item()
    packed = (moe35_tp1["packed"] - documents).abs().max().item()
    hub = (moe35_tp1["hub_logits"] - moe35_tp1["logits"]).abs().max().item()
    gate = (ungated - expected).abs().max().item()
    print(
        f"qwen3_5_moe: max |megatron - hf| = {diff:.2e}, packed {packed:.2e}, Hub layout vs text layout "
        f"{hub:.1e}; sigmoid(0) for the shared expert's gate moves HF logits by {gate:.2f}"
    )
    assert moe35_tp1["logits"].shape == expected.shape == (2, 24, 768)
    assert diff <= HF_TOLERANCE and packed <= HF_TOLERANCE
    assert hub == 0.0
    assert gate > 0.05 and (documents - expected).abs().max().item() > 0.05


@pytest.mark.parametrize("layout", ["tp2", "ep2"])
def test_parallel_logits_match_tp1(layout: str, moe35_tp1: dict, moe35_parallel) -> None:
    for rank, results in enumerate(moe35_parallel[layout]):
        logits = results["logits/q"] if layout == "tp2" else results["logits"]
        diff = (logits - moe35_tp1["logits"]).abs().max().item()
        line = f"qwen3_5_moe {layout} rank {rank}: max |logits - tp1| = {diff:.2e}"
        if layout == "tp2":
            packed = (results["packed/q"] - moe35_tp1["packed"]).abs().max().item()
            line += f", packed {packed:.2e}"
            assert packed <= PARALLEL_TOLERANCE
        print(line)
        assert diff <= PARALLEL_TOLERANCE


def _runs(moe35_tp1: dict, moe35_parallel) -> dict[str, dict]:
    return {
        "tp1": moe35_tp1["training"],
        "tp2": moe35_parallel["tp2"][0]["training/q"],
        "ep2": moe35_parallel["ep2"][0]["training"],
    }


def _expected_modules() -> set[str]:
    """PEFT module paths (under the decoder layers) of the tiny model's adapter: the explicit
    targets at TP=1 / TP=2 and the default at EP=2 are the same (ART's default for Qwen3.5 MoE)."""
    mlp = [f"mlp.shared_expert.{m}" for m in ("gate_proj", "up_proj", "down_proj")]
    mlp += [f"mlp.experts.{e}.{m}" for e in range(4) for m in ("gate_proj", "up_proj", "down_proj")]
    attention = [f"self_attn.{m}" for m in ("q_proj", "k_proj", "v_proj", "o_proj")]
    delta = [f"linear_attn.{m}" for m in ("in_proj_qkv", "in_proj_z", "out_proj")]
    return {f"0.{m}" for m in mlp + delta} | {f"1.{m}" for m in mlp + attention}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_grpo_steps_train_and_the_adapter_round_trips(
    layout: str, moe35_tp1, moe35_parallel, moe35_dirs
) -> None:
    import torch
    from safetensors.torch import load_file

    from art_mega.trainer.hf_checkpoint import read_hf_config
    from art_mega.trainer.peft_io import adapter_layout

    run = _runs(moe35_tp1, moe35_parallel)[layout]
    norms = [m["loss/grad_norm"] for m in run["metrics"]]
    print(
        f"qwen3_5_moe {layout}: GRPO grad norms {norms}, "
        f"policy losses {[m['loss/policy'] for m in run['metrics']]}"
    )
    assert all(math.isfinite(norm) and norm > 0 for norm in norms)
    assert run["resumed_metrics"]["loss/policy"] == pytest.approx(run["metrics"][2]["loss/policy"], abs=1e-6)
    assert (run["logits"] - moe35_tp1["logits"]).abs().max().item() > 0.05, "the adapter moved the logits"
    for file in ("adapter_model.safetensors", "adapter_config.json"):
        assert (Path(run["adapter"]) / file).read_bytes() == (Path(run["roundtrip"]) / file).read_bytes()
    assert torch.equal(run["imported_logits"], run["logits"])
    tensors = load_file(Path(run["adapter"]) / "adapter_model.safetensors")
    prefix = "base_model.model.model.layers"
    modules = _expected_modules()
    assert set(tensors) == {f"{prefix}.{module}.lora_{m}.weight" for module in modules for m in "AB"}
    targets = json.loads((Path(run["adapter"]) / "adapter_config.json").read_text())["target_modules"]
    layout_shapes = adapter_layout(read_hf_config(moe35_dirs["tiny"]), 4, targets).shapes
    assert layout_shapes == {key: tuple(tensor.shape) for key, tensor in tensors.items()}
    assert tuple(tensors[f"{prefix}.0.mlp.shared_expert.gate_proj.lora_B.weight"].shape) == (48, 4)
    assert tuple(tensors[f"{prefix}.0.mlp.experts.3.down_proj.lora_A.weight"].shape) == (4, 32)


# TP=2 (sequence parallel, experts replicated over the TP ranks at EP=1) trains as TP=1: this
# found the expert linear_fc2 LoRA counted as sequence parallel there (its B's gradient doubled,
# `trainer/rank/lora.py`; grad norm 3.208 against 3.114, adapters 1.8e-3 apart, now 2.2e-5), which
# Qwen3-MoE's TP=2+EP=2 layout does not reach.
def test_tp2_steps_and_adapter_equal_tp1(moe35_tp1, moe35_parallel) -> None:
    from safetensors.torch import load_file

    from tests.trainer.engine_scenarios import assert_steps_match
    from tests.trainer.test_lora_engine import LAYOUT_TOLERANCE

    runs = _runs(moe35_tp1, moe35_parallel)
    tp1, tp2 = (load_file(Path(runs[w]["adapter"]) / "adapter_model.safetensors") for w in ("tp1", "tp2"))
    assert tp1.keys() == tp2.keys()
    diff = max((tp1[key] - tp2[key]).abs().max().item() for key in tp1)
    print(f"qwen3_5_moe: max |tp2 adapter - tp1 adapter| = {diff:.1e}")
    # 2x the dense tolerance: step 3's grad norm is 6.4 here (measured 1.4e-5 apart, 2e-6 relative)
    assert_steps_match(
        "qwen3_5_moe tp2", runs["tp2"]["metrics"], runs["tp1"]["metrics"], 2 * LAYOUT_TOLERANCE
    )
    assert diff <= 1e-3


@pytest.mark.parametrize("layout", LAYOUTS)
def test_peft_loads_the_adapter_with_megatron_logits(
    layout: str, moe35_tp1, moe35_parallel, moe35_dirs, tmp_path: Path
) -> None:
    import torch
    from peft import PeftModel

    from art_mega.trainer.hf_checkpoint import read_hf_config
    from art_mega.trainer.peft_io import write_for_peft

    run = _runs(moe35_tp1, moe35_parallel)[layout]
    peft_dir = write_for_peft(run["adapter"], tmp_path / "peft", read_hf_config(moe35_dirs["tiny"]))
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    model = _hf_model(moe35_dirs["tiny"])
    ids = input_ids(model.config.vocab_size)
    with torch.no_grad():
        base_logits = model(ids).logits
        peft_logits = PeftModel.from_pretrained(model, peft_dir)(ids).logits
        raw_logits = PeftModel.from_pretrained(_hf_model(moe35_dirs["tiny"]), run["adapter"])(ids).logits
    diff = (peft_logits - run["logits"]).abs().max().item()
    effect = (peft_logits - base_logits).abs().max().item()
    experts = (peft_logits - raw_logits).abs().max().item()
    print(
        f"{layout} qwen3_5_moe: max |PEFT - megatron| = {diff:.2e}; the adapter moves logits by up to "
        f"{effect:.2f}, its experts' part (which PEFT drops from the per-expert export) by {experts:.2f}"
    )
    assert diff <= HF_TOLERANCE
    assert effect > 0.05
    assert experts > 0.05, "PEFT now loads the per-expert export itself; LoraNames.for_peft may go"


def test_refusals_and_limits() -> None:
    from art_mega.trainer.families import family_for
    from art_mega.trainer.families.spec import ParallelLayout

    family = family_for(QWEN3_5_35B_A3B)
    args = family.model_args(QWEN3_5_35B_A3B)
    assert family.name == "qwen3_5_moe" and family.model_args(QWEN3_6_35B_A3B) == args
    assert (
        args.num_experts,
        args.top_k,
        args.expert_ffn_hidden_size,
        args.shared_expert_ffn_hidden_size,
    ) == (
        256,
        8,
        512,
        512,
    )
    assert sum(args.linear_layers) == 30 and (args.num_heads, args.num_query_groups, args.head_dim) == (
        16,
        2,
        256,
    )
    assert family.valid_tp_sizes(args) == [1, 2, 4, 8, 16]
    with pytest.raises(UserError) as caught:
        family.check_parallel(args, ParallelLayout(tp=8, ep=3))
    assert str(caught.value) == (
        "ep=3 cannot split this qwen3_5_moe model's 256 experts; use ep in {1, 2, 4, 8, 16, 32, 64, 128, 256}."
    )
    text = {**QWEN3_5_35B_A3B["text_config"], "num_experts_per_tok": 300}
    with pytest.raises(UserError) as caught:
        family.model_args({**QWEN3_5_35B_A3B, "text_config": text})
    assert str(caught.value) == "num_experts_per_tok=300 must be between 1 and num_experts=256."
    text = {**QWEN3_5_35B_A3B["text_config"], "hidden_act": "gelu"}
    with pytest.raises(UserError) as caught:
        family.model_args({**QWEN3_5_35B_A3B, "text_config": text})
    assert str(caught.value) == "hidden_act='gelu' is not supported; Qwen3.5 uses 'silu'."


def _moe_param_count(text: dict) -> int:
    """Parameters of the text decoder from the architecture: the dense family's count with the
    shared expert as its MLP, plus per layer the routed experts (3 h I each), the router (E h) and
    the shared expert's gate (h)."""
    h, experts, width = text["hidden_size"], text["num_experts"], text["moe_intermediate_size"]
    dense = _hf_param_count({**text, "intermediate_size": text["shared_expert_intermediate_size"]})
    return dense + text["num_hidden_layers"] * (experts * 3 * h * width + experts * h + h)


@pytest.mark.timeout(900)
def test_qwen3_5_35b_a3b_maps_on_meta(meta_mapper: MetaMapper) -> None:
    """`tests.trainer.meta_mapping_worker` at TP=8, EP=8 (LoRA on every target of the family)."""
    got = meta_mapper.map(QWEN3_5_35B_A3B, 8, 8)
    print(
        f"Qwen3.5-35B-A3B: {got['hf_names']} HF tensors -> {got['megatron_keys']} Megatron tensors per rank, "
        f"{got['megatron_params']:,} parameters, {got['lora_layers']} LoRA layers on rank 0"
    )
    assert (got["family"], got["hf_class"], got["hf_names"]) == ("qwen3_5_moe", "Qwen3_5MoeForCausalLM", 693)
    assert got["unread"] == [] and got["unknown_reads"] == []
    assert got["missing"] == [] and got["unexpected"] == [] and got["mismatched"] == []
    assert got["hf_params"] == got["megatron_params"] == _moe_param_count(QWEN3_5_35B_A3B["text_config"])
    assert got["megatron_params"] == 34_660_610_688
    # rank 0 per layer: 32 experts' and the shared expert's linear_fc1 + linear_fc2, plus
    # in_proj_qkv / in_proj_z / out_proj on 30 delta-net layers, linear_qkv / linear_proj on 10
    assert got["lora_layers"] == 40 * (2 * 256 // 8 + 2) + 30 * 3 + 10 * 2
    assert got["lora_unmatched"] == []
    shapes = got["rank0_shapes"]
    layer0 = "decoder.layers.0."
    assert shapes[layer0 + "self_attention.in_proj_qkv.weight"] == [(2 * 16 * 128 + 32 * 128) // 8, 2048]
    assert shapes[layer0 + "mlp.router.weight"] == [256, 2048]
    assert shapes[layer0 + "mlp.shared_experts.gate_weight"] == [1, 2048]
    assert shapes[layer0 + "mlp.shared_experts.linear_fc1.weight"] == [2 * 512 // 8, 2048]
    assert shapes[layer0 + "mlp.experts.local_experts.31.linear_fc1.weight"] == [2 * 512, 2048]
    assert "decoder.layers.0.mlp.experts.local_experts.32.linear_fc1.weight" not in shapes

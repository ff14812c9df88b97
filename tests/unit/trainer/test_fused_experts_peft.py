"""The PEFT form of the Qwen3.5 MoE, Gemma 4 MoE and DeepSeek-V3 adapters (`LoraNames.for_peft`,
`families/fused_experts.py`): art-mega writes their experts per expert (the names vLLM 0.32's
Qwen3_5MoeForCausalLM and Gemma 4 read), which PEFT 0.21 drops on transformers' fused experts;
`for_peft` packs them into PEFT's `target_parameters` tensors on `{experts}.gate_up_proj` (gate
rows first) and `{experts}.down_proj`, value by value, and back bit-exactly; DeepSeek-V3's
dense and shared MLPs become 2-D `target_parameters` (`LoraNames.mlp_parameters`). Families whose
adapters PEFT loads as written are left as they are. tests/trainer/test_qwen3_5_moe_family.py and
test_gemma4_moe_family.py load trained adapters this way in PEFT against Megatron's logits.
"""

from __future__ import annotations

import pytest

from art_mega.trainer.families import fused_experts
from art_mega.trainer.families.gemma4 import SPEC as GEMMA4
from art_mega.trainer.families.gpt_oss import SPEC as GPT_OSS
from art_mega.trainer.families.qwen3_5_moe import SPEC as QWEN3_5_MOE
from art_mega.trainer.families.qwen3_moe import SPEC as QWEN3_MOE
from tests.real_size_configs import GEMMA4_26B_A4B_TEXT

torch = pytest.importorskip("torch")

PREFIX = "base_model.model.model.layers"
RANK, EXPERTS, HIDDEN, FFN = 4, 4, 64, 32
CONFIG = {"r": RANK, "lora_alpha": 8, "target_modules": ["down_proj", "gate_proj", "up_proj", "q_proj"]}


def per_expert_tensors(experts: str, modules: tuple[str, ...], dense: str) -> dict[str, torch.Tensor]:
    """Seeded per-module tensors as `LoraNames.to_peft` writes them: two layers, each with a
    q_proj, a dense (or shared-expert) MLP under `dense` and 4 experts under `experts` (gate and
    up share one A), `modules` of the MLP targeted."""
    generator = torch.Generator().manual_seed(0)
    out = {}

    def add(where: str, module: str, a: torch.Tensor, fan_out: int) -> None:
        out[f"{where}.{module}.lora_A.weight"] = a.clone()
        out[f"{where}.{module}.lora_B.weight"] = torch.randn(fan_out, RANK, generator=generator)

    for i in range(2):
        add(f"{PREFIX}.{i}.self_attn", "q_proj", torch.randn(RANK, HIDDEN, generator=generator), 128)
        for where in [f"{PREFIX}.{i}.{dense}", *(f"{PREFIX}.{i}.{experts}.{e}" for e in range(EXPERTS))]:
            shared = torch.randn(RANK, HIDDEN, generator=generator)
            for module in ("gate_proj", "up_proj"):
                if module in modules:
                    add(where, module, shared, FFN)
            if "down_proj" in modules:
                add(where, "down_proj", torch.randn(RANK, FFN, generator=generator), HIDDEN)
    return out


@pytest.mark.parametrize(
    ("names", "experts", "dense"),
    [
        (QWEN3_5_MOE.lora, "mlp.experts", "mlp.shared_expert"),
        (GEMMA4.lora_names(GEMMA4.model_args(GEMMA4_26B_A4B_TEXT)), "experts", "mlp"),
    ],
    ids=["qwen3_5_moe", "gemma4_moe"],
)
def test_experts_pack_into_peft_target_parameters_and_back_bit_exactly(
    names, experts: str, dense: str
) -> None:
    assert names.fused_experts == experts
    per_expert = per_expert_tensors(experts, ("gate_proj", "up_proj", "down_proj"), dense)
    packed, config = names.for_peft(per_expert, CONFIG)
    assert config == {**CONFIG, "target_parameters": [f"{experts}.gate_up_proj", f"{experts}.down_proj"]}
    kept = {key for key in per_expert if f".{experts}." not in key}
    layer = f"{PREFIX}.1.{experts}"
    wrapped = {f"{layer}.{path}lora_{m}.weight" for path in ("base_layer.", "") for m in "AB"}
    assert set(packed) == kept | wrapped | {key.replace(".1.", ".0.") for key in wrapped}
    assert all(torch.equal(packed[key], per_expert[key]) for key in kept)
    gate_up_a, gate_up_b = (
        packed[f"{layer}.base_layer.lora_A.weight"],
        packed[f"{layer}.base_layer.lora_B.weight"],
    )
    down_a, down_b = packed[f"{layer}.lora_A.weight"], packed[f"{layer}.lora_B.weight"]
    assert gate_up_a.shape == (EXPERTS * RANK, HIDDEN) and gate_up_b.shape == (2 * FFN, RANK * EXPERTS)
    assert down_a.shape == (EXPERTS * RANK, FFN) and down_b.shape == (HIDDEN, RANK * EXPERTS)
    # expert 2's delta on HF's gate_up_proj[2] [2I, h] is B_2 A_2 with B_2 = lora_B columns
    # k * E + 2 (PEFT's ParamWrapper.get_delta_weight, the parameter not transposed): gate rows first
    expert = f"{layer}.2"
    delta = gate_up_b[:, 2::EXPERTS] @ gate_up_a[2 * RANK : 3 * RANK]
    for rows, module in ((slice(0, FFN), "gate_proj"), (slice(FFN, None), "up_proj")):
        wanted = (
            per_expert[f"{expert}.{module}.lora_B.weight"] @ per_expert[f"{expert}.{module}.lora_A.weight"]
        )
        assert torch.equal(delta[rows], wanted)
    down = per_expert[f"{expert}.down_proj.lora_B.weight"] @ per_expert[f"{expert}.down_proj.lora_A.weight"]
    assert torch.equal(down_b[:, 2::EXPERTS] @ down_a[2 * RANK : 3 * RANK], down)
    back = fused_experts.unpack(packed, config, experts, interleave=False)
    assert back.keys() == per_expert.keys()
    assert all(torch.equal(back[key], value) for key, value in per_expert.items())


def test_experts_gate_up_alone_is_the_outer_wrapper() -> None:
    per_expert = per_expert_tensors("mlp.experts", ("gate_proj", "up_proj"), "mlp.shared_expert")
    packed, config = QWEN3_5_MOE.lora.for_peft(per_expert, CONFIG)
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj"]
    assert tuple(packed[f"{PREFIX}.0.mlp.experts.lora_B.weight"].shape) == (2 * FFN, RANK * EXPERTS)
    assert not any("base_layer" in key for key in packed)


@pytest.mark.parametrize("spec", [GPT_OSS, QWEN3_MOE], ids=["gpt_oss", "qwen3_moe"])
def test_adapters_peft_loads_as_written_stay(spec) -> None:
    per_expert = per_expert_tensors("mlp.experts", ("gate_proj", "up_proj", "down_proj"), "mlp")
    tensors, config = spec.lora.for_peft(per_expert, CONFIG)
    assert spec.lora.fused_experts == "" and config == CONFIG
    assert tensors.keys() == per_expert.keys()
    assert all(tensors[key] is value for key, value in per_expert.items())


def test_deepseek_v3_adapter_names_its_dense_and_shared_mlps_as_parameters() -> None:
    """DeepSeek-V3 (`LoraNames.mlp_parameters`): the routed experts packed as above, and the dense
    layer's and the shared experts' gate/up/down_proj as 2-D `target_parameters` with their
    tensors as they are, so that no gate/up/down_proj is left in `target_modules` for PEFT's MoE
    conversion to take for the experts'."""
    from art_mega.trainer.families.deepseek_v3 import SPEC as DEEPSEEK_V3

    tensors = per_expert_tensors("mlp.experts", ("gate_proj", "up_proj", "down_proj"), "mlp.shared_experts")
    dense = f"{PREFIX}.0.mlp.shared_experts."  # layer 0 dense, as DeepSeek-V3's first layers
    tensors = {key.replace(dense, f"{PREFIX}.0.mlp."): value for key, value in tensors.items()}
    tensors = {key: value for key, value in tensors.items() if f"{PREFIX}.0.mlp.experts." not in key}
    out, config = DEEPSEEK_V3.lora.for_peft(tensors, CONFIG)
    mlp = ("gate_proj", "up_proj", "down_proj")
    assert config == {
        **CONFIG,
        "target_modules": ["q_proj"],
        "target_parameters": [
            "mlp.experts.gate_up_proj",
            "mlp.experts.down_proj",
            *(f"{path}.{m}.weight" for path in ("mlp", "mlp.shared_experts") for m in mlp),
        ],
    }
    kept = {key for key in tensors if ".mlp.experts." not in key}
    assert {key for key in kept if f"{PREFIX}.0.mlp." in key} == {
        f"{PREFIX}.0.mlp.{m}.lora_{x}.weight" for m in mlp for x in "AB"
    }
    assert all(out[key] is tensors[key] for key in kept)
    assert set(out) - kept == {
        f"{PREFIX}.1.mlp.experts.{p}lora_{x}.weight" for p in ("base_layer.", "") for x in "AB"
    }

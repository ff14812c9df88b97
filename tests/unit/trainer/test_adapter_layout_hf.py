"""`peft_io.adapter_layout` (the rule `checkpoint.check_warm_start` holds a warm-start or resumed
adapter to at register) against transformers' own model of every family's tiny config, built on
the meta device (no memory, no weights): with every target of the family, the layout's keys and
shapes are exactly those of the HF modules the targets name under the decoder layers, each
nn.Linear's lora_A [r, in_features] / lora_B [out_features, r], and each fused 3-D expert
parameter [E, out, in] (or [E, in, out] where transformers marks it `is_transposed`, GPT-OSS)
per expert (`...experts.{e}.gate_proj` [r, h] / [I, r], the names `LoraNames.to_peft` writes) or
packed as PEFT's `target_parameters` tensors where the family writes them so
(`fused_experts.wrappers`: A [E r, in], B [out, E r]). The one key HF has no module for is
Gemma 4's v_proj on a k_eq_v layer (`gemma4.Gemma4LoraNames.to_peft` writes it for vLLM as the
k_proj adapter). About 6 s for all of them (3 s of it importing transformers).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from art_mega.trainer.families import family_for, fused_experts
from art_mega.trainer.peft_io import adapter_layout

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

RANK = 4


def _tiny_config(name: str) -> Any:
    """transformers' config object of the tiny model `name` (the `art_mega.basemodels` builders'
    configs; a multimodal wrapper with its default vision tower, free on the meta device)."""
    from art_mega.basemodels import tiny
    from art_mega.basemodels.tiny_deepseek_v3 import DEEPSEEK_V3_TINY
    from art_mega.basemodels.tiny_gemma4_moe import GEMMA4_MOE_TINY
    from art_mega.basemodels.tiny_gpt_oss import GPT_OSS_TINY
    from art_mega.basemodels.tiny_moe import MOE_SIZES
    from art_mega.basemodels.tiny_qwen3_5_moe import QWEN3_5_MOE_TINY

    if name in ("llama", "qwen2", "qwen3", "mistral", "gemma3_text", "qwen3_5", "gemma4_text"):
        return tiny._hf_config(name, tiny.tiny_spec(name))
    if name == "gemma3":
        text = tiny._hf_config("gemma3_text", tiny.tiny_spec("gemma3_text")).to_dict()
        return transformers.Gemma3Config(
            text_config=text,
            architectures=["Gemma3ForConditionalGeneration"],
        )
    if name == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**MOE_SIZES, architectures=["Qwen3MoeForCausalLM"])
    if name == "gpt_oss":
        return transformers.GptOssConfig(**GPT_OSS_TINY, architectures=["GptOssForCausalLM"])
    if name == "deepseek_v3":
        return transformers.DeepseekV3Config(**DEEPSEEK_V3_TINY, architectures=["DeepseekV3ForCausalLM"])
    if name == "gemma4_moe":
        return transformers.Gemma4TextConfig(
            **tiny.GEMMA4_TINY, **GEMMA4_MOE_TINY, architectures=["Gemma4ForCausalLM"]
        )
    text_moe = transformers.Qwen3_5MoeTextConfig(**QWEN3_5_MOE_TINY, architectures=["Qwen3_5MoeForCausalLM"])
    if name == "qwen3_5_moe_text":
        return text_moe
    if name == "qwen3_5_wrapper":
        text = {
            **tiny._hf_config("qwen3_5", tiny.tiny_spec("qwen3_5")).to_dict(),
            "model_type": "qwen3_5_text",
        }
        return transformers.Qwen3_5Config(text_config=text, architectures=["Qwen3_5ForConditionalGeneration"])
    assert name == "qwen3_5_moe_wrapper"
    text = {**text_moe.to_dict(), "model_type": "qwen3_5_moe_text"}
    return transformers.Qwen3_5MoeConfig(
        text_config=text, architectures=["Qwen3_5MoeForConditionalGeneration"]
    )


TINY_MODELS = (
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "gemma3_text",
    "gemma3",
    "gemma4_text",
    "gemma4_moe",
    "qwen3_5",
    "qwen3_5_wrapper",
    "qwen3_5_moe_text",
    "qwen3_5_moe_wrapper",
    "qwen3_moe",
    "gpt_oss",
    "deepseek_v3",
)


def _expert_shapes(
    where: str, module: Any, leaves: set[str], packed: dict[str, str] | None
) -> dict[str, tuple[int, int]]:
    """PEFT key (under `where`, the experts module's key prefix) -> shape of the LoRA of a
    transformers experts module with 3-D `gate_up_proj` / `down_proj`: per expert and module
    (`leaves` of gate_proj / up_proj / down_proj), or, with `packed` (parameter -> wrapper path
    suffix, `fused_experts.wrappers`), per parameter as PEFT's `target_parameters` LoRA."""
    transposed = getattr(module, "is_transposed", False)
    out: dict[str, tuple[int, int]] = {}
    for parameter, modules in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
        experts, d1, d2 = getattr(module, parameter).shape
        fan_in, fan_out = (d1, d2) if transposed else (d2, d1)
        if packed is not None:
            if parameter in packed:
                out[f"{where}{packed[parameter]}.lora_A.weight"] = (experts * RANK, fan_in)
                out[f"{where}{packed[parameter]}.lora_B.weight"] = (fan_out, experts * RANK)
            continue
        for e in range(experts):
            for leaf in (m for m in modules if m in leaves):
                out[f"{where}.{e}.{leaf}.lora_A.weight"] = (RANK, fan_in)
                out[f"{where}.{e}.{leaf}.lora_B.weight"] = (fan_out // len(modules), RANK)
    return out


def _hf_shapes(
    model: Any, prefix: str, leaves: set[str], parameters: list[str]
) -> dict[str, tuple[int, int]]:
    """PEFT key -> shape of a rank-`RANK` LoRA on every HF module under the decoder layers
    (`prefix`, PEFT's key prefix of them) whose name is one of `leaves`: nn.Linear modules, and
    the experts' fused parameters (`_expert_shapes`; packed when `parameters`, adapter_config's
    `target_parameters`, names them)."""
    module_prefix = prefix.removeprefix("base_model.model.") + "."
    packed = None
    if parameters:
        suffixes = fused_experts.wrappers(parameters)
        packed = {p.rsplit(".", 1)[1]: path.removeprefix(p.rsplit(".", 1)[0]) for p, path in suffixes.items()}
    out: dict[str, tuple[int, int]] = {}
    for name, module in model.named_modules():
        if not name.startswith(module_prefix):
            continue
        where = f"base_model.model.{name}"
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[1] in leaves:
            out[f"{where}.lora_A.weight"] = (RANK, module.in_features)
            out[f"{where}.lora_B.weight"] = (module.out_features, RANK)
        elif isinstance(getattr(module, "gate_up_proj", None), torch.nn.Parameter):
            out.update(_expert_shapes(where, module, leaves, packed))
    return out


def _meta_model(config: Any) -> Any:
    with torch.device("meta"):
        return getattr(transformers, config.architectures[0])(config)


@pytest.mark.parametrize("name", TINY_MODELS)
def test_the_layout_is_the_hf_models_modules(name: str, tmp_path: Path) -> None:
    config = _tiny_config(name)
    config.save_pretrained(tmp_path)  # the config.json a checkpoint carries
    hf_config = json.loads((tmp_path / "config.json").read_text())
    spec = family_for(hf_config)
    names = spec.lora_names(spec.model_args(hf_config))
    fields = names.peft_targets(names.targets)
    layout = adapter_layout(hf_config, RANK, fields["target_modules"], fields.get("target_parameters", ()))

    model = _meta_model(config)
    leaves = set(names.hf_target_modules(names.targets))
    expected = _hf_shapes(model, names.layer_prefix, leaves, fields.get("target_parameters", []))
    found = dict(layout.shapes)
    if name.startswith("gemma4"):  # its k_eq_v global layer's v_proj copy of k_proj (module docstring)
        v_proj = re.compile(r"^(.*\.1\.self_attn\.)v_proj(\.lora_[AB]\.weight)$")
        extra = {key: shape for key, shape in found.items() if key not in expected}
        assert sorted(extra) == sorted(filter(v_proj.match, found)) and len(extra) == 2
        assert all(shape == expected[v_proj.sub(r"\1k_proj\2", key)] for key, shape in extra.items())
        found = {key: shape for key, shape in found.items() if key not in extra}
    assert found == expected
    depth = len(names.layer_prefix.split("."))
    assert {int(key.split(".")[depth]) for key in expected} == set(range(layout.num_layers)) == {0, 1}
    print(f"{name}: {len(expected)} LoRA tensors as transformers' modules")

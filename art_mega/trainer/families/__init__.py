"""Model families, one file each: every family declares one typed `FamilySpec` (`families/spec.py`),
and `family_for` picks it by the HF config's `model_type`.

A spec holds the family's whole contract with the trainer: the HF model types it reads, the config
mapping (HF config -> architecture arguments, refusing what it cannot express exactly), the
megatron-core transformer config and layer spec, the parallel limits (valid TP sizes, whether the
layers have experts for EP/ETP), the HF -> Megatron weight adapter per TP/EP rank, and the LoRA
<-> PEFT names both ways (`LoraNames`). `layout.py` has the fused-weight tensor functions the
adapters share. The rest of the trainer asks the spec (`model_builder`, `lora`, `peft_io`,
`peft_config`, the backend's register checks) and holds no table of family or HF module names.

Adding a family:

1. Write `families/<name>.py` with `MODEL_TYPES` and `SPEC = FamilySpec(...)`: a new `model_args`
   (a frozen dataclass read from config.json; refuse each value Megatron cannot express exactly
   in one `UserError` sentence naming field, value and fix) and the rest either new or reused
   from a close family (`dataclasses.replace(llama.SPEC, ...)` as `mistral.py` does).
   The registry finds it: every module of this package but `layout` and `spec` is a family file
   and must have a `SPEC` (a model_type claimed by two families fails at import).
2. Add its test, `tests/trainer/test_<name>_family.py`: a tiny checkpoint
   (`basemodels/tiny.py` builds one per arch) whose Megatron logits match transformers', whose
   exported LoRA adapter loads in PEFT with the same logits, and its config refusals.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from art_mega.errors import UserError
from art_mega.trainer.families.spec import FamilySpec, LoraNames

_NOT_FAMILIES = frozenset({"layout", "spec", "gemma4_moe", "fused_experts"})
"""This package's modules that are not family files: the shared tensor layouts, the spec types,
Gemma 4's MoE block (a part of `gemma4.py`'s family) and PEFT's fused-experts LoRA layout."""


def _family_specs() -> tuple[FamilySpec[Any], ...]:
    """Every family file's `SPEC`, in module-name order (`RuntimeError` for a family file without one)."""
    specs = []
    for name in sorted(info.name for info in pkgutil.iter_modules(__path__)):
        if name in _NOT_FAMILIES:
            continue
        spec = vars(importlib.import_module(f"{__name__}.{name}")).get("SPEC")
        if not isinstance(spec, FamilySpec):
            raise RuntimeError(f"family file {__name__}.{name} has no SPEC (a FamilySpec)")
        specs.append(spec)
    return tuple(specs)


_SPECS = _family_specs()


def _by_model_type(specs: tuple[FamilySpec[Any], ...]) -> dict[str, FamilySpec[Any]]:
    table: dict[str, FamilySpec[Any]] = {}
    for spec in specs:
        for model_type in spec.model_types:
            if model_type in table:
                raise RuntimeError(
                    f"model_type {model_type!r} is claimed by {table[model_type].name} and {spec.name}"
                )
            table[model_type] = spec
    return table


FAMILIES: dict[str, FamilySpec[Any]] = _by_model_type(_SPECS)
"""HF `model_type` -> the spec of the family that converts it."""


def _shared_lora_names(specs: tuple[FamilySpec[Any], ...]) -> LoraNames:
    """The LoRA names of every family: the union of their targets, with the union of their expert
    targets; the defaults are the llama family's (ART's default for dense models: q/k/v/o_proj and
    gate/up/down_proj), every other target is optional. A model's own default is its family's
    (`LoraNames.default_targets`: Qwen3.5 adds its gated delta-net projections, DeepSeek-V3 has MLA
    projections and no q/k/v_proj), which the backend resolves once the model is known.

    A LoRA config names its targets before the model is known (`trainer.protocol.LoraConfig`,
    `MegatronBackend(lora_targets=...)`), so those names must mean the same in every family; two
    families naming a Megatron target's HF modules (or its parent) differently, or one HF module
    for two Megatron targets, fail here, at import.
    """
    modules: dict[str, tuple[str, ...]] = {}
    parents: dict[str, str] = {}
    hf_owner: dict[str, str] = {}
    for spec in sorted(specs, key=lambda spec: spec.name != "llama"):  # llama's targets first
        for target, hf_names in spec.lora.modules.items():
            parent = spec.lora.parents[target]
            if (
                modules.setdefault(target, hf_names) != hf_names
                or parents.setdefault(target, parent) != parent
            ):
                raise RuntimeError(f"family {spec.name} names its LoRA module {target} unlike another family")
            for hf in hf_names:
                if hf_owner.setdefault(hf, target) != target:
                    raise RuntimeError(
                        f"family {spec.name} maps {hf} to {target}, another family to {hf_owner[hf]}"
                    )
    experts = {target for spec in specs for target in spec.lora.expert_targets}
    (llama,) = (spec for spec in specs if spec.name == "llama")
    default = set(llama.lora.default_targets)
    return LoraNames(
        modules=modules,
        parents=parents,
        expert_targets=tuple(target for target in modules if target in experts),
        optional=tuple(target for target in modules if target not in default),
        mlp_is_experts=True,  # ART's "experts" before the model is known; its family decides at register
    )


LORA_NAMES: LoraNames = _shared_lora_names(_SPECS)
"""The LoRA target names of every family (Megatron and HF), for configs written before a model is
chosen; code holding a model uses its family's `FamilySpec.lora`."""


def family_for(config: dict[str, Any]) -> FamilySpec[Any]:
    """The family spec for an HF config dict; `UserError` naming the supported types otherwise."""
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise UserError(
            f"model_type={model_type!r} is not supported by the Megatron trainer; "
            f"supported: {', '.join(sorted(FAMILIES))}."
        )
    return FAMILIES[model_type]


def lora_names_of(config: dict[str, Any]) -> LoraNames:
    """The LoRA <-> PEFT names of the model whose config.json dict is `config` (its family's
    `FamilySpec.lora_names`; `default_targets` is what a LoRA without targets trains on it).
    Raises `UserError` as `family_for` and the family's `model_args`."""
    spec = family_for(config)
    return spec.lora_names(spec.model_args(config))


def decoder_config(config: dict[str, Any]) -> dict[str, Any]:
    """The text decoder's config.json dict: its family's `FamilySpec.text_config` where it has one
    (a multimodal wrapper's sparse text_config with the family's defaults filled, Gemma 3), else
    `config` itself (also for a model_type no family reads). Raises `UserError` as that function."""
    spec = FAMILIES.get(config.get("model_type"))
    if spec is None or spec.text_config is None:
        return config
    return spec.text_config(config)

"""LoRA target names: Megatron's linear layers and the Hugging Face modules each one stands for.

Torch-free, so the controller can check a backend's LoRA targets and a warm-start adapter's
`target_modules` at `register`, before any trainer rank starts (`trainer.peft_config`).
"""

from __future__ import annotations

from typing import Literal

from art_mega.errors import UserError

ParallelKind = Literal["column", "row"]

TARGETS: dict[str, ParallelKind] = {
    "linear_qkv": "column",
    "linear_proj": "row",
    "linear_fc1": "column",
    "linear_fc2": "row",
}
"""Megatron linear layer name -> its tensor-parallel kind (the dense GPT layer's linears)."""

HF_TARGETS: dict[str, tuple[str, ...]] = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}
"""Megatron target -> the Hugging Face module names it stands for (fused: several)."""

DEFAULT_TARGETS = tuple(TARGETS)


def normalise_targets(targets: tuple[str, ...]) -> tuple[str, ...]:
    """Megatron target names from Megatron and/or HF names, in `TARGETS` order.

    A fused Megatron layer needs all of its HF modules: q_proj without k_proj and v_proj cannot be
    expressed with one adapter on linear_qkv, so it is refused (one sentence).
    """
    hf_to_megatron = {hf: mc for mc, names in HF_TARGETS.items() for hf in names}
    wanted: set[str] = set()
    hf_seen: set[str] = set()
    for name in targets:
        if name in TARGETS:
            wanted.add(name)
        elif name in hf_to_megatron:
            hf_seen.add(name)
            wanted.add(hf_to_megatron[name])
        else:
            known = ", ".join([*TARGETS, *hf_to_megatron])
            raise UserError(f"LoRA target {name!r} is not known; use some of: {known}.")
    for megatron_name, hf_names in HF_TARGETS.items():
        partial = hf_seen & set(hf_names)
        if partial and partial != set(hf_names) and megatron_name not in targets:
            raise UserError(
                f"LoRA targets {sorted(partial)} need all of {list(hf_names)}: Megatron fuses them "
                f"into {megatron_name}, which takes one adapter."
            )
    return tuple(name for name in TARGETS if name in wanted)


def hf_target_modules(targets: tuple[str, ...]) -> list[str]:
    """The HF module names (PEFT's `target_modules`, sorted) of normalised Megatron `targets`."""
    return sorted(hf for name in targets for hf in HF_TARGETS[name])

"""Model families, one file each (torchtitan style): HF config -> Megatron config + spec, and the
HF <-> Megatron weight adapter for that family. `family_for` picks the file by `model_type`.

A family module provides: `MODEL_TYPES`, `model_args(hf_config)`, `check_parallel(args, tp)`,
`valid_tp_sizes(args)`, `transformer_config(args, tp=, dtype=, device=)`,
`layer_spec(args, use_te=)`, `gpt_model_kwargs(args, tp=)`,
`megatron_state_dict(args, read, tp_size=, tp_rank=)` and `TE_NAME_MAP`. A family with experts
sets `EXPERT_PARALLEL = True`; its `check_parallel`, `transformer_config` and
`megatron_state_dict` then also take the expert-parallel sizes and coordinates (ep, ep_rank,
etp, etp_rank) as keywords.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from art_mega.errors import UserError
from art_mega.trainer.families import llama, qwen3_moe

FAMILIES: dict[str, ModuleType] = {
    **dict.fromkeys(llama.MODEL_TYPES, llama),
    **dict.fromkeys(qwen3_moe.MODEL_TYPES, qwen3_moe),
}
"""HF `model_type` -> the family module that converts it."""


def family_for(config: dict[str, Any]) -> ModuleType:
    """The family module for an HF config dict; `UserError` naming the supported types otherwise."""
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise UserError(
            f"model_type={model_type!r} is not supported by the Megatron trainer; "
            f"supported: {', '.join(sorted(FAMILIES))}."
        )
    return FAMILIES[model_type]

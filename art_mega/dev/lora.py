"""ART 0.5.23's `art.dev.LoRAConfig` (`TrainableModel(lora_config=...)`, which replaced
`_internal_config.peft_args`), and `lora_settings`, which maps it onto art-mega's LoRA
(`MegatronBackend(lora_rank=, lora_alpha=, lora_targets=)`).

ART (`art/dev/get_model_config.py`, `art/unsloth/service.py`) hands the dict to PEFT as
`r=rank, lora_alpha=alpha, lora_dropout=dropout, init_lora_weights=init_weights`, the other keys
as they are. art-mega's trainer honours `rank`, `alpha` and `target_modules`; the keys that only
tune how the trainer runs (`use_gradient_checkpointing`, `random_state`, `max_seq_length`,
`temporary_location`) are accepted with one logged line; the keys that would change what is
trained in a way art-mega's LoRA cannot (dropout, a bias, rsLoRA, a layer subset, extra saved
modules, LoftQ or no-init weights) are refused with one sentence unless at PEFT's "off" value.
"""

from __future__ import annotations

import logging
from typing import Any

from typing_extensions import TypedDict

from art_mega.errors import HyperParameterError

log = logging.getLogger(__name__)


class LoRAConfig(TypedDict, total=False):
    """ART 0.5.23's LoRA setting (every key optional; absent: the backend's LoRA)."""

    rank: int
    target_modules: list[str]
    alpha: int
    dropout: float
    bias: str
    layers_to_transform: list[int] | None
    layers_pattern: str | None
    use_gradient_checkpointing: str
    random_state: int
    max_seq_length: int
    use_rslora: bool
    modules_to_save: list[str] | None
    init_weights: bool
    loftq_config: dict
    temporary_location: str


HONOURED = {"rank": "lora_rank", "alpha": "lora_alpha", "target_modules": "lora_targets"}
"""LoRAConfig keys art-mega's trainer honours, by the MegatronBackend argument they set."""

HARDWARE_ONLY = {
    "use_gradient_checkpointing": "Megatron recomputes activations as its TrainerSpec says",
    "random_state": "art-mega initialises LoRA A with its own seed (B starts at 0, so step 0 is the base model)",
    "max_seq_length": "the packed row length is _internal_config.init_args.max_seq_length or MegatronBackend(seq_len=)",
    "temporary_location": "art-mega keeps no temporary adapter copies",
}
"""LoRAConfig keys that tune the run, not the adapter: accepted with one logged line (what
art-mega does instead)."""

OFF = {
    "dropout": (0, 0.0),
    "bias": ("none",),
    "layers_to_transform": (None,),
    "layers_pattern": (None,),
    "use_rslora": (False,),
    "modules_to_save": (None, []),
    "init_weights": (True,),
    "loftq_config": ({},),
}
"""LoRAConfig keys art-mega cannot train otherwise, with the values at which they do nothing (PEFT's)."""


def lora_settings(config: Any, where: str = "TrainableModel(lora_config=...)") -> dict[str, Any]:
    """`config` (a LoRAConfig dict or None) as MegatronBackend keywords (`lora_rank`,
    `lora_alpha`, `lora_targets`: only those it sets). None or {}: {} (the backend's LoRA).

    Raises:
        HyperParameterError: not a dict; a key LoRAConfig lacks; a key of `OFF` at another value
            (one sentence: field, value, fix). The honoured values are checked by the backend
            (`check_backend_options`).
    """
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise HyperParameterError(
            f"{where} got {type(config).__name__} {config!r}; pass art.dev.LoRAConfig(rank=8, alpha=16) (a dict) or None",
            "lora_config",
            config,
        )
    out: dict[str, Any] = {}
    for key, value in config.items():
        if key in HONOURED:
            out[HONOURED[key]] = (
                tuple(value) if key == "target_modules" and isinstance(value, list) else value
            )
        elif key in HARDWARE_ONLY:
            log.info("%s sets %s=%r: %s", where, key, value, HARDWARE_ONLY[key])
        elif key in OFF:
            if not any(value == off and type(value) is type(off) for off in OFF[key]):
                off = OFF[key][-1]
                raise HyperParameterError(
                    f"{where} sets {key}={value!r}, which art-mega's LoRA cannot train (plain LoRA on "
                    f"every layer of the target modules); remove it or set {key}={off!r}",
                    f"lora_config.{key}",
                    value,
                )
        else:
            raise HyperParameterError(
                f"{where} has the key {key!r}, which ART's LoRAConfig does not have; use one of "
                f"{', '.join(LoRAConfig.__annotations__)}",
                f"lora_config.{key}",
                value,
            )
    return out

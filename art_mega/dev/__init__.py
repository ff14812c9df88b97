"""ART's `art.dev`: the experimental configuration types (`InternalModelConfig` and the argument
dicts it holds, `LoRAConfig`, the per-call `TrainConfig` / `TrainSFTConfig` dicts), typed as
openpipe-art 0.5.23 types them (0.5.18's names keep working). Fields art-mega does not read are
refused when set (`check_internal_config`, `lora.lora_settings`); a name of ART's `art.dev` that
art-mega does not provide raises its one sentence (`art_mega.unsupported`)."""

from typing import Any

from art_mega.dev.engine import EngineArgs
from art_mega.dev.lora import LoRAConfig
from art_mega.dev.model import (
    InitArgs,
    InternalModelConfig,
    PeftArgs,
    RolloutWeightUpdateMode,
    TrainerArgs,
    VllmRuntimeArgs,
    check_internal_config,
)
from art_mega.dev.sft import TrainSFTConfig
from art_mega.dev.train import TrainConfig

__all__ = [
    "EngineArgs",
    "InitArgs",
    "InternalModelConfig",
    "LoRAConfig",
    "PeftArgs",
    "RolloutWeightUpdateMode",
    "TrainConfig",
    "TrainSFTConfig",
    "TrainerArgs",
    "VllmRuntimeArgs",
    "check_internal_config",
]


def __getattr__(name: str) -> Any:
    from art_mega.unsupported import missing

    raise missing("art_mega.dev", name)

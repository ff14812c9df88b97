"""ART's `art.dev`: the experimental configuration types (`InternalModelConfig` and the argument
dicts it holds, the per-call `TrainConfig` / `TrainSFTConfig` dicts), typed as openpipe-art
0.5.18 types them. Fields art-mega does not read are refused when set (`check_internal_config`)."""

from art_mega.dev.engine import EngineArgs
from art_mega.dev.model import (
    InitArgs,
    InternalModelConfig,
    PeftArgs,
    TrainerArgs,
    check_internal_config,
)
from art_mega.dev.sft import TrainSFTConfig
from art_mega.dev.train import TrainConfig

__all__ = [
    "EngineArgs",
    "InitArgs",
    "InternalModelConfig",
    "PeftArgs",
    "TrainConfig",
    "TrainSFTConfig",
    "TrainerArgs",
    "check_internal_config",
]

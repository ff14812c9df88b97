"""ART's `art.utils.sft`: SFT helpers (re-exported from `art_mega.sft`)."""

from art_mega.sft import (
    SFTConfig,
    SFTDatasetChunk,
    create_lr_schedule,
    create_sft_dataset_iterator,
    iterate_file,
    train_sft_from_file,
)

__all__ = [
    "SFTConfig",
    "SFTDatasetChunk",
    "create_lr_schedule",
    "create_sft_dataset_iterator",
    "iterate_file",
    "train_sft_from_file",
]

"""ART's `art.utils.sft`: the SFT helpers (defined in `art_mega.sft`)."""

from art_mega.sft import (
    SFTChunk,
    TrainSFTConfig,
    create_lr_schedule,
    create_sft_dataset_iterator,
    get_file_row_count,
    iterate_file,
    train_sft_from_file,
)

__all__ = [
    "SFTChunk",
    "TrainSFTConfig",
    "create_lr_schedule",
    "create_sft_dataset_iterator",
    "get_file_row_count",
    "iterate_file",
    "train_sft_from_file",
]

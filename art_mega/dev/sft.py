"""ART's `art.dev.TrainSFTConfig`: the experimental per-call options of
`model.train_sft(..., _config=...)` (a dict; openpipe-art 0.5.23 defines `metric_logging`, 0.5.18 no keys)."""

from typing import Any

from typing_extensions import TypedDict


class TrainSFTConfig(TypedDict, total=False):
    """ART's dev.TrainSFTConfig. `metric_logging` (ART 0.5.23's SFT metric sampling) is refused
    by `train_sft` unless None: art-mega logs every SFT step's metrics."""

    metric_logging: Any

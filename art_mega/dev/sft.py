"""ART's `art.dev.TrainSFTConfig`: the experimental per-call options of
`model.train_sft(..., _config=...)` (a dict; openpipe-art 0.5.18 defines no keys)."""

from typing_extensions import TypedDict


class TrainSFTConfig(TypedDict, total=False):
    """ART's dev.TrainSFTConfig: no keys (any key given is one ART does not have)."""

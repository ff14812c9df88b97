"""ART's `art.utils` names that programs import (re-exports)."""

from art_mega.gather import gather_trajectory_groups
from art_mega.sft import iterate_dataset

__all__ = ["gather_trajectory_groups", "iterate_dataset"]

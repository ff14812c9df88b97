"""ART's `art.utils` names that programs import."""

from art_mega.gather import gather_trajectory_groups
from art_mega.sft import iterate_dataset
from art_mega.utils.limit_concurrency import limit_concurrency
from art_mega.utils.retry import retry

__all__ = ["gather_trajectory_groups", "iterate_dataset", "limit_concurrency", "retry"]

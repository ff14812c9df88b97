"""ART's `art.utils` names that programs import.

`iterate_dataset` is imported from the submodule of that name, as ART's `art/utils/__init__.py`
does: the attribute is the function, and `art_mega.utils.iterate_dataset` the module path stays
importable (`from art_mega.utils.iterate_dataset import DatasetBatch`).
"""

from art_mega.gather import gather_trajectory_groups
from art_mega.utils.iterate_dataset import iterate_dataset
from art_mega.utils.limit_concurrency import limit_concurrency
from art_mega.utils.retry import retry

__all__ = ["gather_trajectory_groups", "iterate_dataset", "limit_concurrency", "retry"]

"""ART's `art.utils` names that programs import.

`iterate_dataset` is imported from the submodule of that name, as ART's `art/utils/__init__.py`
does: the attribute is the function, and `art_mega.utils.iterate_dataset` the module path stays
importable (`from art_mega.utils.iterate_dataset import DatasetBatch`). `strip_logprobs` is both
a function here and a module (`from art_mega.utils.strip_logprobs import strip_logprobs`), as in
ART; a name ART's `art.utils` has and art-mega lacks raises its one sentence (`art_mega.unsupported`).
"""

from typing import Any

from art_mega.gather import gather_trajectory_groups
from art_mega.utils.iterate_dataset import iterate_dataset
from art_mega.utils.limit_concurrency import limit_concurrency
from art_mega.utils.retry import retry
from art_mega.utils.strip_logprobs import strip_logprobs

__all__ = ["gather_trajectory_groups", "iterate_dataset", "limit_concurrency", "retry", "strip_logprobs"]


def __getattr__(name: str) -> Any:
    from art_mega.unsupported import missing

    raise missing("art_mega.utils", name)

"""ART's `art.utils.iterate_dataset` module: `from art.utils.iterate_dataset import
iterate_dataset, DatasetBatch` works as in ART.

As in ART, `art.utils.iterate_dataset` the attribute is the function (`art_mega.utils` binds
it over the module's name), while this module stays importable by its path. Both names are
art_mega.sft's, where the SFT and RL dataset iterators live together.
"""

from art_mega.sft import DatasetBatch, iterate_dataset

__all__ = ["DatasetBatch", "iterate_dataset"]

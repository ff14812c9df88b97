"""Trainer test fixtures: tiny HF models (built once per session) and a one-rank Megatron world.

Every test module here calls `require_trainer_deps()` first: it skips without megatron-core
and transformers (the `cpu` extra).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from art_mega.models.tiny import build_tiny_model
from tests.trainer.common import EQUIVALENCE_MODELS, TINY_MODELS, free_port, input_ids, megatron_logits


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Test model name (see `TINY_MODELS`) -> its HF directory."""
    root = tmp_path_factory.mktemp("tiny-models")
    return {name: build_tiny_model(root / name, arch, **sizes) for name, (arch, sizes) in TINY_MODELS.items()}


@pytest.fixture(scope="session")
def megatron_world() -> Iterator[object]:
    """This pytest process as a one-rank Megatron world (TP=1, gloo, CPU compatibility layer),
    torn down (patches removed) at the end of the session."""
    from art_mega.topology.compiled import TrainerRank
    from art_mega.topology.groups import rank_coordinates
    from art_mega.topology.trainer import TrainerSpec
    from art_mega.trainer.cpu_compat import remove_cpu_compat
    from art_mega.trainer.parallel import destroy_parallel, init_parallel

    rank = TrainerRank(rank=0, host_id="local", local_rank=0, **rank_coordinates(0, 1))
    state = init_parallel(rank, TrainerSpec(), 1, master_addr="127.0.0.1", master_port=free_port())
    yield state
    destroy_parallel()
    remove_cpu_compat()


@pytest.fixture(scope="session")
def tp1_logits(megatron_world, tiny_dirs: dict[str, Path]) -> dict[str, object]:
    """Equivalence model name -> TP=1 Megatron logits [2, 24, 768] on `input_ids`."""
    from art_mega.trainer.model_builder import build_megatron_model

    logits = {}
    for name in EQUIVALENCE_MODELS:
        built = build_megatron_model(tiny_dirs[name])
        assert not built.uses_te and built.padded_vocab_size == built.vocab_size == 768
        logits[name] = megatron_logits(built, input_ids(built.vocab_size))
    return logits

"""Trainer test fixtures: tiny HF models (built once per session) and a one-rank Megatron world.

Every test module here calls `require_trainer_deps()` first: it skips without megatron-core
and transformers (the `cpu` extra).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from art_mega.basemodels.tiny import build_tiny_model
from tests.trainer.common import (
    EQUIVALENCE_MODELS,
    TINY_MODELS,
    MetaMapper,
    RankProcesses,
    free_port,
    input_ids,
    megatron_logits,
)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Test model name (see `TINY_MODELS`) -> its HF directory."""
    root = tmp_path_factory.mktemp("tiny-models")
    return {name: build_tiny_model(root / name, arch, **sizes) for name, (arch, sizes) in TINY_MODELS.items()}


@pytest.fixture(scope="session")
def meta_mapper(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MetaMapper]:
    """The session's meta-device mapping worker (`MetaMapper`), started at its first use."""
    mapper = MetaMapper(tmp_path_factory.mktemp("meta-maps"))
    yield mapper
    mapper.close()


@pytest.fixture(scope="session")
def megatron_world() -> Iterator[object]:
    """This pytest process as a one-rank Megatron world (TP=1, gloo, CPU compatibility layer),
    torn down (patches removed) at the end of the session."""
    from art_mega.topology.compiled import TrainerRank
    from art_mega.topology.groups import rank_coordinates
    from art_mega.topology.trainer import TrainerSpec
    from art_mega.trainer.rank.cpu_compat import remove_cpu_compat
    from art_mega.trainer.rank.parallel import destroy_parallel, init_parallel

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


@pytest.fixture(scope="session")
def engine_world(
    tiny_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RankProcesses]:
    """The 2-rank `tests.trainer.engine_worker` world, started (not awaited): the in-process TP=1
    scenarios run while it works."""
    world = RankProcesses("tests.trainer.engine_worker", tmp_path_factory.mktemp("engine-world"), tiny_dirs)
    yield world
    world.kill()


@pytest.fixture(scope="session")
def tp2_engine(engine_world: RankProcesses) -> list[dict]:
    """Each rank's engine results: {"tp2": run_all(...), "dp2": {...}} (see engine_worker)."""
    return engine_world.results()


@pytest.fixture(scope="session")
def tp1_engine(
    megatron_world, tiny_dirs: dict[str, Path], engine_world: RankProcesses, tmp_path_factory
) -> dict:
    """`engine_scenarios.run_all` in this process (TP=1), plus the SFT and empty-batch scenarios."""
    import torch

    from tests.trainer import engine_scenarios

    models = {name: str(path) for name, path in tiny_dirs.items()}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is several times faster on 2 cores
    try:
        results = engine_scenarios.run_all(megatron_world, models, tmp_path_factory.mktemp("engine-tp1"))
        results["sft"] = engine_scenarios.sft_steps(megatron_world, models["llama"])
        results["nothing_trainable"] = engine_scenarios.nothing_trainable(megatron_world, models["llama"])
        return results
    finally:
        torch.set_num_threads(threads)

"""ART 0.5.23's `art.megatron.MegatronBackend` as `art_mega.megatron.MegatronBackend`: ART's
Megatron LoRA defaults (rank 1 on an MoE model, 8 on a dense one, alpha 32;
`art/megatron/lora_config.py`) chosen at register from the resolved model's config.json, where
the program chose no rank or alpha; its `runtime=` / `path=` contract. Register's checks run for
real on published configs (JSON only, no process starts)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from art_mega.errors import UserError
from tests.real_size_configs import CONFIGS
from tests.trainer.gpt_oss_configs import GPT_OSS_20B
from tests.trainer.qwen3_5_configs import QWEN3_6_27B
from tests.unit.backend.test_register_checks import _topology


def _resolved(tmp_path: Path, config: dict) -> object:
    from art_mega.basemodels.resolve import ResolvedModel

    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return ResolvedModel(tmp_path)


def _register_checks(backend: object, tmp_path: Path, config: dict, lora_config: dict | None = None) -> dict:
    """The LoRA `backend` trains `config`'s model with after register's checks (the model's
    `lora_config` applied first, as register does)."""
    backend._apply_lora_config(SimpleNamespace(lora_config=lora_config))
    topology = _topology()
    backend._check_model_and_adapter(
        topology.trainer, topology.replicas, _resolved(tmp_path / "model", config), tmp_path / "run", None
    )
    return backend._lora_settings(tmp_path / "model")


@pytest.mark.parametrize(
    "config,rank",
    [(CONFIGS["Qwen3-30B-A3B"], 1), (GPT_OSS_20B, 1), (CONFIGS["Llama-3.1-8B"], 8), (QWEN3_6_27B, 8)],
    ids=["qwen3_moe", "gpt_oss", "llama", "qwen3_6"],
)
def test_arts_megatron_lora_defaults_by_model(tmp_path: Path, config: dict, rank: int) -> None:
    from art_mega.megatron import MegatronBackend

    settings = _register_checks(MegatronBackend(), tmp_path, config)
    assert (settings["rank"], settings["alpha"]) == (rank, 32.0)


def test_a_chosen_rank_or_alpha_stays(tmp_path: Path) -> None:
    """`TrainableModel(lora_config=...)` and art-mega's keywords replace ART's defaults, each alone."""
    from art_mega.megatron import MegatronBackend

    moe = CONFIGS["Qwen3-30B-A3B"]
    settings = _register_checks(MegatronBackend(), tmp_path / "a", moe, {"rank": 16})
    assert (settings["rank"], settings["alpha"]) == (16, 32.0)
    settings = _register_checks(MegatronBackend(lora_alpha=8.0), tmp_path / "b", moe)
    assert (settings["rank"], settings["alpha"]) == (1, 8.0)


def test_the_local_backend_keeps_unsloths_defaults(tmp_path: Path) -> None:
    """ART's LocalBackend trains rank 8, alpha 16 (`art/unsloth/service.py`) on any model."""
    from art_mega.local import LocalBackend

    settings = _register_checks(LocalBackend(), tmp_path, CONFIGS["Qwen3-30B-A3B"])
    assert (settings["rank"], settings["alpha"]) == (8, 16.0)


def test_runtime_and_path_are_checked_in_one_sentence(tmp_path: Path) -> None:
    from art_mega.megatron import MegatronBackend

    with pytest.raises(UserError, match=r"^MegatronBackend\(runtime='x'\) must be a started art_mega ArtRuntime"):
        MegatronBackend(runtime="x")
    runtime = SimpleNamespace(
        topology=SimpleNamespace(cluster=SimpleNamespace(artifact_root=str(tmp_path / "root"))),
        clients={},
        health=None,
    )
    with pytest.raises(UserError) as caught:
        MegatronBackend(runtime=runtime, path=str(tmp_path / "elsewhere"))
    assert str(caught.value) == (
        f"MegatronBackend(path={str(tmp_path / 'elsewhere')!r}) must be the runtime's "
        f"ClusterSpec.artifact_root {str(tmp_path / 'root')!r}, where its runs live; leave path out"
    )
    backend = MegatronBackend(runtime=runtime, path=str(tmp_path / "root"))
    assert backend._runtime is runtime and not backend._owns_runtime


def test_the_module_is_arts() -> None:
    """`import art_mega as art`: `art.megatron.MegatronBackend`, and ART's other names are not there."""
    import art_mega as art

    assert art.megatron.MegatronBackend.__module__ == "art_mega.megatron"
    assert art.megatron.__all__ == ["MegatronBackend"]
    with pytest.raises(ImportError):
        from art_mega.megatron import MegatronOperationResidencySummary  # noqa: F401

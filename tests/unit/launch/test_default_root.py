"""ART's default root: runs of `LocalBackend()`, of a launch's default artifact_root and of a model
that is not registered land in `./.art/<project>/models/<name>`; a run that exists only under
art-mega's earlier defaults (`./.art-mega/artifacts` for a backend, `./.art-mega` for a model's
base_path) is still read there, with one logged line naming both folders."""

from __future__ import annotations

import logging

from art_mega import TrainableModel
from art_mega.launch.context import ArtLaunchContext, default_artifact_root
from art_mega.metrics import read_history
from art_mega.trainer.checkpoint import root_holding_run, run_dir, warn_earlier_launch_run

WARNING = (
    "art-mega: reading the run at {old} (art-mega's earlier default root); new runs go to {new} "
    "(ART's default root): move the folder there to keep them together"
)


def test_fresh_runs_go_to_arts_root(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    assert default_artifact_root() == str(tmp_path / ".art")
    assert root_holding_run("artifact_root", "proj", "agent") == tmp_path / ".art"
    model = TrainableModel(name="agent", project="proj", base_model="tiny")
    assert model.base_path == ".art"
    assert model.output_dir == tmp_path / ".art" / "proj" / "models" / "agent"
    assert caplog.records == []


def test_a_launch_cluster_defaults_to_arts_root(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    launch = ArtLaunchContext(worker_addresses=("tcp://127.0.0.1:1",), launch_id="x")
    assert launch.homogeneous_cluster().artifact_root == str(tmp_path / ".art")


def test_an_earlier_backend_run_is_read_with_one_line(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    old = run_dir(tmp_path / ".art-mega" / "artifacts", "proj", "resumed")
    (old / "checkpoints").mkdir(parents=True)
    caplog.set_level(logging.WARNING)
    assert root_holding_run("artifact_root", "proj", "resumed") == tmp_path / ".art-mega" / "artifacts"
    assert root_holding_run("artifact_root", "proj", "resumed") == tmp_path / ".art-mega" / "artifacts"
    new = run_dir(tmp_path / ".art", "proj", "resumed")
    assert [r.getMessage() for r in caplog.records] == [WARNING.format(old=old, new=new)]
    assert root_holding_run("artifact_root", "proj", "other") == tmp_path / ".art"  # a new run
    new.mkdir(parents=True)  # once the run exists under .art, that one is read
    assert root_holding_run("artifact_root", "proj", "resumed") == tmp_path / ".art"
    assert len(caplog.records) == 1


async def test_an_earlier_unregistered_run_keeps_its_history(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    old = tmp_path / ".art-mega" / "proj" / "models" / "judge"
    old.mkdir(parents=True)
    (old / "history.jsonl").write_text('{"step": 0, "val/reward": 0.25}\n')
    caplog.set_level(logging.WARNING)
    model = TrainableModel(name="judge", project="proj", base_model="tiny")
    assert model.output_dir == old
    await model.log(None, metrics={"reward": 0.75}, step=1, split="val")
    assert [(r["step"], r["val/reward"]) for r in read_history(old / "history.jsonl")] == [(0, 0.25), (1, 0.75)]
    new = tmp_path / ".art" / "proj" / "models" / "judge"
    assert [r.getMessage() for r in caplog.records] == [WARNING.format(old=old, new=new)]
    assert not new.exists()
    # a base_path given explicitly is used as given, even at ART's default
    assert TrainableModel(name="judge", project="proj", base_model="tiny", base_path=".art").output_dir == new


def test_a_launch_names_an_earlier_run_it_does_not_read(tmp_path, monkeypatch, caplog):
    """A launch's cluster root is fixed before any model is known: at `register` a run that
    exists only under the earlier root is named, with the artifact_root that resumes it."""
    monkeypatch.chdir(tmp_path)
    caplog.set_level(logging.WARNING)
    root = tmp_path / ".art"
    assert not warn_earlier_launch_run(root, "proj", "agent")  # nothing earlier
    old = run_dir(tmp_path / ".art-mega" / "artifacts", "proj", "agent")
    old.mkdir(parents=True)
    assert not warn_earlier_launch_run(tmp_path / "elsewhere", "proj", "agent")  # a root the program chose
    assert warn_earlier_launch_run(root, "proj", "agent")
    assert [r.getMessage() for r in caplog.records] == [
        f"art-mega: a new run starts at {root / 'proj' / 'models' / 'agent'} (ART's default root); the run at "
        f"{old} (art-mega's earlier default root) is not read: pass launch.homogeneous_cluster(artifact_root="
        f"{str(tmp_path / '.art-mega' / 'artifacts')!r}) to resume it"
    ]

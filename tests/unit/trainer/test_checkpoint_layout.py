"""`art_mega.trainer.checkpoint`, the one owner of a run's checkpoint folder: layout, the two-phase
save (staging folder placed, then the commit pointer moved), resume, keep/delete and the refusal of
a malformed commit pointer or manifest. Plain files in tmp_path; no torch, no ranks."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from art_mega.errors import CheckpointFileError, UserError
from art_mega.trainer import checkpoint as ckpt

SHA = "ab" * 32


def manifest(step: int) -> ckpt.Manifest:
    return ckpt.Manifest(
        step=step,
        adapter_sha256=SHA,
        base_model="/models/tiny",
        layout=ckpt.ManifestLayout(world_size=2, tp=1, dp=2),
        written_at=1.5,
    )


def save(root, step: int, commit: bool = True) -> None:
    """A save as the ranks and the controller do it: stage, manifest, place, then commit."""
    final = ckpt.step_dir(root, step)
    staging = ckpt.prepare_staging(final)
    (ckpt.adapter_dir(staging) / "adapter_model.safetensors").write_bytes(b"w%d" % step)
    ckpt.rank_state_file(staging, 0).write_bytes(b"state")
    ckpt.write_manifest(staging, manifest(step))
    ckpt.place_folder(staging, final)
    if commit:
        ckpt.write_commit(root, step)


def test_the_layout_names_every_file_of_a_checkpoint(tmp_path):
    root = ckpt.checkpoints_dir(tmp_path / "run")
    assert root == tmp_path / "run" / "checkpoints"
    assert ckpt.step_dir(root, 3) == root / "0003"
    assert ckpt.step_dir(root, 12345) == root / "12345"  # wider steps keep every digit
    assert ckpt.staging_dir(root / "0003") == root / ".staging-0003"
    assert ckpt.adapter_dir(root / "0003") == root / "0003"  # ART's place: the step folder itself
    assert ckpt.rank_state_file(root / "0003", 7) == root / "0003" / "rank00007.pt"
    assert ckpt.manifest_file(root / "0003") == root / "0003" / "manifest.json"


def test_a_save_places_a_whole_folder_and_the_pointer_commits_it(tmp_path):
    save(tmp_path, 0)
    save(tmp_path, 1)
    assert (tmp_path / "LATEST").read_text() == "1\n"
    assert ckpt.read_commit(tmp_path) == 1
    assert sorted(p.name for p in (tmp_path / "0001").iterdir()) == [
        "adapter_model.safetensors",
        "manifest.json",
        "rank00000.pt",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0000", "0001", "LATEST"]  # nothing staged left
    assert ckpt.read_manifest(tmp_path / "0001") == manifest(1)


def test_the_manifest_on_disk_keeps_its_format(tmp_path):
    """The JSON an older trainer wrote (json.dumps of a dict, indent=2) is what is written now, and reads."""
    old = {
        "step": 4,
        "adapter_sha256": SHA,
        "base_model": "/models/tiny",
        "layout": {"world_size": 2, "tp": 1, "dp": 2},
        "written_at": 1.5,
    }
    ckpt.write_manifest(tmp_path, manifest(4))
    assert (tmp_path / "manifest.json").read_text() == json.dumps(old, indent=2)
    (tmp_path / "manifest.json").write_text(json.dumps({**old, "written_at": 1700000000}))  # an int time
    assert ckpt.read_manifest(tmp_path).written_at == 1700000000.0


def test_a_crash_while_the_pointer_is_written_leaves_the_old_commit(tmp_path):
    save(tmp_path, 0)
    save(tmp_path, 1, commit=False)
    with pytest.raises(RuntimeError, match="crash"):
        with ckpt.atomic_write(tmp_path / "LATEST") as handle:
            handle.write(b"1")
            raise RuntimeError("crash")
    assert (tmp_path / "LATEST").read_text() == "0\n" and ckpt.read_commit(tmp_path) == 0
    assert (tmp_path / ".LATEST.tmp").exists()
    ckpt.write_commit(tmp_path, 1)  # the next commit replaces the leftover
    assert ckpt.read_commit(tmp_path) == 1 and not (tmp_path / ".LATEST.tmp").exists()


def test_a_step_saved_again_replaces_its_uncommitted_folder_whole(tmp_path):
    save(tmp_path, 0)
    save(tmp_path, 1, commit=False)
    (tmp_path / "0001" / "rank00001.pt").write_bytes(b"from the failed attempt")
    save(tmp_path, 1)
    assert sorted(p.name for p in (tmp_path / "0001").iterdir()) == [
        "adapter_model.safetensors",
        "manifest.json",
        "rank00000.pt",
    ]
    assert not list(tmp_path.glob(".*"))  # neither the staging nor the trash folder is left


def test_a_file_where_the_staging_folder_goes_is_refused(tmp_path):
    (tmp_path / ".staging-0002").write_text("stale\n")
    with pytest.raises(FileExistsError):
        ckpt.prepare_staging(tmp_path / "0002")


def test_resume_reads_the_commit_and_ignores_what_a_crash_left(tmp_path):
    save(tmp_path, 0)
    save(tmp_path, 1)
    save(tmp_path, 2, commit=False)  # placed, but the controller died before the commit
    staging = ckpt.prepare_staging(tmp_path / "0003")  # a save killed mid-way
    ckpt.rank_state_file(staging, 0).write_bytes(b"half")
    (tmp_path / ".trash-0002").mkdir()
    (tmp_path / ".LATEST.tmp").write_text("3")
    assert ckpt.read_commit(tmp_path) == 1
    assert ckpt.step_folders(tmp_path) == [0, 1, 2]
    removed = ckpt.clean_uncommitted(tmp_path)
    assert sorted(p.name for p in removed) == [".LATEST.tmp", ".staging-0003", ".trash-0002"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0000", "0001", "0002", "LATEST"]
    assert ckpt.read_commit(tmp_path) == 1


def test_nothing_is_committed_without_a_pointer_or_its_folder(tmp_path):
    assert ckpt.read_commit(tmp_path) is None
    save(tmp_path, 0, commit=False)
    assert ckpt.read_commit(tmp_path) is None
    ckpt.write_commit(tmp_path, 5)  # a pointer whose folder was removed: the run starts afresh
    assert ckpt.read_commit(tmp_path) is None


@pytest.mark.parametrize("text", ["", "abc\n", "-1\n", "1.5\n", "²\n", "0x2\n"])
def test_a_malformed_pointer_is_refused_naming_its_path(tmp_path, text):
    save(tmp_path, 1)
    (tmp_path / "LATEST").write_text(text)
    with pytest.raises(CheckpointFileError) as info:
        ckpt.read_commit(tmp_path)
    message = str(info.value)
    assert message.startswith(f"{tmp_path / 'LATEST'} holds {text.strip()!r}, not the number of")
    assert message.count(". ") == 0 and isinstance(info.value, UserError) and info.value.exit_code == 2
    assert info.value.path == str(tmp_path / "LATEST")


def _set(field: str, value):
    """A manifest text: the good one with `field` (dotted) set to `value`."""

    def edit(good: dict) -> str:
        *parents, name = field.split(".")
        target = good
        for parent in parents:
            target = target[parent]
        target[name] = value
        return json.dumps(good)

    return edit


@pytest.mark.parametrize(
    ("edit", "why"),
    [
        (lambda good: "{not json", "manifest='{not json' is invalid: Invalid JSON"),
        (lambda good: '{"step": 1}', "manifest.adapter_sha256 is required"),
        (_set("step", "1"), "manifest.step='1' is invalid"),
        (_set("extra", True), "manifest.extra=True is not a known field"),
        (_set("adapter_sha256", "nope"), "manifest.adapter_sha256='nope' is invalid"),
        (_set("layout.tp", 0), "manifest.layout.tp=0 is invalid"),
    ],
)
def test_a_malformed_manifest_is_refused_naming_its_path(tmp_path, edit, why):
    save(tmp_path, 1)
    path = tmp_path / "0001" / "manifest.json"
    path.write_text(edit(json.loads(path.read_text())))
    for read in (lambda: ckpt.read_commit(tmp_path), lambda: ckpt.read_manifest(tmp_path / "0001")):
        with pytest.raises(CheckpointFileError) as info:
            read()
        assert str(info.value).startswith(f"{path} is not a checkpoint manifest: {why}")
        assert info.value.path == str(path)


def test_a_manifest_of_another_step_is_refused(tmp_path):
    save(tmp_path, 1)
    ckpt.write_manifest(tmp_path / "0001", manifest(2))
    with pytest.raises(
        CheckpointFileError, match="manifest.json says step 2, but the commit pointer .* names step 1"
    ):
        ckpt.read_commit(tmp_path)


def test_a_missing_manifest_is_refused_where_a_rank_resumes(tmp_path):
    (tmp_path / "0001").mkdir()
    with pytest.raises(
        CheckpointFileError, match=r"manifest.json cannot be read \(No such file or directory\)"
    ):
        ckpt.read_manifest(tmp_path / "0001")


def test_delete_keeps_the_latest_and_the_best_by_arts_rule(tmp_path):
    # ART 0.5.23: the best step is the one of the highest mean of the metric over its history
    # rows (rows without it, or with null, count for nothing); the served window protects
    # nothing here (the backend unloads those steps first)
    rows = [
        {"step": 1, "val/reward": 0.9},
        {"step": 2, "val/reward": 0.2},
        {"step": 2, "train/reward": 5.0},
        {"step": 3, "val/reward": 0.5},
    ]
    assert ckpt.best_step(rows, "val/reward") == 1
    assert ckpt.deletable_steps([0, 1, 2, 3], 3, ckpt.best_step(rows, "val/reward")) == [0, 2]
    assert ckpt.best_step(rows, "train/reward") == 2
    averaged = [{"step": 1, "m": 1.0}, {"step": 1, "m": 0.0}, {"step": 2, "m": 0.6}, {"step": 3, "m": None}]
    assert ckpt.best_step(averaged, "m") == 2  # step 1's mean is 0.5
    tied = [{"step": 4, "m": 0.5}, {"step": 2, "m": 0.5}, {"step": 3, "m": float("nan")}]
    assert ckpt.best_step(tied, "m") == 2  # the earliest of equal means; NaN left out
    assert ckpt.best_step(rows, "val/loss") is None
    steps = [0, 1, 2, 3, 4, 5]
    assert ckpt.deletable_steps(steps, 5, None) == [0, 1, 2, 3, 4]  # no metric: the latest only
    assert ckpt.deletable_steps(steps, 5, 9) == [0, 1, 2, 3, 4]  # the best step has no folder left
    assert ckpt.deletable_steps([], 0, None) == []
    for step in (0, 1):
        save(tmp_path, step)
    assert ckpt.delete_step(tmp_path, 0) == tmp_path / "0000"
    assert ckpt.step_folders(tmp_path) == [1] and ckpt.read_commit(tmp_path) == 1
    ckpt.delete_step(tmp_path, 0)  # already gone: nothing to do


def _art_last_checkpoint_dir(art_path, project: str, name: str):
    """ART 0.5.18's lookup, transcribed (ART is not installed here): `utils.output_dirs.get_model_dir`,
    `utils.get_model_step.get_step_from_dir` (the largest all-digit folder under checkpoints/) and
    `local.checkpoints.get_last_checkpoint_dir` (`checkpoints/{step:04d}`)."""
    import os

    output_dir = f"{art_path}/{project}/models/{name}"
    checkpoint_dir = os.path.join(output_dir, "checkpoints")
    step = max((int(d) for d in os.listdir(checkpoint_dir) if d.isdigit()), default=0)
    return os.path.join(checkpoint_dir, f"{step:04d}")


def test_the_adapter_files_are_where_arts_code_reads_them(tmp_path):
    run = ckpt.run_dir(tmp_path, "proj", "agent")
    root = ckpt.checkpoints_dir(run)
    root.mkdir(parents=True)
    for step in (0, 1, 2):
        final = ckpt.step_dir(root, step)
        staging = ckpt.prepare_staging(final)
        for name in ckpt.ADAPTER_FILES:
            (ckpt.adapter_dir(staging) / name).write_bytes(b"%s of step %d" % (name.encode(), step))
        ckpt.write_manifest(staging, manifest(step))
        ckpt.place_folder(staging, final)
        ckpt.write_commit(root, step)
    last = _art_last_checkpoint_dir(tmp_path, "proj", "agent")
    assert last == str(ckpt.step_dir(root, 2)) == str(ckpt.adapter_dir(ckpt.step_dir(root, 2)))
    # ART's megatron service copies f"{lora_path}/adapter_model.safetensors" and reads
    # adapter_config.json beside it; vLLM and PEFT load the same folder
    assert (Path(last) / "adapter_model.safetensors").read_bytes() == b"adapter_model.safetensors of step 2"
    assert (Path(last) / "adapter_config.json").read_bytes() == b"adapter_config.json of step 2"


def test_a_committed_step_in_the_earlier_adapter_folder_layout_is_refused(tmp_path):
    save(tmp_path, 0)
    save(tmp_path, 1)
    old = tmp_path / "0001" / "adapter"  # where an earlier art-mega wrote the adapter
    old.mkdir()
    (tmp_path / "0001" / "adapter_model.safetensors").rename(old / "adapter_model.safetensors")
    (old / "adapter_config.json").write_text("{}")
    with pytest.raises(CheckpointFileError) as caught:
        ckpt.read_commit(tmp_path)
    assert str(caught.value) == (
        f"{old} is art-mega's earlier checkpoint layout (ART's tools and this trainer read the adapter "
        "from the step folder itself): move adapter_config.json and adapter_model.safetensors from it "
        f"up into {tmp_path / '0001'}; restore it from a copy, or give the model another name to start "
        "a new run"
    )
    assert caught.value.path == str(old)
    for name in ckpt.ADAPTER_FILES:  # moved up as the sentence says: the run resumes
        (old / name).rename(tmp_path / "0001" / name)
    assert ckpt.read_commit(tmp_path) == 1
    (tmp_path / "0000" / "adapter_config.json").write_text("{}")
    (tmp_path / "0000" / "adapter").mkdir()
    (tmp_path / "0000" / "adapter" / "adapter_config.json").write_text("{}")
    ckpt.check_layout(tmp_path / "0000")  # an adapter/ folder beside ART's files is left alone


def test_the_module_imports_neither_torch_nor_safetensors():
    code = (
        "import sys, art_mega.trainer.checkpoint; "
        "print(sorted(m for m in ('torch', 'safetensors', 'megatron') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
